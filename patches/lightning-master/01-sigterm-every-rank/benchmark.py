"""Per-step cost of the SIGTERM check in DDP training, on the installed Lightning.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node=2 benchmark.py --step-ms 1 [--validate-every 10] [--accelerator cuda]

The ranks train a tiny model whose step sleeps ``--step-ms`` milliseconds (on CUDA: runs that long of matrix products).
Blocks of steps take turns: the SIGTERM check as the installed Lightning has it, then none (as before #20825, and with
#21666 alone). Both halves run in the same job, so the ratio is not moved by the noise between jobs. With
``--validate-every N`` a validation of 5 batches (each as long as a step) runs every N steps, and its cost counts too.
Rank 0 prints the mean time per step of each half (validation included) and their ratio. The check, by Lightning:

- ``master``: #20825's broadcast from rank 0 at every training batch (``_broadcast_sigterm_tensor``);
- this pull request: the vote of ``_SIGTERMVote`` at every training batch and at the epoch end; with the evaluation
  loops' pull request, at every evaluation batch and where a rank leaves an evaluation dataloader too;
- #21666 alone: none; both halves run the same code, and the ratio shows the noise of the measurement.
"""

import argparse
import os
import statistics
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.loops import utilities

VAL_BATCHES = 5


class Tiny(pl.LightningModule):
    def __init__(self, step_seconds: float, matmuls: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.step_seconds, self.matmuls = step_seconds, matmuls

    def work(self):
        if self.matmuls:  # CUDA: GPU work that the host does not wait for
            x = torch.ones(4096, 4096, device=self.device)
            for _ in range(self.matmuls):
                x = x @ x / 4096
        else:
            time.sleep(self.step_seconds)  # the work of a step, without competing for the cores

    def training_step(self, batch, batch_idx):
        self.work()
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        self.work()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Interleave(pl.Callback):
    """Switches the check on and off block by block; times every step and every validation."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.checking = False
        self.starts = []  # (checking, time) at each training batch start
        self.validations = {True: [], False: []}  # seconds per validation run
        self.validated_at = set()  # indexes of the starts whose step ran a validation

    def on_train_start(self, trainer, pl_module):
        loop = trainer.fit_loop.epoch_loop
        if hasattr(loop, "_broadcast_sigterm_tensor"):  # master: #20825
            broadcast = loop._broadcast_sigterm_tensor
            loop._broadcast_sigterm_tensor = lambda: broadcast() if self.checking else None
        elif hasattr(utilities, "_SIGTERMVote"):  # this pull request: every rank turns it on and off at the same step
            vote = utilities._SIGTERMVote
            poll, leave = vote.poll, getattr(vote, "leave", None)
            vote.poll = lambda s, *a, **k: poll(s, *a, **k) if self.checking else s.trainer.received_sigterm
            if leave is not None:  # the evaluation loops' pull request
                vote.leave = lambda s: leave(s) if self.checking else (int(s.trainer.received_sigterm), 0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.checking = (trainer.global_step // self.block) % 2 == 0
        self.starts.append((self.checking, time.perf_counter()))

    def on_validation_start(self, trainer, pl_module):
        self.validation_started = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.validations[self.checking].append(time.perf_counter() - self.validation_started)
            self.validated_at.add(len(self.starts) - 1)

    def on_train_end(self, trainer, pl_module):
        steps = {True: [], False: []}
        for i in range(2 * self.block, len(self.starts) - 1):  # the first round warms up; a block's edges are left out
            (before, _), (mode, start), (after, end) = self.starts[i - 1], self.starts[i], self.starts[i + 1]
            if before == mode == after and i not in self.validated_at:
                steps[mode].append(end - start)
        every = trainer.val_check_batch if self.validations[False] else 0
        per_step = {}
        for mode in (True, False):  # a step, plus a validation's share where there is one
            step = statistics.mean(steps[mode])  # not the median: a vote spaced over several steps costs only some
            per_step[mode] = step + (statistics.mean(self.validations[mode]) / every if every else 0)
        if trainer.is_global_zero:
            check, none = per_step[True] * 1000, per_step[False] * 1000
            print(
                f"lightning {pl.__version__}, {trainer.world_size} ranks: check {check:.3f} ms/step, "
                f"no check {none:.3f} ms/step, {(check / none - 1) * 100:+.2f}%"
            )


def matmuls_for(step_ms: float) -> int:
    """How many 4096 x 4096 products take about ``step_ms`` on this GPU."""
    x = torch.ones(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        x = x @ x / 4096
    torch.cuda.synchronize()
    return max(1, round(step_ms / ((time.perf_counter() - start) * 1000 / 20)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--step-ms", type=float, default=1.0)
    parser.add_argument("--validate-every", type=int, default=0, help="steps between validations; 0: none")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    if args.accelerator == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # about 10 s of steps a job: long blocks for fast steps, at least 6 rounds of on and off
    block = 40 if args.step_ms < 50 else 10
    rounds = max(6, min(20, int(5000 / (block * args.step_ms))))
    steps = 2 * block * rounds
    pl.seed_everything(0)
    data = TensorDataset(torch.randn(4 * steps, 8), torch.randn(4 * steps, 1))
    validation = {}
    if args.validate_every:
        val_data = DataLoader(TensorDataset(torch.randn(VAL_BATCHES * 2, 8)), batch_size=2)
        validation = {"val_dataloaders": val_data}
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        strategy="ddp",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 2)),
        max_steps=steps,
        val_check_interval=args.validate_every or 1.0,
        check_val_every_n_epoch=None if args.validate_every else 1,
        num_sanity_val_steps=0,
        callbacks=[Interleave(block)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    matmuls = matmuls_for(args.step_ms) if args.accelerator == "cuda" else 0
    trainer.fit(Tiny(args.step_ms / 1000, matmuls), DataLoader(data, batch_size=2), **validation)
