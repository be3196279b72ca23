"""ddp_sigterm/_core/runtime.py: what the package does to the process: DataLoader workers leave the recorded signals
to their DataLoader's process and end with it, the way out after a stop, handlers and threads that a closed runtime
leaves no trace of."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from ddp_sigterm._core.deadline import Deadline
from ddp_sigterm._core.runtime import Runtime
from ddp_sigterm._core.signals import SignalRecorder


def _closed(runtime: Runtime) -> None:
    runtime.close(stopped=False, leaving=False, destroy_default_group=False, redeliver=False)


def test_after_leave_a_late_stop_signal_cannot_change_the_exit() -> None:
    """After an agreed stop the process exits with 128 + signal on its own: torchrun's SIGTERM to the ranks still
    running must not end it first (it would exit -15)."""
    script = (
        "import os, signal, sys\n"
        "from ddp_sigterm._core.runtime import Runtime\n"
        "from ddp_sigterm._core.signals import SignalRecorder\n"
        "runtime = Runtime(SignalRecorder((signal.SIGTERM, signal.SIGUSR2)))\n"
        "runtime.start(handlers=True)\n"
        "runtime.close(stopped=True, leaving=True, destroy_default_group=False, redeliver=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "os.kill(os.getpid(), signal.SIGUSR2)\n"
        "sys.exit(143)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 143, done.stderr


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
    runtime = Runtime(recorder)
    runtime.start(handlers=True)
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
        _closed(runtime)
    # unprotected. No timeout: torch then checks its workers every 5 s. Its SIGCHLD handler, which reports a killed
    # worker at once, may be gone: a Trainer's teardown earlier in this process (test_lightning_integration) puts back
    # every handler it saw at set-up, SIG_DFL for SIGCHLD included, and torch installs its handler once per process;
    # a 60 s timeout then cost a minute of make test.
    loader = torch.utils.data.DataLoader(_MaskReport(), num_workers=1, multiprocessing_context="fork", batch_size=None)
    with pytest.raises(RuntimeError, match="DataLoader worker .* (killed by signal|exited unexpectedly)"):
        list(loader)


def _sigterm_from_another_process(pid: int) -> None:
    """As SLURM's ``scancel`` sends it: from outside, to every process of the job."""
    subprocess.run([sys.executable, "-c", f"import os, signal; os.kill({pid}, signal.SIGTERM)"], check=True, timeout=60)


def test_dataloader_worker_drops_a_sigterm_from_outside_and_ends_on_its_loaders() -> None:
    """The worker survives a SIGTERM from another process; its DataLoader's process ends it at once with one, as
    torch's shutdown does (terminate() after its join's timeout) and multiprocessing's exit, with exit code 0 as
    torch's worker; the main process gets no thread of the package's."""
    runtime = Runtime(SignalRecorder((signal.SIGTERM,)))
    runtime.start(handlers=True)
    try:
        loader = torch.utils.data.DataLoader(list(range(64)), num_workers=1, multiprocessing_context="fork",
                                             timeout=60)
        batches = iter(loader)
        next(batches)
        (worker,) = multiprocessing.active_children()
        _sigterm_from_another_process(worker.pid)
        worker.join(timeout=1.0)
        assert worker.is_alive()
        assert next(batches) is not None  # and still serves its batches
        assert not [thread.name for thread in threading.enumerate() if thread.name.startswith("ddp_sigterm")]
        worker.terminate()
        worker.join(timeout=10)
        assert worker.exitcode == 0
        del batches
    finally:
        _closed(runtime)


def test_process_exits_while_its_protected_dataloader_workers_are_alive() -> None:
    """multiprocessing ends daemonic children at exit with SIGTERM, then joins them without a timeout: DataLoader
    workers that leave SIGTERM to their parent must still end on it (found by the soak: a stop during validation,
    persistent workers)."""
    script = (
        "import signal, torch\n"
        "from ddp_sigterm._core.runtime import Runtime\n"
        "from ddp_sigterm._core.signals import SignalRecorder\n"
        "Runtime(SignalRecorder((signal.SIGTERM,))).start(handlers=True)\n"
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
    # torch's SIGCHLD handler raises for a worker ended by a signal (the workers exit 0)
    assert "Traceback" not in out, out


def test_start_and_close_are_idempotent_and_leave_nothing_behind() -> None:
    """One start, one close, either twice is harmless: the handlers it replaced are back, the deadline's thread has
    ended and the wakeup fd is the one before; the recording handler chained to the handler in place."""
    seen: list[int] = []
    def users(signum: int, frame: object) -> None:
        seen.append(signum)

    previous = signal.signal(signal.SIGUSR2, users)
    threads, fd = threading.enumerate(), signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd)
    try:
        recorder = SignalRecorder((signal.SIGUSR2,))
        runtime = Runtime(recorder)
        deadline = Deadline(60.0, recorder.signals, "rank 0 of 2", lambda: "nothing")
        runtime.start(handlers=True, deadline=deadline)
        runtime.start(handlers=True, deadline=deadline)
        assert [t.name for t in threading.enumerate() if t not in threads] == ["ddp_sigterm-deadline"]
        os.kill(os.getpid(), signal.SIGUSR2)
        assert recorder.signum == signal.SIGUSR2
        assert seen == [signal.SIGUSR2]
        _closed(runtime)
        _closed(runtime)
        assert signal.getsignal(signal.SIGUSR2) is users
        assert signal.set_wakeup_fd(fd) == fd
        assert threading.enumerate() == threads
        os.kill(os.getpid(), signal.SIGUSR2)
        assert seen == [signal.SIGUSR2] * 2
    finally:
        signal.signal(signal.SIGUSR2, previous)
