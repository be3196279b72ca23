"""The runtime: the one owner of everything the package does to the process.

A coordinator has one :class:`Runtime`; its :meth:`~Runtime.start` and :meth:`~Runtime.close`, each
safe to call twice, are the only code of the package that

* makes and destroys the package's gloo groups (:meth:`Runtime.make_groups`);
* installs and restores signal handlers: the recording handler, chained to the one it replaces; SIG_IGN
  for the stop signals while the process leaves after a stop; and raises again a stop signal that came
  after the run's last agreement;
* starts and joins the package's threads (the heartbeat's, the stop deadline's and the cloud notice
  watch's: :class:`Heartbeat`, :class:`Deadline` and :class:`NoticeWatch` are their bodies and state,
  nothing more) and sets the interpreter's wakeup fd;
* registers the at-fork hook and the exit functions (below);
* runs an integration's effects at the agreed stop (``on_stop``: retiring Lightning's launcher watch).

What outlives one runtime is module state, here too:

* **Forked children** (one at-fork hook, registered at the first use; it cannot be unregistered and
  does nothing while nothing is registered): a child forked by a DataLoader while a recorder is active
  blocks the stop signals (SLURM signals every process of a job step: a worker must neither act on the
  signal nor die of it; a blocked signal stays pending and the worker still ends when its loader shuts
  it down); every forked child forgets the stop deadline's descriptors, so that it cannot write into
  its parent's watch.
* **At exit**: DataLoader workers that block SIGTERM are killed (multiprocessing's exit function
  would send them SIGTERM and wait forever), registered only while a recorder is active or such a
  worker lives; after a stop of a multi-process run, the default gloo group is destroyed; a heartbeat
  still running (the process exits without ``close()``) is ended first.

The way out after a stop of several ranks, 128 + the signal, is kept by :meth:`Runtime.close` (the
stop signals ignored until the process exits, the default gloo group destroyed at exit) and, in
Lightning, by the two effects the Trainer integration names in ``_lightning/internals.py``: the
handlers Lightning restores at teardown become SIG_IGN, and its launcher watch is retired.

A run that gets no signal leaves nothing here once its runtime is closed, but the at-fork hook,
which does nothing then.
"""

from __future__ import annotations

import atexit
import datetime
import math
import multiprocessing
import multiprocessing.util  # registers its exit function first, so that ours runs before it
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType

import torch.distributed as dist
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from ddp_sigterm._core import log
from ddp_sigterm._core.deadline import Deadline
from ddp_sigterm._core.decision import StopDecision
from ddp_sigterm._core.notices import POLL_TIMEOUT, Notice, NoticeWatch
from ddp_sigterm._core.port import Heartbeat
from ddp_sigterm._core.signals import Handler, SignalRecorder, chains_to, default_action

# Seconds close() waits, beyond one heartbeat period, for the heartbeat to end on a peer that is late.
_CLOSE_SECONDS = 5.0

TORCH_INTERNALS = (
    ("torch.utils.data.dataloader", "_MultiProcessingDataLoaderIter.__init__",
     "the fork hook knows a DataLoader's worker by the frame that forked it"),
    ("torch.distributed.distributed_c10d", "_set_pg_timeout",
     "the package's groups connect within connect_timeout, then wait up to agreement_timeout (torch >= 2.3)"),
)
"""Every private name of torch the package reaches: (module, name, what for). tests/test_internals.py, the canary,
fails naming one that is gone."""


class GroupUnavailable(RuntimeError):
    """The stop's own gloo groups could not be made on every rank; raised on every rank alike, the
    message names each rank that failed and why."""


