"""`python -m queryqueue`: the `queryqueue` command."""

import sys

from queryqueue.supervisor.cli import main

sys.exit(main())
