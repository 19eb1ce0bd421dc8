"""Progress of a bench run on stderr: a rich bar on a terminal, else one line per round or measurement."""

from __future__ import annotations

import math
import sys
import time


class ProgressReporter:
    """Counts runs (one per variant and measurement); `log` lines carry the elapsed time and an estimate left."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

                self.bar = Progress(TextColumn("{task.description:<40}"), BarColumn(),
                                    TextColumn("{task.completed}/{task.total} steps"),
                                    TimeElapsedColumn(), TimeRemainingColumn(),
                                    console=Console(file=sys.stderr), transient=True)
                self.task = self.bar.add_task("starting", total=total)
                self.bar.start()
            except ImportError:
                self.bar = None

    def advance(self, description: str, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(self.task, advance=n, description=description)

    def log(self, message: str) -> None:
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        line = f"[{_minutes_seconds(elapsed)} elapsed, ~{_minutes_seconds(eta)} left] {message}"
        if self.bar is not None:
            self.bar.console.print(line, highlight=False)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _minutes_seconds(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"
