"""Saving at the agreed stop, so that every rank learns whether it worked.

A checkpoint written at a stop is written once, by ranks that are about to exit: a failure on one rank
must not leave the others waiting in a barrier, and a file cut short must never look like a checkpoint
that resuming would pick. :func:`save_in_unison` gives any framework that: every rank takes part in
writing a temporary file, every rank learns whether every rank succeeded, and only then does the
writing rank give the file its final name. Used by the Trainer callback, by
:func:`ddp_sigterm.fabric.save_at_stop`, and directly by plain torch.distributed loops.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ddp_sigterm._core import log
from ddp_sigterm._core.coordinator import StopCoordinator

PARTIAL_NAME = ".ddp_sigterm-partial.ckpt"
T = TypeVar("T")


class StopError(RuntimeError):
    """Saving the agreed stop checkpoint (or requeueing the job) failed on some rank; every rank
    raises it, and the message names the rank, the step and the reason."""


def save_in_unison(stop: StopCoordinator, write: Callable[[str], Any], path: str, *, writer: bool,
                   step: int | None = None) -> str | None:
    """At the agreed stop, on every rank: ``write(partial)``, where ``partial`` is a temporary file
    beside ``path`` (a collective save such as ``fabric.save``, or ``torch.save`` on the writing rank
    and nothing elsewhere). The writing rank (``writer``: one rank, usually global rank 0) checks the
    file is there; once every rank reports success, it renames it to ``path``. A failure on any rank
    raises :class:`StopError` on every rank, naming the rank and the reason. Every rank must call it at the
    same point; it ends with every rank past the save (it is also the barrier). Returns the final path
    on the writing rank, None elsewhere. ``step`` (for messages) defaults to the agreed stop's. Every rank
    logs the path and how long the save took."""
    if step is None and stop.decision is not None:
        step = stop.decision.step
    directory = os.path.dirname(path) or "."
    partial = os.path.join(directory, PARTIAL_NAME)
    what = f"saving the stop checkpoint of step {step} in {directory}"
    stop.activity = what

    def write_and_check() -> None:
        write(partial)
        if writer and not os.path.exists(partial):
            _raise_why_not_written(partial)

    def rename() -> str | None:
        if not writer:
            return None
        os.replace(partial, path)
        return path

    started = time.monotonic()
    in_unison(stop, write_and_check, what, step)
    final = in_unison(stop, rename, f"naming the stop checkpoint of step {step} in {directory}", step)
    log.logger.info("rank %d of %d: the stop checkpoint of step %s is saved: %s (%.3f s, every rank)", stop.rank,
                    stop.world_size, step, path, time.monotonic() - started)
    return final


def in_unison(stop: StopCoordinator, action: Callable[[], T], what: str, step: int | None) -> T:
    """Run this rank's part of ``what`` after the agreed stop; every rank then reports whether its
    part raised, and if it failed anywhere, every rank raises :class:`StopError` (with this rank's own
    error as the cause, where it has one). Returns ``action()``'s result. Every rank must call it at
    the same point: it is also the barrier that ends ``what``."""
    try:
        result = action()
    except Exception as error:  # every rank must learn of it: reported, then raised as StopError
        stop.all_succeeded(False, what, step)
        raise StopError(f"ddp_sigterm: rank {stop.rank}: every rank stopped at step {step}, but {what} failed: "
                        f"{type(error).__name__}: {error}") from error
    failed = stop.all_succeeded(True, what, step)
    if failed is None:
        return result
    raise StopError(f"ddp_sigterm: rank {stop.rank}: every rank stopped at step {step}, but {what} failed on rank "
                    f"{failed} (its log has the reason)")


def _raise_why_not_written(partial: str) -> None:
    """Lightning (2.6.6) returns from a save that a PermissionError stopped as if it had succeeded
    (``_atomic_save`` re-raises only EXDEV); find the reason by creating a file where it should be."""
    probe = os.path.join(os.path.dirname(partial), ".ddp_sigterm-probe")
    with open(probe, "wb"):  # raises the file system's reason, e.g. PermissionError
        pass
    os.remove(probe)
    raise OSError(f"{partial} is missing after a save that reported no error")
