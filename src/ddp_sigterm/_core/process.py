"""Everything the package does to the process beyond one call, in one module.

* **The package's own gloo groups** (:func:`cpu_groups`, :func:`release_cpu_group`): made by every
  rank at the same point when a coordinator starts, destroyed when it closes.
* **Forked children** (one at-fork hook, registered at the first use; it cannot be unregistered and
  does nothing while nothing is registered): a child forked by a DataLoader while a recorder is active
  blocks the stop signals (SLURM signals every process of a job step: a worker must neither act on the
  signal nor die of it; a blocked signal stays pending and the worker still ends when its loader shuts
  it down); every forked child forgets the stop deadline's descriptors, so that it cannot write into
  its parent's watch.
* **At exit**: DataLoader workers that block SIGTERM are killed (multiprocessing's exit function
  would send them SIGTERM and wait forever), registered only while a recorder is active or such a
  worker lives; after a stop of a multi-process run, the default gloo group is destroyed.
* **Leaving after a stop** (:func:`leave`): the stop signals are ignored until the process exits.

A run that gets no signal leaves nothing here once its coordinator is closed, but the at-fork hook,
which does nothing then.
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing
import multiprocessing.util  # registers its exit function first, so that ours runs before it
import os
import signal
import socket
import sys
import threading
from types import FrameType

import torch.distributed as dist
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter


class GroupUnavailable(RuntimeError):
    """The stop's own gloo groups could not be made on every rank; raised on every rank alike, the
    message names each rank that failed and why."""


# -- the package's gloo groups ---------------------------------------------------------------------
def cpu_groups(count: int, timeout_seconds: float, connect_seconds: float) -> list[dist.ProcessGroup]:
    """``count`` new gloo groups of every rank of the default group, each given ``connect_seconds`` to
    connect, then ``timeout_seconds`` for every collective; give each back with :func:`release_cpu_group`.

    Contract: every rank calls it at the same point; all of them return the groups, or all raise
    :class:`GroupUnavailable`. Gloo may fail to connect where the training's own group works (an NCCL
    job whose nodes' host names resolve to a loopback address, a second interface; docs/multi-node.md),
    and one rank may fail at once while a peer waits out the connection timeout (Gloo waits for its
    peers in turn: 5 x ``connect_seconds`` measured with 4 ranks). So after each group the ranks tell
    each other over the default group, which works if training does, and all of them stop at the first
    group that failed anywhere: every rank makes as many groups as the others, so the names torch gives
    later groups stay the same on every rank.
    """
    # torch < 2.3 cannot change a group's timeout once made: there the groups connect within timeout_seconds
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    connect = datetime.timedelta(seconds=connect_seconds if set_timeout is not None else timeout_seconds)
    made: list[dist.ProcessGroup] = []
    for _ in range(count):
        failure = None
        try:
            made.append(dist.new_group(backend="gloo", timeout=connect))
        except Exception as error:  # told to every rank below, and raised there
            failure = f"{type(error).__name__}: {error}"
        failures: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
        if any(failures):
            for group in made:
                release_cpu_group(group)
            named = "; ".join(f"global rank {rank}: {why}" for rank, why in enumerate(failures) if why)
            raise GroupUnavailable(f"the stop's own gloo group of all {len(failures)} ranks could not be made "
                                   f"(connect_timeout={connect_seconds:g} s) ({named})")
        if set_timeout is not None:
            set_timeout(datetime.timedelta(seconds=timeout_seconds), made[-1])
    return made


def release_cpu_group(group: dist.ProcessGroup) -> None:
    """Destroy a group of :func:`cpu_groups` (every rank, same point)."""
    if dist.is_initialized():
        dist.destroy_process_group(group)


# -- forked children -------------------------------------------------------------------------------
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
    if _closed_in_children:
        signal.set_wakeup_fd(-1)
        for end in _closed_in_children:
            end.close()
        _closed_in_children.clear()


def _forked_by_dataloader() -> bool:
    """The child inherits the stack of the fork: a DataLoader forks its workers while creating its
    iterator. (If torch ever moves that, workers lose the protection; nothing else changes.)"""
    frame: FrameType | None = sys._getframe()
    while frame is not None:
        if frame.f_code is _MultiProcessingDataLoaderIter.__init__.__code__:
            return True
        frame = frame.f_back
    return False


def block_in_dataloader_workers(signals: tuple[int, ...]) -> None:
    """From now on, DataLoader workers forked by this process block ``signals`` (other forked children
    keep them unblocked, as they would without the package); their exit is seen to (see module)."""
    _register_fork_hook()
    _blocked_in_workers.update(signals)
    # after multiprocessing's own exit function, so that it runs first (at most once, however often called)
    atexit.unregister(_end_blocking_workers)
    atexit.register(_end_blocking_workers)


def unblock_in_dataloader_workers(signals: tuple[int, ...]) -> None:
    """Undo :func:`block_in_dataloader_workers` for ``signals``; the exit function goes once nothing
    needs it."""
    _blocked_in_workers.difference_update(signals)
    if not _blocked_in_workers and not _blocking_workers():
        atexit.unregister(_end_blocking_workers)


def close_in_forked_children(*ends: socket.socket) -> None:
    """A child forked while ``ends`` are open closes them and clears its wakeup fd (the deadline's)."""
    _register_fork_hook()
    _closed_in_children.update(ends)


def keep_in_forked_children(*ends: socket.socket) -> None:
    """Undo :func:`close_in_forked_children`."""
    _closed_in_children.difference_update(ends)


def _end_blocking_workers() -> None:
    """multiprocessing's exit function sends SIGTERM to daemonic children and joins them: a worker
    that blocks SIGTERM would keep this process from exiting. (Linux: the mask is read from /proc.)"""
    workers = _blocking_workers()
    if workers and threading.current_thread() is threading.main_thread():
        # torch's SIGCHLD handler raises for a worker ended by a signal: here that is this kill, and the
        # exception would cut the loop short, leaving a worker that multiprocessing then waits for forever
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in workers:
        child.kill()


def _blocking_workers() -> list[multiprocessing.process.BaseProcess]:
    return [child for child in multiprocessing.active_children()
            if child.daemon and child.pid is not None and signal.SIGTERM in _blocked_signals(child.pid)]


def _blocked_signals(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigBlk:"):
                    mask = int(line.split()[1], 16)
                    return {n for n in range(1, 65) if mask & (1 << (n - 1))}
    except OSError:  # gone already, or no /proc
        pass
    return set()


# -- leaving after a stop --------------------------------------------------------------------------
_destroy_registered_by: int | None = None


def leave(signals: tuple[int, ...], destroy_default_group: bool) -> None:
    """After the agreed stop of a multi-process run the process is on its way out with 128 + signal.

    A later stop signal (torchrun sends SIGTERM to the ranks still running when the first one exits)
    must not turn that into death by the signal: ``signals`` are ignored from here on. SIG_IGN, not a
    Python handler: the interpreter resets Python handlers to SIG_DFL while it finalizes, and the exit
    of a torch process takes tens of milliseconds after that; the stop deadline still bounds the exit.
    Main thread only (elsewhere that part is a no-op). With ``destroy_default_group``, the default
    process group is destroyed at exit if it is a gloo group (``Settings.destroy_at_exit``)."""
    if threading.current_thread() is threading.main_thread():
        for signum in signals:
            signal.signal(signum, signal.SIG_IGN)
    if destroy_default_group:
        _destroy_default_group_at_exit()


def _destroy_default_group_at_exit() -> None:
    """Registered once per process (a forked child does not run its parent's registration). Only gloo:
    its group alive at exit is what aborts the interpreter, and destroying an NCCL group after a peer
    crashed can wait for that peer (Lightning registers its own exit handler for NCCL)."""
    global _destroy_registered_by
    if _destroy_registered_by == os.getpid():
        return
    _destroy_registered_by = os.getpid()
    atexit.register(_destroy_default_group, os.getpid())


def _destroy_default_group(owner: int) -> None:
    if os.getpid() == owner and dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()
