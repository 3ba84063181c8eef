"""Terminal helpers shared by the CLI and the demo."""

from __future__ import annotations

import os

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

# Columns when writing to a pipe or file: wider than any table's natural width, so
# tables keep whole names (rich pads nothing to the width; a table only shrinks).
LOG_WIDTH = 1000


def make_console(stderr: bool = False) -> Console:
    """A console for the CLI. On a terminal, rich's own choices; into a pipe or a log
    file, no colours (rich drops them there) and lines as long as a table needs:
    rich's 80-column default cut names to "a…" and "degrad…" (``$COLUMNS`` wins)."""
    console = Console(stderr=stderr)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(stderr=stderr, width=LOG_WIDTH)
    return console


class fleet_progress:
    """A progress bar fed by ``LocalFleet.start(progress=...)``."""

    def __init__(self, console: Console, title: str = "starting emulated hosts"):
        self._bar = Progress(TextColumn("{task.description}"), BarColumn(),
                             MofNCompleteColumn(), TimeElapsedColumn(), console=console)
        self._title = title
        self._task = None

    def __enter__(self):
        self._bar.start()

        def update(message: str, done: int, total: int) -> None:
            if self._task is None:
                self._task = self._bar.add_task(self._title, total=total)
            self._bar.update(self._task, completed=done, total=total,
                             description=f"{self._title}: {message}")

        return update

    def __exit__(self, *exc):
        self._bar.stop()
