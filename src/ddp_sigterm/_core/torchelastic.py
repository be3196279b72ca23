"""torchrun restarts on one store for every attempt (torch up to at least 2.13): a restarted rank can read a dead
peer's address from the previous attempt and fail or hang. The package cannot reach the agent's environment, so
it says what to change (docs/torchrun.md)."""

from __future__ import annotations

import os
from collections.abc import Mapping

# The variables of torchrun's agent read below, and the module of torch that sets each (the canary checks it).
AGENT_VARIABLES = {"TORCHELASTIC_USE_AGENT_STORE": "torch.distributed.elastic.agent.server.local_elastic_agent",
                   "TORCHELASTIC_MAX_RESTARTS": "torch.distributed.elastic.agent.server.local_elastic_agent"}


def restart_hazard(environ: Mapping[str, str] | None = None) -> str | None:
    """A warning if this worker's torchrun may restart the group on a store the attempts share, else None."""
    environ = os.environ if environ is None else environ
    try:
        restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return None
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restarts <= 0:
        return None
    return (f"ddp_sigterm: torchrun may restart this job (--max-restarts={restarts}) on a store that its attempts "
            "share: a restarted rank can then read a previous attempt's addresses and fail at start-up (Gloo "
            "'connectFullMesh failed ... Connection refused') or hang. Run it as `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            "torchrun --rdzv-backend=c10d --rdzv-endpoint=<host:port> ... (or --standalone on one node)`: each attempt "
            "then gets a store of its own. See the package's docs/torchrun.md")
