"""Multi-node jobs across network namespaces (tests/support/nodes.py): 2 nodes x 2 ranks, ``Trainer(num_nodes=2,
devices=2)``, started as each launcher starts them, stopped by a SIGTERM to one rank of node 2 or by a drain
of node 2, then resumed on both nodes to an uninterrupted run's weights; the Fabric example under torchrun; a
two-node SLURM cluster's preemption and requeue; and Gloo's multi-node pitfalls, stock / package / patched. Run
by ``make test-multinode`` (root; marker ``multinode``, not in ``make test``).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from ddp_sigterm_tests import nodes, slurm_cluster
from ddp_sigterm_tests.harness import JobResult, OutsideSignal, Supervised, supervise
from ddp_sigterm_tests.helpers import (
    HANG_BOUND,
    MUST_FINISH,
    SIGTERM_EXIT,
    SignalAfterStep,
    assert_finished,
    per_rank,
    saved_step,
)
from ddp_sigterm_tests.scenario import Scenario

pytestmark = [pytest.mark.multinode, pytest.mark.scenario]

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"
NODES, DEVICES = 2, 2
WORLD = NODES * DEVICES
MAX_STEPS = 20
# Steps of 50 ms: the stop comes well before the end. The final weights are compared within float32's tolerance,
# not bit for bit: with 4 ranks the gradients' sum depends on the order gloo adds them in (see Scenario.keep_weights).
TRAINING = Scenario(data_by_step=True, batches=10, step_sleep=0.05, max_steps=MAX_STEPS, keep_weights=True)
RESUME = {"DDP_SIGTERM_RESUME": "1"}  # a relaunch resumes by itself
PORT = nodes.PORT
PYTHONS = {"stock": sys.executable, "package": sys.executable, "patched": os.environ.get("MULTINODE_PATCHED_PYTHON")}


@pytest.fixture(scope="module")
def cluster() -> nodes.Nodes:
    why = nodes.available()
    if why:
        if os.environ.get("MULTINODE_REQUIRED") == "1":
            pytest.fail(f"make test-multinode cannot run here: {why}")
        pytest.skip(f"multi-node tests skipped: {why}")
    with nodes.Nodes(NODES, dead=True) as made:
        yield made


def node_job(out: Path, cluster: nodes.Nodes, launcher: str, root: Path, inject: str = "",
             gloo_ifname: tuple[int, str] | None = None, env: dict[str, str] | None = None,
             step_sleep: float = TRAINING.step_sleep, **kwargs: Any) -> JobResult:
    """A scenario job of ``DEVICES`` ranks on each node (see :func:`nodes.job`), configured as every test here is,
    its checkpoints in ``root``; ``inject``, ``gloo_ifname`` and ``step_sleep`` (the weights do not depend on it):
    see :class:`scenario.Scenario`."""
    training = replace(TRAINING, root_dir=str(root), inject=inject, gloo_ifname=gloo_ifname, step_sleep=step_sleep)
    return nodes.job(out, cluster, launcher, DEVICES, training, env={**RESUME, **(env or {})}, **kwargs)


@pytest.fixture(scope="module")
def straight_weights(cluster: nodes.Nodes, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The weights of an uninterrupted run across the nodes: what every resumed run must end with."""
    root = tmp_path_factory.mktemp("straight")
    straight = node_job(root / "run", cluster, "independent", root)
    assert_finished(straight, steps=MAX_STEPS)
    return final_weights(straight)


def final_weights(result: JobResult) -> dict[str, torch.Tensor]:
    """Rank 0's final weights, after checking that every rank ended with the same ones."""
    assert len({o["weights"] for o in result.outcomes.values()}) == 1, result.describe()
    return torch.load(result.out / "weights.rank0.pt")


def assert_stopped_in_unison(result: JobResult, root: Path) -> None:
    """Every rank on both nodes stopped at one step with 128 + SIGTERM, and one checkpoint was saved in ``root``."""
    why = result.describe()
    assert not result.timed_out, why
    assert sorted(result.outcomes) == list(range(WORLD)), why
    assert {o["exit_code"] for o in result.outcomes.values()} == {SIGTERM_EXIT}, why
    (step,) = set(result.steps().values())
    assert 0 < step < MAX_STEPS, why
    assert len(list(root.glob("hpc_ckpt_*.ckpt"))) == 1, why


