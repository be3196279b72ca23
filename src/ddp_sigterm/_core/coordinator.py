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

import dataclasses
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence

import torch.distributed as dist

from ddp_sigterm._core import exit_codes, log, torchelastic
from ddp_sigterm._core.agreement import Agreement, GroupUnavailable, cpu_groups, destroy_default_group_at_exit, members
from ddp_sigterm._core.cadence import Cadence
from ddp_sigterm._core.deadline import Deadline
from ddp_sigterm._core.heartbeat import Heartbeat
from ddp_sigterm._core.settings import Settings
from ddp_sigterm._core.signals import SignalRecorder, default_action, ignore_until_exit

HEARTBEAT_SECONDS = 0.5
"""The heartbeat's period at most (``max_delay / 2`` when smaller): it also bounds how long the first rank to
end a run waits at ``close()`` for the others' heartbeat to end."""

# Seconds close() waits, beyond one heartbeat period, for the heartbeat to end on a peer that is late.
_CLOSE_SECONDS = 5.0


@dataclasses.dataclass(frozen=True)
class StopDecision:
    """What every rank agreed on. ``received_at`` and ``decided_at`` are ``time.monotonic()`` values
    of this process; ``received_at`` is None on a rank that was not signalled itself. ``signalled_rank``:
    the lowest rank that recorded a stop signal."""

    signum: int
    step: int | None
    boundary: int
    decided_at: float
    received_at: float | None
    boundaries_since_signal: int | None
    requeue: bool = False
    signalled_rank: int | None = None

    @property
    def exit_code(self) -> int:
        return exit_codes.stopped(self.signum)


