"""Terminal helpers shared by the CLI and the demo."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


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
