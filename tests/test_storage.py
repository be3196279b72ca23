"""Where the Trainer's stop checkpoints go, which one a relaunch resumes from, how many stay, and what is
left when the save fails: a local directory, a ``file://`` URL, and a real S3-compatible server (moto in
server mode on 127.0.0.1, started here) through s3fs, as a user on object storage runs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from ddp_sigterm_tests.harness import s3_filesystem, s3_server
from ddp_sigterm_tests.helpers import SIGTERM_EXIT, assert_finished, fit
from ddp_sigterm_tests.scenario import Scenario

pytestmark = pytest.mark.scenario
STOP_FAILED = 200  # ddp_sigterm._core.exit_codes.STOP_FAILED, written out: the table in docs/reliability.md
BUCKET = "ddp-sigterm-test"


def stopped_in_unison(result, exit_code: int = SIGTERM_EXIT) -> int:
    why = result.describe()
    assert not result.timed_out, why
    assert set(result.returncodes.values()) == {exit_code}, why
    steps = set(result.steps().values())
    assert len(steps) == 1, why
    return steps.pop()


def same_weights(*results) -> bool:
    return len({o["weights"] for result in results for o in result.outcomes.values()}) == 1


def test_file_url_root_stops_saves_and_resumes_by_itself(tmp_path: Path) -> None:
    """default_root_dir="file:///...": the save goes through fsspec (it used os.path, and failed); a
    relaunch with DDP_SIGTERM_RESUME=1 and no ckpt_path resumes and ends with an uninterrupted run's weights."""
    root = tmp_path / "root"
    url = Scenario(root_dir=f"file://{root}", batches=4, max_steps=8, data_by_step=True)
    result = fit(tmp_path / "job", replace(url, inject="1:2:forward"))
    step = stopped_in_unison(result)
    assert [p.name for p in root.iterdir() if p.name.startswith(("hpc_ckpt", ".ddp_sigterm"))] == ["hpc_ckpt_1.ckpt"]
    assert torch.load(root / "hpc_ckpt_1.ckpt", weights_only=False)["global_step"] == step
    resumed = fit(tmp_path / "job", url, env={"DDP_SIGTERM_RESUME": "1"})
    assert_finished(resumed, steps=8)
    assert {o["batches_started"] for o in resumed.outcomes.values()} == {8 - step}, resumed.describe()
    straight = fit(tmp_path / "straight", replace(url, root_dir=str(tmp_path / "straight")))
    assert_finished(straight, steps=8)
    assert same_weights(resumed, straight), "resumed weights differ from an uninterrupted run's"


@pytest.mark.extended
def test_without_resume_setting_a_relaunch_starts_afresh(tmp_path: Path) -> None:
    """Off by default: the same script run again in the same directory starts from scratch, as stock does."""
    stopped_in_unison(fit(tmp_path, Scenario(inject="0:2:forward", max_steps=6)))
    again = fit(tmp_path, Scenario(max_steps=6))
    assert_finished(again, steps=6)
    assert {o["batches_started"] for o in again.outcomes.values()} == {6}, again.describe()


def test_a_failed_save_exits_200_everywhere_and_leaves_no_partial_file(tmp_path: Path) -> None:
    """Rank 1 cannot gather its part of the checkpoint after rank 0 wrote the file: every rank raises
    StopError and exits 200 (retryable), rank 0 removes what it wrote, the older stop checkpoint stays."""
    first = fit(tmp_path, Scenario(inject="0:2:forward"))
    stopped_in_unison(first)
    result = fit(tmp_path, Scenario(inject="0:2:forward", resume=True, fail_save_on_rank=1))
    why = result.describe()
    stopped_in_unison(result, exit_code=STOP_FAILED)
    outcomes = result.outcomes
    assert all(o["exception"].startswith("StopError: ddp_sigterm: rank") for o in outcomes.values()), why
    assert "disk quota exceeded" in outcomes[1]["exception"], why
    assert "failed on rank 1 (its log has the reason)" in outcomes[0]["exception"], why
    assert "disk quota exceeded" in result.log("rank1"), why  # the reason, with its traceback, in the log
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["hpc_ckpt_1.ckpt"], why
    assert not list(tmp_path.glob(".ddp_sigterm*")), why


