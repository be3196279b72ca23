"""The user's object, :class:`StopCoordinator` (its loop: docs/torch-distributed.md), and :class:`IntegrationView`,
what integrations call. How often ranks agree is decided in ``decision.py``; the process's effects are ``runtime.py``'s.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch.distributed as dist

from ddp_sigterm._core import log, notices, torchelastic
from ddp_sigterm._core.clouds import Notice, named
from ddp_sigterm._core.deadline import Deadline
from ddp_sigterm._core.decision import Ballot, StopDecision, StopSchedule, where
from ddp_sigterm._core.decision import Sequence as Steps
from ddp_sigterm._core.notices import NoticeSettings
from ddp_sigterm._core.port import Driver, GlooPort, Heartbeat
from ddp_sigterm._core.runtime import GroupUnavailable, Runtime
from ddp_sigterm._core.settings import Settings, resolve
from ddp_sigterm._core.signals import SignalRecorder, stop_signals

_STEP_ASIDE = ("A stop signal is handled as it would be without the package. Gloo connects each rank to the address of "
               "the interface it picks on its node: the one its host name resolves to (often a loopback address such "
               "as 127.0.1.1), unless GLOO_SOCKET_IFNAME names one. Set GLOO_SOCKET_IFNAME=<the interface the nodes "
               "reach each other on, e.g. eth0> on every node (docs/multi-node.md), or raise "
               "DDP_SIGTERM_CONNECT_TIMEOUT if the group is only slow to form.")


class StopCoordinator:
    """Records stop signals and agrees, across ranks, at which step boundary everyone stops."""

    def __init__(self, settings: Settings | None = None, requeue_signal: int | None = None,
                 distributed: bool = True, on_decided: Sequence[Callable[[StopDecision], None]] = (),
                 routed_signals: tuple[int, ...] = (), notice: NoticeSettings | None = None) -> None:
        """``requeue_signal`` (SLURM's) stops too and sets ``decision.requeue``; ``distributed=False``: this process
        agrees alone, not with the default group's ranks; ``on_decided``: run on every rank at the agreed stop;
        ``routed_signals``: those a framework hands ``integration.record`` itself; ``notice``: default from the env."""
        self._inner = IntegrationView(settings or Settings.resolve(), requeue_signal, distributed, on_decided,
                                      routed_signals, notice or resolve(NoticeSettings))

    @property
    def integration(self) -> IntegrationView:
        """What framework integrations and the package's threads use (internal: it may change)."""
        return self._inner

    def start(self, install_handlers: bool = True) -> None:
        """Every rank, same point (a collective): make the stop's gloo groups, start its threads, install the recording
        handlers. Switched off, or without groups on every rank (it warns once), it never stops. Safe to call twice."""
        self._inner.start(install_handlers)

    def should_stop(self, step: int | None = None) -> bool:
        """Call at every step boundary on every rank: True on every rank at the same boundary, and from then on."""
        return self._inner.run(self._inner.schedule.passing, step, self._inner.signalled())

    def should_stop_on_leaving(self, step: int | None = None) -> bool:
        """Call on every rank as it leaves a loop whose length may differ between ranks (evaluation): votes with the
        ranks still in it until all have left, then the same answer everywhere."""
        return self._inner.run(self._inner.schedule.leaving, step)

    def decide_now(self, step: int | None = None) -> bool:
        """Agree now, on every rank at the same point: once at the end of a run, so a late signal is not lost."""
        return self._inner.run(self._inner.schedule.now, step)

    def close(self, redeliver: bool = True) -> None:
        """Every rank, same point: a run that did not stop leaves nothing (after a stop of several ranks the signals
        stay ignored). ``redeliver``: a signal after the last agreement is raised again where nothing else would act on
        it. Safe to call twice."""
        self._inner.close(redeliver)

    @property
    def decision(self) -> StopDecision | None:
        """The agreed stop's decision, None until a stop is agreed."""
        return self._inner.schedule.decision

    @property
    def exit_code(self) -> int:
        """128 + the agreed signal number; RuntimeError if no stop was agreed."""
        return self._inner.agreed().exit_code


class IntegrationView:
    """The coordinator's working parts, for framework integrations and the stop's save; the package's threads call
    :meth:`noticed` and :meth:`waiting_for_now`, which take the lock."""

    def __init__(self, settings: Settings, requeue_signal: int | None, distributed: bool,
                 on_decided: Sequence[Callable[[StopDecision], None]], routed_signals: tuple[int, ...],
                 notice: NoticeSettings) -> None:
        self.settings, self.notice_settings, self.requeue_signal = settings, notice, requeue_signal
        self._distributed = distributed
        self._recorder = SignalRecorder(stop_signals(settings.signal_numbers, requeue_signal, routed_signals))
        self.signals = self._recorder.signals  # the one set: recorder, deadline, ignore after a stop, exit codes
        self.record = self._recorder.record  # a handler that only records, for frameworks that chain handlers
        self._runtime = Runtime(self._recorder, routed_signals, on_stop=on_decided)
        self.install_handlers = self._runtime.install_handlers  # for the signals the framework does not route
        self.acting = settings.enabled  # False too where start() stepped aside
        self.rank, self.world_size = 0, 1  # the default group's from start(), where the package acts on several
        self.schedule = StopSchedule(0, True, self._ballot, time.monotonic)  # replaced at start() with the ranks'
        self._port = GlooPort(0, 1)
        self._driver: Driver | None = None
        self._lock = threading.Lock()  # the notice and the activity, which the package's threads read or write
        self._activity: str | None = None
        self._notice: Notice | None = None
        self._began = self._closed = False

    def start(self, install_handlers: bool) -> None:
        if not self.settings.enabled or self._began:
            return
        self._began = True
        log.activate(self.settings.log_level)
        if self._distributed and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            Settings.check_environment()  # a misspelt variable would leave a default in force
            began = time.monotonic()
            try:
                voting, beating = self._runtime.make_groups(2, self.settings.agreement_timeout,
                                                            self.settings.connect_timeout)
            except GroupUnavailable as error:  # on every rank: never stop; global rank 0 says so, once
                self.acting = False
                if dist.get_rank() == 0:
                    warnings.warn(f"ddp_sigterm steps aside for this run: {error}. {_STEP_ASIDE}", stacklevel=3)
                return
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            log.logger.debug("rank %d: the stop's gloo groups made in %.3f s", self.rank, time.monotonic() - began)
            self._port = GlooPort(self.rank, self.world_size, voting, beating)
            self.schedule = StopSchedule(self.rank, False, self._ballot, time.monotonic)
        self._driver = Driver(self.schedule, self._port, self.waiting_for)
        heartbeat = deadline = None
        if self.world_size > 1:  # alone, no peer can keep a stop from ending: no heartbeat, no deadline
            heartbeat = Heartbeat(self._driver, self.settings.max_delay / 2, self.signalled)
            deadline = Deadline(self.settings.stop_deadline, self.signals, f"rank {self.rank} of {self.world_size}",
                                self.waiting_for_now)
            if self.rank == 0 and (hazard := torchelastic.restart_hazard()) is not None:
                warnings.warn(hazard, stacklevel=3)
        self._runtime.start(install_handlers, heartbeat, deadline, notices.watch(self.notice_settings, self.noticed))
        peers = f"all {self.world_size} ranks" if self.world_size > 1 else "this process alone"
        log.logger.debug("rank %d of %d: recording %s; the stop agreement runs on %s", self.rank, self.world_size,
                         ", ".join(signal.Signals(s).name for s in self.signals), peers)

    def close(self, redeliver: bool) -> None:
        self._closed = True
        stopped, notice = self.schedule.decision is not None, self._noticed_now()
        if not stopped and notice is not None:  # no signal of the process's own: nothing to pass on
            log.logger.warning("rank %d: %s came after the run's last stop agreement: nothing was stopped", self.rank,
                               notice.describe())
        self._runtime.close(stopped, leaving=stopped and self.world_size > 1,
                            destroy_default_group=self.settings.destroy_at_exit,
                            redeliver=redeliver and notice is None)
        # dropped now, the groups go with the run, not with the interpreter's last garbage collection
        self._driver, self._port = None, GlooPort(self.rank, self.world_size)
        log.logger.debug("rank %d: closed (%s)", self.rank, "after the agreed stop" if stopped else "no stop")

    @property
    def ignored_after_stop(self) -> tuple[int, ...]:
        """The signals ignored from an agreed stop until the process exits: none in a process alone."""
        return self.signals if self.world_size > 1 else ()

    def run(self, start: Callable[..., bool | Steps], *args: object) -> bool:
        """One of the schedule's sequences, run on the driver; at the agreed stop, log it and run the runtime's part."""
        if self.schedule.decision is not None:
            return True
        if not self.acting or self._closed:
            return False
        if self._driver is None:
            raise RuntimeError("ddp_sigterm: StopCoordinator.start() was not called")
        if not self._driver.run(start, *args):
            return False
        decision = self.agreed()
        with self._lock:
            self._activity = f"the process to exit after the stop agreed at {self.schedule.where}"
        self._log(decision)
        self._runtime.stopped(decision)
        return True

    def agreed(self) -> StopDecision:
        if self.schedule.decision is None:
            raise RuntimeError("ddp_sigterm: no stop was agreed")
        return self.schedule.decision

    def signalled(self) -> bool:
        return bool(self._recorder.signum)

    def _ballot(self) -> Ballot:
        notice = self._noticed_now()
        requeue = self.requeue_signal is not None and (bool(self._recorder.mask & (1 << self.requeue_signal))
                                                       or notice is not None)  # a notice: the node goes
        return Ballot(self._recorder.signum, self._recorder.received_at, requeue, notice.code if notice else 0,
                      notice.epoch_seconds if notice else 0)

    def _log(self, decision: StopDecision) -> None:
        received = f"received by rank {decision.signalled_rank}, not here"
        if decision.received_at is not None:
            since = f"{decision.decided_at - decision.received_at:.3f} s"
            if decision.boundaries_since_signal is not None:
                since += f", {decision.boundaries_since_signal} step boundaries"
            received = f"received here at {log.wall_clock(decision.received_at)} ({since} before the agreement)"
        log.logger.info("rank %d of %d: %s %s; every rank stops at %s", self.rank, self.world_size, self.stop_cause,
                        received, self.schedule.where)

    @property
    def stop_cause(self) -> str:
        """What the agreed stop was asked by, for messages: the signal's name, or the cloud's notice."""
        decision = self.agreed()
        return named(decision.notice, decision.notice_at) if decision.notice else signal.Signals(decision.signum).name

    def lowest_failed_rank(self, succeeded: bool, what: str, step: int | None = None) -> int | None:
        """After the agreed stop, every rank, same point (the barrier that ends ``what``): whether this rank's part
        succeeded; returns the lowest rank where it failed, or None, the same everywhere."""
        end = f"the end of {what} at {where(step, self.schedule.boundary)}"
        with self.waiting_for(f"{end}, which needs all {self.world_size} ranks"):
            return self._port.lowest_failed_rank(succeeded, end)

    # -- the package's threads -------------------------------------------------------------------
    def noticed(self, notice: Notice) -> None:
        """The notice watch's thread: a cloud's notice is a stop request, as this process's first stop signal."""
        with self._lock:
            self._notice = notice
        self._recorder.record(self.signals[0])
        self._runtime.noticed(notice)

    def _noticed_now(self) -> Notice | None:
        with self._lock:
            return self._notice

    def waiting_for_now(self) -> str:
        """What the main thread waits for (the deadline's thread names it if the stop overruns)."""
        with self._lock:
            if self._activity is not None:
                return self._activity
        if self.schedule.boundary == 0:
            return "the first step boundary"
        return f"the next step boundary after {self.schedule.where} (a step, or a collective inside it)"

    @contextlib.contextmanager
    def waiting_for(self, what: str) -> Iterator[None]:
        """Name what the main thread waits for while the block runs (``"saving the stop checkpoint of step 7"``)."""
        with self._lock:
            previous, self._activity = self._activity, what
        try:
            yield
        finally:
            with self._lock:
                self._activity = previous
