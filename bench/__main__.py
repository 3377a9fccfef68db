"""``python -m bench``: every benchmark in one run (see :mod:`bench.run_all`)."""

from .run_all import main

raise SystemExit(main())
