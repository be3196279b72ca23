"""A hand-written torch.distributed DDP loop using the framework-agnostic core (no Lightning).

Launched by the harness like the Lightning scenario (a :class:`scenario.Job`: max_steps, step_sleep, inject),
it writes outcome.rank<R>.json with what such a loop has: its rank, the step it reached, whether (and at which
step) it stopped, its exit code, the coordinator's decision, and when it signalled itself. Rank 0 saves
``step<N>.pt`` at the stop.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import torch
import torch.distributed as dist
from ddp_sigterm_tests.scenario import Job

from ddp_sigterm import StopCoordinator

JOB = Job.read()
SCENARIO = JOB.scenario
OUT = JOB.out
INJECT = SCENARIO.injections()  # phase "forward": before the step's forward


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stop = StopCoordinator()
    stop.start()
    outcome = {"rank": rank, "exit_code": 0, "stopped_at": None, "stop": None, "injected_at": None}
    step = 0

    def stop_here() -> None:
        if rank == 0:
            torch.save({"step": step, "model": model.module.state_dict()}, os.path.join(OUT, f"step{step}.pt"))
        dist.barrier()
        outcome.update(stopped_at=step, exit_code=stop.exit_code, stop=dataclasses.asdict(stop.decision))
        raise SystemExit(stop.exit_code)

    try:
        while step < SCENARIO.max_steps:
            step += 1
            for injected in INJECT:
                if injected.matches(rank, step, "forward") and outcome["injected_at"] is None:
                    outcome["injected_at"] = time.monotonic()
                    os.kill(os.getpid(), injected.signum)
            time.sleep(SCENARIO.step_sleep)
            loss = model(torch.randn(4, 16)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if stop.should_stop(step):
                stop_here()
        if stop.decide_now(step):  # a signal after the last agreement is not lost
            stop_here()
    finally:
        outcome.update(step=step)
        with open(os.path.join(OUT, f"outcome.rank{rank}.json"), "w") as f:
            json.dump(outcome, f)
        stop.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
