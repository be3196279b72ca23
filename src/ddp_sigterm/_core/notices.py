"""Cloud preemption notices: asking a cloud's metadata service whether this machine is about to go.

A spot or preemptible VM is told in advance: AWS two minutes before a spot interruption, Google Compute
Engine about 30 seconds before a preemption, Azure at least 30 seconds before a spot eviction. Each
source here asks one cloud, once per :meth:`~NoticeSource.poll`, the way its documentation specifies
(docs/cloud-notices.md cites it), and answers a :class:`Notice` or None. Pure where it can be: the
answers are read by functions with no I/O (``aws_notice``, ``gce_notice``, ``azure_notice``), and
:func:`detect_cloud` reads files only, never the network.

The requests go to ``base_url`` and nowhere else: no proxy (a metadata service is link-local: a
proxy would ask its own), no redirect, a timeout on each, a bounded answer. A service that is slow,
refuses, or answers something else raises :class:`MetadataError`, naming the cloud, the URL and
what went wrong. :class:`NoticeWatch` is the body of the thread that polls a source (the runtime starts
and ends it): a failed poll is logged once and the watch goes on; a notice is handed on, once.
"""

from __future__ import annotations

import dataclasses
import datetime
import email.utils
import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from email.message import Message
from http.client import HTTPMessage
from pathlib import Path
from typing import IO, Protocol

from ddp_sigterm._core import log
from ddp_sigterm._core.settings import SettingsError, check_seconds, read_from_environment

CLOUDS = ("aws", "gce", "azure")

DEFAULT_URLS = {"aws": "http://169.254.169.254", "gce": "http://metadata.google.internal",
                "azure": "http://169.254.169.254"}
"""Each cloud's metadata service, as its documentation names it. Used only when ``notice`` names a cloud,
or ``auto`` found one in this machine's DMI data; every test gives a 127.0.0.1 URL instead."""

GCE_NOTICE_SECONDS = 30.0
"""GCE's ``preempted`` carries no time. A Spot VM has 30 s from the ACPI soft off to the hard off, and by
default (no ``preemptionNoticeDuration``) ``preempted`` turns TRUE with the soft off, when the OS starts
shutting down: the notice's time is taken as 30 s after it was seen."""

POLL_TIMEOUT = 2.0
"""Seconds one request of a poll may take (less if the poll period is shorter)."""

KINDS = (("aws", "terminate"), ("aws", "stop"), ("aws", "hibernate"), ("gce", "preempted"), ("azure", "Preempt"))
"""Every (cloud, action) a notice can be: the stop agreement carries a notice as its index here, plus one."""

_AZURE_NAME = re.compile(r"[\w.-]{1,80}")
_MAX_ANSWER = 65536  # bytes read of one answer: a notice is a few hundred
_AWS_TOKEN_SECONDS = 21600  # the longest IMDSv2 token; asked for again a minute before it lapses


@read_from_environment
@dataclasses.dataclass(frozen=True)
class NoticeSettings:
    """The notice watch's settings; every field can be overridden by ``DDP_SIGTERM_<FIELD>``."""

    notice: str = "off"
    """A cloud's preemption notice stops the run as its first stop signal would, before that signal comes:
    ``aws`` (a spot interruption, 2 minutes ahead), ``gce`` (a preemption, up to 30 s), ``azure`` (a spot
    eviction, at least 30 s), ``auto`` (the cloud this machine's DMI data names, found without the network;
    in none, nothing is asked), or ``off``. On each node local rank 0 asks every ``notice_period`` seconds; the
    stop's deadline becomes the sooner of ``stop_deadline`` and the notice's time (docs/cloud-notices.md)."""

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


class MetadataError(RuntimeError):
    """The metadata service could not be asked, or answered something its documentation does not allow."""


@dataclasses.dataclass(frozen=True)
class Notice:
    """A cloud's word that this machine is about to go: ``action`` in the cloud's own terms (AWS's
    ``terminate``/``stop``/``hibernate``, GCE's ``preempted``, Azure's ``Preempt``), ``at`` the time the
    cloud gives for it (UTC; for GCE, 30 s after the notice was seen), ``detail`` what else it said."""

    cloud: str
    action: str
    at: datetime.datetime | None
    detail: str = ""

    @property
    def code(self) -> int:
        """How the stop agreement carries it (:data:`KINDS`)."""
        return KINDS.index((self.cloud, self.action)) + 1

    @property
    def epoch_seconds(self) -> int:
        """``at`` in whole seconds since the epoch (rounded down: never later than the cloud's time), 0 if none."""
        return int(self.at.timestamp()) if self.at is not None else 0

    def describe(self) -> str:
        """As the logs name it, with the detail: ``"the azure preemption notice (Preempt at ...; EventId A1)"``."""
        text = named(self.code, self.epoch_seconds)
        return f"{text[:-1]}; {self.detail})" if self.detail else text


