"""``python -m mpkern ...`` is the ``mpkern`` command line."""

from .cli import main

raise SystemExit(main())
