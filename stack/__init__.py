"""The layered stack of this project: check it, export it as a patch series, replay it.

``python -m stack check`` proves the stack described by ``stack/layers.toml``:

1. every tracked file belongs to exactly one layer, and every listed path is live;
2. no module imports (statically: top-level, function-local, ``TYPE_CHECKING``,
   literal ``importlib.import_module``/``__import__``) a module of a higher layer;
3. each prefix 1..k is green: the tests of layers 1..k pass while the modules of the
   layers above k are unimportable.

``python -m stack export OUTDIR`` writes the series (from HEAD) as ``git format-patch``
files ``0001-<slug>.patch`` ...; ``python -m stack verify-export OUTDIR`` replays it
with ``git am`` into an empty repository, testing every prefix there.
"""

from .cli import main

__all__ = ["main"]
