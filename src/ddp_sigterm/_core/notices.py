"""Cloud preemption notices: the watch that polls a cloud's metadata service (:mod:`ddp_sigterm._core.clouds`
reads its answers), and its settings. docs/cloud-notices.md tells what each cloud says and what is done with it."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable

from ddp_sigterm._core import log
from ddp_sigterm._core.clouds import CLOUDS, MetadataError, Notice, NoticeSource, detect_cloud, source
from ddp_sigterm._core.settings import SettingsError, check_seconds, read_from_environment

POLL_TIMEOUT = 2.0  # seconds one request of a poll may take (less if the poll period is shorter)


@read_from_environment
@dataclasses.dataclass(frozen=True)
class NoticeSettings:
    """The notice watch's settings; every field can be overridden by ``DDP_SIGTERM_<FIELD>``."""

    notice: str = "off"
    """A cloud's preemption notice stops the run as a stop signal would, before it comes: ``aws``, ``gce``,
    ``azure``, ``auto`` (the cloud this machine's DMI data names; in none, nothing is asked) or ``off``. Local
    rank 0 of each node asks; the deadline ends by the notice's time (docs/cloud-notices.md)."""

    notice_url: str = ""
    """The metadata service to ask instead of the cloud's own (``http://host:port``)."""

    notice_period: float = 2.0
    """Seconds between two questions to the metadata service (each bounded by 2 s)."""

    def __post_init__(self) -> None:
        notice = self.notice.strip().lower() if isinstance(self.notice, str) else self.notice
        if notice not in ("off", "auto", *CLOUDS):
            raise SettingsError(f"notice must be one of off, auto, {', '.join(CLOUDS)}; got {self.notice!r}")
        object.__setattr__(self, "notice", notice)
        if not isinstance(self.notice_url, str) or (self.notice_url and not self.notice_url.startswith("http://")):
            raise SettingsError(f"notice_url must be an http:// URL, got {self.notice_url!r}")
        check_seconds(self, "notice_period")


class NoticeWatch:
    """The body of the thread that polls ``source`` every ``period`` s until a notice comes (handed to ``on_notice``
    once, from this thread) or :meth:`end`, within :data:`POLL_TIMEOUT`. A failed poll is logged once."""

    def __init__(self, source: NoticeSource, period: float, on_notice: Callable[[Notice], None]) -> None:
        self.source, self.period, self._on_notice = source, period, on_notice
        self.polls = 0
        self._ended = threading.Event()

    def end(self) -> None:
        self._ended.set()

    def watch(self) -> None:
        failed = False
        while not self._ended.is_set():
            self.polls += 1
            try:
                notice = self.source.poll(timeout=min(POLL_TIMEOUT, self.period))
            except MetadataError as error:
                if not failed:
                    log.logger.warning("the %s preemption notice cannot be read (%s); the run goes on, and the watch "
                                       "keeps asking (this is said once)", self.source.cloud, error)
                failed, notice = True, None
            if notice is not None and not self._ended.is_set():
                self._on_notice(notice)
                return
            self._ended.wait(self.period)


def watch(settings: NoticeSettings, on_notice: Callable[[Notice], None]) -> NoticeWatch | None:
    """This process's watch: on local rank 0 of each node (``LOCAL_RANK``, or SLURM's ``SLURM_LOCALID``); None where
    ``notice`` is off, or ``auto`` finds no cloud."""
    if settings.notice == "off" or os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) != "0":
        return None
    cloud: str | None = settings.notice
    if cloud == "auto":
        cloud = detect_cloud()
        log.logger.debug("notice=auto: in %s", cloud or "no cloud")
    if cloud is None:
        return None
    asked = source(cloud, settings.notice_url or None)
    log.logger.debug("asking %s for a preemption notice every %g s", asked.base_url, settings.notice_period)
    return NoticeWatch(asked, settings.notice_period, on_notice)
