"""Forked children: DataLoader workers block the stop signals, and every child forgets the deadline's socket.

SLURM signals every process of a job step: a DataLoader worker must neither act on a stop signal nor die of
it, so while a recorder is active a worker forked by a DataLoader blocks the stop signals (they stay pending;
it still ends when its loader shuts it down), and at exit such workers are killed, since multiprocessing
would send them SIGTERM and wait forever. Module state, as it outlives a run: one at-fork hook (it cannot be
unregistered, and does nothing while nothing is registered). Only the runtime calls this module.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util  # registers its exit function first, so that ours runs before it
import os
import signal
import socket
import sys
import threading
from types import FrameType

from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter  # in runtime.TORCH_INTERNALS

_blocked_in_workers: set[int] = set()  # the stop signals a DataLoader worker forked now blocks
_closed_in_children: set[socket.socket] = set()  # the deadline's ends of its wakeup socket pair
_fork_hook_registered = False


def _register_fork_hook() -> None:
    global _fork_hook_registered
    if not _fork_hook_registered:
        os.register_at_fork(after_in_child=_in_forked_child)
        _fork_hook_registered = True


def _in_forked_child() -> None:
    if _blocked_in_workers and _forked_by_dataloader():
        signal.pthread_sigmask(signal.SIG_BLOCK, _blocked_in_workers)
    _blocked_in_workers.clear()
    if _closed_in_children:  # so that the child cannot write into its parent's deadline
        signal.set_wakeup_fd(-1)
        for end in _closed_in_children:
            end.close()
        _closed_in_children.clear()


def _forked_by_dataloader() -> bool:
    """The child inherits the stack of the fork, and a DataLoader forks its workers while creating its
    iterator. (If torch ever moves that, workers lose the protection; nothing else changes.)"""
    frame: FrameType | None = sys._getframe()
    while frame is not None:
        if frame.f_code is _MultiProcessingDataLoaderIter.__init__.__code__:
            return True
        frame = frame.f_back
    return False


def block_in_dataloader_workers(signals: tuple[int, ...]) -> None:
    """DataLoader workers forked from now on block ``signals`` (other forked children do not), and such
    workers are killed at exit."""
    _register_fork_hook()
    _blocked_in_workers.update(signals)
    # after multiprocessing's own exit function, so that it runs first (at most once, however often called)
    atexit.unregister(_end_blocking_workers)
    atexit.register(_end_blocking_workers)


def unblock_in_dataloader_workers(signals: tuple[int, ...]) -> None:
    """Undo :func:`block_in_dataloader_workers` for ``signals``; the exit function goes once nothing needs it."""
    _blocked_in_workers.difference_update(signals)
    if not _blocked_in_workers and not _blocking_workers():
        atexit.unregister(_end_blocking_workers)


def close_in_forked_children(*ends: socket.socket) -> None:
    """A child forked while ``ends`` are registered closes them and clears its wakeup fd."""
    _register_fork_hook()
    _closed_in_children.update(ends)


def keep_in_forked_children(*ends: socket.socket) -> None:
    _closed_in_children.difference_update(ends)


def _end_blocking_workers() -> None:
    """Kill the daemonic children that block SIGTERM, which multiprocessing's exit function would wait for."""
    workers = _blocking_workers()
    if workers and threading.current_thread() is threading.main_thread():
        # torch's SIGCHLD handler raises for a worker ended by a signal: that exception would cut this loop
        # short, leaving a worker that multiprocessing then waits for forever
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in workers:
        child.kill()


def _blocking_workers() -> list[multiprocessing.process.BaseProcess]:
    return [child for child in multiprocessing.active_children()
            if child.daemon and child.pid is not None and signal.SIGTERM in _blocked_signals(child.pid)]


def _blocked_signals(pid: int) -> set[int]:
    """The signals ``pid`` blocks, read from /proc (Linux); none if it is gone or there is no /proc."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigBlk:"):
                    mask = int(line.split()[1], 16)
                    return {n for n in range(1, 65) if mask & (1 << (n - 1))}
    except OSError:
        pass
    return set()
