"""The framework-agnostic core: ask ``should_stop()`` at every step boundary, on every rank.

Needs torch only. A plain torch.distributed or Fabric loop uses it like this::

    stop = StopCoordinator()          # after init_process_group, at the same point on every rank
    stop.start()                      # installs the recording handlers
    try:
        for step, batch in enumerate(loader):
            train_step(batch)
            if stop.should_stop(step):   # every rank, every step: same answer everywhere
                save_checkpoint(step)
                raise SystemExit(stop.exit_code)  # 128 + signal number
        if stop.decide_now(step):        # once at the end: a signal after the last agreement
            save_checkpoint(step)
            raise SystemExit(stop.exit_code)
    finally:
        stop.close()
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from types import FrameType

import torch.distributed as dist

from ddp_sigterm._core import log, notices, torchelastic
from ddp_sigterm._core.agreement import Agreement
from ddp_sigterm._core.deadline import Deadline
from ddp_sigterm._core.heartbeat import Heartbeat
from ddp_sigterm._core.runtime import GroupUnavailable, Runtime
from ddp_sigterm._core.schedule import StopDecision, StopSchedule, Vote
from ddp_sigterm._core.settings import Settings
from ddp_sigterm._core.signals import SignalRecorder, stop_signals


class StopCoordinator:
    """Records stop signals and agrees, across ranks, at which step boundary everyone stops."""

    def __init__(self, settings: Settings | None = None, requeue_signal: int | None = None,
                 distributed: bool = True, on_decided: Sequence[Callable[[StopDecision], None]] = (),
                 routed_signals: tuple[int, ...] = ()) -> None:
        """``requeue_signal``: a signal that also asks for the job to be requeued (SLURM's, when the
        job requeues itself); it stops like the others and sets ``decision.requeue`` on every rank.

        The ranks that agree are those of the default process group. ``distributed=False``: this process
        alone, with no collective at all, whatever ``torch.distributed`` says (a one-device run in a
        process that also ran a multi-device one).

        ``on_decided``: called in order with the decision as soon as a stop is agreed, on every rank,
        before ``should_stop`` returns True (an integration's part of the stop, such as retiring
        Lightning's launcher watch); an exception propagates.

        ``routed_signals``: signals a framework hands :meth:`record` itself (Lightning's connector routes
        SIGTERM whatever the settings say): they stop the run too, and the coordinator installs no
        handler for them."""
        self.settings = settings if settings is not None else Settings.resolve()
        signals = stop_signals(self.settings.signal_numbers, requeue_signal, routed_signals)
        self._requeue_signal = requeue_signal
        self._distributed = distributed
        self._recorder = SignalRecorder(signals)
        self._runtime = Runtime(self._recorder, routed_signals, on_stop=on_decided)
        self._agreement: Agreement | None = None
        self._heartbeat: Heartbeat | None = None
        self._schedule = StopSchedule(alone=True)  # replaced at start() by the one of the agreement's ranks
        self._activity: str | None = None  # what this rank waits for, if not the next step boundary (see waiting_for)
        self._stepped_aside: str | None = None
        self._notice: notices.Notice | None = None  # set once, by the notice watch's thread
        self._began = False

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, install_handlers: bool = True) -> None:
        """Create the agreement's and the heartbeat's groups (a collective: every rank, same point), start
        the heartbeat and the stop deadline and, unless the framework composes signal handlers itself,
        install the recording handlers (all of it by the runtime, :mod:`ddp_sigterm._core.runtime`). With
        the package switched off (``enabled=False``, ``DDP_SIGTERM=0``) it does none of it: the
        coordinator never stops. If the groups cannot be made within ``connect_timeout`` on every rank, it
        does none of it either, on every rank: it warns once and steps aside (``acting`` is False,
        ``stepped_aside`` says why). Safe to call twice."""
        if not self.settings.enabled or self._began:
            return
        self._began = True
        log.activate(self.settings.log_level)
        deadline = None
        if not (self._distributed and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            self._agreement = Agreement()  # alone, no peer can keep a stop from ending: no deadline
        else:
            Settings.check_environment()  # a misspelt variable would leave a default in force
            began = time.monotonic()
            try:
                voting, beating = self._runtime.make_groups(2, self.settings.agreement_timeout,
                                                            self.settings.connect_timeout)
            except GroupUnavailable as error:
                self._step_aside(error)
                return
            log.logger.debug("rank %d: the stop's gloo groups made in %.3f s", dist.get_rank(),
                             time.monotonic() - began)
            self._agreement = Agreement(voting)
            self._heartbeat = Heartbeat(beating, self.settings.max_delay, lambda: bool(self._recorder.signum))
            deadline = Deadline(self.settings.stop_deadline, self._recorder.signals,
                                f"rank {self.rank} of {self.world_size}", self._waiting_for_now)
        self._schedule = StopSchedule(alone=not self._agreement.distributed)
        hazard = torchelastic.restart_hazard() if self._agreement.distributed and self.rank == 0 else None
        if hazard is not None:
            warnings.warn(hazard, stacklevel=2)
        self._runtime.start(install_handlers, self._heartbeat, deadline, self._notice_watch())
        peers = f"all {self.world_size} ranks" if self._agreement.distributed else "this process alone"
        log.logger.debug("rank %d of %d: recording %s; the stop agreement runs on %s", self.rank, self.world_size,
                         ", ".join(signal.Signals(s).name for s in self._recorder.signals), peers)

    def _notice_watch(self) -> notices.NoticeWatch | None:
        """The watch of the cloud's preemption notice (``Settings.notice``), on one process of each node
        (local rank 0: ``LOCAL_RANK``, or SLURM's ``SLURM_LOCALID``; a process that has neither is its
        node's only one); None where it is off, or ``auto`` finds no cloud."""
        cloud = self.settings.notice
        local_rank = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
        if cloud == "off" or local_rank != "0":
            return None
        if cloud == "auto":
            found = notices.detect_cloud()
            log.logger.debug("rank %d: notice=auto: %s", self.rank, f"in {found}" if found else "in no cloud")
            if found is None:
                return None
            cloud = found
        source = notices.source(cloud, self.settings.notice_url or None)
        log.logger.debug("rank %d: asking %s for a preemption notice every %g s", self.rank, source.base_url,
                         self.settings.notice_period)
        return notices.NoticeWatch(source, self.settings.notice_period, self._noticed)

    def _noticed(self, notice: notices.Notice) -> None:
        """The watch's thread: a notice is a stop request here, as this process's first stop signal would be
        (the notice first, so that the main thread finds it with the signal)."""
        self._notice = notice
        self._recorder.record(self._recorder.signals[0])
        self._runtime.noticed(notice)

    def _step_aside(self, error: GroupUnavailable) -> None:
        """No group to agree on: this coordinator never stops, on any rank (they all got the same error),
        and the run goes on as it would without the package; global rank 0 says so, once."""
        self._stepped_aside = str(error)
        if dist.get_rank() == 0:
            warnings.warn(f"ddp_sigterm steps aside for this run: {error}. A stop signal is handled as it would be "
                          "without the package. Gloo connects each rank to the address of the interface it picks "
                          "on its node: the one its host name resolves to (often a loopback address such as "
                          "127.0.1.1), unless GLOO_SOCKET_IFNAME names one. Set GLOO_SOCKET_IFNAME=<the interface "
                          "the nodes reach each other on, e.g. eth0> on every node (docs/multi-node.md), or raise "
                          "DDP_SIGTERM_CONNECT_TIMEOUT if the group is only slow to form.", stacklevel=3)

    def close(self, redeliver: bool = True) -> None:
        """Restore the signal handlers, end the heartbeat and the deadline's watch, destroy the groups:
        every rank calls it at the same point, and after a run that did not stop nothing of the
        coordinator is left in the process. Safe to call twice. After a stop among several ranks the
        process is leaving (the stop signals are ignored from here on, so a late one, such as torchrun's
        SIGTERM to the ranks still running, cannot change its exit code), and the deadline keeps running
        until the process has exited. A process alone leaves nothing behind, stopped or not.

        A stop signal that came after the run's last agreement stopped nothing (a cloud's notice then stops
        nothing either, and is only logged). With ``redeliver``, when
        no exception is on its way out (``close()`` in a ``finally`` after the loop ended normally) and
        the handler now back is the signal's default action, the signal is raised again, so that it does
        what it would have done without the package (a handler someone installed was already called when
        the signal arrived). The Trainer integration does not redeliver: stock Lightning, whose handler
        is in place until its teardown, keeps such a signal too."""
        stopped, rank = self.decision is not None, self.rank
        if not stopped and self._notice is not None:  # no signal of the process's own: nothing to pass on
            log.logger.warning("rank %d: %s came after the run's last stop agreement: nothing was stopped", rank,
                               self._notice.describe())
        self._runtime.close(stopped, leaving=stopped and self.world_size > 1,
                            destroy_default_group=self.settings.destroy_at_exit,
                            redeliver=redeliver and self._notice is None)
        # The heartbeat's thread reads this coordinator through a closure: dropping both ends the cycle now, so that
        # the groups' objects go with the run, not with the interpreter's last garbage collection at exit.
        self._heartbeat = self._agreement = None
        log.logger.debug("rank %d: closed (%s)", rank, "after the agreed stop" if stopped else "no stop")

    # -- what it records -------------------------------------------------------------------------
    def record(self, signum: int, frame: FrameType | None = None) -> None:
        """A signal handler that records a stop signal and does nothing else (it does not chain), for
        frameworks that register and chain handlers themselves, such as Lightning's signal connector."""
        self._recorder.record(signum, frame)

    def install_handlers(self) -> None:
        """Record the stop signals the framework does not route to :meth:`record`, chaining to the handlers
        in place; :meth:`close` restores them. Main thread."""
        self._runtime.install_handlers()

    @property
    def signals(self) -> tuple[int, ...]:
        """The signal numbers that stop the run (:func:`ddp_sigterm._core.signals.stop_signals`)."""
        return self._recorder.signals

    @property
    def requeue_signal(self) -> int | None:
        return self._requeue_signal

    @property
    def ignored_after_stop(self) -> tuple[int, ...]:
        """The signals the process ignores from an agreed stop until it exits: the stop signals when
        several ranks stopped, none in a process alone (see :meth:`close`)."""
        return self._recorder.signals if self.world_size > 1 else ()

    def _waiting_for_now(self) -> str:
        """What this rank waits for, named by the stop deadline if it runs out (read from its thread)."""
        if self._activity is not None:
            return self._activity
        if self._schedule.boundary == 0:
            return "the first step boundary"
        return f"the next step boundary after {self._where(self._schedule.step)} (a step, or a collective inside it)"

    @contextlib.contextmanager
    def waiting_for(self, what: str) -> Iterator[None]:
        """Name what this rank waits for while the block runs, for the stop deadline's message if it
        runs out (``"saving the stop checkpoint of step 7 in /ckpt"``); the previous name comes back after."""
        previous, self._activity = self._activity, what
        try:
            yield
        finally:
            self._activity = previous

    # -- the decision --------------------------------------------------------------------------
    @property
    def acting(self) -> bool:
        """Whether this coordinator can stop the run: switched on, and not stepped aside at ``start``."""
        return self.settings.enabled and self._stepped_aside is None

    @property
    def stepped_aside(self) -> str | None:
        """Why this coordinator never stops: its gloo groups could not be made (on every rank alike)."""
        return self._stepped_aside

    @property
    def world_size(self) -> int:
        return self._agreement.world_size if self._agreement is not None else 1

    @property
    def rank(self) -> int:
        return self._agreement.rank if self._agreement is not None else 0

    @property
    def decision(self) -> StopDecision | None:
        """The agreed stop's decision, None until a stop is agreed."""
        return self._schedule.decision

    def should_stop(self, step: int | None = None) -> bool:
        """Call at every step boundary on every rank. Returns True on every rank at the same boundary.

        It counts the boundary; with peers, it runs the agreement only from the boundary the heartbeat
        names after a signal (:mod:`ddp_sigterm._core.heartbeat`); alone, it decides on its own signal.
        ``step`` is used in the decision and in messages. Once True, it stays True."""
        if self.decision is not None:
            return True
        if not self.acting:
            return False
        signalled = bool(self._recorder.signum)
        boundary = self._schedule.passing(step, signalled)
        requested = self._heartbeat.passing(boundary) if self._heartbeat is not None else None
        return self._schedule.agrees_here(requested, signalled) and self.decide_now(step)

    def decide_now(self, step: int | None = None) -> bool:
        """Run the agreement now. Every rank must call it at the same point, for instance once at the end
        of a run so that a signal after the last step boundary is not lost."""
        if self.decision is not None:
            return True
        if not self.acting:
            return False
        return self._stopped(self._agree(step, in_loop=True))

    def should_stop_on_leaving(self, step: int | None = None) -> bool:
        """Call on every rank as it leaves a loop whose number of steps may differ between ranks
        (evaluation; prediction shards its data without padding). Keeps taking part in the
        agreements of the ranks still in the loop until every rank has left it, then returns the
        same answer on every rank."""
        if self.decision is not None:
            return True
        if not self.acting:
            return False
        vote = self._agree(step, in_loop=False)
        while StopSchedule.leaving_again(vote):
            vote = self._agree(step, in_loop=False)
        return self._stopped(vote)

    def _where(self, step: int | None) -> str:
        boundary = self._schedule.boundary
        return f"step {step} (boundary {boundary})" if step is not None else f"boundary {boundary}"

    def _started(self) -> Agreement:
        if self._agreement is None:
            raise RuntimeError("ddp_sigterm: StopCoordinator.start() was not called")
        return self._agreement

    def _agree(self, step: int | None, in_loop: bool) -> Vote:
        agreement = self._started()
        where = self._where(step)
        with self.waiting_for(f"the stop agreement at {where}, which needs all {self.world_size} ranks"):
            notice = self._notice
            return agreement.decide(self._recorder.signum, where, in_loop, self._requeue_received(),
                                    self._schedule.boundary, notice.code if notice else 0,
                                    notice.epoch_seconds if notice else 0)

    def _stopped(self, vote: Vote) -> bool:
        """Give the vote to the schedule; if it decided a stop: log it, and the runtime arms the deadline and
        runs the integration's actions."""
        now = time.monotonic()
        decision = self._schedule.voted(vote, now, self._recorder.received_at)
        if decision is None:
            return False
        self._activity = f"the process to exit after the stop agreed at {self._where(decision.step)}"
        self._log_decision(decision)
        self._runtime.stopped(decision, now)
        return True

    @property
    def stop_cause(self) -> str:
        """What the agreed stop was asked by, for messages: the signal's name, or the cloud's notice."""
        decision = self.decision
        if decision is None:
            raise RuntimeError("ddp_sigterm: no stop was agreed")
        if decision.notice:
            return notices.named(decision.notice, decision.notice_at)
        return signal.Signals(decision.signum).name

    def _log_decision(self, decision: StopDecision) -> None:
        name = self.stop_cause
        if decision.received_at is not None:
            since = f"{decision.decided_at - decision.received_at:.3f} s"
            if decision.boundaries_since_signal is not None:
                since += f", {decision.boundaries_since_signal} step boundaries"
            received = f"{name} received here at {log.wall_clock(decision.received_at)} ({since} before the agreement)"
        else:
            received = f"{name} received by rank {decision.signalled_rank}, not here"
        log.logger.info("rank %d of %d: %s; every rank stops at %s", self.rank, self.world_size, received,
                        self._where(decision.step))

    def _requeue_received(self) -> bool:
        """The job's requeue signal, or a cloud's notice (the node goes: under SLURM the job runs again elsewhere)."""
        return self._requeue_signal is not None and (bool(self._recorder.mask & (1 << self._requeue_signal))
                                                     or self._notice is not None)

    def lowest_failed_rank(self, succeeded: bool, what: str, step: int | None = None) -> int | None:
        """After the agreed stop, every rank reports whether its part of ``what`` (saving the stop
        checkpoint) succeeded; returns the lowest rank on which it failed, or None if it succeeded on
        every rank, the same on every rank. Every rank must call it at the same point: it is also the
        barrier that ends ``what``."""
        agreement = self._started()
        where = f"the end of {what} at {self._where(step)}"
        with self.waiting_for(f"{where}, which needs all {self.world_size} ranks"):
            return agreement.lowest_failed_rank(succeeded, where)

    @property
    def exit_code(self) -> int:
        """128 + the agreed signal number, the code a process killed by that signal would report;
        RuntimeError if no stop was agreed."""
        if self.decision is None:
            raise RuntimeError("ddp_sigterm: no stop was agreed")
        return self.decision.exit_code
