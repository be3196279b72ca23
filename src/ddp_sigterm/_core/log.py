"""The package's log: ``logging.getLogger("ddp_sigterm")``, on every rank.

A stop logs, at INFO, on every rank: which signal, which rank received it and when, the agreed step,
the stop checkpoint and how long saving it took. A run that gets no signal logs nothing at INFO. Nothing
is logged from a signal handler (a handler only records) or from the deadline's thread (it may end the
process while the main thread holds a handler's lock: it writes to stderr directly).

The level is ``Settings.log_level`` (``DDP_SIGTERM_LOG_LEVEL``), set when a coordinator starts. If
neither this logger nor the root logger has a handler then (a script that never configured logging),
starting adds one that writes to stderr, as Lightning does for its own logger, so that the lines reach
the job's log; a script that configured logging gets them through its own handlers.
"""

from __future__ import annotations

import datetime
import logging
import time

logger = logging.getLogger("ddp_sigterm")


def activate(level: str) -> None:
    logger.setLevel(level)
    if not logger.handlers and not logging.getLogger().hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def wall_clock(monotonic: float) -> str:
    """A ``time.monotonic()`` value of this process as local wall-clock time, to the millisecond."""
    moment = time.time() - (time.monotonic() - monotonic)
    return datetime.datetime.fromtimestamp(moment).isoformat(sep=" ", timespec="milliseconds")
