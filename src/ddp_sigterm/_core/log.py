"""The package's log: ``logging.getLogger("ddp_sigterm")``, on every rank (docs/configuration.md). Never used in
a signal handler or the deadline's thread, which may end the process while another thread holds a handler's lock."""

from __future__ import annotations

import datetime
import logging
import time

logger = logging.getLogger("ddp_sigterm")


def activate(level: str) -> None:
    """Set the level; where no handler would show the lines (logging never configured), write to stderr."""
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
