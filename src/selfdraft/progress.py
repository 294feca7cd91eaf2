"""Progress reporting for long jobs: a tqdm bar on a terminal, periodic plain lines otherwise.

tqdm redraws one line with carriage returns ten times a second; written to a file or a pipe that
is an unreadable blob, and `disable=None` (tqdm's "not a terminal") silences it entirely. When the
stream is not a terminal, `progress_bar` prints one complete line every SELFDRAFT_PROGRESS_INTERVAL
seconds (default 30) plus a final one: done/total, elapsed<ETA and the average rate since the start.
"""

from __future__ import annotations

import os
import sys
import time

from tqdm import tqdm

DEFAULT_INTERVAL_S = 30.0


def _is_terminal(file) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class LogProgress(tqdm):
    """tqdm that writes whole lines, at most one per `interval` seconds (the first and last always)."""

    def __init__(self, *args, interval: float = DEFAULT_INTERVAL_S, **kwargs) -> None:
        # set before tqdm's first display()
        self._interval, self._last_line, self._logged_n = interval, float("-inf"), None
        total = kwargs.get("total")
        if total is None and args and hasattr(args[0], "__len__"):
            total = len(args[0])
        kwargs.setdefault("bar_format", "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}, "
                          "{rate_fmt}{postfix}]" if total else "{desc}: {n_fmt} [{elapsed}, {rate_fmt}{postfix}]")
        kwargs.setdefault("smoothing", 0.0)  # a rate over the whole run: lines far apart, no short-term noise
        kwargs.setdefault("mininterval", min(interval, 1.0))
        super().__init__(*args, **kwargs)

    def display(self, msg=None, pos=None, force: bool = False) -> bool:
        if msg == "":  # tqdm clearing its line: nothing to clear in a log
            return False
        now = time.monotonic()
        if not force and now - self._last_line < self._interval:
            return True
        self._last_line, self._logged_n = now, self.n
        self.fp.write((self.__str__() if msg is None else msg) + "\n")
        self.fp.flush()
        return True

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        super().set_postfix(ordered_dict, refresh=False, **kwargs)  # shown on the next line, not a line of its own

    def clear(self, nolock: bool = False) -> None:
        pass  # lines are never redrawn

    def close(self) -> None:
        if not self.disable and self.n != self._logged_n:
            self.display(force=True)  # the final count, rate and elapsed time
        self.leave = False  # tqdm's own close would redraw and add a newline
        super().close()


def progress_bar(iterable=None, *, file=None, disable: bool = False, interval: float | None = None, **kwargs) -> tqdm:
    """A tqdm bar on a terminal; log lines (LogProgress) when `file` (default stderr) is a file or a pipe.

    `disable` is a plain bool: unlike tqdm's `disable=None`, a non-terminal still gets progress.
    """
    file = file if file is not None else sys.stderr
    if disable or _is_terminal(file):
        kwargs.setdefault("dynamic_ncols", True)
        return tqdm(iterable, file=file, disable=disable, **kwargs)
    if interval is None:
        interval = float(os.environ.get("SELFDRAFT_PROGRESS_INTERVAL", DEFAULT_INTERVAL_S))
    return LogProgress(iterable, file=file, interval=interval, **kwargs)
