"""Per-step cost of the SIGTERM check in DDP training, on the installed Lightning.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node=2 benchmark.py --step-ms 1

CPU ranks (Gloo) train a tiny model whose step sleeps ``--step-ms`` milliseconds. Blocks of steps take turns: the
SIGTERM check as the installed Lightning has it, then none (what the loops did before #20825, and with #21666 alone).
Both halves run in the same job, so the ratio is not moved by the noise between jobs. Rank 0 prints the median time
per step of each half and their ratio. The check, by Lightning:

- ``master``: #20825's broadcast from rank 0 at every batch (``_broadcast_sigterm_tensor``);
- this pull request: ``_any_rank_received_sigterm`` at the end of every batch;
- #21666 alone: none; both halves run the same code, and the ratio shows the noise of the measurement.
"""

import argparse
import os
import statistics
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.loops import training_epoch_loop


class Tiny(pl.LightningModule):
    def __init__(self, step_seconds: float) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.step_seconds = step_seconds

    def training_step(self, batch, batch_idx):
        time.sleep(self.step_seconds)  # the work of a step, without competing for the cores
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Interleave(pl.Callback):
    """Switches the check on and off block by block and times every step."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.checking = False
        self.starts = []

    def on_train_start(self, trainer, pl_module):
        loop = trainer.fit_loop.epoch_loop
        if hasattr(loop, "_broadcast_sigterm_tensor"):  # master: #20825
            broadcast = loop._broadcast_sigterm_tensor
            loop._broadcast_sigterm_tensor = lambda: broadcast() if self.checking else None
        elif hasattr(training_epoch_loop, "_any_rank_received_sigterm"):  # this pull request
            agreed = training_epoch_loop._any_rank_received_sigterm
            training_epoch_loop._any_rank_received_sigterm = lambda trainer, leaving_loop=False: (
                agreed(trainer, leaving_loop) if self.checking else trainer.received_sigterm
            )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.checking = (trainer.global_step // self.block) % 2 == 0
        self.starts.append((self.checking, time.perf_counter()))

    def on_train_end(self, trainer, pl_module):
        steps = {True: [], False: []}
        for i in range(2 * self.block, len(self.starts) - 1):  # the first round warms up; a block's edges are left out
            (before, _), (mode, start), (after, end) = self.starts[i - 1], self.starts[i], self.starts[i + 1]
            if before == mode == after:
                steps[mode].append(end - start)
        if trainer.is_global_zero:
            check, none = statistics.median(steps[True]) * 1000, statistics.median(steps[False]) * 1000
            print(
                f"lightning {pl.__version__}, {trainer.world_size} ranks: check {check:.3f} ms/step, "
                f"no check {none:.3f} ms/step, {(check / none - 1) * 100:+.2f}%"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--step-ms", type=float, default=1.0)
    step_ms = parser.parse_args().step_ms
    # about 10 s of steps a job: long blocks for fast steps, at least 6 rounds of on and off
    block = 40 if step_ms < 50 else 10
    rounds = max(6, min(20, int(5000 / (block * step_ms))))
    steps = 2 * block * rounds
    pl.seed_everything(0)
    data = TensorDataset(torch.randn(4 * steps, 8), torch.randn(4 * steps, 1))
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 2)),
        max_steps=steps,
        callbacks=[Interleave(block)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(step_ms / 1000), DataLoader(data, batch_size=2))