# Each launcher once; a rank's SIGTERM and a drain each at least once (the decision does not depend on the launcher).
@pytest.mark.parametrize(("launcher", "how"), [("torchrun", "drain"), ("independent", "rank"), ("lightning", "rank")])
def test_stop_on_node_2_stops_both_nodes_and_resumes(cluster: nodes.Nodes, straight_weights: dict[str, torch.Tensor],
                                                    tmp_path: Path, launcher: str, how: str) -> None:
    """SIGTERM to global rank 3 alone (``rank``), or to every process of node 2 at once (``drain``, as a
    node drain or a spot reclaim does): all four ranks stop at one step, exit 143, one checkpoint; the same
    command on both nodes then resumes it and ends with the uninterrupted run's weights."""
    if how == "rank":
        stopped = node_job(tmp_path / "stop", cluster, launcher, tmp_path, inject="3:3:forward")
    else:
        stopped = node_job(tmp_path / "stop", cluster, launcher, tmp_path,
                           outside=OutsideSignal(rank=2, batch=3, targets="node:1"))
    assert_stopped_in_unison(stopped, tmp_path)
    codes = set(stopped.returncodes.values())
    # torchrun's agents exit 1 for any failed worker (docs/torchrun.md); every other process exits as its rank
    assert codes == ({1} if launcher == "torchrun" else {SIGTERM_EXIT}), stopped.describe()
    resumed = node_job(tmp_path / "resume", cluster, launcher, tmp_path)
    assert_finished(resumed, steps=MAX_STEPS)
    assert min(o["batches_started"] for o in resumed.outcomes.values()) < MAX_STEPS, "it did not resume"
    torch.testing.assert_close(final_weights(resumed), straight_weights)


# examples/plain_torch.py's torch.distributed under torchrun: test_stop_on_node_2_stops_both_nodes_and_resumes[torchrun]
@pytest.mark.parametrize("example", ["fabric"])
def test_example_stops_across_nodes_and_resumes(cluster: nodes.Nodes, tmp_path: Path, example: str) -> None:
    """examples/fabric.py (``Fabric(num_nodes=2)``) under torchrun on both nodes: SIGTERM to global rank 3 after
    its step 3, every rank stops at one step, one checkpoint holds it; the same command resumes there on both nodes
    and finishes."""
    root = tmp_path / "checkpoints"
    stopped = example_job(tmp_path / "stop", cluster, example, root, signal_rank=3)
    text, why = stopped.output(), stopped.output()[-6000:]
    stops = per_rank(r"stopped at step (\d+)", text)
    assert sorted(stops) == list(range(WORLD)), why
    assert len(set(stops.values())) == 1, why
    assert re.findall(r"exit (\d+)", text) == [str(SIGTERM_EXIT)] * WORLD, why
    (step,) = set(stops.values())
    _, saved = saved_step(example, root)
    assert saved == step, why
    resumed = example_job(tmp_path / "resume", cluster, example, root, signal_rank=None)
    text, why = resumed.output(), resumed.output()[-6000:]
    assert per_rank(r"pid \d+, starting at step (\d+)", text) == dict.fromkeys(range(WORLD), step), why
    assert per_rank(r"finished at step (\d+)", text) == dict.fromkeys(range(WORLD), EXAMPLE_STEPS), why
    assert set(resumed.returncodes.values()) == {0}, why


EXAMPLE_STEPS = 60


def example_job(out: Path, cluster: nodes.Nodes, example: str, root: Path, signal_rank: int | None) -> Supervised:
    """An example under torchrun on every node; SIGTERM to ``signal_rank``'s process after its step 3."""
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    commands = {}
    for node in range(NODES):
        args = [str(EXAMPLES / f"{example}.py"), "--root", str(root), "--max-steps", str(EXAMPLE_STEPS),
                *(["--num-nodes", str(NODES)] if example == "fabric" else [])]
        commands[f"node{node}"] = (cluster.torchrun(node, DEVICES, args), env)
    signalled = SignalAfterStep(lambda: "".join(path.read_text(errors="replace") for path in out.glob("node*.log")),
                                signal_rank, 3) if signal_rank is not None else None
    result = supervise(out, commands, MUST_FINISH, on_poll=signalled)
    assert not result.timed_out, result.output()[-6000:]
    assert signalled is None or signalled.sent, result.output()[-6000:]
    return result


# -- torchrun, elastic: --nnodes=1:2 ---------------------------------------------------------------------------
# 240 samples shuffled by the loader, batches of 4: 15 batches per rank and epoch on 4 ranks, 30 on 2
ELASTIC = Scenario(train_loader="stateful", shuffle="loader", record_samples=True, samples=240, max_epochs=3,
                   step_sleep=0.01, elastic=True)


