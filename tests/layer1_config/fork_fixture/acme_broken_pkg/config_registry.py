"""Never imported: the package's __init__ fails first."""


def broken_debug() -> None:
    """Never reached."""
