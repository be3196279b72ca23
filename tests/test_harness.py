"""The suite's own tools: the fault injections a scenario job sends itself (tests/support/injection.py), and the
description of a job its processes read (tests/support/scenario.py)."""

from __future__ import annotations

import pytest
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
