"""Entry point for ``python -m moshpit``."""

from moshpit.cli import console

console()
