"""Loops of uneven length between step boundaries, on the core alone: the heartbeat against the re-sync.

``python uneven_loop.py SEED OUT`` on each rank (torch.distributed's ``env://`` variables set). Every cycle,
each rank runs an evaluation-like loop of its own random length (``should_stop`` at each boundary, then
``should_stop_on_leaving``), then three training steps (``should_stop``). The heartbeat runs every 5 ms,
so its reports keep landing while the ranks' boundary counts differ and when the leaving agreement
re-syncs them. One rank, chosen by SEED, sends itself SIGTERM at a point SEED chooses: in its loop, just
before leaving it, or in training. Writes ``outcome.rank<R>.json``: where the rank stopped and what it agreed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import sys
import time

import torch.distributed as dist

from ddp_sigterm import Settings, StopCoordinator

CYCLES = 40


def main(seed: int, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    choose = random.Random(seed)
    target, at_cycle, at_point = choose.randrange(2), choose.randrange(1, 8), choose.choice(["loop", "leave", "train"])
    own = random.Random(seed * 100 + rank)  # this rank's loop lengths and step times
    stop = StopCoordinator(Settings(max_delay=0.01))
    stop.start()
    where: list[object] = ["finished"]

    def point(cycle: int, name: str, index: int = 0) -> None:
        if rank == target and (cycle, name, index) == (at_cycle, at_point, 0):
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(own.uniform(0.0, 0.003))

    try:
        for cycle in range(CYCLES):
            for index in range(own.randrange(1, 8)):
                point(cycle, "loop", index)
                if stop.should_stop(None):
                    where = ["loop", cycle, index]
                    raise SystemExit(stop.exit_code)
            point(cycle, "leave")
            if stop.should_stop_on_leaving(None):
                where = ["leave", cycle]
                raise SystemExit(stop.exit_code)
            for index in range(3):
                point(cycle, "train", index)
                if stop.should_stop(cycle * 3 + index):
                    where = ["train", cycle, index]
                    raise SystemExit(stop.exit_code)
    finally:
        decision = stop.decision
        with open(os.path.join(out, f"outcome.rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "target": target, "signalled_at": [at_cycle, at_point], "stopped": where,
                       "stop": None if decision is None else dataclasses.asdict(decision)}, f)
        stop.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
