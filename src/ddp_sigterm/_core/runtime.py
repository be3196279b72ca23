"""The runtime: the one owner of everything the package does to the process: its gloo groups, the recording
handlers, its threads (heartbeat, deadline, notice watch), the wakeup fd, the at-fork hook (``workers.py``), exit
functions, and the way out after a stop: 128 + the signal (docs/how-it-works.md, sections 6 and 7).
"""

from __future__ import annotations

import atexit
import datetime
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType

import torch.distributed as dist

from ddp_sigterm._core import log, workers
from ddp_sigterm._core.clouds import Notice
from ddp_sigterm._core.deadline import Deadline
from ddp_sigterm._core.decision import StopDecision
from ddp_sigterm._core.notices import POLL_TIMEOUT, NoticeWatch
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
    """The stop's own gloo groups could not be made on every rank; raised on every rank, naming who failed."""


class Runtime:
    """The process-wide effects of one coordinator: ``recorder``'s handlers (but for the ``routed`` signals, which a
    framework hands the recorder itself), threads, wakeup fd and groups; ``on_stop`` is called in order with the
    decision at the agreed stop (an exception propagates). ``start`` and ``close`` are each safe to call twice."""

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

    def make_groups(self, count: int, timeout_seconds: float, connect_seconds: float) -> list[dist.ProcessGroup]:
        """``count`` new gloo groups of every rank, each given ``connect_seconds`` to connect, then ``timeout_seconds``
        per collective. Contract: every rank calls it at the same point; all return the groups or all raise
        :class:`GroupUnavailable`, at the first group that failed anywhere (so groups get the same names everywhere)."""
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
        self._groups.extend(made)
        return made

    def start(self, handlers: bool, heartbeat: Heartbeat | None = None, deadline: Deadline | None = None,
              watch: NoticeWatch | None = None) -> None:
        """DataLoader workers forked from now on leave the stop signals to this process; the given bodies get their
        threads (the deadline only in the main thread, the only one with a wakeup fd and signal handlers)."""
        if self._started:
            return
        self._started = True
        workers.block_in_dataloader_workers(self.recorder.signals)
        if heartbeat is not None:
            self._heartbeat = heartbeat, _thread(heartbeat.beat, "heartbeat")
            atexit.register(self._end_heartbeat_at_exit, os.getpid())
        if deadline is not None and threading.current_thread() is threading.main_thread():
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            workers.close_in_forked_children(reader, writer)
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

    def noticed(self, notice: Notice) -> None:
        """A cloud's notice came (the watch's thread): the deadline counts from now, ending by the notice's time."""
        if self._deadline is not None:
            self._deadline[0].arm(time.monotonic(), notice.describe(), _seconds_to(notice.epoch_seconds))

    def stopped(self, decision: StopDecision) -> None:
        """At the agreed stop: the deadline counts from its decision (ending by a notice's time); ``on_stop`` runs."""
        if self._deadline is not None:
            self._deadline[0].arm(decision.decided_at, "the agreed stop", _seconds_to(decision.notice_at))
        for action in self._on_stop:
            action(decision)

    def close(self, stopped: bool, leaving: bool, destroy_default_group: bool, redeliver: bool) -> None:
        """Every rank at the same point: handlers back, threads ended (an armed deadline goes on if ``stopped``), groups
        destroyed; ``leaving``: :func:`_leave`. ``redeliver``: a signal after the last agreement is raised again if
        nothing else would act on it (no exception on its way out, main thread, default action back)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._end_heartbeat_at_exit)
        failing = sys.exc_info()[1] is not None
        for signum, previous in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()
        workers.unblock_in_dataloader_workers(self.recorder.signals)
        if leaving:
            _leave(self.recorder.signals, destroy_default_group)
        self._end_deadline(keep_armed=stopped)
        if self._watch is not None:
            self._watch[0].end()
            self._watch[1].join(POLL_TIMEOUT + _CLOSE_SECONDS)  # out of its request within the request's timeout
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
        """Give the wakeup fd back; end the thread unless ``keep_armed`` and armed: it then bounds the exit."""
        if self._deadline is None:
            return
        deadline, thread = self._deadline
        self._deadline = None  # a notice from now on arms nothing
        workers.keep_in_forked_children(*deadline.ends())
        main = threading.current_thread() is threading.main_thread()
        if main:
            signal.set_wakeup_fd(deadline.previous_fd)
        if deadline.armed_at is None or not keep_armed:
            deadline.end(close_writer=main)  # elsewhere the wakeup fd still points at the writer: keep it open
            thread.join(timeout=5.0)  # it only waits in select(), which the wake-up ends

    def _end_heartbeat_at_exit(self, owner: int) -> None:
        """At an exit without :meth:`close` (a ``ddp_spawn`` rank, a crash), not in a forked child: a heartbeat inside
        a collective while the interpreter finalizes would abort it."""
        if os.getpid() == owner:
            self._end_heartbeat()

    def _end_heartbeat(self) -> dist.ProcessGroup | None:
        """End the heartbeat, waiting a period and :data:`_CLOSE_SECONDS` for its thread, and give its group back
        (a thread still waiting on a silent peer keeps it until the group's timeout). Returns the group."""
        if self._heartbeat is None:
            return None
        heartbeat, thread = self._heartbeat
        self._heartbeat = None
        heartbeat.end()
        thread.join(heartbeat.period + _CLOSE_SECONDS)
        if not thread.is_alive() and heartbeat.group is not None:
            _release_group(heartbeat.group)
        return heartbeat.group


def _seconds_to(epoch_seconds: int) -> float:
    return epoch_seconds - time.time() if epoch_seconds else math.inf


def _thread(target: Callable[[], None], name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=f"ddp_sigterm-{name}", daemon=True)
    thread.start()
    return thread


def _release_group(group: dist.ProcessGroup) -> None:
    if dist.is_initialized():
        dist.destroy_process_group(group)


def _leave(signals: tuple[int, ...], destroy_default_group: bool) -> None:
    """After the agreed stop of a multi-process run, keep the exit 128 + signal: ``signals`` are ignored from here on
    (main thread only; SIG_IGN, as the interpreter resets Python handlers while it finalizes: docs/reliability.md).
    With ``destroy_default_group``, a gloo default group is destroyed at exit."""
    if threading.current_thread() is threading.main_thread():
        for signum in signals:
            signal.signal(signum, signal.SIG_IGN)
    if destroy_default_group:
        atexit.unregister(_destroy_default_group)  # registered once, however many runs stop
        atexit.register(_destroy_default_group, os.getpid())


def _destroy_default_group(owner: int) -> None:
    """Only gloo: its group alive at exit aborts the interpreter, while destroying an NCCL group after a peer
    crashed can wait for that peer (Lightning has its own exit handler for NCCL)."""
    if os.getpid() == owner and dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()
