"""A private single-node SLURM cluster for the tests: ``munged``, ``slurmctld`` and ``slurmd`` on this
machine, configured under a directory of ours, started and stopped by pid.

Nothing is written outside that directory (not /etc/slurm, not /etc/munge): the daemons get their own
configuration file, munge key and socket, state, spool, logs and ports, and the clients find them through
``SLURM_CONF`` (see :attr:`Cluster.env`). It refuses to start next to a SLURM that is already configured or
running on the machine, rather than risk disturbing it.

The partitions: ``low`` (the default; preemptible: ``PreemptMode=REQUEUE``, ``GraceTime``) and ``high``
(a higher ``PriorityTier``: a job there preempts a ``low`` job that holds the CPUs it needs).

    .venv/bin/python -m ddp_sigterm_tests.slurm_cluster up build/slurm     # start it; prints the SLURM_CONF to export
    .venv/bin/python -m ddp_sigterm_tests.slurm_cluster down build/slurm   # stop what `up` started
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ddp_sigterm_tests.harness import free_port
from ddp_sigterm_tests.nodes import Nodes

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "squeue", "sinfo")
PACKAGES = ("slurm-wlm", "munge")
# Preemption's grace period: SIGTERM, then this many seconds to exit, then SIGKILL. And the time SLURM
# gives a job's processes between a cancel's SIGTERM and SIGKILL (scancel, time limit).
GRACE_TIME = 30
KILL_WAIT = 30
# How long a job's wait may take by default: a run to its end, or a stop.
MUST_FINISH = 180.0
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE"}
# What examples/slurm/'s scripts print: the batch script's line at the start of each run, each rank's steps.
RUN_LINE = re.compile(r"^sbatch: job \d+ run (\d+) ", re.MULTILINE)
STEP_LINE = re.compile(r"\[rank (\d+)\] step (\d+)")


class Unavailable(RuntimeError):
    """The cluster cannot run here; the message says what is missing."""


def missing_programs() -> list[str]:
    return [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name, path=_sbin_path()) is None]


def install() -> None:
    """Install SLURM and munge from the distribution's packages when a program is missing (root and
    apt-get needed); raise :class:`Unavailable` saying what is missing when that cannot be done."""
    missing = missing_programs()
    if not missing:
        return
    why = f"SLURM programs missing: {', '.join(missing)} (Debian packages: {' '.join(PACKAGES)})"
    if os.geteuid() != 0:
        raise Unavailable(f"{why}; installing them needs root")
    if shutil.which("apt-get") is None:
        raise Unavailable(f"{why}; no apt-get here to install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode != 0:
            raise Unavailable(f"{why}; `{' '.join(command)}` failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    if missing_programs():
        raise Unavailable(f"still missing after apt-get install: {', '.join(missing_programs())}")


def existing_cluster() -> str | None:
    """Why this machine already has a SLURM that a second one could disturb, or None."""
    for conf in (Path("/etc/slurm/slurm.conf"), Path("/etc/slurm-llnl/slurm.conf")):
        if conf.exists():
            return f"a SLURM cluster is configured here ({conf})"
    for pid, name in _processes():
        if name in ("slurmctld", "slurmd", "slurmdbd"):
            return f"{name} is already running here (pid {pid})"
    return None


@dataclasses.dataclass
class Cluster:
    root: Path
    node: str  # its nodes' names, comma-separated
    pids: dict[str, int]  # daemon ("slurmd:<node>" for each node's) -> pid, in the order they started
    started: float  # time.time() before the first daemon started

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment in which SLURM's clients (and ``scontrol`` inside jobs) reach this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": _sbin_path()}

    def run(self, *argv: str, check: bool = True, timeout: float = 60.0) -> str:
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout, check=False)
        if check and done.returncode != 0:
            raise RuntimeError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stdout}{done.stderr}")
        return done.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (``JobState``, ``ExitCode``, ``Restarts``, ``Reason``, ...)."""
        return parse_fields(self.run("scontrol", "show", "job", "--oneliner", job_id))

    def wait_for(self, what: str, predicate, timeout: float, poll: float = 0.5):
        """Call ``predicate()`` until it returns something true; that value, or raise TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            found = predicate()
            if found:
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} after {timeout:.0f} s; {self.diagnosis()}")
            time.sleep(poll)

    def diagnosis(self) -> str:
        return (f"squeue:\n{self.run('squeue', '--all', check=False)}"
                f"sinfo:\n{self.run('sinfo', '-N', '-l', check=False)}")

    def jobs(self) -> list[str]:
        """Ids of the jobs the controller still runs or holds (pending, running, completing)."""
        return self.run("squeue", "--all", "--noheader", "--format=%i", check=False).split()

    def stop(self) -> None:
        """Cancel every job, then stop the daemons this cluster started, each by its pid, and the
        ``slurmstepd`` processes they left (started after this cluster, so ours), and any process of a
        job still running (its environment has a ``SLURM_JOB_ID`` and names this cluster's ``SLURM_CONF``,
        which sbatch exports to the job)."""
        try:
            if self.jobs():
                self.run("scancel", "--full", "--signal=KILL", *self.jobs(), check=False)
                self.run("scancel", *self.jobs(), check=False)
                deadline = time.monotonic() + 30
                while self.jobs() and time.monotonic() < deadline:
                    time.sleep(0.5)
        finally:
            for pid in reversed(self.pids.values()):  # the slurmds, slurmctld, munged
                _end(pid)
            for pid, name in _processes():
                if name == "slurmstepd" and _started_after(pid, self.started):
                    _end(pid)
            marker = f"SLURM_CONF={self.conf}\0".encode()
            for pid, _ in _processes():
                try:
                    environ = Path(f"/proc/{pid}/environ").read_bytes()
                except OSError:
                    continue
                ours = marker in environ and b"\0SLURM_JOB_ID=" in environ  # a job's, not a shell that exported it
                if ours:
                    _end(pid, wait=1.0)


class Job:
    """One ``sbatch`` job of ``cluster`` running a script of examples/slurm/ in ``ranks`` tasks; its output file is
    ``<out>/slurm-<id>.out``. A wait that times out fails (AssertionError) with what SLURM records and the output."""

    def __init__(self, cluster: Cluster, out: Path, sbatch: list[str], env: dict[str, str], ranks: int) -> None:
        """Submit it: ``sbatch`` holds the options, the script and its arguments; ``env`` the job's environment
        (``cluster.env`` and what the script reads)."""
        argv = ["sbatch", "--parsable", f"--output={out}/slurm-%j.out", *sbatch]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=True)
        self.cluster, self.ranks = cluster, ranks
        self.id = done.stdout.strip().split(";")[0]
        self.out = out / f"slurm-{self.id}.out"
        self.submitted = time.monotonic()

    def text(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def runs(self) -> list[str]:
        """The output of each run of the job (a requeued job appends the next run's)."""
        text = self.text()
        starts = [m.start() for m in RUN_LINE.finditer(text)]
        return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])]

    def fields(self) -> dict[str, str]:
        return self.cluster.job(self.id)

    def describe(self) -> str:
        fields = self.fields()
        shown = " ".join(f"{k}={fields.get(k)}" for k in ("JobState", "Reason", "ExitCode", "Restarts", "StartTime",
                                                           "EndTime", "PreemptTime"))
        lines = [line for line in self.text().splitlines() if not STEP_LINE.fullmatch(line)]
        return f"job {self.id}: {shown}\n----- {self.out} without the step lines -----\n" + "\n".join(lines[-60:])

    def wait(self, what: str, predicate, timeout: float = MUST_FINISH):
        try:
            return self.cluster.wait_for(what, predicate, timeout)
        except TimeoutError as error:
            raise AssertionError(f"{error}\n{self.describe()}") from None

    def wait_for_step(self, step: int) -> None:
        """Until every rank of the current run has printed ``step``."""
        def reached() -> bool:
            runs = self.runs()
            last: dict[int, int] = {}
            for rank, done in STEP_LINE.findall(runs[-1] if runs else ""):
                last[int(rank)] = max(last.get(int(rank), 0), int(done))
            return all(last.get(rank, 0) >= step for rank in range(self.ranks))
        self.wait(f"step {step} on all {self.ranks} ranks of job {self.id}", reached)

    def wait_ended(self, timeout: float = MUST_FINISH) -> dict[str, str]:
        """Until SLURM records the job ended (not requeued); its fields."""
        return self.wait(f"end of job {self.id}", lambda: (lambda f: f if f.get("JobState") in ENDED else None)(
            self.fields()), timeout)

    def wait_requeued(self, restarts: int = 1, timeout: float = MUST_FINISH) -> dict[str, str]:
        """Until SLURM has requeued the job ``restarts`` times and it waits to run again; its fields."""
        def requeued():
            fields = self.fields()
            return fields if fields.get("Restarts") == str(restarts) and fields.get("JobState") == "PENDING" else None
        return self.wait(f"requeue of job {self.id}", requeued, timeout)

    def start_now(self, minutes: int = 10) -> None:
        """A requeued job waits ~2 min (``Reason=BeginTime``): start it now, with a time limit that its
        second run cannot reach (so the time limit's warning signal does not come again)."""
        self.cluster.run("scontrol", "update", f"JobId={self.id}", "StartTime=now", f"TimeLimit={minutes}")

    def assert_nothing_left(self) -> None:
        """No process of the job is still running (slurmstepd, srun, a rank, a DataLoader worker)."""
        left = self.wait(f"exit of every process of job {self.id}", lambda: not job_processes(self.id) or None, 30)
        assert left, f"job {self.id} left {job_processes(self.id)}"


