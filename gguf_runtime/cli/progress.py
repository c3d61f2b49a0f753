"""Progress bars for loading weights and capturing graphs: shown on a terminal only."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

ProgressFn = Callable[[str, int, int], None]


@contextmanager
def progress_bars(quiet: bool = False) -> Iterator[Optional[ProgressFn]]:
    """Yields a callback ``(label, done, total)``, or None when bars should stay hidden."""
    if quiet or not sys.stdout.isatty() or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    tasks: dict[str, int] = {}

    def update(label: str, done: int, total: int) -> None:
        if label not in tasks:
            tasks[label] = bars.add_task(label, total=total)
        bars.update(tasks[label], completed=done, total=total)

    with bars:
        yield update
