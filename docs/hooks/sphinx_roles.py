"""mkdocs hook: show the Sphinx roles of our docstrings as code, not as raw markup.

The API reference renders docstrings with mkdocstrings, which reads their ``:param:`` fields
but leaves inline roles alone: ``:class:`~moshpit.X``` came out as ``:class:`` followed by
``~moshpit.X`` in code. This rewrites each role to its target in code, keeping only the last
component where the target starts with ``~`` (as Sphinx shows it).
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|mod|data|exc|obj|const):<code>(~?)([^<]+)</code>")


def show_role(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if short else target}</code>"


def on_page_content(html: str, **_: Any) -> str:
    return ROLE.sub(show_role, html)