class Runtime:
    """The process-wide effects of one coordinator (see module): ``recorder``'s handlers for its signals
    but ``routed`` (those a framework hands :meth:`SignalRecorder.record` itself), the threads, the wakeup
    fd, the groups, and ``on_stop``, called in order with the decision at the agreed stop (an exception
    propagates). :meth:`start` once, :meth:`close` once; either again does nothing."""

    def __init__(self, recorder: SignalRecorder, routed: tuple[int, ...] = (),
                 on_stop: Sequence[Callable[[StopDecision], None]] = ()) -> None:
        self.recorder = recorder
        self._routed = tuple(routed)
        self._on_stop = tuple(on_stop)
        self._previous: dict[int, Handler] = {}  # the handlers the recording handler replaced
        self._groups: list[dist.ProcessGroup] = []
        self._heartbeat: tuple[Heartbeat, threading.Thread] | None = None
        self._deadline: tuple[Deadline, threading.Thread] | None = None
        self._watch: tuple[NoticeWatch, threading.Thread] | None = None
        self._started = self._closed = False

    # -- start ---------------------------------------------------------------------------------
    def make_groups(self, count: int, timeout_seconds: float, connect_seconds: float) -> list[dist.ProcessGroup]:
        """``count`` gloo groups of every rank of the default group (:func:`_cpu_groups`: a collective, all
        ranks get them or all raise :class:`GroupUnavailable`), destroyed by :meth:`close`."""
        groups = _cpu_groups(count, timeout_seconds, connect_seconds)
        self._groups.extend(groups)
        return groups

    def start(self, handlers: bool, heartbeat: Heartbeat | None = None, deadline: Deadline | None = None,
              watch: NoticeWatch | None = None) -> None:
        """DataLoader workers forked from now on block the stop signals; ``heartbeat``, ``deadline`` and
        ``watch`` get their threads (the deadline only in the main thread: the wakeup fd can be set nowhere
        else, and no signal handler runs elsewhere); with ``handlers``, the recording handler is installed
        for every stop signal but the routed ones (main thread; a framework that registers its handlers
        later calls :meth:`install_handlers` then)."""
        if self._started:
            return
        self._started = True
        _block_in_dataloader_workers(self.recorder.signals)
        if heartbeat is not None:
            self._heartbeat = heartbeat, _thread(heartbeat.beat, "heartbeat")
            atexit.register(self._end_heartbeat_at_exit, os.getpid())
        if deadline is not None and threading.current_thread() is threading.main_thread():
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            _close_in_forked_children(reader, writer)
            deadline.listen(reader, writer, previous_fd)
            self._deadline = deadline, _thread(deadline.watch, "deadline")
        if watch is not None:
            self._watch = watch, _thread(watch.watch, "notice")
        if handlers:
            self.install_handlers()

    def install_handlers(self) -> None:
        """Record the stop signals but the routed ones, chaining to the handlers in place. Main thread."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("ddp_sigterm: signal handlers can only be installed from the main thread")
        for signum in self.recorder.signals:
            if signum not in self._routed and signum not in self._previous:
                self._previous[signum] = signal.getsignal(signum)
                signal.signal(signum, self._record_and_chain)

    def _record_and_chain(self, signum: int, frame: FrameType | None) -> None:
        self.recorder.record(signum, frame)
        previous = self._previous.get(signum)
        if chains_to(previous):
            previous(signum, frame)

    # -- the stop ------------------------------------------------------------------------------
    def noticed(self, notice: Notice) -> None:
        """A cloud's preemption notice came (the watch's thread): the deadline counts from now, as from a stop
        signal, and ends no later than the notice's time."""
        if self._deadline is not None:
            self._deadline[0].arm(time.monotonic(), notice.describe(), _seconds_to(notice.epoch_seconds))

    def stopped(self, decision: StopDecision, now: float) -> None:
        """At the agreed stop: the deadline counts from ``now`` (and ends no later than a notice's time); the
        integration's effects run."""
        if self._deadline is not None:
            self._deadline[0].arm(now, "the agreed stop", _seconds_to(decision.notice_at))
        for action in self._on_stop:
            action(decision)

    def close(self, stopped: bool, leaving: bool, destroy_default_group: bool, redeliver: bool) -> None:
        """Put the handlers back; ``leaving`` (a stop among several ranks): ignore the stop signals until the
        process exits and, with ``destroy_default_group``, destroy the default gloo group at exit
        (:func:`_leave`). End the deadline's watch, unless ``stopped`` armed it: then it bounds the exit.
        End the heartbeat on every rank (every rank closes at the same point) and destroy the groups. With
        ``redeliver``, a stop signal recorded after the run's last agreement (``stopped`` False) is raised
        again when nothing else would act on it: no exception on its way out, the main thread, and the
        handler now back is the signal's default action."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._end_heartbeat_at_exit)
        failing = sys.exc_info()[1] is not None
        for signum, previous in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()
        _unblock_in_dataloader_workers(self.recorder.signals)
        if leaving:
            _leave(self.recorder.signals, destroy_default_group)
        self._end_deadline(keep_armed=stopped)
        self._end_watch()
        heartbeat_group = self._end_heartbeat()
        for group in self._groups:
            if group is not heartbeat_group:
                _release_group(group)
        self._groups.clear()
        late = self.recorder.signum
        if not stopped and late and redeliver and not failing and \
                threading.current_thread() is threading.main_thread() and default_action(signal.getsignal(late)):
            self.recorder.signum = 0  # once
            log.logger.warning("%s came after the run's last stop agreement: no stop was agreed; passing it on to "
                               "the handler it replaced", signal.Signals(late).name)
            signal.raise_signal(late)

    def _end_deadline(self, keep_armed: bool) -> None:
        """Give the wakeup fd back and end the deadline's thread, unless ``keep_armed`` and armed: after a
        stop the process is on its way out, and the bound holds until it is gone."""
        if self._deadline is None:
            return
        deadline, thread = self._deadline
        self._deadline = None
        _keep_in_forked_children(*deadline.ends())
        main = threading.current_thread() is threading.main_thread()
        if main:
            signal.set_wakeup_fd(deadline.previous_fd)
        if deadline.armed_at is None or not keep_armed:
            deadline.end(close_writer=main)  # elsewhere the wakeup fd still points at the writer: keep it open
            thread.join(timeout=5.0)  # it only waits in select(), which the wake-up ends

    def _end_watch(self) -> None:
        """End the notice watch; its thread is out of its request within the request's timeout."""
        if self._watch is None:
            return
        watch, thread = self._watch
        self._watch = None
        watch.end()
        thread.join(POLL_TIMEOUT + _CLOSE_SECONDS)

    def _end_heartbeat_at_exit(self, owner: int) -> None:
        """The process exits without :meth:`close` (a rank ``ddp_spawn`` started: its ``fit`` runs without
        Lightning's exception handling; a crash): end the heartbeat first. Its thread, inside a collective while
        the interpreter finalizes, would abort the process ("terminate called without an active exception")
        when it takes the GIL back. Not in a forked child, which has no such thread."""
        if os.getpid() == owner:
            self._end_heartbeat()

    def _end_heartbeat(self) -> dist.ProcessGroup | None:
        """End the heartbeat and give its group back, waiting up to a period and :data:`_CLOSE_SECONDS` for
        this rank's thread; it takes longer only when a peer stopped answering, and then the thread and its
        group are left to the group's timeout. Returns the group left so, if any."""
        if self._heartbeat is None:
            return None
        heartbeat, thread = self._heartbeat
        self._heartbeat = None
        heartbeat.end()
        thread.join(heartbeat.period + _CLOSE_SECONDS)
        if thread.is_alive() or heartbeat.group is None:
            return heartbeat.group
        _release_group(heartbeat.group)
        return heartbeat.group


