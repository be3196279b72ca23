"""ddp_sigterm: every DDP rank stops at the same step on SIGTERM, saves one checkpoint, exits 128+signal.

The public API. The core (:class:`StopCoordinator`, :class:`Settings`, :func:`save_in_unison`,
:class:`DataPosition`) needs torch only; importing it registers no hook and starts nothing (starting a coordinator
does). The Lightning integrations need ``pip install ddp_sigterm[lightning]`` (or ``[pytorch-lightning]``):
:class:`UnisonStop`, the Trainer callback for ``lightning.pytorch``, is imported on first use so that
``import ddp_sigterm`` does not import Lightning; ``ddp_sigterm.pytorch_lightning_integration.UnisonStop``
is the one for the standalone ``pytorch_lightning``; :mod:`ddp_sigterm.fabric` serves Fabric loops and
:mod:`ddp_sigterm.slurm` requeues a SLURM job.

Layout: ``_core/`` is the framework-agnostic core (signals, schedule, agreement, heartbeat, deadline,
process-wide effects, coordinator, checked save, log); ``_lightning/`` is what the Trainer and Fabric
integrations share (and the Trainer's own settings), with every private name of Lightning in
``_lightning/internals.py``.
"""

from __future__ import annotations

from typing import Any

from ddp_sigterm._core.coordinator import StopCoordinator
from ddp_sigterm._core.data_position import DataPosition
from ddp_sigterm._core.decision import StopDecision
from ddp_sigterm._core.notices import NoticeSettings
from ddp_sigterm._core.port import AgreementError
from ddp_sigterm._core.settings import Settings, SettingsError
from ddp_sigterm._core.stop_save import StopError, save_in_unison
from ddp_sigterm._lightning import settings as _trainer_settings  # noqa: F401  # its DDP_SIGTERM_* are known

__version__ = "0.1.0"
__all__ = ["AgreementError", "DataPosition", "NoticeSettings", "Settings", "SettingsError", "StopCoordinator",
           "StopDecision", "StopError", "UnisonStop", "__version__", "save_in_unison"]


def __getattr__(name: str) -> Any:
    if name == "UnisonStop":
        try:
            from ddp_sigterm import lightning_integration
        except ModuleNotFoundError as error:
            raise ModuleNotFoundError(f"ddp_sigterm.UnisonStop is the Lightning integration, which needs lightning "
                                      f"(pip install 'ddp_sigterm[lightning]'): {error}") from error
        return lightning_integration.UnisonStop
    raise AttributeError(f"module 'ddp_sigterm' has no attribute {name!r}")
