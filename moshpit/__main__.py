"""Entry point for ``python -m moshpit``."""

import sys

from moshpit.cli import main

sys.exit(main())
