"""Several "nodes" on this machine: one network namespace each, joined by a bridge (make test-multinode).

Each node has ``eth0`` on a private subnet of the test's own (10.213.K.0/24, K from this process's id) and
its ``lo``; the host side has the bridge, at 10.213.K.254 (where a daemon of the host, SLURM's controller,
is reached from the nodes), and the veth ends. The file system is shared: a checkpoint directory is shared
storage. A node's ``/etc/hosts`` is its own (``ip netns exec`` binds ``/etc/netns/<node>/hosts`` over it):
it names every node by its namespace's name, and by default maps the machine's host name to the node's own
address, as a cluster's DNS does; a test may map that elsewhere (a loopback address, a second interface)
to reproduce Gloo's pitfalls.

Everything made is written to a ledger file first (``MULTINODE_LEDGER``, default build/multinode/created),
and removed by name in ``finally``: the processes still in each namespace (``ip netns pids``), the
namespace, the links, the hosts file. ``python tests/support/nodes.py cleanup <ledger>`` does the same from the
Makefile's trap, for a run that was killed; it touches nothing the ledger does not name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

from ddp_sigterm_tests.harness import SCRIPT, JobResult, OutsideSignal, job_environment, run_commands
from ddp_sigterm_tests.scenario import Job, Scenario

REPO = Path(__file__).resolve().parent.parent
PORT = "29400"  # node 0's, in its own namespace: nothing else listens there
LEDGER = Path(os.environ.get("MULTINODE_LEDGER", REPO / "build" / "multinode" / "created"))
HOSTNAME = socket.gethostname()


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Nodes:
    """``count`` namespaces joined by a bridge; ``address(i)`` is node i's (from 0), ``run(i, argv)`` the argv
    that runs a command there. ``dead=True`` also gives each node ``eth1``, on a subnet no other node has
    (10.212.K.0/24, ordered before eth0's: Gloo's pairs connect from the greater address to the smaller,
    so a peer must reach it), the second interface of Gloo's pitfall."""

    def __init__(self, count: int, dead: bool = False, ledger: Path = LEDGER) -> None:
        self.count, self.dead, self.ledger = count, dead, ledger
        tag = f"{os.getpid() % 100000}"
        self.subnet = 20 + os.getpid() % 200
        self.bridge = f"dsb{tag}"
        self.names = [f"dsn{tag}x{i}" for i in range(count)]

    def address(self, node: int) -> str:
        return f"10.213.{self.subnet}.{node + 1}"

    @property
    def host_address(self) -> str:
        return f"10.213.{self.subnet}.254"

    def dead_address(self, node: int) -> str:
        return f"10.212.{self.subnet}.{node + 1}"

    def run(self, node: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[node], *argv]

    def run_daemon(self, node: int, argv: list[str]) -> list[str]:
        """Like :meth:`run`, but the node keeps the machine's /sys (``ip netns exec`` mounts a sysfs of the
        namespace's, without /sys/fs/cgroup, which slurmd needs): the namespace's network and hosts file only."""
        name = self.names[node]
        return ["nsenter", f"--net=/run/netns/{name}", "unshare", "--mount", "--propagation=private", "sh", "-c",
                f'mount --bind /etc/netns/{name}/hosts /etc/hosts && exec "$@"', "sh", *argv]

    def torchrun(self, node: int, per_node: int, args: list[str], python: str = sys.executable,
                 port: str = PORT, nnodes: str | None = None) -> list[str]:
        """The argv that runs torchrun on ``node`` for a job of ``per_node`` ranks on every node (c10d
        rendezvous on node 0); ``nnodes``: torchrun's ``--nnodes`` (``MIN:MAX``), default every node."""
        return self.run(node, [python, "-m", "torch.distributed.run", f"--nnodes={nnodes or self.count}",
                               f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
                               f"--rdzv-endpoint={self.address(0)}:{port}", "--rdzv-id=job",
                               # the address the other nodes reach this one at: torchrun's default is its host
                               # name's (the same on every node here, as where names are not unique or in DNS)
                               f"--local-addr={self.address(node)}", *args])

    def map_hostname(self, node: int, address: str) -> None:
        """Node ``node`` resolves the machine's host name to ``address`` from now on."""
        hosts = Path("/etc/netns") / self.names[node] / "hosts"
        names = "".join(f"{self.address(other)} {name}\n" for other, name in enumerate(self.names))
        hosts.write_text(f"127.0.0.1 localhost\n{address} {HOSTNAME}\n{names}")

    def _record(self, kind: str, name: str) -> None:
        with open(self.ledger, "a") as ledger:
            ledger.write(f"{kind} {name}\n")

    def __enter__(self) -> Nodes:
        self.ledger.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._record("link", self.bridge)
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for node, name in enumerate(self.names):
                self._record("netns", name)
                ip("netns", "add", name)
                Path("/etc/netns", name).mkdir(parents=True, exist_ok=True)
                self.map_hostname(node, self.address(node))
                ip("-n", name, "link", "set", "lo", "up")
                host_end = f"{name}h"
                self._record("link", host_end)
                ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", name)
                ip("link", "set", host_end, "master", self.bridge, "up")
                ip("-n", name, "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
                ip("-n", name, "link", "set", "eth0", "up")
                if self.dead:  # a veth whose other end is on no bridge: nothing is behind it
                    self._record("link", f"{name}d")
                    ip("link", "add", f"{name}d", "type", "veth", "peer", "name", "eth1", "netns", name)
                    ip("-n", name, "addr", "add", f"{self.dead_address(node)}/24", "dev", "eth1")
                    ip("-n", name, "link", "set", "eth1", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        cleanup(self.ledger)


def cleanup(ledger: Path) -> list[str]:
    """Remove what ``ledger`` names (then the ledger): kill the processes in each namespace, delete it,
    its hosts file, and the links. Returns what it removed."""
    if not ledger.exists():
        return []
    entries = [line.split(" ", 1) for line in ledger.read_text().splitlines() if " " in line]
    removed = []
    for kind, name in entries:
        if kind == "netns" and name.startswith("dsn"):
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            if subprocess.run(["ip", "netns", "del", name], capture_output=True).returncode == 0:
                removed.append(f"netns {name}")
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
    with contextlib.suppress(OSError):
        Path("/etc/netns").rmdir()  # only if empty: another user's entries stay
    for kind, name in entries:
        if kind == "link" and name.startswith("ds") and \
                subprocess.run(["ip", "link", "del", name], capture_output=True).returncode == 0:
            removed.append(f"link {name}")
    ledger.unlink()
    return removed


def available() -> str | None:
    """Why nodes cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    return None


def job(out: Path, cluster: Nodes, launcher: str, devices: int, scenario: Scenario | None = None,
        env: dict[str, str] | None = None, outside: OutsideSignal | None = None, timeout: float = 180.0,
        python: str = sys.executable, implementation: str = "package", script: Path = SCRIPT,
        port: str = PORT, node_env: dict[int, dict[str, str]] | None = None,
        torchrun_args: tuple[str, ...] = (), nnodes: str | None = None) -> JobResult:
    """A scenario job (tests/support/scenario_train.py running ``scenario``) of ``devices`` ranks on each node, node N's
    processes in its namespace, labelled ``nodeN`` (``nodeN.rankR`` when each rank is a process of its own):
    ``torchrun`` (multi-node, c10d rendezvous on node 0), ``independent`` (one process per rank with MASTER_ADDR,
    as srun starts them) or ``lightning`` (one process per node; Lightning's launcher starts the node's other
    ranks). ``implementation``: the fix ``python`` has (see scenario.Job). ``node_env``: node N's own variables,
    over ``env``. ``torchrun_args`` and ``nnodes``: torchrun's own options (``--max-restarts``;
    ``--nnodes=MIN:MAX``)."""
    world = cluster.count * devices
    common = job_environment(Job(scenario or Scenario(), str(out), devices=devices, num_nodes=cluster.count,
                                 implementation=implementation), env)
    master = {"MASTER_ADDR": cluster.address(0), "MASTER_PORT": port}
    commands: dict[str, tuple[list[str], dict[str, str]]] = {}
    for node in range(cluster.count):
        base = {**common, **(node_env or {}).get(node, {})}
        if launcher == "torchrun":
            commands[f"node{node}"] = (cluster.torchrun(node, devices, [*torchrun_args, str(script)], python, port,
                                                        nnodes), base)
        elif launcher == "lightning":
            commands[f"node{node}"] = (cluster.run(node, [python, str(script)]),
                                       {**base, **master, "NODE_RANK": str(node)})
        elif launcher == "independent":
            for local in range(devices):
                rank = node * devices + local
                commands[f"node{node}.rank{rank}"] = (cluster.run(node, [python, str(script)]), {
                    **base, **master, "WORLD_SIZE": str(world), "NODE_RANK": str(node), "LOCAL_RANK": str(local)})
        else:
            raise ValueError(f"unknown launcher {launcher!r}")
    return run_commands(out, launcher, world, commands, timeout, outside)


if __name__ == "__main__":
    if sys.argv[1:2] == ["cleanup"]:
        for what in cleanup(Path(sys.argv[2]) if len(sys.argv) > 2 else LEDGER):
            print(f"tests/support/nodes.py: removed {what}")
    else:
        sys.exit("usage: python tests/support/nodes.py cleanup [ledger]")
