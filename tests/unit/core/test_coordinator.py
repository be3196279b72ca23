"""ddp_sigterm/_core/coordinator.py without a process group: one rank decides alone, logs the stop, passes on a
signal that came after the last agreement, and works in a thread other than the main one."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from ddp_sigterm_tests.metadata_server import MetadataServer

from ddp_sigterm import NoticeSettings, Settings, StopCoordinator
from ddp_sigterm._core.deadline import Deadline
from ddp_sigterm._core.runtime import Runtime
from ddp_sigterm._core.signals import SignalRecorder


@pytest.mark.parametrize("level", ["INFO", "WARNING"])
def test_a_stop_is_logged_at_info(caplog, level: str) -> None:
    coordinator = StopCoordinator(Settings.resolve(environ={"DDP_SIGTERM_LOG_LEVEL": level}, signals=("SIGUSR2",)))
    coordinator.start()
    try:
        with caplog.at_level(logging.DEBUG, logger="root"):
            assert not coordinator.should_stop(2)
            os.kill(os.getpid(), signal.SIGUSR2)
            assert coordinator.should_stop(3)
    finally:
        coordinator.close()
    stops = [r.getMessage() for r in caplog.records if r.name == "ddp_sigterm"]
    if level == "WARNING":
        assert stops == []
    else:
        (line,) = stops
        assert re.fullmatch(r"rank 0 of 1: SIGUSR2 received here at \S+ \S+ \([0-9.]+ s, 0 step boundaries before "
                            r"the agreement\); every rank stops at step 3 \(boundary 2\)", line), line


def test_single_process_coordinator_stops_at_the_next_boundary() -> None:
    coordinator = StopCoordinator(Settings.resolve(environ={}, signals=("SIGUSR2",)))
    before = signal.getsignal(signal.SIGUSR2)
    threads = threading.enumerate()
    coordinator.start()
    try:
        assert [coordinator.should_stop(step) for step in range(3)] == [False, False, False]
        os.kill(os.getpid(), signal.SIGUSR2)
        assert coordinator.should_stop(3) is True
        assert coordinator.exit_code == 128 + signal.SIGUSR2
        assert coordinator.decision.step == 3
        assert coordinator.decision.boundaries_since_signal == 0
    finally:
        coordinator.close()
        coordinator.close()
    # alone, a process has no peer to wait for and none to be told to leave by: after the stop, its
    # handlers are its own again and nothing of the coordinator runs (the script may well go on)
    assert signal.getsignal(signal.SIGUSR2) == before
    assert threading.enumerate() == threads


_LATE = """
import os, signal, sys
from ddp_sigterm import Settings, StopCoordinator
seen = []
if sys.argv[1] == "handler":
    signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
