"""What the package's groups cost to make, and how soon a stop lands, across nodes: ``make bench-multinode`` (root).

Jobs of N nodes x 2 ranks (network namespaces on this machine, tests/support/nodes.py; every rank on 2 cores, so 8 ranks
are oversubscribed 4 to a core), one process per rank with MASTER_ADDR, 50 ms steps. SIGTERM goes to the last rank
(on the last node) at its batch 3. Read from the package's own log (``DDP_SIGTERM_LOG_LEVEL=DEBUG``): the time each
rank took to make the stop's two gloo groups (the least is the last rank to get there, which waits for no one: the
groups' own cost; the most adds how much later than the first the last rank got there), and on the signalled rank
the time from its SIGTERM to the agreed stop; from the harness: the time from that SIGTERM until every process of
every node had exited. Writes a Markdown table to stdout (docs/multi-node.md holds the last one).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from ddp_sigterm_tests import nodes
from ddp_sigterm_tests.scenario import Scenario

ROOT = Path(__file__).resolve().parent.parent

MADE = re.compile(r"rank (\d+): the stop's gloo groups made in ([\d.]+) s")
AGREED = re.compile(r"SIGTERM received here at .* \(([\d.]+) s, (\d+) step boundaries before the agreement\)")
DEVICES = 2


def measure(count: int, out: Path) -> dict[str, float]:
    last = count * DEVICES - 1
    with nodes.Nodes(count) as cluster:
        scenario = Scenario(max_steps=400, batches=400, step_sleep=0.05, inject=f"{last}:3:forward")
        result = nodes.job(out, cluster, "independent", DEVICES, scenario, timeout=600,
                           env={"DDP_SIGTERM_LOG_LEVEL": "DEBUG"})
    injected = result.outcomes.get(last, {}).get("injected_at")
    if result.timed_out or set(result.returncodes.values()) != {143} or injected is None:
        raise RuntimeError(f"the job did not stop cleanly:\n{result.describe()}")
    made = [float(seconds) for label in result.logs for _, seconds in MADE.findall(result.log(label))]
    agreed = AGREED.search(result.log(f"node{count - 1}.rank{last}"))
    if len(made) != count * DEVICES or agreed is None:
        raise RuntimeError(f"the package's log lacks a figure:\n{result.describe()}")
    return {"made_min": min(made), "made_max": max(made), "agreed": float(agreed.group(1)),
            "boundaries": int(agreed.group(2)), "gone": max(result.exited_at.values()) - injected}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 3, 4, 6])
    args = parser.parse_args()
    why = nodes.available()
    if why:
        sys.exit(f"bench-multinode cannot run here: {why}")
    print("| nodes x ranks | groups made: least (most) | SIGTERM -> agreed stop | SIGTERM -> every process gone |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for count in args.nodes:
            f = measure(count, Path(tmp) / f"n{count}")
            print(f"| {count} x {DEVICES} | {f['made_min']:.3f} s ({f['made_max']:.3f} s) | {f['agreed']:.2f} s "
                  f"({f['boundaries']} step{'' if f['boundaries'] == 1 else 's'}) | {f['gone']:.1f} s |", flush=True)


if __name__ == "__main__":
    main()