def _seconds_to(epoch_seconds: int) -> float:
    """Seconds from now to a notice's time (0: none, no bound)."""
    return epoch_seconds - time.time() if epoch_seconds else math.inf


def _thread(target: Callable[[], None], name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=f"ddp_sigterm-{name}", daemon=True)
    thread.start()
    return thread


# -- the package's gloo groups ---------------------------------------------------------------------
def _cpu_groups(count: int, timeout_seconds: float, connect_seconds: float) -> list[dist.ProcessGroup]:
    """``count`` new gloo groups of every rank of the default group, each given ``connect_seconds`` to
    connect, then ``timeout_seconds`` for every collective; the runtime gives each back.

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
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)  # in TORCH_INTERNALS
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
                _release_group(group)
            named = "; ".join(f"global rank {rank}: {why}" for rank, why in enumerate(failures) if why)
            raise GroupUnavailable(f"the stop's own gloo group of all {len(failures)} ranks could not be made "
                                   f"(connect_timeout={connect_seconds:g} s) ({named})")
        if set_timeout is not None:
            set_timeout(datetime.timedelta(seconds=timeout_seconds), made[-1])
    return made


def _release_group(group: dist.ProcessGroup) -> None:
    """Destroy a group of :func:`_cpu_groups` (every rank, same point)."""
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


def _block_in_dataloader_workers(signals: tuple[int, ...]) -> None:
    """From now on, DataLoader workers forked by this process block ``signals`` (other forked children
    keep them unblocked, as they would without the package); their exit is seen to (see module)."""
    _register_fork_hook()
    _blocked_in_workers.update(signals)
    # after multiprocessing's own exit function, so that it runs first (at most once, however often called)
    atexit.unregister(_end_blocking_workers)
    atexit.register(_end_blocking_workers)


def _unblock_in_dataloader_workers(signals: tuple[int, ...]) -> None:
    """Undo :func:`_block_in_dataloader_workers` for ``signals``; the exit function goes once nothing
    needs it."""
    _blocked_in_workers.difference_update(signals)
    if not _blocked_in_workers and not _blocking_workers():
        atexit.unregister(_end_blocking_workers)


def _close_in_forked_children(*ends: socket.socket) -> None:
    """A child forked while ``ends`` are open closes them and clears its wakeup fd (the deadline's)."""
    _register_fork_hook()
    _closed_in_children.update(ends)


def _keep_in_forked_children(*ends: socket.socket) -> None:
    """Undo :func:`_close_in_forked_children`."""
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


def _leave(signals: tuple[int, ...], destroy_default_group: bool) -> None:
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
