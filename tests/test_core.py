"""Unit tests of the core, without a process group: settings, signal recording, fork safety."""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ddp_sigterm import Settings, SettingsError, StopCoordinator, slurm
from ddp_sigterm._core.deadline import Deadline
from ddp_sigterm._core.exit_codes import GAVE_UP
from ddp_sigterm._core.signals import SignalRecorder


# -- settings -------------------------------------------------------------------------------------
def test_settings_defaults_and_environment_precedence() -> None:
    assert Settings().max_delay == 1.0
    assert Settings().signals == ("SIGTERM",)
    code = Settings.resolve(environ={}, max_delay=0.5)
    assert code.max_delay == 0.5
    env = Settings.resolve(environ={"DDP_SIGTERM_MAX_DELAY": "2.5", "DDP_SIGTERM_SIGNALS": "term, usr2"}, max_delay=0.5)
    assert env.max_delay == 2.5  # the environment overrides the code
    assert env.signals == ("SIGTERM", "SIGUSR2")
    assert Settings.resolve(environ={"DDP_SIGTERM": "0"}).enabled is False
    assert Settings().stop_deadline == 25.0
    assert Settings().destroy_at_exit is True
    assert Settings.resolve(environ={"DDP_SIGTERM_STOP_DEADLINE": "inf"}).stop_deadline == math.inf
    assert Settings().log_level == "INFO"
    assert Settings.resolve(environ={"DDP_SIGTERM_LOG_LEVEL": " warning"}).log_level == "WARNING"
    stored = Settings.resolve(environ={"DDP_SIGTERM_CHECKPOINT_DIR": "s3://bucket/run",
                                       "DDP_SIGTERM_KEEP_CHECKPOINTS": "2", "DDP_SIGTERM_RESUME": "yes"})
    assert (stored.checkpoint_dir, stored.keep_checkpoints, stored.resume) == ("s3://bucket/run", 2, True)
    assert (Settings().checkpoint_dir, Settings().keep_checkpoints, Settings().resume) == ("", 0, False)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"DDP_SIGTERM_MAX_DELAY": "soon"}, "DDP_SIGTERM_MAX_DELAY='soon': expected a number"),
        ({"DDP_SIGTERM_MAX_DELAY": "-1"}, "max_delay must be a positive number"),
        ({"DDP_SIGTERM_CHECK_BUDGET": "2"}, "check_budget must be a fraction"),
        ({"DDP_SIGTERM_SIGNALS": "SIGNOPE"}, "Unknown signal 'SIGNOPE'"),
        ({"DDP_SIGTERM_SIGNALS": "SIGKILL"}, "cannot include SIGKILL"),
        ({"DDP_SIGTERM": "maybe"}, "DDP_SIGTERM='maybe': expected one of"),
        ({"DDP_SIGTERM_MAXDELAY": "1"}, "Unknown environment variable(s) DDP_SIGTERM_MAXDELAY"),
        ({"DDP_SIGTERM_STOP_DEADLINE": "0"}, "stop_deadline must be a positive number of seconds or inf"),
        ({"DDP_SIGTERM_STOP_DEADLINE": "nan"}, "stop_deadline must be a positive number of seconds or inf"),
        ({"DDP_SIGTERM_DESTROY_AT_EXIT": "sometimes"}, "DDP_SIGTERM_DESTROY_AT_EXIT='sometimes': expected one of"),
        ({"DDP_SIGTERM_KEEP_CHECKPOINTS": "two"}, "DDP_SIGTERM_KEEP_CHECKPOINTS='two': expected a whole number"),
        ({"DDP_SIGTERM_KEEP_CHECKPOINTS": "-1"}, "keep_checkpoints must be a whole number, 0 to keep all, got -1"),
        ({"DDP_SIGTERM_RESUME": "later"}, "DDP_SIGTERM_RESUME='later': expected one of"),
        ({"DDP_SIGTERM_LOG_LEVEL": "LOUD"}, "log_level must be a logging level such as INFO or WARNING, got 'LOUD'"),
    ],
)
def test_bad_settings_fail_with_a_clear_message(environ: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as error:
        Settings.resolve(environ=environ)
    assert message in str(error.value)


# -- signal recording -----------------------------------------------------------------------------
def test_recorder_records_chains_and_restores() -> None:
    seen = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
    try:
        recorder = SignalRecorder((signal.SIGUSR2,))
        recorder.install()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert recorder.signum == signal.SIGUSR2
        assert recorder.received_at is not None
        assert seen == [signal.SIGUSR2]  # the user's handler still ran
        first = recorder.received_at
        os.kill(os.getpid(), signal.SIGUSR2)
        assert recorder.count == 2
        assert recorder.received_at == first
        recorder.restore()
        recorder.restore()  # twice is fine
        os.kill(os.getpid(), signal.SIGUSR2)
        assert recorder.count == 2
        assert seen == [signal.SIGUSR2] * 3
    finally:
        signal.signal(signal.SIGUSR2, previous)


class _MaskReport(torch.utils.data.Dataset):
    """Each item: whether the worker has SIGTERM blocked, after the worker sent itself SIGTERM."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> bool:
        blocked = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        os.kill(os.getpid(), signal.SIGTERM)  # from "outside" (not the parent): kills an unprotected worker
        return blocked


def _exit_1_if_sigterm_blocked() -> None:
    raise SystemExit(1 if signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []) else 0)


def test_dataloader_workers_block_the_signal_other_forked_children_keep_it() -> None:
    recorder = SignalRecorder((signal.SIGTERM,))
    recorder.install()
    try:
        loader = torch.utils.data.DataLoader(_MaskReport(), num_workers=1, multiprocessing_context="fork",
                                             batch_size=None, timeout=60)
        assert list(loader) == [True, True]  # the worker survived its SIGTERM, with the signal blocked
        assert recorder.signum == 0  # the parent saw nothing
        # any other forked process keeps SIGTERM unblocked (it inherits the Python handler, as under stock Lightning)
        child = multiprocessing.get_context("fork").Process(target=_exit_1_if_sigterm_blocked)
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0
    finally:
        recorder.restore()
    loader = torch.utils.data.DataLoader(_MaskReport(), num_workers=1, multiprocessing_context="fork",
                                         batch_size=None, timeout=60)
    # unprotected
    with pytest.raises(RuntimeError, match="DataLoader worker .* (killed by signal|exited unexpectedly)"):
        list(loader)


def test_importing_the_package_registers_nothing() -> None:
    """Importing any module of the package defines things and does nothing else: no at-fork hook, no
    exit function, no thread, no signal handler (they come with a run, and go with it)."""
    script = (
        "import atexit, os, signal, threading\n"
        "registered = []\n"
        "atexit.register = lambda f, *a, **k: registered.append(f)\n"
        "os.register_at_fork = lambda **hooks: registered.extend(hooks.values())\n"
        "handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)}\n"
        "threads = threading.active_count()\n"
        "import torch, lightning.pytorch, pytorch_lightning  # what they register is theirs\n"
        "registered.clear()\n"
        "import importlib, pkgutil, ddp_sigterm\n"
        "modules = [m.name for m in pkgutil.walk_packages(ddp_sigterm.__path__, 'ddp_sigterm.')]\n"
        "assert len(modules) > 10 and 'ddp_sigterm._lightning.internals' in modules, modules\n"
        "for name in modules: importlib.import_module(name)\n"
        "assert registered == [], registered\n"
        "assert threading.active_count() == threads\n"
        "assert {s: signal.getsignal(s) for s in handlers} == handlers\n"
    )
    run_python(script)


def run_python(script: str) -> None:
    """Run ``script`` in a fresh interpreter (nothing imported yet); its assertions must hold."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_core_imports_no_lightning() -> None:
    """The core needs torch only: ``pip install ddp_sigterm`` without the [lightning] extra works."""
    script = (
        "import sys, ddp_sigterm, ddp_sigterm.slurm, ddp_sigterm._core.coordinator, ddp_sigterm._core.stop_save\n"
        "found = sorted(m for m in sys.modules if m.split('.')[0] in\n"
        "               ('lightning', 'pytorch_lightning', 'lightning_fabric', 'lightning_utilities'))\n"
        "assert not found, found\n"
    )
    run_python(script)


# -- the coordinator without a process group ------------------------------------------------------
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


# -- the stop deadline, in a process of its own (it ends the process) ------------------------------
# The main thread blocks in os.read, as it would in a collective waiting for a stuck peer; the
# recording handler runs (PEP 475 retries the read), the stop is never decided.
_BLOCKED = """
import os, signal, sys
from ddp_sigterm._core.deadline import Deadline
from ddp_sigterm._core.signals import SignalRecorder
SignalRecorder((signal.SIGTERM,)).install()
Deadline(float(sys.argv[1]), (signal.SIGTERM,), "rank 0 of 2", lambda: "a peer that never answers").start()
print("ready", flush=True)
os.read(os.pipe()[0], 1)
"""


def _blocked_child(deadline: float) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", _BLOCKED, str(deadline)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert child.stdout.readline() == "ready\n"
    return child


@pytest.mark.parametrize("signals", [1, 2, 3], ids=["deadline", "burst", "third-request"])
def test_deadline_ends_a_blocked_process_with_the_reason(signals: int) -> None:
    """``burst``: three signals within milliseconds (a scheduler, then a launcher forwarding) are one
    request; ``third-request``: three signals 2 s apart end the process at the third."""
    child = _blocked_child(deadline=2.0 if signals < 3 else 30.0)
    try:
        sent = time.monotonic()
        for _ in range(1 if signals == 1 else 3):
            os.kill(child.pid, signal.SIGTERM)
            time.sleep(0.01 if signals == 2 else 2.0)
        _, err = child.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
    assert child.returncode == GAVE_UP, err
    assert "ddp_sigterm: rank 0 of 2: " in err, err
    assert "it was waiting for a peer that never answers" in err, err
    if signals < 3:
        assert "did not complete within stop_deadline=2 s of the first SIGTERM" in err
        assert 1.9 < took < 30, took
    else:
        assert "SIGTERM received a third time (at least 1 s apart)" in err
        assert took < 20, took  # at the third request (4 s), not at the deadline (30 s)


# -- SLURM ------------------------------------------------------------------------------------------
def test_slurm_job_ids() -> None:
    assert slurm.job_id({"SLURM_JOB_ID": "77"}) == "77"
    assert slurm.job_id({"SLURM_JOB_ID": "80", "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3"}) == "77_3"
    with pytest.raises(slurm.RequeueError, match="SLURM_JOB_ID is not set"):
        slurm.job_id({})
    with pytest.raises(slurm.RequeueError, match="'77; rm' is not a SLURM job id"):
        slurm.job_id({"SLURM_JOB_ID": "77; rm"})


@pytest.mark.parametrize(("fields", "preempted"), [
    ("Requeue=1 StartTime=2026-12-01T09:00:00 PreemptTime=2026-12-01T09:10:00", "2026-12-01T09:10:00"),
    ("Requeue=1 StartTime=2026-12-01T09:00:00 PreemptTime=2026-12-01T09:00:00", "2026-12-01T09:00:00"),
    ("Requeue=1 StartTime=2026-12-01T09:00:00 PreemptTime=None", None),  # scancel, time limit
    ("Requeue=0 StartTime=2026-12-01T09:00:00 PreemptTime=2026-12-01T09:10:00", None),  # SLURM cancels it
    ("Requeue=1 StartTime=2026-12-01T09:20:00 PreemptTime=2026-12-01T09:10:00", None),  # a run before a requeue
])
def test_slurm_tells_a_preemption_from_other_sigterms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       fields: str, preempted: str | None) -> None:
    """What ``scontrol show job --oneliner`` prints (22.05, as seen on tests/test_slurm.py's cluster)
    decides; a failing ``scontrol`` raises with its output."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$*" = "show job --oneliner 77" ] || exit 3\n'
                        f'echo "JobId=77 JobName=train JobState=RUNNING Reason=None {fields} '
                        'Command=/x/train.sbatch"\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert slurm.preempted({"SLURM_JOB_ID": "77"}) == preempted
    with pytest.raises(slurm.RequeueError, match="scontrol show job --oneliner 78 failed with exit code 3"):
        slurm.preempted({"SLURM_JOB_ID": "78"})


def test_process_exits_while_its_protected_dataloader_workers_are_alive() -> None:
    """multiprocessing ends daemonic children at exit with SIGTERM, then joins them; DataLoader workers
    that block SIGTERM must still end (found by the soak: a stop during validation, persistent workers)."""
    script = (
        "import signal, torch\n"
        "from ddp_sigterm._core.signals import SignalRecorder\n"
        "SignalRecorder((signal.SIGTERM,)).install()\n"
        "loader = torch.utils.data.DataLoader(list(range(64)), num_workers=2, persistent_workers=True,\n"
        "                                     multiprocessing_context='fork')\n"
        "batches = iter(loader)\n"
        "next(batches)  # the workers are alive, and stay so until the interpreter exits\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = child.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        out = "<still running after 60 s: the exit waits for workers that never end>"
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    assert child.returncode == 0, out
    # torch's SIGCHLD handler raising for the killed workers: it cut the kills short (a hang, 1 CI run in ~10)
    assert "Traceback" not in out, out


def test_coordinator_started_outside_the_main_thread_works_without_a_deadline() -> None:
    """Some runners (Ray Train, notebooks' helpers) train in a thread: no signal handler runs there and
    the wakeup fd cannot be set, so the deadline does not watch; the coordinator still works."""
    failures: list[BaseException] = []

    def train() -> None:
        try:
            deadline = Deadline(1.0, (signal.SIGTERM,), "rank 0 of 2", lambda: "nothing")
            deadline.start()
            assert deadline._thread is None
            deadline.close()
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


def test_save_in_unison_names_the_file_only_when_it_was_written(tmp_path) -> None:
    """One rank (no process group): the checked save renames the temporary file once it is there; a
    save that wrote nothing (as Lightning's swallowed PermissionError does) or raised is a StopError
    naming the step and the reason, and leaves no file under the checkpoint's name."""
    from ddp_sigterm import StopError, save_in_unison

    stop = StopCoordinator(Settings.resolve(environ={}, signals=("SIGUSR2",), stop_deadline=math.inf))
    before = signal.getsignal(signal.SIGUSR2)
    stop.start()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.should_stop(7)
        path = tmp_path / "step-7.ckpt"
        saved = save_in_unison(stop, lambda partial: torch.save({"step": 7}, partial), str(path), writer=True)
        assert saved == str(path)
        assert torch.load(path)["step"] == 7
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step-7.ckpt"]

        with pytest.raises(StopError, match=r"rank 0: every rank stopped at step 7, but saving the stop checkpoint "
                                            r"of step 7 in .* failed: OSError: .* is missing after a save"):
            save_in_unison(stop, lambda partial: None, str(tmp_path / "other.ckpt"), writer=True)
        with pytest.raises(StopError, match="failed: RuntimeError: disk full"):
            save_in_unison(stop, _raise_disk_full, str(tmp_path / "other.ckpt"), writer=True)
        assert not (tmp_path / "other.ckpt").exists()
    finally:
        stop.close()
        signal.signal(signal.SIGUSR2, before)


def _raise_disk_full(partial: str) -> None:
    raise RuntimeError("disk full")


def test_docs_slurm_shows_the_sbatch_scripts_the_slurm_tests_submit() -> None:
    """docs/slurm.md shows each examples/slurm/*.sbatch as it is (tests/test_slurm.py submits those files)."""
    root = Path(__file__).resolve().parent.parent
    docs = (root / "docs" / "slurm.md").read_text()
    scripts = sorted((root / "examples" / "slurm").glob("*.sbatch"))
    assert scripts
    for script in scripts:
        assert script.read_text().rstrip() in docs, f"docs/slurm.md does not show {script.name} as it is"


# -- the suite's own fault injections (tests/injection.py) ---------------------------------------
def test_fault_injections_are_parsed_once_and_checked() -> None:
    from injection import Injection, encode, parse

    assert parse("1:2:forward;0:*:save:SIGUSR1;1:3") == [
        Injection(1, 2, "forward"), Injection(0, None, "save", "SIGUSR1"), Injection(1, 3, "forward")]
    assert encode("1:2:forward;0:*:save:SIGUSR1") == "1:2:forward;0:*:save:SIGUSR1"
    assert Injection(0, None, "save").matches(0, 7, "save")
    assert not Injection(0, 2, "save").matches(0, 7, "save")
    malformed = {"1:2:fwd": "unknown phase 'fwd'", "1:2:forward:SIGNOPE": "unknown signal 'SIGNOPE'",
                 "one:2": "invalid literal for int", "1:2:forward:SIGTERM:extra": "expected rank:batch"}
    for bad, why in malformed.items():
        with pytest.raises(ValueError, match=why):
            parse(bad)


def test_torchrun_restart_hazard_is_named_only_where_restarts_share_a_store() -> None:
    from ddp_sigterm._core.torchelastic import restart_hazard

    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --rdzv-backend=c10d" in restart_hazard(shared)
    assert restart_hazard({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None  # nothing will restart
    assert restart_hazard({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None  # a store per attempt
    assert restart_hazard({}) is None  # not under torchrun
