"""`python -m torchtosa`: the `torchtosa` command (runtime/cli.py)."""

import sys

from .cli import main

sys.exit(main())
