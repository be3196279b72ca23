"""How an integration object (the Trainer or Fabric callback) is configured, added by an entry point, and chosen."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, TypeVar

from ddp_sigterm._core.notices import NoticeSettings
from ddp_sigterm._core.settings import Settings, resolve

T = TypeVar("T", bound="Integration")
_NOTICE_FIELDS = {field.name for field in dataclasses.fields(NoticeSettings)}


class Integration:
    """The core's and the notice watch's settings (each keyword goes where its field is), and who added it."""

    def __init__(self, settings: Settings | None = None, **overrides: Any) -> None:
        if settings is not None and overrides:
            raise TypeError(f"{type(self).__name__} takes either settings or keyword overrides, not both")
        notice = {name: overrides.pop(name) for name in list(overrides) if name in _NOTICE_FIELDS}
        self.settings = Settings.resolve(**(dataclasses.asdict(settings) if settings is not None else overrides))
        self.notice_settings = resolve(NoticeSettings, **notice)
        self.auto_registered = False

    @classmethod
    def entry_point(cls: type[T]) -> list[T]:
        """What a ``callbacks_factory`` entry point returns: one instance, none when ``DDP_SIGTERM=0``."""
        instance = cls()
        if not instance.settings.enabled:
            return []
        instance.auto_registered = True
        return [instance]


def acting(callbacks: Iterable[Any], family: type[T]) -> T | None:
    """The instance of ``family`` that acts: the first one the user passed, else the entry point's."""
    found = [cb for cb in callbacks if isinstance(cb, family)]
    return next((cb for cb in found if not cb.auto_registered), found[0] if found else None)
