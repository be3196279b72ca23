"""ddp_sigterm/_core/stop_save.py: the checked save on one rank (no process group)."""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch

from ddp_sigterm import Settings, StopCoordinator, StopError, save_in_unison


def test_save_in_unison_names_the_file_only_when_it_was_written(tmp_path) -> None:
    """One rank (no process group): the checked save renames the temporary file once it is there; a
    save that wrote nothing (as Lightning's swallowed PermissionError does) or raised is a StopError
    naming the step and the reason, and leaves no file under the checkpoint's name."""
    stop = StopCoordinator(Settings.resolve(environ={}, signals=("SIGUSR2",), stop_deadline=math.inf))
    before = signal.getsignal(signal.SIGUSR2)
    stop.start()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.should_stop(7)
        path = tmp_path / "step-7.ckpt"
        saved = save_in_unison(stop, lambda partial: torch.save({"step": 7}, partial), str(path), writer=True)
        assert saved == str(path)
        assert torch.load(path)["step"] == 7
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step-7.ckpt"]

        with pytest.raises(StopError, match=r"rank 0: every rank stopped at step 7, but saving the stop checkpoint "
                                            r"of step 7 in .* failed: OSError: .* is missing after a save"):
            save_in_unison(stop, lambda partial: None, str(tmp_path / "other.ckpt"), writer=True)
        with pytest.raises(StopError, match="failed: RuntimeError: disk full"):
            save_in_unison(stop, _raise_disk_full, str(tmp_path / "other.ckpt"), writer=True)
        assert not (tmp_path / "other.ckpt").exists()
    finally:
        stop.close()
        signal.signal(signal.SIGUSR2, before)


def _raise_disk_full(partial: str) -> None:
    raise RuntimeError("disk full")
