"""Forked children: DataLoader workers block the stop signals (SLURM signals every process of a job step), are killed
at exit (multiprocessing would SIGTERM them and wait forever), and every child forgets the deadline's socket. One
at-fork hook outlives a run (it cannot be unregistered). Only the runtime calls this module.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import multiprocessing.util  # registers its exit function first, so that ours runs before it
import os
import signal
import socket
import sys
import threading
import traceback

from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter  # in runtime.TORCH_INTERNALS

_blocked_in_workers: set[int] = set()  # the stop signals a DataLoader worker forked now blocks
_closed_in_children: set[socket.socket] = set()  # the deadline's ends of its wakeup socket pair


@functools.cache  # once: an at-fork hook cannot be unregistered (it does nothing while nothing is registered)
def _register_fork_hook() -> None:
    os.register_at_fork(after_in_child=_in_forked_child)


def _in_forked_child() -> None:
    # The child inherits the stack of the fork, and a DataLoader forks its workers while creating its iterator.
    if _blocked_in_workers and any(frame.f_code is _MultiProcessingDataLoaderIter.__init__.__code__
                                   for frame, _ in traceback.walk_stack(sys._getframe())):
        signal.pthread_sigmask(signal.SIG_BLOCK, _blocked_in_workers)
    _blocked_in_workers.clear()
    if _closed_in_children:  # so that the child cannot write into its parent's deadline
        signal.set_wakeup_fd(-1)
        for end in _closed_in_children:
            end.close()
        _closed_in_children.clear()


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
            if child.daemon and child.pid is not None and _blocks_sigterm(child.pid)]


def _blocks_sigterm(pid: int) -> bool:
    """Whether ``pid`` blocks SIGTERM, read from /proc (Linux); False if it is gone or there is no /proc."""
    try:
        with open(f"/proc/{pid}/status") as status:
            blocked = next(line for line in status if line.startswith("SigBlk:")).split()[1]
    except (OSError, StopIteration):
        return False
    return bool(int(blocked, 16) & (1 << (signal.SIGTERM - 1)))
