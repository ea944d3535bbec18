"""``python -m stack``: see :mod:`stack.cli`."""

import sys

from .cli import main

sys.exit(main())
