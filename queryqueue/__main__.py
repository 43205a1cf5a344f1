"""`python -m queryqueue`: the `queryqueue` command."""

import sys

from queryqueue.cli import main

sys.exit(main())
