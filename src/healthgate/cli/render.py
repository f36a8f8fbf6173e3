"""Plain-text tables for the terminal (no dependency: the output is simple).

A table never cuts text: on a terminal narrower than a row, the last column
(the reason, usually the longest) wraps onto indented continuation lines;
when the output is not a terminal (a pipe, a file), rows are never wrapped,
so scripts read whole lines.
"""

from __future__ import annotations

import shutil
import sys
import textwrap
from collections.abc import Sequence

MIN_WRAP = 20  # narrower than this for the last column: no wrapping (it would be unreadable)


def terminal_width() -> int:
    """The terminal's width, or 0 when standard output is not a terminal."""
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else 0


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int | None = None) -> str:
    width = terminal_width() if width is None else width
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row[:-1]):
            widths[i] = max(widths[i], len(cell))
    indent = sum(widths[:-1]) + 2 * (len(widths) - 1)
    lines = []
    for row in [list(headers), *rows]:
        head = "".join(c.ljust(widths[i]) + "  " for i, c in enumerate(row[:-1]))
        last = row[-1]
        if width and len(head) + len(last) > width and width - indent >= MIN_WRAP:
            chunks = textwrap.wrap(last, width - indent, break_on_hyphens=False) or [""]
            lines.append(head + chunks[0])
            lines += [" " * indent + chunk for chunk in chunks[1:]]
        else:
            lines.append((head + last).rstrip())
    return "\n".join(lines)
