"""ddp_sigterm: every DDP rank stops at the same step on SIGTERM, saves one checkpoint, exits 128+signal.

The core (:class:`StopCoordinator`, :class:`Settings`) needs torch only. The Lightning callback,
:class:`UnisonStop` (for ``lightning.pytorch``), is imported on first use so that ``import ddp_sigterm``
does not import Lightning; ``ddp_sigterm.pytorch_lightning_integration.UnisonStop`` is the one for
the standalone ``pytorch_lightning``, and ``ddp_sigterm.fabric`` serves Fabric loops.
"""

from __future__ import annotations

from typing import Any

from ddp_sigterm.agreement import AgreementError
from ddp_sigterm.coordinator import StopCoordinator, StopDecision
from ddp_sigterm.settings import Settings, SettingsError
from ddp_sigterm.stop_save import StopError, save_in_unison

__version__ = "0.1.0"
__all__ = ["AgreementError", "Settings", "SettingsError", "StopCoordinator", "StopDecision", "StopError", "UnisonStop",
           "__version__", "save_in_unison"]


def __getattr__(name: str) -> Any:
    if name == "UnisonStop":
        from lightning_utilities.core.imports import RequirementCache

        lightning = RequirementCache("lightning>=2.5.1")
        if not lightning:
            raise ModuleNotFoundError(f"ddp_sigterm.{name} is the Lightning integration: {lightning.message}")
        from ddp_sigterm import lightning_integration

        return getattr(lightning_integration, name)
    raise AttributeError(f"module 'ddp_sigterm' has no attribute {name!r}")