coordinator = StopCoordinator(Settings.resolve(environ={}, signals=("SIGUSR2",)))
coordinator.start()
assert coordinator.decide_now(1) is False  # the run's last agreement
os.kill(os.getpid(), signal.SIGUSR2)
coordinator.close()
coordinator.close()
print("went on, handler called", len(seen), "time(s)", flush=True)
"""


@pytest.mark.parametrize("previous", ["default", "handler"])
def test_a_signal_after_the_last_agreement_is_not_swallowed(previous: str) -> None:
    """The run ended without a stop, but a stop signal came after its last agreement. With the default
    action in place before, the process ends by the signal once the coordinator has closed (as without
    the package); a handler someone installed was called once, when the signal arrived."""
    done = subprocess.run([sys.executable, "-c", _LATE, previous], capture_output=True, text=True, timeout=60)
    if previous == "default":
        assert done.returncode == -signal.SIGUSR2, done
        assert "SIGUSR2 came after the run's last stop agreement" in done.stderr, done
        assert "went on" not in done.stdout
    else:
        assert done.returncode == 0, done
        assert "went on, handler called 1 time(s)" in done.stdout, done


def test_coordinator_started_outside_the_main_thread_works_without_a_deadline() -> None:
    """Some runners (Ray Train, notebooks' helpers) train in a thread: no signal handler runs there and
    the wakeup fd cannot be set, so the deadline does not watch; the coordinator still works."""
    failures: list[BaseException] = []

    def train() -> None:
        try:
            runtime = Runtime(SignalRecorder((signal.SIGTERM,)))
            runtime.start(handlers=False, deadline=Deadline(1.0, (signal.SIGTERM,), "rank 0 of 2", lambda: "nothing"))
            assert not [thread for thread in threading.enumerate() if thread.name.startswith("ddp_sigterm")]
            runtime.close(stopped=False, leaving=False, destroy_default_group=False, redeliver=False)
            coordinator = StopCoordinator(Settings.resolve(environ={}))
            coordinator.start(install_handlers=False)
            assert coordinator.should_stop(0) is False
            coordinator.close()
        except BaseException as error:
            failures.append(error)

    thread = threading.Thread(target=train)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert failures == []


def test_one_set_of_stop_signals_includes_what_a_framework_routes() -> None:
    """Lightning's connector hands SIGTERM (and SLURM's requeue signal) to ``record`` whatever the settings
    list: those stop the run too, so the deadline, the ignore after a stop and the exit code know them, and
    the coordinator installs handlers only for the others."""
    settings = Settings.resolve(environ={}, signals=("SIGUSR2",))
    routed = (signal.SIGTERM, signal.SIGUSR1)
    coordinator = StopCoordinator(settings, requeue_signal=signal.SIGUSR1, routed_signals=routed)
    assert coordinator.integration.signals == (signal.SIGUSR2, signal.SIGUSR1, signal.SIGTERM)
    before = {signum: signal.getsignal(signum) for signum in coordinator.integration.signals}
    coordinator.start(install_handlers=False)
    try:
        coordinator.integration.install_handlers()
        assert signal.getsignal(signal.SIGUSR2) != before[signal.SIGUSR2]
        assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
        assert signal.getsignal(signal.SIGUSR1) == before[signal.SIGUSR1]
        coordinator.integration.record(signal.SIGTERM)
        assert coordinator.should_stop(0)
        assert coordinator.exit_code == 128 + signal.SIGTERM
    finally:
        coordinator.close()
    assert {signum: signal.getsignal(signum) for signum in coordinator.integration.signals} == before


def test_a_cloud_notice_stops_a_process_alone_as_its_first_stop_signal_would(caplog, monkeypatch) -> None:
    """Issue 37: the notice watch (a thread of the runtime) hands a notice to the coordinator, which stops at the
    next boundary with its first stop signal's exit code and names the notice; close() ends the watch."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("SLURM_LOCALID", raising=False)
    with MetadataServer("aws") as server:
        coordinator = StopCoordinator(Settings.resolve(environ={}),
                                      notice=NoticeSettings("aws", notice_url=server.url, notice_period=0.05))
        threads = not_the_servers()
        coordinator.start()
        try:
            assert [t.name for t in not_the_servers() if t not in threads] == ["ddp_sigterm-notice"]
            assert not coordinator.should_stop(0)
            server.notice = {"action": "stop", "time": "2026-12-06T12:02:00Z"}
            step, began = 1, time.monotonic()
            with caplog.at_level(logging.INFO, logger="ddp_sigterm"):
                while not coordinator.should_stop(step) and time.monotonic() - began < 30:
                    step += 1
                    time.sleep(0.01)
            assert coordinator.decision is not None
            assert coordinator.exit_code == 128 + signal.SIGTERM
            assert coordinator.integration.stop_cause == "the aws preemption notice (stop at 2026-12-06T12:02:00+00:00)"
        finally:
            coordinator.close()
        assert not_the_servers() == threads
    (line,) = [r.getMessage() for r in caplog.records if r.name == "ddp_sigterm"]
    assert re.fullmatch(rf"rank 0 of 1: the aws preemption notice \(stop at 2026-12-06T12:02:00\+00:00\) received here "
                        rf"at \S+ \S+ \([0-9.]+ s, 0 step boundaries before the agreement\); every rank stops at step "
                        rf"{step} \(boundary {step + 1}\)", line), line


def not_the_servers() -> list[threading.Thread]:
    """This process's threads, but those the test's metadata server starts for each request it answers."""
    return [thread for thread in threading.enumerate() if "process_request_thread" not in thread.name]


@pytest.mark.parametrize(("notice", "local_rank"), [("off", "0"), ("auto", "0"), ("gce", "1")])
def test_no_notice_watch_where_it_is_off_in_no_cloud_or_not_local_rank_0(monkeypatch, notice: str,
                                                                         local_rank: str) -> None:
    """``auto`` finds no cloud on this machine (nor in CI): nothing is asked, no thread starts."""
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    with MetadataServer("gce") as server:
        settings = NoticeSettings(notice, notice_url=server.url)
        coordinator = StopCoordinator(Settings.resolve(environ={}), notice=settings)
        threads = threading.enumerate()
        coordinator.start()
        try:
            assert threading.enumerate() == threads
            assert not coordinator.should_stop(0)
        finally:
            coordinator.close()
    assert server.requests == []


_LATE_NOTICE = """
import sys, time
from ddp_sigterm import NoticeSettings, Settings, StopCoordinator
from ddp_sigterm_tests.metadata_server import MetadataServer
with MetadataServer("gce") as server:
    coordinator = StopCoordinator(Settings.resolve(environ={}),
                                  notice=NoticeSettings("gce", notice_url=server.url, notice_period=0.05))
    coordinator.start()
    assert coordinator.decide_now(1) is False  # the run's last agreement
    server.notice = True
    while not coordinator.integration.signalled():
        time.sleep(0.01)
    coordinator.close()
print("went on", flush=True)
"""


def test_a_notice_after_the_last_agreement_is_logged_and_kills_nothing(monkeypatch) -> None:
    """Unlike a stop signal of the process's own (above), a notice that came after the run's last agreement is not
    raised as a signal at close(): the run has ended, the process goes on (and the next run's notice watch, if
    any, will see the notice again)."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("SLURM_LOCALID", raising=False)
    done = subprocess.run([sys.executable, "-c", _LATE_NOTICE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done
    assert "went on" in done.stdout, done
    assert re.search(r"rank 0: the gce preemption notice \(preempted at \S+; 30 s after it was seen\) came after the "
                     r"run's last stop agreement: nothing was stopped", done.stderr), done.stderr
