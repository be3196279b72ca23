"""Issue 37: a cloud's preemption notice stops every rank in unison, before the SIGTERM comes. Real training jobs
(two ranks, each a node of its own: each asks its own metadata service, a server on 127.0.0.1 that the test starts,
tests/support/metadata_server.py); never a real metadata address."""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from ddp_sigterm_tests.helpers import SIGTERM_EXIT, assert_finished, assert_unison_stop, fit
from ddp_sigterm_tests.metadata_server import MetadataServer, aws_instance_action, azure_event
from ddp_sigterm_tests.scenario import Scenario

pytestmark = pytest.mark.scenario

# ~4 s of steps: a notice 20 polls of 0.1 s into the run comes well before the end
LONG = Scenario(max_steps=200, step_sleep=0.02)
ENV = {"DDP_SIGTERM_NOTICE_PERIOD": "0.1"}


def notice_of(cloud: str, at: datetime.datetime) -> object:
    if cloud == "aws":
        return aws_instance_action(at)
    if cloud == "gce":
        return True
    return [azure_event("node-1", not_before=at.strftime("%a, %d %b %Y %H:%M:%S GMT"))]


# Each cloud's protocol against its stand-in service: tests/unit/core/test_notices.py; the stop is the same for all.
# make test-extended (make test's 6 minutes); make test keeps the stand-in that hangs, refuses or answers garbage.
@pytest.mark.extended
@pytest.mark.parametrize("cloud", ["aws"])
def test_a_notice_to_one_node_stops_every_rank_at_one_step_and_the_run_resumes(tmp_path: Path, cloud: str) -> None:
    """Node 1's service gives a notice some polls into the run; node 0's never does. Both ranks stop at one step with
    one checkpoint and exit as the SIGTERM would (143), each rank's log names the notice, and the same command
    (without a notice) resumes and finishes."""
    at = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0) + datetime.timedelta(minutes=2)
    with MetadataServer(cloud, vm_name="node-0") as quiet, MetadataServer(cloud, vm_name="node-1") as noticing:
        noticing.notice, noticing.quiet_for = notice_of(cloud, at), 20
        quiet.notice = [] if cloud == "azure" else None
        result = fit(tmp_path, LONG, env={**ENV, "DDP_SIGTERM_NOTICE": cloud},
                     rank_env={0: {"DDP_SIGTERM_NOTICE_URL": quiet.url}, 1: {"DDP_SIGTERM_NOTICE_URL": noticing.url}})
    why = result.describe()
    step = assert_unison_stop(result, exit_code=SIGTERM_EXIT)
    assert 0 < step < LONG.max_steps, why
    assert quiet.requests, "node 0 never asked its service"
    named = {"aws": f"the aws preemption notice (terminate at {at.isoformat()})",
             "gce": "the gce preemption notice (preempted at ",
             "azure": f"the azure preemption notice (Preempt at {at.isoformat()})"}[cloud]
    assert re.search(rf"rank 1 of 2: {re.escape(named)}.*received here at", result.log("rank1")), why
    assert re.search(rf"rank 0 of 2: {re.escape(named)}.*received by rank 1, not here; every rank stops at step "
                     rf"{step}", result.log("rank0")), why
    resumed = fit(tmp_path, replace(LONG, resume=True))
    assert_finished(resumed, steps=LONG.max_steps)


def test_a_service_that_hangs_refuses_or_answers_garbage_changes_nothing(tmp_path: Path) -> None:
    """Node 0's service answers every request 5 s late (past each request's bound), node 1's answers garbage:
    the run trains to its end and exits 0, each rank warns once."""
    with MetadataServer("aws") as hanging, MetadataServer("aws") as garbage:
        hanging.delay, garbage.garbage = 5.0, True
        result = fit(tmp_path, replace(LONG, max_steps=60), env={**ENV, "DDP_SIGTERM_NOTICE": "aws"},
                     rank_env={0: {"DDP_SIGTERM_NOTICE_URL": hanging.url}, 1: {"DDP_SIGTERM_NOTICE_URL": garbage.url}})
    assert_finished(result, steps=60)
    for rank, reason in ((0, "timed out"), (1, "not an interruption")):
        warnings = re.findall(r"the aws preemption notice cannot be read \(.*\)", result.log(f"rank{rank}"))
        assert len(warnings) == 1, result.describe()
        assert reason in warnings[0], warnings[0]
    assert len(garbage.requests) > 5, json.dumps([r.path for r in garbage.requests])
