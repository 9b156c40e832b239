"""``python -m ntkgp``: the ``ntkgp`` command line (see :mod:`ntkgp.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
