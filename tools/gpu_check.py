"""What one GPU can check of PR 1's CUDA path (docs/upstream.md, "On GPUs"): one line per check, exit 1 on a failure,
2 where there is no CUDA device. ``make gpu-check`` runs each check with the Python it needs (under 5 minutes).

    python tools/gpu_check.py vote       # the series' vote on a one-rank NCCL group: no .item(), blocking copy or
                                         # stream sync; never waits for the current step's GPU work; the stop one vote
                                         # late (the patched build imported)
    python tools/gpu_check.py trainer    # a one-process CUDA Trainer: SIGTERM at batch 2 stops it (143), then a run
                                         # without a signal finishes (0); with whichever Lightning (and package) imports
    python tools/gpu_check.py window     # Lightning's own code between on_train_batch_end and the next
                                         # on_train_batch_start makes no host sync on CUDA, so that the two-GPU test
                                         # test_sigterm_vote_waits_for_no_gpu_work_of_the_current_batch measures the
                                         # vote alone

Two ranks on NCCL need two GPUs (one GPU cannot hold two NCCL ranks): there, Lightning's own test file runs its
``cuda`` cases, ``PL_RUN_CUDA_TESTS=1 python -m pytest tests_pytorch/trainer/test_ddp_sigterm_handling.py`` from the
patched tree's tests/ folder, and ``torchrun --nproc-per-node=2 benchmark.py --accelerator cuda`` measures the cost.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

FAILED = []


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def vote() -> None:
    """The vote of a fake two-rank trainer on a real one-rank NCCL group: the CUDA path runs as on N ranks."""
    import torch.distributed as dist
    from lightning.pytorch.loops.utilities import _SIGTERMVote

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    strategy = SimpleNamespace(root_device=torch.device("cuda:0"))
    trainer = SimpleNamespace(world_size=2, received_sigterm=False, strategy=strategy)

    def every_step() -> _SIGTERMVote:  # a vote at every step, as with steps slower than the period: exact step counts
        vote = _SIGTERMVote(trainer)
        vote._period_us = 0
        return vote

    sigterm = every_step()
    waits = []  # the host's waits on an event: set_sync_debug_mode does not count them, so they are counted here
    synchronize = torch.cuda.Event.synchronize
    torch.cuda.Event.synchronize = lambda event: (waits.append(event), synchronize(event))[1]  # type: ignore[method-assign]
    x = torch.randn(8192, 8192, device="cuda")
    step_done = torch.cuda.Event()
    stops, running_after_check, check_ms, errors = [], 0, [], []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # an .item(), a blocking copy or a stream sync raises from here on
    try:
        for step in range(12):
            for _ in range(20):  # a step of GPU work, about 30 ms on an H100
                x = torch.tanh(x @ x / 8192)
            step_done.record()
            trainer.received_sigterm = step >= 5  # the signal arrives during step 5
            start = time.perf_counter()
            stops.append(sigterm.poll())
            check_ms.append((time.perf_counter() - start) * 1000)
            running_after_check += not step_done.query()  # the check returned before this step's GPU work ended
            if stops[-1]:
                break
        trainer.received_sigterm, ended = False, every_step()
        at_epoch_end = [ended.poll(), ended.poll(now=True)]  # a batch's vote, then the epoch end's: no signal
        trainer.received_sigterm = True
        at_epoch_end.append(ended.poll(now=True))  # the epoch end votes on the flag as it is now and waits
        trainer.received_sigterm, leaving = False, every_step()  # an evaluation run without a signal
        last = [leaving.poll(), leaving.poll(), leaving.poll(last=True)]  # its last batch starts the vote that leaves
        x = torch.tanh(x @ x / 8192)  # the last batch's GPU work
        last.append(leaving.leave())
    except RuntimeError as error:  # sync_debug_mode("error") raises a RuntimeError naming the synchronizing call
        errors.append(str(error).splitlines()[0])
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.Event.synchronize = synchronize  # type: ignore[method-assign]
    check("vote: no .item(), blocking copy or stream sync under set_sync_debug_mode('error') (an event wait is none "
          "of these)", not errors, errors[0] if errors else "none raised")
    print(f"note vote: {len(waits)} waits on the previous vote's event in {len(stops)} steps and the leaves (each "
          "waits for the GPU work queued before that vote, a step or more ago)", flush=True)
    if errors:
        return
    check("vote: the stop comes one vote late", stops.index(True) == 6 if True in stops else False,
          f"poll() per step {stops} (signal during step 5)")
    check("vote: never waits for the current step's GPU work", running_after_check >= len(stops) - 2,
          f"the step's GPU work was still running when the check returned in {running_after_check} of {len(stops)} "
          f"steps; check {min(check_ms):.2f}-{max(check_ms):.2f} ms on the host")
    check("vote: the epoch end's vote on CUDA", at_epoch_end == [False, False, True],
          f"poll(), poll(now=True), then with a signal poll(now=True): {at_epoch_end}")
    check("vote: leaving an evaluation loop", last == [False, False, False, (0, 0)],
          f"poll(), poll(), poll(last=True), leave(): {last}")
    dist.destroy_process_group()


TRAINER = """
import os, signal, sys, torch, lightning
import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.exceptions import SIGTERMException