class StopCoordinator:
    """Records stop signals and agrees, across ranks, at which step boundary everyone stops."""

    def __init__(self, settings: Settings | None = None, requeue_signal: int | None = None,
                 group: dist.ProcessGroup | None = None, distributed: bool = True,
                 on_decided: Sequence[Callable[[StopDecision], None]] = ()) -> None:
        """``requeue_signal``: a signal that also asks for the job to be requeued (SLURM's, when the
        job requeues itself); it stops like the others and sets ``decision.requeue`` on every rank.

        ``group``: the ranks that agree, those of the loop this coordinator serves (None: every rank of
        the default group). ``distributed=False``: this process alone, with no collective at all,
        whatever ``torch.distributed`` says (a one-device run in a process that also ran a multi-device
        one).

        ``on_decided``: called in order with the decision as soon as a stop is agreed, on every rank,
        before ``should_stop`` returns True (an integration's part of the stop, such as retiring
        Lightning's launcher watch); an exception propagates."""
        self.settings = settings if settings is not None else Settings.resolve()
        self._group, self._distributed = group, distributed
        signals = self.settings.signal_numbers
        if requeue_signal is not None and requeue_signal not in signals:
            signals += (requeue_signal,)
        self.requeue_signal = requeue_signal
        self.on_decided = tuple(on_decided)
        self.recorder = SignalRecorder(signals)
        self.agreement: Agreement | None = None
        self.heartbeat: Heartbeat | None = None
        self.deadline: Deadline | None = None
        self.decision: StopDecision | None = None
        self.boundary = 0  # step boundaries passed, counted the same way on every rank
        self._signal_boundary: int | None = None
        self._requeue = False  # the last vote's
        self._signalled_rank: int | None = None  # the last vote's
        # What this rank waits for, named if the stop deadline runs out (read by its thread).
        self.activity = "the first step boundary"
        # Why this coordinator never stops: its gloo groups could not be made (set by start, on every rank alike)
        self.stepped_aside: str | None = None
        # the cadence and the window it measures (monotonic start, boundary), set by restart_cadence
        self.cadence: Cadence
        self._next_check: int
        self._window_start: float
        self._window_boundary: int
        self.restart_cadence()

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, install_handlers: bool = True) -> None:
        """Create the agreement's and the heartbeat's groups (a collective: every rank, same point) and,
        unless the framework composes signal handlers itself, install the recording handlers. With the
        package switched off (``enabled=False``, ``DDP_SIGTERM=0``) it does neither: the coordinator never
        stops. If the groups cannot be made within ``connect_timeout`` on every rank, it does neither
        either, on every rank: it warns once and steps aside (``acting`` is False, ``stepped_aside`` says why)."""
        if not self.settings.enabled:
            return
        log.activate(self.settings.log_level)
        if self.agreement is None:
            ranks = members(self._group) if self._distributed else ()
            if len(ranks) < 2:
                self.agreement = Agreement()
            else:
                began = time.monotonic()
                try:
                    voting, beating = cpu_groups(ranks, 2, self.settings.agreement_timeout,
                                                 self.settings.connect_timeout, self._group)
                except GroupUnavailable as error:
                    self._step_aside(ranks, error)
                    return
                log.logger.debug("rank %d: the stop's gloo groups made in %.3f s", dist.get_rank(),
                                 time.monotonic() - began)
                self.agreement = Agreement(ranks, voting)
                period = min(self.settings.max_delay / 2, HEARTBEAT_SECONDS)
                self.heartbeat = Heartbeat(beating, period, lambda: bool(self.recorder.signum))
                self.heartbeat.start()
        if self.deadline is None and self.agreement.distributed:  # alone, no peer can keep a stop from ending
            self.deadline = Deadline(self.settings.stop_deadline, self.recorder.signals,
                                     f"rank {self.rank} of {self.world_size}", lambda: self.activity)
            self.deadline.start()
        hazard = torchelastic.restart_hazard() if self.agreement.distributed and self.rank == 0 else None
        if hazard is not None:
            warnings.warn(hazard, stacklevel=2)
        if install_handlers:
            self.recorder.install()
        else:
            self.recorder.activate()
        self.restart_cadence()  # measure from here, not from construction
        peers = f"global ranks {list(self.agreement.ranks)}" if self.agreement.distributed else "this process alone"
        log.logger.debug("rank %d of %d: recording %s; the stop agreement runs on %s", self.rank, self.world_size,
                         ", ".join(signal.Signals(s).name for s in self.recorder.signals), peers)

    def _step_aside(self, ranks: tuple[int, ...], error: GroupUnavailable) -> None:
        """No group to agree on: this coordinator never stops, on any rank (they all got the same error),
        and the run goes on as it would without the package; the first rank says so, once."""
        self.stepped_aside = str(error)
        if dist.get_rank() == ranks[0]:
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
        process is leaving: the stop signals are ignored from here on (so a late one, such as torchrun's
        SIGTERM to the ranks still running, cannot change its exit code), and the deadline keeps running
        until the process has exited. A process alone leaves nothing behind, stopped or not.

        A stop signal that came after the run's last agreement stopped nothing. With ``redeliver``, when
        no exception is on its way out (``close()`` in a ``finally`` after the loop ended normally) and
        the handler now back is the signal's default action, the signal is raised again, so that it does
        what it would have done without the package (a handler someone installed was already called when
        the signal arrived). The Trainer integration does not redeliver: stock Lightning, whose handler
        is in place until its teardown, keeps such a signal too."""
        failing = sys.exc_info()[1] is not None
        self.recorder.restore()
        stopped, rank = self.decision is not None, self.rank
        if stopped and self.world_size > 1:
            ignore_until_exit(self.recorder.signals)
        if self.deadline is not None:
            self.deadline.close(keep_armed=stopped)
            self.deadline = None
        if self.heartbeat is not None:
            self.heartbeat.close(timeout=self.heartbeat.period + _CLOSE_SECONDS)
            self.heartbeat = None
        if self.agreement is not None:
            self.agreement.close()
            self.agreement = None
        log.logger.debug("rank %d: closed (%s)", rank, "after the agreed stop" if stopped else "no stop")
        late = self.recorder.signum
        if not stopped and late and redeliver and not failing and \
                threading.current_thread() is threading.main_thread() and default_action(signal.getsignal(late)):
            self.recorder.signum = 0  # once
            log.logger.warning("rank %d: %s came after the run's last stop agreement: no stop was agreed; passing it "
                               "on to the handler it replaced", rank, signal.Signals(late).name)
            signal.raise_signal(late)

    # -- the decision --------------------------------------------------------------------------
    @property
    def acting(self) -> bool:
        """Whether this coordinator can stop the run: switched on, and not stepped aside at ``start``."""
        return self.settings.enabled and self.stepped_aside is None

    @property
    def world_size(self) -> int:
        return self.agreement.world_size if self.agreement is not None else 1

    @property
    def rank(self) -> int:
        return self.agreement.rank if self.agreement is not None else 0

    def should_stop(self, step: int | None = None) -> bool:
        """Call at every step boundary on every rank. Returns True on every rank at the same boundary.

        Between agreements it only counts; at the agreed cadence it runs the agreement. ``step``
        is used in the decision and in error messages. Once True, it stays True.
        """
        if self.decision is not None:
            return True
        if not self.acting:
            return False
        self.boundary += 1
        if self.recorder.signum and self._signal_boundary is None:
            self._signal_boundary = self.boundary
        if self.world_size == 1:
            return self._decide(self.recorder.signum, step, time.monotonic()) if self.recorder.signum else False
        requested = self.heartbeat.passing(self.boundary) if self.heartbeat is not None else None
        if self.boundary < self._next_check and (requested is None or self.boundary < requested):
            return False
        return self.decide_now(step)

    def decide_now(self, step: int | None = None) -> bool:
        """Run the agreement now, off-cadence. Every rank must call it at the same point, for
        instance once at the end of a run so that a late signal is not lost."""
        if self.decision is not None:
            return True
        if not self.acting:
            return False
        started, passed = time.monotonic(), self.boundary - self._window_boundary  # before the vote re-syncs it
        signum, _ = self._agree(step, in_loop=True)
        finished = time.monotonic()
        self.cadence.observe(started - self._window_start, passed, finished - started)
        self._window_start, self._window_boundary = finished, self.boundary
        return self._decide(signum, step, finished) if signum else False

    def should_stop_on_leaving(self, step: int | None = None) -> bool:
        """Call on every rank as it leaves a loop whose number of steps may differ between ranks
        (evaluation; prediction shards its data without padding). Keeps taking part in the
        agreements of the ranks still in the loop until every rank has left it, then returns the
        same answer on every rank."""
        if self.decision is not None:
            return True
        if not self.acting:
            return False
        while True:
            signum, anyone_in_loop = self._agree(step, in_loop=False)
            if signum or not anyone_in_loop:
                break
        self.restart_cadence()
        return self._decide(signum, step, time.monotonic()) if signum else False

    def restart_cadence(self) -> None:
        """Agree at the next boundary and measure afresh; every rank calls it at the same point, when
        entering or leaving a loop whose steps take their own time (evaluation, prediction), so that
        an interval measured on fast batches does not delay a stop among slow ones."""
        self.cadence = Cadence(self.settings.check_budget, self.settings.max_delay)
        self._next_check = self.boundary + 1
        self._window_start, self._window_boundary = time.monotonic(), self.boundary

    def _where(self, step: int | None) -> str:
        return f"step {step} (boundary {self.boundary})" if step is not None else f"boundary {self.boundary}"

    def _started(self) -> Agreement:
        if self.agreement is None:
            raise RuntimeError("ddp_sigterm: StopCoordinator.start() was not called")
        return self.agreement

    def _agree(self, step: int | None, in_loop: bool) -> tuple[int, bool]:
        agreement = self._started()
        where = self._where(step)
        self.activity = f"the stop agreement at {where}, which needs all {self.world_size} ranks"
        vote = agreement.decide(self.recorder.signum, self.cadence.propose(), where, in_loop,
                                self._requeue_received(), self.boundary)
        self.activity = f"the next step boundary after {where} (a step, or a collective inside it)"
        if self._signal_boundary is not None:  # boundaries since the signal: count the re-sync's jump too
            self._signal_boundary += vote.boundary - self.boundary
        self.boundary = vote.boundary
        self._next_check = self.boundary + vote.interval
        self._requeue = vote.requeue
        self._signalled_rank = vote.signalled_rank
        return vote.signum, vote.anyone_in_loop

    def _decide(self, signum: int, step: int | None, now: float) -> bool:
        since = None if self._signal_boundary is None else self.boundary - self._signal_boundary
        # with peers, the vote's answer (the same everywhere); alone, this process's
        alone = self.world_size == 1
        requeue = self._requeue_received() if alone else self._requeue
        signalled_rank = self.rank if alone else self._signalled_rank
        self.decision = StopDecision(signum, step, self.boundary, now, self.recorder.received_at, since, requeue,
                                     signalled_rank)
        self.activity = f"the process to exit after the stop agreed at {self._where(step)}"
        if self.deadline is not None:
            self.deadline.arm(now, "the agreed stop")
        if self.settings.destroy_at_exit and not alone:
            destroy_default_group_at_exit()  # the process is leaving: see Settings.destroy_at_exit
        self._log_decision(self.decision)
        for action in self.on_decided:
            action(self.decision)
        return True

    def _log_decision(self, decision: StopDecision) -> None:
        name = signal.Signals(decision.signum).name
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
        return self.requeue_signal is not None and bool(self.recorder.mask & (1 << self.requeue_signal))

    def all_succeeded(self, succeeded: bool, what: str, step: int | None = None) -> int | None:
        """After the agreed stop, every rank reports whether its part of ``what`` (saving the stop
        checkpoint) succeeded; returns the lowest rank on which it failed, or None, on every rank.
        Every rank must call it at the same point: it is also the barrier that ends ``what``."""
        agreement = self._started()
        where = f"the end of {what} at {self._where(step)}"
        self.activity = f"{where}, which needs all {self.world_size} ranks"
        failed = agreement.first_failure(succeeded, where)
        self.activity = f"the process to exit after {what} at {self._where(step)}"
        return failed

    @property
    def agreed(self) -> StopDecision:
        """The agreed stop's decision; RuntimeError if no stop was agreed."""
        if self.decision is None:
            raise RuntimeError("ddp_sigterm: no stop was agreed")
        return self.decision

    @property
    def exit_code(self) -> int:
        """128 + the agreed signal number, the code a process killed by that signal would report."""
        return self.agreed.exit_code
