"""Saving at the agreed stop, so that every rank learns whether it worked.

A checkpoint written at a stop is written once, by ranks that are about to exit: a failure on one rank
must not leave the others waiting in a barrier, and a file cut short must never look like a checkpoint
that resuming would pick. :func:`save_in_unison` gives any framework that: every rank takes part in
writing a temporary file, every rank learns whether every rank succeeded, and only then does the
writing rank give the file its final name. Paths are local paths or fsspec URLs (``file://``,
``s3://``, ... as Lightning accepts them); the name is given by the file system's move, a rename on a
local disk. Used by the Trainer callback, by :func:`ddp_sigterm.fabric.save_at_stop`, and directly by
plain torch.distributed loops.
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
    """Saving the agreed stop checkpoint (or requeueing the job) failed on some rank; every rank
    raises it, and the message names the rank, the step and the reason. It ends the process with
    :data:`~ddp_sigterm._core.exit_codes.STOP_FAILED` (200, retryable: the job was told to stop) unless
    caught; the message is logged at ERROR on every rank when it is raised, as Python prints no
    traceback for a ``SystemExit``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = exit_codes.STOP_FAILED

    def __str__(self) -> str:
        return str(self.args[0])


def save_in_unison(stop: StopCoordinator, write: Callable[[str], Any], path: str, *, writer: bool,
                   step: int | None = None) -> str | None:
    """At the agreed stop, on every rank: ``write(partial)``, where ``partial`` is a temporary file
    beside ``path`` (a collective save such as ``fabric.save``, or ``torch.save`` on the writing rank
    and nothing elsewhere). The writing rank (``writer``: one rank, usually global rank 0) checks the
    file is there; once every rank reports success, it moves it to ``path`` (a local path or an fsspec
    URL). A failure on any rank raises :class:`StopError` on every rank, naming the rank and the reason,
    and the writing rank removes the temporary file. Every rank must call it at the
    same point; it ends with every rank past the save (it is also the barrier). Returns the final path
    on the writing rank, None elsewhere. ``step`` (for messages) defaults to the agreed stop's. Every rank
    logs the path and how long the save took."""
    if step is None and stop.decision is not None:
        step = stop.decision.step
    path = str(path)
    fs, target = url_to_fs(path)
    directory = path.rsplit("/", 1)[0] if "/" in path else "."
    partial = f"{directory}/{PARTIAL_NAME}"  # in the form given: the write function may be fsspec's or not
    _, directory_target = url_to_fs(directory)
    partial_target = f"{directory_target}/{PARTIAL_NAME}"
    what = f"saving the stop checkpoint of step {step} in {directory}"

    def write_and_check() -> None:
        write(partial)
        if writer:
            fs.invalidate_cache(directory_target)  # an object store's listing may be cached
            if not fs.exists(partial_target):
                _raise_why_not_written(fs, directory_target, partial_target)

    def rename() -> str | None:
        if not writer:
            return None
        fs.mv(partial_target, target)
        return path

    started = time.monotonic()
    try:
        with stop.integration.waiting_for(what):
            in_unison(stop, write_and_check, what, step)
        naming = f"naming the stop checkpoint of step {step} in {directory}"
        with stop.integration.waiting_for(naming):
            final = in_unison(stop, rename, naming, step)
    except StopError:
        if writer:
            _remove_partial(fs, partial_target)
        raise
    inner = stop.integration
    log.logger.info("rank %d of %d: the stop checkpoint of step %s is saved: %s (%.3f s, every rank)", inner.rank,
                    inner.world_size, step, path, time.monotonic() - started)
    return final


def in_unison(stop: StopCoordinator, action: Callable[[], T], what: str, step: int | None) -> T:
    """Run this rank's part of ``what`` after the agreed stop; every rank then reports whether its
    part raised, and if it failed anywhere, every rank raises :class:`StopError` (with this rank's own
    error as the cause, where it has one). Returns ``action()``'s result. Every rank must call it at
    the same point: it is also the barrier that ends ``what``."""
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
    """Lightning (2.6.6) returns from a save that a PermissionError stopped as if it had succeeded
    (``_atomic_save`` re-raises only EXDEV); find the reason by creating a file where it should be."""
    probe = f"{directory}/.ddp_sigterm-probe"
    with fs.open(probe, "wb"):  # raises the file system's reason, e.g. PermissionError
        pass
    fs.rm(probe)
    raise OSError(f"{partial} is missing after a save that reported no error")


def _remove_partial(fs: Any, partial: str) -> None:
    """After a failed save, the writing rank removes what was written of the temporary file; a removal
    that fails is logged (the stop's own error is the one raised)."""
    try:
        if fs.exists(partial):
            fs.rm(partial, recursive=True)
    except Exception as error:  # the StopError on its way out is the error that matters; this one is logged
        log.logger.warning("could not remove the partial stop checkpoint %s: %s: %s", partial,
                           type(error).__name__, error)
