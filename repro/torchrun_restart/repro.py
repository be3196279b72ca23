"""Minimal repro: torchrun restart after an agreed exit(143) -> gloo 'Connection refused'.

Run under: torchrun --standalone --nproc-per-node=2 --max-restarts=1 repro.py
Env knobs (all optional):
  REPRO_EXTRA_GROUPS=N     make N extra gloo groups with dist.new_group in every attempt (default 0)
  REPRO_DESTROY=1          attempt 0: barrier + destroy_process_group() before sys.exit(143)
  REPRO_WORKAROUND=prefix  init via init_process_group_per_attempt() (per-attempt PrefixStore)
  REPRO_CLEANUP=1          attempt 0: barrier, then each rank deletes its own gloo address keys
  REPRO_PROBE=1            on restart, print which stale gloo keys already exist in the store before init
"""
import faulthandler
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
EXTRA = int(os.environ.get("REPRO_EXTRA_GROUPS", "0"))
WORKAROUND = os.environ.get("REPRO_WORKAROUND", "")
TIMEOUT = timedelta(seconds=30)
# if torchrun SIGTERMs a hung worker, show where it hung
faulthandler.register(signal.SIGTERM, all_threads=False, chain=True)


def log(*a):
    print(f"[attempt{RESTART} rank{RANK}]", *a, flush=True)


def agent_store():
    # A client of the TCPStore torchrun's agent hosts (the one env:// would connect to).
    return dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), WORLD,
        is_master=False, timeout=TIMEOUT,
    )


def init_process_group_per_attempt(backend="gloo", timeout=TIMEOUT):
    """WORKAROUND: same as init_process_group(init_method="env://"), but every key of this
    torchrun attempt lives under its own prefix, so stale keys of a dead attempt are never read."""
    if not dist.is_torchelastic_launched():
        return dist.init_process_group(backend, timeout=timeout)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # mirror torch/distributed/rendezvous.py _create_c10d_store(): client of the agent's store,
    # or rank 0 hosts it when torchrun does not share its store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=(not agent and rank == 0), timeout=timeout,
                          multi_tenant=not agent)
    prefix = f"{os.environ['TORCHELASTIC_RUN_ID']}/attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}"
    store = dist.PrefixStore(f"{prefix}/default_pg", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return None


def init():
    if WORKAROUND == "prefix":
        init_process_group_per_attempt("gloo")
    else:
        dist.init_process_group("gloo", timeout=TIMEOUT)  # env:// (what Lightning etc. do)
    # extra groups reuse the default group's store (and thus its prefix)
    return [dist.new_group(backend="gloo") for _ in range(EXTRA)]


def _gloo_port(v):
    # value = gloo tcp Rank: size_t len, hostname, size_t len, sockaddr_storage..., pair ids
    n = int.from_bytes(v[:8], "little")
    addr = v[16 + n:]
    return int.from_bytes(addr[2:4], "big")  # sockaddr_in(6).sin_port


def probe():
    # Which gloo address keys are already in torchrun's store before this attempt's init?
    # (gloo key for rank r of group g: "default_pg/<g>//cpu//0/<r>"; new_group: "default_pg/0//<g>//cpu//0/<r>")
    s = agent_store()
    keys = sorted(k for k in s.list_keys() if k.startswith("default_pg/"))
    old = {k: _gloo_port(s.get(k)) for k in keys}
    log("stale gloo keys in agent store before init (key -> dead listener port):", old)

    def later():  # after init wrote the new values: did the OS hand out the same port again?
        import time
        time.sleep(3)
        new = {k: _gloo_port(s.get(k)) for k in keys}
        log("ports now:", new, "REUSED" if any(old[k] == new[k] for k in keys) else "")
    import threading
    threading.Thread(target=later, daemon=True).start()


def main():
    if RESTART > 0 and os.environ.get("REPRO_PROBE") == "1":
        probe()
    groups = init()
    t = torch.ones(1)
    dist.all_reduce(t)
    for g in groups:
        dist.all_reduce(t, group=g)
    if RESTART > 0:
        log("restart OK, all_reduce ->", t.item())
        dist.destroy_process_group()
        sys.exit(0)

    # attempt 0: "train" a few steps, then an agreed stop at step 10 (as after SIGTERM)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 11):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
    dist.barrier()
    if os.environ.get("REPRO_DESTROY") == "1":
        dist.destroy_process_group()
    if os.environ.get("REPRO_CLEANUP") == "1":
        # (c) after the barrier nobody reads the address keys any more: drop this rank's
        # gloo keys so the next attempt cannot read them (only helps on a *clean* exit).
        s = agent_store()
        for k in s.list_keys():
            if k.startswith("default_pg/") and k.endswith(f"/{RANK}"):
                s.delete_key(k)
    log("agreed stop at step 10 -> exit 143")
    sys.exit(143)


if __name__ == "__main__":
    main()
