"""``python -m zerompi.bench``: see :mod:`zerompi.bench`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
