#!/usr/bin/env python3
"""Run repro.py N times under torchrun (one run at a time) and count failures.

usage: run.py NAME N [KEY=VAL ...] [-- extra torchrun args]
  KEY=VAL are env vars for torchrun/workers (e.g. REPRO_EXTRA_GROUPS=1 REPRO_WORKAROUND=prefix).
  Default torchrun args: --standalone --nproc-per-node=2 --max-restarts=1
  Put '--' then replacement rendezvous args to replace '--standalone'
  (e.g. -- --rdzv-backend=c10d --rdzv-endpoint=localhost:29555).
Logs: $REPRO_OUT/logs/NAME/<i>.log ; summary appended to $REPRO_OUT/results.txt (REPRO_OUT default:
build/repro-torchrun). torchrun is this Python's (``python -m torch.distributed.run``).
"""
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
OUT = os.environ.get("REPRO_OUT", "build/repro-torchrun")


def main():
    name, n = sys.argv[1], int(sys.argv[2])
    rest = sys.argv[3:]
    rdzv = ["--standalone"]
    if "--" in rest:
        i = rest.index("--")
        rest, rdzv = rest[:i], rest[i + 1:]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for kv in rest:
        k, v = kv.split("=", 1)
        env[k] = v
    logdir = f"{OUT}/logs/{name}"
    os.makedirs(logdir, exist_ok=True)
    fails, kinds = 0, {}
    for i in range(n):
        cmd = ["timeout", "-k", "5", "60", *TORCHRUN, *rdzv, "--nproc-per-node=2",
               "--max-restarts=1", os.path.join(HERE, "repro.py")]
        t0 = time.time()
        with open(f"{logdir}/{i}.log", "w") as f:
            p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            try:
                rc = p.wait(timeout=80)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                rc = p.wait()
        with open(f"{logdir}/{i}.log") as f:
            out = f.read()
        ok = rc == 0 and out.count("restart OK") == 2
        if ok:
            kind = "ok"
        else:
            fails += 1
            if "Connection refused" in out:
                kind = "ConnRefused"
            elif "Connection reset" in out:
                kind = "ConnReset"
            elif rc == 124:
                kind = "hang(killed@60s)"
            else:
                kind = f"rc{rc}"
        kinds[kind] = kinds.get(kind, 0) + 1
        print(f"{name} run {i}: rc={rc} {kind} ({time.time() - t0:.1f}s)", flush=True)
    line = f"{name}: {fails}/{n} fail  {kinds}  env={rest} rdzv={rdzv}"
    print(line)
    with open(f"{OUT}/results.txt", "a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    main()
