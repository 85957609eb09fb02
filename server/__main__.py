"""`python -m server ...`: the same as the `gradient-inspector` command."""

import sys

from .cli import main

sys.exit(main())