def job_processes(job_id: str) -> list[int]:
    """Processes whose environment says they belong to SLURM job ``job_id``."""
    marker = f"SLURM_JOB_ID={job_id}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def parse_fields(text: str) -> dict[str, str]:
    """``Key=Value Key=Value ...`` (``scontrol --oneliner``) into a dict; a value may hold spaces only
    as the last field of a line, which the tests do not read."""
    fields: dict[str, str] = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if sep:
            fields[key] = value
    return fields


def configuration(root: Path, nodes: dict[str, str], controller: str, cpus: int, ports: tuple[int, int]) -> str:
    """``nodes``: name -> the address slurmctld reaches its slurmd at; ``controller``: slurmctld's address (on this
    machine, whose host name it must be known by)."""
    names = ",".join(nodes)
    node_lines = "".join(f"NodeName={name} NodeAddr={address} CPUs={cpus} RealMemory=1000 State=UNKNOWN\n"
                         for name, address in nodes.items())
    return f"""\
# Written by ddp_sigterm_tests.slurm_cluster: a private cluster for ddp_sigterm's tests.
ClusterName=ddpsigterm
SlurmctldHost={socket.gethostname().split(".")[0]}({controller})
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# a job asks for requeueing itself (sbatch --requeue), as the scripts in docs/slurm.md do
JobRequeue=0
KillWait={KILL_WAIT}
MinJobAge=600
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{node_lines}PartitionName=low Nodes={names} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE \
GraceTime={GRACE_TIME}
PartitionName=high Nodes={names} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""


def start(root: Path, timeout: float = 60.0, nodes: Nodes | None = None) -> Cluster:
    """Start a fresh cluster in ``root`` (emptied first) and wait until its nodes are idle: this machine,
    or one slurmd in each of ``nodes``' namespaces (tests/support/nodes.py), slurmctld on the host at their
    bridge's address."""
    why = existing_cluster()
    if why:
        raise Unavailable(f"{why}: not starting a second one next to it")
    if os.geteuid() != 0:
        raise Unavailable("the test cluster's slurmd runs jobs as root: run as root")
    if root.exists():
        shutil.rmtree(root)
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir(parents=True)
    hosts = {name: nodes.address(i) for i, name in enumerate(nodes.names)} if nodes else \
        {socket.gethostname().split(".")[0]: "127.0.0.1"}
    for name in hosts:
        (root / "spool" / name).mkdir()
    cluster = Cluster(root, ",".join(hosts), {}, time.time())
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    # two CPUs, whatever the machine has: a 2-task job fills the node, so that a 1-task job of the high partition
    # must preempt it
    if (os.cpu_count() or 1) < 2:
        raise Unavailable("the test cluster's node has 2 CPUs: this machine has fewer")
    controller = nodes.host_address if nodes else "127.0.0.1"
    cluster.conf.write_text(configuration(root, hosts, controller, 2, (free_port(), free_port())))
    logs = root / "log"
    commands = {
        "munged": ["munged", "--foreground", "--force", f"--socket={root}/munge/munge.socket", f"--key-file={key}",
                   f"--pid-file={root}/munge/munged.pid", f"--log-file={logs}/munged.log",
                   f"--seed-file={root}/munge/munged.seed"],
        "slurmctld": ["slurmctld", "-D", "-i", "-f", str(cluster.conf)],
    }
    for i, name in enumerate(hosts):  # "slurmd:<node>": one per node, in the node's namespace if it has one
        argv = [_which("slurmd"), "-D", "-f", str(cluster.conf), "-N", name]
        commands[f"slurmd:{name}"] = nodes.run_daemon(i, argv) if nodes else argv

    def idle() -> bool:
        states = cluster.run("sinfo", "--noheader", "--Node", "--format=%T", check=False).split()
        return len(states) >= len(hosts) and all(state == "idle" for state in states)

    try:
        for name, argv in commands.items():
            with open(logs / f"{name.replace(':', '-')}.out", "w") as out:
                proc = subprocess.Popen([_which(argv[0]), *argv[1:]], env=cluster.env, stdout=out,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            cluster.pids[name] = proc.pid
            if name == "munged":
                cluster.wait_for("munge socket", (root / "munge" / "munge.socket").exists, 10, poll=0.1)
        cluster.wait_for(f"idle nodes {', '.join(hosts)}", idle, timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _sbin_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _which(name: str) -> str:
    found = shutil.which(name, path=_sbin_path())
    if found is None:
        raise Unavailable(f"{name} not found")
    return found


def _processes() -> list[tuple[int, str]]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found.append((int(entry.name), (entry / "comm").read_text().strip()))
            except OSError:
                continue
    return found


def _started_after(pid: int, when: float) -> bool:
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
    except (OSError, StopIteration, IndexError, ValueError):
        return False
    return boot + ticks / os.sysconf("SC_CLK_TCK") >= when - 1


def _end(pid: int, wait: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``wait`` seconds; ``pid`` is a daemon or step we started."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:  # not our child: poll /proc
            if not Path(f"/proc/{pid}").exists() or _zombie(pid):
                return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("up", "down"):
        print(__doc__)
        return 2
    root = Path(argv[1]).resolve()
    if argv[0] == "up":
        install()
        cluster = start(root)
        pids = " ".join(f"{name}={pid}" for name, pid in cluster.pids.items())
        (root / "pids").write_text(pids)
        print(f"export SLURM_CONF={cluster.conf}   # {pids}")
        return 0
    pids = {name: int(pid) for name, pid in (item.split("=") for item in (root / "pids").read_text().split())}
    running = dict(_processes())
    # only pids that still run the daemon `up` started there (a pid may have been reused since)
    ours = {name: pid for name, pid in pids.items() if running.get(pid) == name.split(":")[0]}
    Cluster(root, "", ours, (root / "pids").stat().st_mtime - 5).stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
