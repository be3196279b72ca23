"""ddp_sigterm/slurm.py: the job id to requeue, and whether SLURM is preempting the job, from a stand-in
``scontrol`` (tests/test_slurm.py runs a real cluster)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddp_sigterm import slurm


def test_slurm_job_ids() -> None:
    assert slurm.job_id({"SLURM_JOB_ID": "77"}) == "77"
    assert slurm.job_id({"SLURM_JOB_ID": "80", "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3"}) == "77_3"
    with pytest.raises(slurm.RequeueError, match="SLURM_JOB_ID is not set"):
        slurm.job_id({})
    with pytest.raises(slurm.RequeueError, match="'77; rm' is not a SLURM job id"):
        slurm.job_id({"SLURM_JOB_ID": "77; rm"})


@pytest.mark.parametrize(("fields", "preempted"), [
    ("Requeue=1 StartTime=2026-12-01T09:00:00 PreemptTime=2026-12-01T09:10:00", "2026-12-01T09:10:00"),
    ("Requeue=1 StartTime=2026-12-01T09:00:00 PreemptTime=2026-12-01T09:00:00", "2026-12-01T09:00:00"),
    ("Requeue=1 StartTime=2026-12-01T09:00:00 PreemptTime=None", None),  # scancel, time limit
    ("Requeue=0 StartTime=2026-12-01T09:00:00 PreemptTime=2026-12-01T09:10:00", None),  # SLURM cancels it
    ("Requeue=1 StartTime=2026-12-01T09:20:00 PreemptTime=2026-12-01T09:10:00", None),  # a run before a requeue
])
def test_slurm_tells_a_preemption_from_other_sigterms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       fields: str, preempted: str | None) -> None:
    """What ``scontrol show job --oneliner`` prints (22.05, as seen on tests/test_slurm.py's cluster)
    decides; a failing ``scontrol`` raises with its output."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$*" = "show job --oneliner 77" ] || exit 3\n'
                        f'echo "JobId=77 JobName=train JobState=RUNNING Reason=None {fields} '
                        'Command=/x/train.sbatch"\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert slurm.preempted({"SLURM_JOB_ID": "77"}) == preempted
    with pytest.raises(slurm.RequeueError, match="scontrol show job --oneliner 78 failed with exit code 3"):
        slurm.preempted({"SLURM_JOB_ID": "78"})


def test_scontrol_requeue_outlives_the_sigterm_of_the_requeue_it_asked_for(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """SLURM signals every process of the job's step when it requeues the job, ``scontrol requeue`` too: in CI it once
    died of that SIGTERM (exit code -15) after slurmctld had requeued the job, and every rank exited 200 for a requeue
    that had happened. The stand-in sends itself SIGTERM, as slurmstepd would, then answers: scontrol must finish.
    A stand-in that is not there raises :class:`RequeueError` with the shell's reason."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$*" = "requeue 77" ] || exit 3\nkill -TERM $$\nsleep 0.2\n'
                        'echo "$$ outlived SIGTERM" > "$(dirname "$0")/answered"\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert slurm.requeue({"SLURM_JOB_ID": "77"}) == "77"
    assert "outlived SIGTERM" in (tmp_path / "answered").read_text()
    with pytest.raises(slurm.RequeueError, match="scontrol requeue 78 failed with exit code 3"):
        slurm.requeue({"SLURM_JOB_ID": "78"})
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(slurm.RequeueError, match="scontrol requeue 77 failed with exit code 127: .*not found"):
        slurm.requeue({"SLURM_JOB_ID": "77"})