def named(code: int, epoch_seconds: int) -> str:
    """A notice as the logs name it, from what the stop agreement carries: ``"the aws preemption notice
    (terminate at 2026-12-06T12:02:00+00:00)"``."""
    cloud, action = KINDS[code - 1]
    at = datetime.datetime.fromtimestamp(epoch_seconds, datetime.timezone.utc) if epoch_seconds else None
    return f"the {cloud} preemption notice ({action}{f' at {at.isoformat()}' if at else ''})"


class NoticeSource(Protocol):
    """What :func:`source` returns: asks one cloud's metadata service, at ``base_url``."""

    cloud: str
    base_url: str

    def poll(self, timeout: float) -> Notice | None:
        """Ask once, each request within ``timeout`` seconds: the notice, None if there is none yet, or
        :class:`MetadataError`."""


# -- the answers, read without I/O -------------------------------------------------------------
def aws_notice(status: int, body: bytes) -> Notice | None:
    """``GET /latest/meta-data/spot/instance-action``: 404 until an interruption is scheduled, then
    ``{"action": "terminate" | "stop", "time": "2026-12-06T12:00:00Z"}`` (``hibernate`` too: the
    interruption's EventBridge event names it)."""
    if status == 404:
        return None
    if status != 200:
        raise MetadataError(f"spot/instance-action answered HTTP {status}")
    try:
        answer = json.loads(body)
        action, at = answer["action"], _utc(datetime.datetime.strptime(answer["time"], "%Y-%m-%dT%H:%M:%SZ"))
    except (ValueError, KeyError, TypeError) as error:
        raise MetadataError(f"spot/instance-action answered {_shown(body)}, not an interruption: {error!r}") from None
    if ("aws", action) not in KINDS:
        raise MetadataError(f"spot/instance-action answered the unknown action {action!r}")
    return Notice("aws", action, at)


def gce_notice(body: bytes, seen: datetime.datetime) -> Notice | None:
    """``instance/preempted``: ``FALSE``, or ``TRUE`` once the VM is being preempted (seen at ``seen``)."""
    text = body.decode("ascii", "replace").strip()
    if text == "FALSE":
        return None
    if text == "TRUE":
        return Notice("gce", "preempted", seen + datetime.timedelta(seconds=GCE_NOTICE_SECONDS),
                      f"{GCE_NOTICE_SECONDS:g} s after it was seen")
    raise MetadataError(f"instance/preempted answered {_shown(body)}, not TRUE or FALSE")


def azure_notice(body: bytes, vm_name: str) -> Notice | None:
    """Scheduled Events: the first event of type ``Preempt`` whose ``Resources`` name this VM. Events of
    other types, and events for other VMs of the same availability set or scale set, are not notices."""
    try:
        events = json.loads(body)["Events"]
        preempts = [event for event in events if event["EventType"] == "Preempt" and vm_name in event["Resources"]]
    except (ValueError, KeyError, TypeError) as error:
        raise MetadataError(f"scheduledevents answered {_shown(body)}, not a list of events: {error!r}") from None
    if not preempts:
        return None
    event = preempts[0]
    not_before = event.get("NotBefore") or ""  # empty once the event has started
    try:
        at = _utc(email.utils.parsedate_to_datetime(not_before)) if not_before else None
    except (ValueError, TypeError):
        raise MetadataError(f"scheduledevents answered the NotBefore {not_before!r}, not an RFC 1123 time") from None
    return Notice("azure", "Preempt", at, f"EventId {event.get('EventId', '?')}")


def detect_cloud(sysfs: Path = Path("/sys")) -> str | None:
    """The cloud this machine runs in, from files under ``sysfs`` alone (no network): ``aws``, ``gce``,
    ``azure`` or None (not a cloud VM, or no DMI data: a container may have none). The marks are those
    the clouds' documentation and cloud-init's ds-identify use: an EC2 UUID (the hypervisor's or the
    DMI product's, starting ``ec2``, or ``45E12AEC`` little-endian) or systemd's ``Amazon EC2`` vendor;
    GCE's product name or serial; Azure's chassis asset tag."""

    def read(name: str) -> str:
        try:
            return (sysfs / name).read_text().strip()
        except OSError:  # absent, or root's only (product_uuid)
            return ""

    dmi = "class/dmi/id/"
    uuids = (read("hypervisor/uuid").lower(), read(dmi + "product_uuid").lower())
    if any(uuid.startswith(("ec2", "45e12aec")) for uuid in uuids) or read(dmi + "sys_vendor") == "Amazon EC2":
        return "aws"
    if read(dmi + "product_name") in ("Google", "Google Compute Engine") or \
            read(dmi + "product_serial").startswith("GoogleCloud-"):
        return "gce"
    if read(dmi + "chassis_asset_tag") == "7783-7084-3265-9085-8269-3286-77":
        return "azure"
    return None


