"""The suite's own tools: the fault injections a scenario job sends itself (tests/support/injection.py), the
description of a job its processes read (tests/support/scenario.py), and what a job that hangs leaves behind
(tests/support/harness.py)."""

from __future__ import annotations

import os
import sys

import pytest
from ddp_sigterm_tests.harness import STACKS, _ours, _start_time, supervise
from ddp_sigterm_tests.injection import Injection, encode, parse
from ddp_sigterm_tests.scenario import Job, Scenario


def test_fault_injections_are_parsed_once_and_checked() -> None:
    assert parse("1:2:forward;0:*:save:SIGUSR1;1:3") == [
        Injection(1, 2, "forward"), Injection(0, None, "save", "SIGUSR1"), Injection(1, 3, "forward")]
    assert encode("1:2:forward;0:*:save:SIGUSR1") == "1:2:forward;0:*:save:SIGUSR1"
    assert Injection(0, None, "save").matches(0, 7, "save")
    assert not Injection(0, 2, "save").matches(0, 7, "save")
    malformed = {"1:2:fwd": "unknown phase 'fwd'", "1:2:forward:SIGNOPE": "unknown signal 'SIGNOPE'",
                 "one:2": "invalid literal for int", "1:2:forward:SIGTERM:extra": "expected rank:batch"}
    for bad, why in malformed.items():
        with pytest.raises(ValueError, match=why):
            parse(bad)


def test_a_job_reaches_its_processes_as_it_was_described() -> None:
    """What a test asks for is what the job's script reads, tuples included; a bad field fails in the test."""
    scenario = Scenario(inject="1:605:forward", step_sleep=0.001, slow_phase=(601, 0.1), gloo_ifname=(1, "nosuch0"),
                        resume=True, fail_save_on_rank=1)
    job = Job(scenario, "out/job", devices=2, num_nodes=3, implementation="patched")
    assert Job.read(job.environment()) == job
    assert job.world_size == 6
    assert scenario.injections() == [Injection(1, 605, "forward")]
    for field, value, why in [("inject", "1:2:fwd", "unknown phase 'fwd'"), ("stage", "train", "unknown stage"),
                              ("trainer_package", "lightning", "unknown Trainer package")]:
        with pytest.raises(ValueError, match=why):
            Scenario(**{field: value})
    with pytest.raises(TypeError, match="SCENARIO_INJECT"):  # no field has an environment variable's name
        Scenario(**{"SCENARIO_INJECT": "1:2:forward"})


def test_a_job_that_hangs_leaves_where_it_waits(tmp_path) -> None:
    """A job past its timeout is killed, but first py-spy writes every process's stacks where the job's
    description shows them: a hang seen once in CI names the line it waited on."""
    hanging = "import time\ndef waiting_here():\n    time.sleep(120)\nwaiting_here()\n"
    run = supervise(tmp_path, {"rank0": ([sys.executable, "-c", hanging], dict(os.environ))}, timeout=3.0)
    assert run.timed_out
    assert run.returncodes == {"rank0": None}
    stacks = (tmp_path / STACKS).read_text()
    assert "waiting_here" in stacks, stacks


def test_a_group_number_another_process_took_is_not_the_jobs() -> None:
    """pid_max is 32768 here and threads take numbers too, so a job's ended group number can come round to
    another test's process while the job runs: the harness ends only groups whose leader is the one it saw."""
    me = os.getpid()
    started = _start_time(me)
    assert started is not None
    unused = next(pid for pid in range(2**22 - 1, 1, -1) if _start_time(pid) is None)
    assert _ours({me: started, unused: started - 1}) == {me, unused}  # ours; ended (its members may remain)
    assert _ours({me: started - 1}) == set()  # the number now leads a process started at another time
