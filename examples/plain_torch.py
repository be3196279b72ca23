"""A hand-written torch.distributed DDP loop with ddp_sigterm's core (no Lightning).

    torchrun --nproc-per-node 2 examples/plain_torch.py --root runs/plain
    kill -TERM <pid of any rank>      # every rank stops at the same step, one checkpoint, exit 143
    torchrun --nproc-per-node 2 examples/plain_torch.py --root runs/plain   # resumes, finishes, exit 0

The checkpoint holds the data position too: the ``state_dict`` of torchdata's ``StatefulDataLoader`` (``pip install
torchdata``), so the resumed run trains on the batch after the stop, in the epoch's order, and ends with an
uninterrupted run's weights. Rank 0 writes it: every rank is at the same batch of its own shard.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from ddp_sigterm import StopCoordinator, save_in_unison


def newest_checkpoint(root: str) -> str | None:
    steps = [int(m.group(1)) for name in os.listdir(root) if (m := re.fullmatch(r"step-(\d+)\.pt", name))]
    return os.path.join(root, f"step-{max(steps)}.pt") if steps else None


def loader(rank: int, world_size: int) -> StatefulDataLoader:
    """This rank's shard of the data, shuffled by epoch (4 batches of 32 per rank and epoch with 2 ranks); its
    ``state_dict`` is its position in the epoch."""
    generator = torch.Generator().manual_seed(1234)
    data = TensorDataset(torch.randn(256, 16, generator=generator), torch.randn(256, 1, generator=generator))
    return StatefulDataLoader(data, batch_size=32, sampler=DistributedSampler(data, world_size, rank, seed=0))


def digest(model: torch.nn.Module) -> str:
    """A fingerprint of the weights: a resumed run must end with an uninterrupted run's."""
    return hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="runs/plain", help="checkpoints go here")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR, ...
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = loader(rank, dist.get_world_size())
    os.makedirs(args.root, exist_ok=True)
    start = epoch = 0
    if (path := newest_checkpoint(args.root)) is not None:
        state = torch.load(path, map_location="cpu")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        data.load_state_dict(state["loader"])  # its next iterator goes on from the batch after the stop
        start, epoch = state["step"], state["epoch"]
    stop = StopCoordinator()  # settings from DDP_SIGTERM_* variables
    stop.start()  # every rank, same point: the agreement's group is created, stop signals are recorded
    print(f"[rank {rank}] pid {os.getpid()}, starting at step {start}", flush=True)

    def save_and_exit(step: int) -> None:
        path = os.path.join(args.root, f"step-{step}.pt")

        def write(partial: str) -> None:  # rank 0 writes; every rank learns whether it worked
            if rank == 0:
                torch.save({"step": step, "epoch": epoch, "model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(), "loader": data.state_dict()}, partial)

        save_in_unison(stop, write, path, writer=rank == 0)  # renamed to path once it worked; else StopError
        name = signal.Signals(stop.decision.signum).name
        print(f"[rank {rank}] stopped at step {step} by {name}, checkpoint {path}, exit {stop.exit_code}", flush=True)
        raise SystemExit(stop.exit_code)

    step = start
    try:
        while step < args.max_steps:
            data.sampler.set_epoch(epoch)  # before the iterator is made: it draws the epoch's order
            for x, y in data:
                time.sleep(args.step_seconds)  # stands in for real work
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                print(f"[rank {rank}] step {step}", flush=True)
                if stop.should_stop(step):  # every rank, every step: the same answer everywhere
                    save_and_exit(step)
                if step == args.max_steps:
                    break
            else:
                epoch += 1
        if stop.decide_now(step):  # a signal after the last agreement is not lost
            save_and_exit(step)
        print(f"[rank {rank}] finished at step {step}, weights {digest(model)}", flush=True)
    finally:
        stop.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
