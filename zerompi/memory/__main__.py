"""``python -m zerompi.memory``."""

import sys

from .cli import main

sys.exit(main())
