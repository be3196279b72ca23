"""ddp_sigterm/_core/torchelastic.py: when a torchrun restart would meet the previous attempt's store."""

from __future__ import annotations

from ddp_sigterm._core.torchelastic import restart_hazard


def test_torchrun_restart_hazard_is_named_only_where_restarts_share_a_store() -> None:
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --rdzv-backend=c10d" in restart_hazard(shared)
    assert restart_hazard({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None  # nothing will restart
    assert restart_hazard({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None  # a store per attempt
    assert restart_hazard({}) is None  # not under torchrun
