"""Rendering helpers shared by the CLI's live displays (``moshpit demo``, ``moshpit train``)."""

from __future__ import annotations

from typing import Any

# columns a live display leaves free at the right edge of the terminal (see SpareColumns)
SPARE_COLUMNS = 2


class SpareColumns:
    """Renders ``renderable`` ``spare`` columns narrower than the terminal.

    Why: rich's Live redraws a frame by moving the cursor up from the end of the frame's last
    line. On Ctrl-C the terminal echoes "^C" at the cursor; when the last line reaches the last
    column, that echo wraps to a new line, the redraw then starts one line too low and leaves the
    old first line (the table's title) on screen: the title printed twice. Two free columns leave
    room for the echo.
    """

    def __init__(self, renderable: Any, spare: int = SPARE_COLUMNS) -> None:
        self.renderable = renderable
        self.spare = spare

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield from console.render(
            self.renderable, options.update_width(max(1, options.max_width - self.spare))
        )
