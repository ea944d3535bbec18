"""The saved data position, shared by every loader: samples read, as whole global batches."""

from __future__ import annotations

__all__ = ["steps_read"]


def steps_read(samples: int, local_batch_size: int, dp_degree: int) -> int:
    """How many global batches of ``local_batch_size x dp_degree`` a saved position of
    ``samples`` global samples is (``ValueError`` naming both when not a whole number)."""
    global_batch_size = local_batch_size * dp_degree
    if samples % global_batch_size:
        raise ValueError(
            f"the data position ({samples} samples read) is not a whole number of global batches of "
            f"{global_batch_size} (local_batch_size={local_batch_size} x data-parallel degree "
            f"{dp_degree}); resume with a global batch size that divides {samples}."
        )
    return samples // global_batch_size
