"""A rank that runs nothing but the package's heartbeat (ddp_sigterm._core.port.Heartbeat), beating every
``HEARTBEAT_PERIOD`` seconds on a gloo group of its own while the main thread passes step boundaries, for
``HEARTBEAT_SECONDS``: what tests/test_fork_safety.py watches gloo's threads do. Started with the environment
of torch.distributed's env:// rendezvous (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import torch.distributed as dist

from ddp_sigterm._core.decision import Ballot, StopSchedule
from ddp_sigterm._core.port import Driver, GlooPort, Heartbeat


def main() -> None:
    dist.init_process_group("gloo")
    schedule = StopSchedule(dist.get_rank(), False, Ballot, time.monotonic)
    port = GlooPort(dist.get_rank(), dist.get_world_size(), beating=dist.new_group(backend="gloo"))
    driver = Driver(schedule, port, lambda what: contextlib.nullcontext())
    heartbeat = Heartbeat(driver, float(os.environ["HEARTBEAT_PERIOD"]), lambda: False)
    thread = threading.Thread(target=heartbeat.beat, daemon=True)
    thread.start()
    print(f"beating, pid {os.getpid()}", flush=True)
    until, boundary = time.monotonic() + float(os.environ["HEARTBEAT_SECONDS"]), 0
    while time.monotonic() < until:
        boundary += 1
        driver.run(schedule.passing, boundary, False)
        time.sleep(0.001)
    heartbeat.end()
    thread.join(10)
    dist.destroy_process_group()
    print("ended", flush=True)


if __name__ == "__main__":
    main()