# -- the sources -------------------------------------------------------------------------------
class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str,
                         headers: HTTPMessage, newurl: str) -> None:
        return None  # the redirect's own answer (3xx) is then an error: nothing goes past base_url


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def _request(cloud: str, method: str, url: str, headers: Mapping[str, str],
             timeout: float) -> tuple[int, Message, bytes]:
    """``(status, headers, body)`` of one request; HTTP errors are answers too. Anything else:
    :class:`MetadataError`."""
    request = urllib.request.Request(url, method=method, headers=dict(headers))  # noqa: S310 (http only: _base_url)
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            return response.status, response.headers, response.read(_MAX_ANSWER)
    except urllib.error.HTTPError as answer:
        with answer:
            return answer.code, answer.headers, answer.read(_MAX_ANSWER)
    except (OSError, ValueError) as error:  # URLError, timeouts, a connection refused or reset
        raise MetadataError(f"{cloud}: {method} {url} failed: {error}") from error


def _base_url(cloud: str, url: str | None) -> str:
    """``url`` (or the cloud's own) without its trailing slash; only ``http://``: what a metadata service speaks."""
    url = (url or DEFAULT_URLS[cloud]).rstrip("/")
    if not url.startswith("http://"):
        raise ValueError(f"the {cloud} metadata service's URL must start with http://, got {url!r}")
    return url


class AwsSpot:
    """EC2's spot interruption notice through IMDSv2: a session token (``PUT /latest/api/token``), kept
    until a minute before it lapses and asked for again after a 401, then ``GET
    /latest/meta-data/spot/instance-action`` with it. Where the token cannot be had (an instance that
    allows only IMDSv1; a container one hop too far for the token's answer), it asks without one, as
    IMDSv1 allows."""

    cloud = "aws"

    def __init__(self, base_url: str | None = None) -> None:
        self.base_url = _base_url(self.cloud, base_url)
        self._token: tuple[str, float] | None = None  # the token and when (time.monotonic()) to renew it
        self._no_token = ""  # why the last token request failed

    def poll(self, timeout: float) -> Notice | None:
        url = f"{self.base_url}/latest/meta-data/spot/instance-action"
        status, _, body = _request(self.cloud, "GET", url, self._headers(timeout), timeout)
        if status == 401 and self._token is not None:  # the token lapsed or was revoked: once more with a new one
            self._token = None
            status, _, body = _request(self.cloud, "GET", url, self._headers(timeout), timeout)
        if status == 401:
            raise MetadataError(f"aws: GET {url} answered 401 (the instance requires IMDSv2) and the session token "
                                f"could not be had ({self._no_token}): in a container, the instance's metadata hop "
                                "limit must be 2 or more")
        try:
            return aws_notice(status, body)
        except MetadataError as error:
            raise MetadataError(f"aws: GET {url}: {error}") from None

    def _headers(self, timeout: float) -> dict[str, str]:
        """The token's header, asking for a token first if there is none or it is about to lapse; no header
        (IMDSv1) if none can be had."""
        if self._token is None or time.monotonic() >= self._token[1]:
            self._token = None
            url = f"{self.base_url}/latest/api/token"
            try:
                status, _, body = _request(self.cloud, "PUT", url,
                                           {"X-aws-ec2-metadata-token-ttl-seconds": str(_AWS_TOKEN_SECONDS)}, timeout)
            except MetadataError as error:
                self._no_token = str(error)
                return {}
            if status != 200 or not body.strip():
                self._no_token = f"PUT {url} answered HTTP {status}"
                return {}
            self._token = body.decode("ascii", "replace").strip(), time.monotonic() + _AWS_TOKEN_SECONDS - 60
        return {"X-aws-ec2-metadata-token": self._token[0]}


