"""One rank of the collective micro-benchmark: the agreement's all-reduce alone, timed.

Started by benchmarks/bench.py (through the test harness, one process per rank). Each rank joins a
gloo group, runs BENCH_WARMUP all-reduces of the agreement's payload (``PAYLOAD_SIZE`` int64,
one per field of its vote), then times BENCH_REPEATS of them, and writes ``collective.rank<R>.json``
with every duration in seconds.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
from ddp_sigterm_tests.scenario import Job

from ddp_sigterm._core.port import PAYLOAD_SIZE

ENV = os.environ
OUT = Job.read().out  # the harness's job: where to write


def main() -> None:
    rank, world = int(ENV["NODE_RANK"]), int(ENV["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    votes = torch.zeros(PAYLOAD_SIZE, dtype=torch.int64)
    for _ in range(int(ENV.get("BENCH_WARMUP", "50"))):
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
    durations = []
    for _ in range(int(ENV.get("BENCH_REPEATS", "500"))):
        start = time.perf_counter()
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        durations.append(time.perf_counter() - start)
    dist.barrier()
    with open(os.path.join(OUT, f"collective.rank{rank}.json"), "w") as f:
        json.dump({"durations": durations}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