class Model(BoringModel):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2 and sys.argv[2] == "signal":
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)

trainer = pl.Trainer(accelerator="cuda", devices=1, max_steps=8, default_root_dir=sys.argv[1], logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     limit_val_batches=0)
package = [type(c).__name__ for c in trainer.callbacks if "ddp_sigterm" in type(c).__module__]
print(f"lightning {lightning.__version__}, package callbacks {package}", flush=True)
try:
    trainer.fit(Model())
finally:
    print(f"global_step {trainer.global_step}, files {sorted(os.listdir(sys.argv[1]))}", flush=True)
"""


def trainer() -> None:
    with tempfile.TemporaryDirectory() as root:
        for mode, code in (("signal", 128 + signal.SIGTERM), ("none", 0)):
            run = subprocess.run([sys.executable, "-c", TRAINER, root, mode], capture_output=True, text=True,
                                 timeout=300)
            lines = [line for line in run.stdout.splitlines() if line.startswith(("lightning", "global_step"))]
            check(f"trainer on CUDA, {mode}", run.returncode == code,
                  f"exit {run.returncode} (expected {code}); " + "; ".join(lines) + (run.stderr[-600:] if
                                                                                    run.returncode != code else ""))


def window() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    class ForbidHostSync(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx < 5:  # the last batch's window runs into the epoch's end
                torch.cuda.set_sync_debug_mode("error")

        def on_train_batch_start(self, *args):
            torch.cuda.set_sync_debug_mode("default")

        def on_train_epoch_end(self, *args):
            torch.cuda.set_sync_debug_mode("default")

    trainer = pl.Trainer(accelerator="cuda", devices=1, max_epochs=1, limit_train_batches=6, limit_val_batches=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[ForbidHostSync()])
    try:
        trainer.fit(BoringModel())
        check("Lightning's batch-end window makes no host sync", True, f"{trainer.global_step} steps")
    except RuntimeError as error:
        check("Lightning's batch-end window makes no host sync", False, str(error).splitlines()[0])
    finally:
        torch.cuda.set_sync_debug_mode("default")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print(f"no CUDA device here (torch {torch.__version__}): nothing checked; a CUDA build of torch and a GPU are "
              "needed", flush=True)
        sys.exit(2)
    try:
        {"vote": vote, "trainer": trainer, "window": window}[sys.argv[1]]()
    except Exception as error:  # reported, and the other checks of the script still run
        check(sys.argv[1], False, f"{type(error).__name__}: {error}")
        raise
    sys.exit(1 if FAILED else 0)