class GcePreempted:
    """GCE's ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google``; the answer
    must carry the same header (what else answers at that name is not GCE's metadata server)."""

    cloud = "gce"

    def __init__(self, base_url: str | None = None) -> None:
        self.base_url = _base_url(self.cloud, base_url)

    def poll(self, timeout: float) -> Notice | None:
        url = f"{self.base_url}/computeMetadata/v1/instance/preempted"
        status, headers, body = _request(self.cloud, "GET", url, {"Metadata-Flavor": "Google"}, timeout)
        if status != 200:
            raise MetadataError(f"gce: GET {url} answered HTTP {status}: {_shown(body)}")
        if headers.get("Metadata-Flavor") != "Google":
            raise MetadataError(f"gce: GET {url} answered without Metadata-Flavor: Google: not GCE's metadata server")
        try:
            return gce_notice(body, datetime.datetime.now(datetime.timezone.utc))
        except MetadataError as error:
            raise MetadataError(f"gce: GET {url}: {error}") from None


class AzureScheduledEvents:
    """Azure's Scheduled Events (``GET /metadata/scheduledevents``, ``Metadata: true``): a ``Preempt``
    event naming this VM, whose name is asked once (``/metadata/instance/compute/name``)."""

    cloud = "azure"
    api_version = "2020-07-01"

    def __init__(self, base_url: str | None = None) -> None:
        self.base_url = _base_url(self.cloud, base_url)
        self.vm_name: str | None = None

    def poll(self, timeout: float) -> Notice | None:
        if self.vm_name is None:
            path = f"/metadata/instance/compute/name?api-version={self.api_version}&format=text"
            name = self._get(path, timeout).decode("utf-8", "replace").strip()
            if not _AZURE_NAME.fullmatch(name):  # letters, digits, _ . - (a scale set's instance: <set>_<id>)
                raise MetadataError(f"azure: GET {self.base_url}{path} answered {name[:80]!r}, not a VM's name")
            self.vm_name = name
        path = f"/metadata/scheduledevents?api-version={self.api_version}"
        try:
            return azure_notice(self._get(path, timeout), self.vm_name)
        except MetadataError as error:
            raise MetadataError(f"azure: GET {self.base_url}{path}: {error}") from None

    def _get(self, path: str, timeout: float) -> bytes:
        url = f"{self.base_url}{path}"
        status, _, body = _request(self.cloud, "GET", url, {"Metadata": "true"}, timeout)
        if status != 200:
            raise MetadataError(f"azure: GET {url} answered HTTP {status}: {_shown(body)}")
        return body


def source(cloud: str, base_url: str | None = None) -> NoticeSource:
    """The source for ``cloud`` (one of :data:`CLOUDS`), asking ``base_url`` or the cloud's own service."""
    kinds: dict[str, type[AwsSpot] | type[GcePreempted] | type[AzureScheduledEvents]] = {
        "aws": AwsSpot, "gce": GcePreempted, "azure": AzureScheduledEvents}
    if cloud not in kinds:
        raise ValueError(f"no notice source for {cloud!r}; one of {', '.join(CLOUDS)}")
    return kinds[cloud](base_url)


class NoticeWatch:
    """The body and state of the thread that polls ``source`` every ``period`` seconds, from :meth:`watch`
    until a notice comes (handed to ``on_notice``, once, from this thread) or :meth:`end`. A poll that
    fails (a service that hangs, refuses, or answers garbage) is logged once, at WARNING, and the
    watch goes on: the run must not suffer for it. Each request is bounded by :data:`POLL_TIMEOUT`, so
    the thread ends within that of :meth:`end`."""

    def __init__(self, source: NoticeSource, period: float, on_notice: Callable[[Notice], None]) -> None:
        self.source, self.period = source, period
        self.polls = 0
        self._on_notice = on_notice
        self._ended = threading.Event()
        self._failed = False

    def end(self) -> None:
        self._ended.set()

    def watch(self) -> None:
        while not self._ended.is_set():
            self.polls += 1
            try:
                notice = self.source.poll(timeout=min(POLL_TIMEOUT, self.period))
            except MetadataError as error:
                if not self._failed:
                    self._failed = True
                    log.logger.warning("the %s preemption notice cannot be read (%s); the run goes on, and the watch "
                                       "keeps asking (this is said once)", self.source.cloud, error)
                notice = None
            if notice is not None and not self._ended.is_set():
                self._on_notice(notice)
                return
            self._ended.wait(self.period)


def _utc(moment: datetime.datetime) -> datetime.datetime:
    return moment.replace(tzinfo=datetime.timezone.utc) if moment.tzinfo is None else moment


def _shown(body: bytes) -> str:
    text = body[:200].decode("utf-8", "replace")
    return repr(text + ("..." if len(body) > 200 else ""))
