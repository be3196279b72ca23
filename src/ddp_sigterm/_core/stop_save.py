"""Saving at the agreed stop: every rank writes its part of a temporary file and learns whether all succeeded, and
only then is the file moved to its name (a local path or an fsspec URL). So a failure on one rank leaves no other
waiting in a barrier, and a file cut short never looks like a checkpoint a resume would pick.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from fsspec.core import url_to_fs

from ddp_sigterm._core import exit_codes, log
from ddp_sigterm._core.coordinator import StopCoordinator

PARTIAL_NAME = ".ddp_sigterm-partial.ckpt"
T = TypeVar("T")


class StopError(SystemExit):
    """Saving the stop checkpoint (or requeueing) failed on some rank; raised on every rank, naming the rank, the
    step and the reason (logged at ERROR: a ``SystemExit`` prints no traceback). Exits with ``STOP_FAILED``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = exit_codes.STOP_FAILED  # str() is still the message (the first argument)


def save_in_unison(stop: StopCoordinator, write: Callable[[str], Any], path: str, *, writer: bool,
                   step: int | None = None) -> str | None:
    """At the agreed stop, every rank at the same point (a barrier): ``write(partial)``, a temporary file beside
    ``path``, which the ``writer`` rank moves to ``path`` (and returns it; None elsewhere) once every rank succeeded.
    A failure anywhere raises :class:`StopError` on every rank. ``step`` (for messages): the agreed stop's."""
    if step is None and stop.decision is not None:
        step = stop.decision.step
    path = str(path)
    fs, target = url_to_fs(path)
    directory = path.rsplit("/", 1)[0] if "/" in path else "."
    partial = f"{directory}/{PARTIAL_NAME}"  # in the form given: the write function may be fsspec's or not
    _, directory_target = url_to_fs(directory)
    partial_target = f"{directory_target}/{PARTIAL_NAME}"

    def write_and_check() -> None:
        write(partial)
        if writer:
            fs.invalidate_cache(directory_target)  # an object store's listing may be cached
            if not fs.exists(partial_target):
                _raise_why_not_written(fs, directory_target, partial_target)

    def rename() -> None:
        if writer:
            fs.mv(partial_target, target)

    started = time.monotonic()
    try:
        for action, what in ((write_and_check, f"saving the stop checkpoint of step {step} in {directory}"),
                             (rename, f"naming the stop checkpoint of step {step} in {directory}")):
            with stop.integration.waiting_for(what):
                in_unison(stop, action, what, step)
    except StopError:
        if writer:
            _remove_partial(fs, partial_target)
        raise
    inner = stop.integration
    log.logger.info("rank %d of %d: the stop checkpoint of step %s is saved: %s (%.3f s, every rank)", inner.rank,
                    inner.world_size, step, path, time.monotonic() - started)
    return path if writer else None


def in_unison(stop: StopCoordinator, action: Callable[[], T], what: str, step: int | None) -> T:
    """``action()``, this rank's part of ``what``, every rank at the same point (a barrier); if it raised on any rank,
    every rank raises :class:`StopError` (chaining its own error)."""
    try:
        result = action()
    except Exception as error:  # every rank must learn of it: reported, then raised as StopError
        stop.integration.lowest_failed_rank(False, what, step)
        message = (f"ddp_sigterm: rank {stop.integration.rank}: every rank stopped at step {step}, but {what} failed: "
                   f"{type(error).__name__}: {error}")
        log.logger.error("%s; exiting with %d", message, exit_codes.STOP_FAILED, exc_info=error)
        raise StopError(message) from error
    failed = stop.integration.lowest_failed_rank(True, what, step)
    if failed is None:
        return result
    message = (f"ddp_sigterm: rank {stop.integration.rank}: every rank stopped at step {step}, but {what} failed "
               f"on rank {failed} (its log has the reason)")
    log.logger.error("%s; exiting with %d", message, exit_codes.STOP_FAILED)
    raise StopError(message)


def _raise_why_not_written(fs: Any, directory: str, partial: str) -> None:
    """Lightning (2.6.6) returns from a save a PermissionError stopped as if it succeeded (``_atomic_save``
    re-raises only EXDEV): find the reason by creating a file there."""
    probe = f"{directory}/.ddp_sigterm-probe"
    with fs.open(probe, "wb"):  # raises the file system's reason, e.g. PermissionError
        pass
    fs.rm(probe)
    raise OSError(f"{partial} is missing after a save that reported no error")


def _remove_partial(fs: Any, partial: str) -> None:
    try:
        if fs.exists(partial):
            fs.rm(partial, recursive=True)
    except Exception as error:  # the StopError on its way out is the error that matters; this one is logged
        log.logger.warning("could not remove the partial stop checkpoint %s: %s: %s", partial,
                           type(error).__name__, error)
