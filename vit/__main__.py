"""``python -m qvl.vit``: the ``qvl`` command line (see :mod:`qvl.vit.cli`)."""

import sys

from .cli import main

sys.exit(main())
