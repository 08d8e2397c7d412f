"""``python -m zerompi.memory``."""

import os
import sys

from .cli import main

try:
    status = main()
    sys.stdout.flush()
except BrokenPipeError:  # (piped into head: the reader left, nothing to say)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # (no second error when Python flushes at exit)
    status = 0
sys.exit(status)
