"""The Trainer callback's pure helpers, without a Trainer."""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from ddp_sigterm._lightning.at_stop import positionless


class Positioned:
    """A loader whose position Lightning saves: it has ``state_dict`` and ``load_state_dict``."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class HalfPositioned:
    def state_dict(self) -> dict[str, Any]:
        return {}


def test_positionless_names_each_loader_a_checkpoint_cannot_place_in_any_structure() -> None:
    assert positionless(None) == []
    assert positionless(Positioned()) == []
    assert positionless(DataLoader([1, 2])) == ["DataLoader"]
    assert positionless(HalfPositioned()) == ["HalfPositioned"]
    nested = {"text": DataLoader([1]), "images": [Positioned(), (DataLoader([2]), HalfPositioned())]}
    assert positionless(nested) == ["DataLoader", "DataLoader", "HalfPositioned"]
