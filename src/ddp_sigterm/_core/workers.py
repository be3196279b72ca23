"""Forked children: a DataLoader worker leaves the stop signals to its DataLoader's process (SLURM signals every
process of a job step), as upstream PR 6 does: it blocks them, and a thread ends it on a SIGTERM from that process
(torch's shutdown, multiprocessing's exit), dropping any other. Every child forgets the deadline's socket. One at-fork
hook outlives a run (it cannot be unregistered). Only the runtime calls this module.
"""

from __future__ import annotations

import functools
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
    # after threading's own hook (registered at its import), which resets its state: the child may start a thread
    os.register_at_fork(after_in_child=_in_forked_child)


def _in_forked_child() -> None:
    # The child inherits the stack of the fork, and a DataLoader forks its workers while creating its iterator.
    if _blocked_in_workers and any(frame.f_code is _MultiProcessingDataLoaderIter.__init__.__code__
                                   for frame, _ in traceback.walk_stack(sys._getframe())):
        signal.pthread_sigmask(signal.SIG_BLOCK, _blocked_in_workers)  # and in the threads started from here on
        if signal.SIGTERM in _blocked_in_workers:
            threading.Thread(target=_end_on_sigterm, args=(os.getppid(),), name="ddp_sigterm-worker",
                             daemon=True).start()
    _blocked_in_workers.clear()
    if _closed_in_children:  # so that the child cannot write into its parent's deadline
        signal.set_wakeup_fd(-1)
        for end in _closed_in_children:
            end.close()
        _closed_in_children.clear()


def _end_on_sigterm(loader: int) -> None:
    """A worker's SIGTERM from its DataLoader's process ``loader`` (its parent), or any once that is gone, ends it with
    0 as torch's worker does (so exits and shutdowns never wait for it); another is dropped: the run's stop ends it."""
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == loader or os.getppid() != loader:
            os._exit(0)


def block_in_dataloader_workers(signals: tuple[int, ...]) -> None:
    """DataLoader workers forked from now on block ``signals`` (other forked children do not); see the module."""
    _register_fork_hook()
    _blocked_in_workers.update(signals)


def unblock_in_dataloader_workers(signals: tuple[int, ...]) -> None:
    _blocked_in_workers.difference_update(signals)


def close_in_forked_children(*ends: socket.socket) -> None:
    """A child forked while ``ends`` are registered closes them and clears its wakeup fd."""
    _register_fork_hook()
    _closed_in_children.update(ends)


def keep_in_forked_children(*ends: socket.socket) -> None:
    _closed_in_children.difference_update(ends)
