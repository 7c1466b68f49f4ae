"""Terminal progress for planning: stages and a bar, shown only when it helps.

:class:`TerminalProgress` is the ``progress(stage, done, total)`` callback that
``autopar.plan`` calls.  It draws nothing for the first ``delay_s`` seconds (quick plans
stay quiet) and nothing at all when the stream is not a terminal (logs and pipes stay
clean); after that it shows the current stage and a bar of ``done / total`` with rich,
on stderr, and clears it when closed.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

__all__ = ["TerminalProgress"]


class TerminalProgress:
    """A ``progress(stage, done, total)`` callback drawing a rich bar on a terminal."""

    def __init__(self, stream: IO[str] | None = None, *, delay_s: float = 1.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.delay_s = delay_s
        self.start = time.perf_counter()
        self._bar: Any = None
        self._task: Any = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.enabled or (self._bar is None and time.perf_counter() - self.start < self.delay_s):
            return
        if self._bar is None:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TaskProgressColumn(),
                TimeElapsedColumn(),
                console=Console(file=self.stream),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(stage, total=max(total, 1))
        self._bar.update(self._task, description=stage, completed=done, total=max(total, 1))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> TerminalProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
