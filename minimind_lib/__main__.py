"""`python -m minimind_lib info|pretrain|sft|chat ...`: the command line of notebooks 07 and 08 (see
cli.py)."""

import sys

from .cli import main

sys.exit(main())
