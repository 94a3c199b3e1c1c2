"""Warnings that a flood must not turn into a flood of log lines: at most one line per interval, saying how many
were held back."""

from __future__ import annotations

import logging
import time
from typing import Any, Final

__all__ = ["INTERVAL_S", "LimitedWarning"]

INTERVAL_S: Final = 10.0


class LimitedWarning:
    """One kind of warning, logged at most once per ``interval`` seconds; the next line logged says how many were
    held back meanwhile (a peer sending garbage in a loop, a port scan, a limit hit again and again)."""

    def __init__(self, logger: logging.Logger, interval: float = INTERVAL_S) -> None:
        self._log = logger
        self._interval = interval
        self._next = 0.0
        self.held = 0
        """Warnings not logged since the last line."""

    def __call__(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now < self._next:
            self.held += 1
            return
        self._next = now + self._interval
        if self.held:
            msg += f" ({self.held} more like this in the last {self._interval:g} s were not logged)"
            self.held = 0
        self._log.warning(msg, *args)