@pytest.mark.extended  # make test's 6 minutes
def test_keep_newest_deletes_only_older_stop_checkpoints(tmp_path: Path) -> None:
    from ddp_sigterm._lightning import stop_checkpoints

    for name in ("hpc_ckpt_2.ckpt", "hpc_ckpt_10.ckpt", "hpc_ckpt_9.ckpt", "last.ckpt", ".ddp_sigterm-partial.ckpt"):
        (tmp_path / name).write_bytes(b"x")
    url = f"file://{tmp_path}"
    assert stop_checkpoints.saved(url) == [f"{url}/hpc_ckpt_{n}.ckpt" for n in (2, 9, 10)]  # by number, not by name
    assert stop_checkpoints.keep_newest(str(tmp_path), 0) == []
    assert stop_checkpoints.keep_newest(str(tmp_path), 2) == [f"{tmp_path}/hpc_ckpt_2.ckpt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ddp_sigterm-partial.ckpt", "hpc_ckpt_10.ckpt",
                                                           "hpc_ckpt_9.ckpt", "last.ckpt"]
    assert stop_checkpoints.saved(str(tmp_path / "missing")) == []


# -- a real S3-compatible server ------------------------------------------------------------------
@pytest.fixture
def s3(tmp_path: Path) -> Iterator[dict[str, str]]:
    with s3_server(tmp_path, BUCKET) as env:
        yield env


def _names(env: dict[str, str], prefix: str) -> list[str]:
    fs = s3_filesystem(env)
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(prefix)) if fs.exists(prefix) else []


@pytest.mark.extended  # make test's 10 minutes
def test_s3_stop_checkpoints_keep_newest_and_resume(tmp_path: Path, s3: dict[str, str]) -> None:
    """checkpoint_dir=s3://bucket/run, keep_checkpoints=1, resume on: stopped twice, relaunched three
    times, the job ends with an uninterrupted run's weights; the bucket holds one stop checkpoint, the
    newest, and no temporary file."""
    prefix = f"{BUCKET}/run"
    env = {**s3, "DDP_SIGTERM_CHECKPOINT_DIR": f"s3://{prefix}", "DDP_SIGTERM_KEEP_CHECKPOINTS": "1",
           "DDP_SIGTERM_RESUME": "1"}
    job = Scenario(batches=4, max_steps=8, data_by_step=True)
    first = fit(tmp_path / "job", replace(job, inject="1:2:forward"), env=env)
    step = stopped_in_unison(first)
    assert _names(s3, prefix) == ["hpc_ckpt_1.ckpt"], first.describe()
    # resumes at `step`, stopped again 2 batches on
    second = fit(tmp_path / "job", replace(job, inject="0:2:forward"), env=env)
    later = stopped_in_unison(second)
    assert later > step, second.describe()
    assert _names(s3, prefix) == ["hpc_ckpt_2.ckpt"], second.describe()
    last = fit(tmp_path / "job", job, env=env)
    assert_finished(last, steps=8)
    assert {o["batches_started"] for o in last.outcomes.values()} == {8 - later}, last.describe()
    assert list((tmp_path / "job").glob("hpc_ckpt_*")) == [], "a stop checkpoint went to default_root_dir"
    straight = fit(tmp_path / "straight", job)
    assert_finished(straight, steps=8)
    assert same_weights(last, straight), "resumed weights differ from an uninterrupted run's"


@pytest.mark.extended
def test_s3_failed_save_leaves_no_partial_object(tmp_path: Path, s3: dict[str, str]) -> None:
    prefix = f"{BUCKET}/failing"
    result = fit(tmp_path, Scenario(inject="0:2:forward", fail_save_on_rank=1),
                 env={**s3, "DDP_SIGTERM_CHECKPOINT_DIR": f"s3://{prefix}"})
    stopped_in_unison(result, exit_code=STOP_FAILED)
    assert _names(s3, prefix) == [], result.describe()

