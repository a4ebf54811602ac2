"""A one-line text progress bar on stderr (rank 0 only); no dependency.

On a terminal it redraws in place; in a log (not a TTY) it prints a line every tenth of the way.
"""
from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


class Progress:
    def __init__(self, total: int, enabled: bool, width: int = 30) -> None:
        self.total, self.enabled, self.width = max(1, total), enabled, width
        self.done = 0
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._last_tenth = -1

    def advance(self, label: str, units: int = 1) -> None:
        self.done = min(self.total, self.done + units)
        if not self.enabled:
            return
        fraction = self.done / self.total
        filled = int(fraction * self.width)
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {time.perf_counter() - self.start:5.0f}s  {label}"
        if self.tty:
            sys.stderr.write("\r" + line[:120].ljust(120))
            sys.stderr.flush()
        elif int(fraction * 10) > self._last_tenth:
            self._last_tenth = int(fraction * 10)
            print(line, file=sys.stderr, flush=True)

    def grow(self, units: int) -> None:
        """More work discovered (e.g. warm-compile rebuilds once the modes that compiled are known)."""
        self.total += units

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()
