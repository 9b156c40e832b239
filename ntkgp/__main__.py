"""``python -m ntkgp``: the ``ntkgp`` command line (see :mod:`ntkgp.cli`)."""

import sys

from .cli import main

sys.exit(main())