def test_torchrun_elastic_resumes_on_the_node_left_each_sample_once(cluster: nodes.Nodes, tmp_path: Path) -> None:
    """``torchrun --nnodes=1:2 --max-restarts=1`` on both nodes (2 ranks each); node 2 is drained inside the second
    epoch (SIGTERM to every process of it, as a spot reclaim): the four ranks stop at one step, node 2's torchrun
    exits, node 1's restarts its workers, the rendezvous closes with node 1 alone, and the attempt resumes
    (``DDP_SIGTERM_RESUME=1``) on its 2 ranks: rank 0 says so, the rest of the stopped epoch comes each sample once
    (but for the padding it names), the next epoch every sample once, and torchrun exits 0."""
    scenario = replace(ELASTIC, root_dir=str(tmp_path))
    drain = OutsideSignal(rank=0, batch=20, targets="node:1")
    result = nodes.job(tmp_path / "job", cluster, "torchrun", DEVICES, scenario, outside=drain, nnodes="1:2",
                       torchrun_args=("--max-restarts=1", "--rdzv-conf=last_call_timeout=1"),
                       env={**RESUME, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    why = result.describe()
    assert not result.timed_out, why
    assert drain.sent_at is not None, why
    assert result.returncodes["node0"] == 0, why
    assert result.returncodes["node1"] != 0, why
    assert [path.name for path in tmp_path.glob("hpc_ckpt_*.ckpt")] == ["hpc_ckpt_1.ckpt"], why
    resumed = {rank: o for rank, o in result.outcomes.items() if o["attempt"] == 1}
    assert sorted(resumed) == [0, 1], why
    assert {o["world_size"] for o in resumed.values()} == {DEVICES}, why
    assert {o["exit_code"] for o in resumed.values()} == {0}, why
    said = result.log("node0")
    assert said.count(f"the job resumed on {DEVICES} ranks where it stopped on {WORLD}") == 1, why
    (padding,) = re.findall(r"is dealt out over the 2 data-parallel ranks, each sample once \((\d+) places", said)
    counts: dict[int, Counter[int]] = {}
    for rank in range(WORLD):
        for line in (result.out / f"samples.rank{rank}").read_text().splitlines():
            _, epoch, *indices = map(int, line.split())
            counts.setdefault(epoch, Counter()).update(indices)
    assert set(counts[1]) == set(range(scenario.samples)), f"samples never trained in the stopped epoch\n{why}"
    assert sum(counts[1].values()) - scenario.samples == int(padding), f"samples trained twice\n{why}"
    assert counts[2] == Counter(range(scenario.samples)), why


# -- SLURM on two nodes ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm(cluster: nodes.Nodes, tmp_path_factory: pytest.TempPathFactory) -> slurm_cluster.Cluster:
    """A SLURM cluster of the two nodes: one slurmd in each namespace, slurmctld on the host (at the bridge's
    address), started for these tests and stopped, every daemon by pid, at their end."""
    try:
        slurm_cluster.install()
        started = slurm_cluster.start(tmp_path_factory.mktemp("slurm"), nodes=cluster)
    except slurm_cluster.Unavailable as why:
        if os.environ.get("MULTINODE_REQUIRED") == "1":
            pytest.fail(f"MULTINODE_REQUIRED=1, but no SLURM cluster can run here: {why}", pytrace=False)
        pytest.skip(f"no SLURM cluster here: {why}")
    try:
        yield started
    finally:
        started.stop()


def test_slurm_preempts_both_nodes_requeues_and_resumes(slurm: slurm_cluster.Cluster, tmp_path: Path) -> None:
    """``sbatch --nodes=2 --ntasks-per-node=2`` (examples/slurm/trainer.sbatch: ``Trainer(num_nodes=2)``) in the
    preemptible partition; a job of the high partition needs one of its CPUs. SLURM sends SIGTERM to every task on
    both nodes with GraceTime to go: the four ranks stop at one step, save, global rank 0 requeues the job, every
    task exits 143 well within GraceTime. Started again, it resumes on both nodes and finishes with max_steps."""
    max_steps = 400
    root = tmp_path / "checkpoints"
    env = {**slurm.env, "PYTHON": sys.executable, "ROOT": str(root), "PYTHONUNBUFFERED": "1", "MASTER_PORT": PORT}
    sbatch = [f"--chdir={HERE.parent}", "--partition=low", f"--nodes={NODES}", f"--ntasks-per-node={DEVICES}",
              str(EXAMPLES / "slurm" / "trainer.sbatch"), "--max-steps", str(max_steps), "--step-seconds", "0.05"]
    job = slurm_cluster.Job(slurm, tmp_path, sbatch, env, ranks=WORLD)
    job.wait_for_step(20)
    high = slurm.run("sbatch", "--parsable", "--partition=high", "--ntasks=1", f"--output={tmp_path}/high-%j.out",
                     "--wrap=sleep 5").strip()
    preempting = time.monotonic()
    job.wait_requeued(timeout=slurm_cluster.GRACE_TIME + 30)
    requeued_in = time.monotonic() - preempting
    first = job.text()
    stops = per_rank(r"stopped at step (\d+)", first)
    assert sorted(stops) == list(range(WORLD)), job.describe()
    assert len(set(stops.values())) == 1, job.describe()
    (step,) = set(stops.values())
    assert "requeued: SLURM is preempting it" in first, job.describe()
    assert requeued_in < slurm_cluster.GRACE_TIME, job.describe()
    job.wait(f"end of the high job {high}", lambda: slurm.job(high).get("JobState") == "COMPLETED", 60)
    job.start_now()
    fields = job.wait_ended()
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), job.describe()
    second = job.text()[len(first):]
    assert per_rank(r"pid \d+, starting at step (\d+)", second) == dict.fromkeys(range(WORLD), step), job.describe()
    assert per_rank(r"finished at step (\d+)", second) == dict.fromkeys(range(WORLD), max_steps), job.describe()
    for node in slurm.node.split(","):  # each run's tasks ran on both nodes (each slurmd launched them)
        log = (slurm.root / "log" / f"slurmd-{node}.log").read_text()
        assert log.count(f"launch task StepId={job.id}.0 request") == 2, f"{node}: {log}"
    print(f"two-node SLURM job {job.id}: stopped at step {step}, requeued {requeued_in:.1f} s after the high job's "
          f"sbatch (GraceTime={slurm_cluster.GRACE_TIME}), then finished at step {max_steps}")


def test_slurm_requeues_a_job_that_resumes_on_one_node_of_two(slurm: slurm_cluster.Cluster, tmp_path: Path) -> None:
    """``sbatch --nodes=1-2 --ntasks-per-node=2`` (examples/slurm/trainer.sbatch passes the nodes the run got): it
    runs on both nodes; SLURM's requeue signal (``scancel --signal=USR1``, what ``--signal`` sends before the time
    limit) reaches every task, the four ranks stop at one step and global rank 0 requeues the job. Node 2 is drained
    meanwhile; SLURM 22.05 keeps the requeued job's 4 tasks, so the job is told 2 (``scontrol update``, as an
    operator would, docs/slurm.md): the requeued run gets node 1 alone, resumes there on 2 ranks, says so once, and
    finishes."""
    max_steps = 300
    root = tmp_path / "checkpoints"
    env = {**slurm.env, "PYTHON": sys.executable, "ROOT": str(root), "PYTHONUNBUFFERED": "1", "MASTER_PORT": PORT}
    sbatch = [f"--chdir={HERE.parent}", "--partition=low", "--nodes=1-2", f"--ntasks-per-node={DEVICES}",
              str(EXAMPLES / "slurm" / "trainer.sbatch"), "--max-steps", str(max_steps), "--step-seconds", "0.02"]
    job = slurm_cluster.Job(slurm, tmp_path, sbatch, env, ranks=WORLD)
    second_node = slurm.node.split(",")[1]
    try:
        job.wait_for_step(20)
        slurm.run("scancel", "--signal=USR1", job.id)
        job.wait_requeued(timeout=60)
        slurm.run("scontrol", "update", f"NodeName={second_node}", "State=DRAIN", "Reason=elastic-test")
        # SLURM (22.05) keeps the task count of the requeued job's run (4): let it start on the node left
        slurm.run("scontrol", "update", f"JobId={job.id}", "NumNodes=1-2", f"NumTasks={DEVICES}")
        first = job.text()
        stops = per_rank(r"stopped at step (\d+)", first)
        assert sorted(stops) == list(range(WORLD)), job.describe()
        (step,) = set(stops.values())
        job.start_now()
        fields = job.wait_ended()
    finally:
        slurm.run("scontrol", "update", f"NodeName={second_node}", "State=RESUME", check=False)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), job.describe()
    second = job.text()[len(first):]
    assert per_rank(r"pid \d+, starting at step (\d+)", second) == dict.fromkeys(range(DEVICES), step), \
        job.describe()
    assert per_rank(r"finished at step (\d+)", second) == dict.fromkeys(range(DEVICES), max_steps), job.describe()
    assert second.count(f"the job resumed on {DEVICES} ranks where it stopped on {WORLD}") == 1, job.describe()
    # examples/trainer.py: 4096 samples in batches of 32, so 32 steps per epoch on 4 ranks. A stop at an epoch's end
    # (step 32, one run in about 20) leaves nothing of it to deal: the next epoch starts on the 2 ranks as stock
    # Lightning starts it.
    dealt = "is dealt out over the 2 data-parallel ranks" in second
    assert dealt == (step % (4096 // (WORLD * 32)) != 0), job.describe()
    print(f"SLURM job {job.id} (--nodes=1-2): stopped at step {step} on {WORLD} ranks, requeued, resumed on "
          f"{DEVICES} ranks of one node, finished at step {max_steps}")


# -- Gloo's pitfalls -------------------------------------------------------------------------------------------
def three_ways(out: Path, cluster: nodes.Nodes, timeout: float, gloo_ifname: tuple[int, str] | None = None,
               package_env: dict[str, str] | None = None) -> dict[str, JobResult]:
    """The same no-signal job, stock (the package switched off), with the package and with the patched Lightning,
    run at once (node 0's port differs), each to its end or ``timeout``."""
    runs = {"stock": {"DDP_SIGTERM": "0"}, "package": package_env or {}, "patched": {}}
    if PYTHONS["patched"] is None:
        pytest.fail("MULTINODE_PATCHED_PYTHON is not set: make test-multinode sets it to the patched Lightning's venv")

    def one(name: str) -> JobResult:
        return node_job(out / name, cluster, "independent", out / name, gloo_ifname=gloo_ifname, timeout=timeout,
                        python=PYTHONS[name], implementation="patched" if name == "patched" else "package",
                        env=runs[name], port=str(int(PORT) + list(runs).index(name)))

    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        return dict(zip(runs, pool.map(one, runs)))


def trained(result: JobResult) -> bool:
    """Whether any rank started a training batch."""
    return any("train " in path.read_text() for path in result.out.glob("progress.rank*"))


@pytest.mark.parametrize("pitfall", ["loopback", "second-interface"])
def test_gloo_cannot_connect_stock_package_and_patched_alike(cluster: nodes.Nodes, tmp_path: Path,
                                                             pitfall: str) -> None:
    """Every node's host name resolves to a loopback address (127.0.1.1, Debian's default), or node 2's to its
    second interface, which node 1 cannot reach. Gloo advertises that address, so the training's own process
    group cannot form: stock, package and patched Lightning fail alike, before any step and before the package
    makes anything (some ranks fail within seconds, the others wait). Naming the interface that reaches the
    other nodes (GLOO_SOCKET_IFNAME=eth0) is the fix, and with it the same job trains to its end. (Node 2 alone
    on a loopback address connects: Gloo's pairs connect from the greater address to the smaller one, and
    127.0.1.1 reaches node 1's 10.213.x.1.)"""
    mapped = [0, 1] if pitfall == "loopback" else [1]
    for node in mapped:
        cluster.map_hostname(node, "127.0.1.1" if pitfall == "loopback" else cluster.dead_address(node))
    try:
        results = three_ways(tmp_path / "bad", cluster, timeout=HANG_BOUND)
        for name, result in results.items():
            why = f"{name}:\n{result.describe()}"
            assert not trained(result), why
            assert result.timed_out or set(result.returncodes.values()) != {0}, why
            print(f"{pitfall}, {name}: exit codes {result.returncodes}, timed out: {result.timed_out}")
        fixed = node_job(tmp_path / "fixed", cluster, "independent", tmp_path, env={"GLOO_SOCKET_IFNAME": "eth0"})
        assert_finished(fixed, steps=MAX_STEPS)
    finally:
        for node in mapped:
            cluster.map_hostname(node, cluster.address(node))


def test_package_group_that_cannot_connect_steps_aside(cluster: nodes.Nodes, tmp_path: Path) -> None:
    """The training's group connects, the package's cannot: once the training's group is made, rank 3 makes its
    later gloo groups on eth1, which node 1 cannot reach (what an NCCL job whose gloo picks the wrong interface
    meets). Stock and patched Lightning make no group of their own and finish; the package, within
    connect_timeout, steps aside on every rank with one warning that names GLOO_SOCKET_IFNAME, and finishes too."""
    results = three_ways(tmp_path, cluster, timeout=MUST_FINISH, gloo_ifname=(3, "eth1"),
                         package_env={"DDP_SIGTERM_CONNECT_TIMEOUT": "4"})
    for name, result in results.items():
        assert_finished(result, steps=MAX_STEPS, stock=True)
    package = results["package"]
    output = "".join(package.log(label) for label in package.logs)
    assert output.count("ddp_sigterm steps aside for this run") == 1, package.describe()
    assert "GLOO_SOCKET_IFNAME=" in output, package.describe()
    assert "global rank 0: " in output, package.describe()
