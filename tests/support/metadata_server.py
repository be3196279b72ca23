"""A cloud's metadata service on 127.0.0.1 (or an address the test made, such as the multi-node bridge's), as its
documentation specifies it (docs/cloud-notices.md), for tests: what it serves (no notice, a notice, garbage, a slow
answer) is set by the test while it runs, and every request it got is kept. Never a real metadata address: the tests
point the package here.

    with MetadataServer("aws") as server:
        server.notice = {"action": "terminate", "time": "2026-12-06T12:00:00Z"}
        ... DDP_SIGTERM_NOTICE_URL=server.url ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import http.server
import json
import threading
import time
import urllib.parse
from typing import Any

AWS_TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"  # noqa: S105 (a header's name)
AWS_TOKEN_HEADER = "X-aws-ec2-metadata-token"  # noqa: S105 (a header's name)


def aws_instance_action(at: datetime.datetime, action: str = "terminate") -> dict[str, str]:
    """AWS's ``spot/instance-action`` answer for an interruption at ``at`` (UTC)."""
    return {"action": action, "time": at.strftime("%Y-%m-%dT%H:%M:%SZ")}


def azure_event(*resources: str, event_type: str = "Preempt",
                not_before: str = "Sun, 06 Dec 2026 12:00:30 GMT") -> dict[str, Any]:
    """One Scheduled Events event, with every field of api-version 2020-07-01, for ``resources`` (VM names)."""
    return {"EventId": f"{event_type}-{'-'.join(resources)}", "EventType": event_type, "ResourceType": "VirtualMachine",
            "Resources": list(resources), "EventStatus": "Scheduled", "NotBefore": not_before,
            "Description": "", "EventSource": "Platform", "DurationInSeconds": -1}


@dataclasses.dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]


class MetadataServer:
    """``cloud``'s service. ``notice``: AWS, the instance-action JSON (None: 404); GCE, whether ``preempted``
    is TRUE; Azure, the list of scheduled events. ``imdsv2`` (AWS): ``"required"`` (a request without a
    token gets 401), ``"optional"``, or ``"absent"`` (no token service: IMDSv1 only). ``delay``: seconds
    before each answer; ``token_delay`` (AWS): before the token's only (in a container one hop too far,
    its answer never comes back). ``quiet_for``: the number of first requests answered as if there were
    no notice (a job's notice then comes some polls into its run). ``garbage``: answer 200 with an HTML
    page to every request. Header names are kept in lower case. ``host``: the address it listens on, 127.0.0.1 or
    one the test made (tests/support/nodes.py's bridge, which every node's namespace reaches)."""

    def __init__(self, cloud: str, vm_name: str = "trainer-vm-1", imdsv2: str = "required",
                 host: str = "127.0.0.1") -> None:
        self.cloud, self.vm_name, self.imdsv2 = cloud, vm_name, imdsv2
        self.notice: Any = [] if cloud == "azure" else None
        self.delay = self.token_delay = 0.0
        self.quiet_for = 0
        self.garbage = False
        self.redirect_to: str | None = None
        self.requests: list[Request] = []
        self.tokens: set[str] = set()
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer((host, 0), _handler(self))
        self._server.daemon_threads = True
        self._server.block_on_close = False  # a handler still in its delay does not hold up the test's end
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> MetadataServer:
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name=f"metadata-{self.cloud}",
                                        daemon=True)  # shutdown() waits up to the poll interval
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def revoke_tokens(self) -> None:
        """AWS: every token issued so far lapses (a request with one gets 401)."""
        with self._lock:
            self.tokens.clear()

    def answer(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        headers = {name.lower(): value for name, value in headers.items()}
        with self._lock:
            self.requests.append(Request(method, path, headers))
        if self.delay:
            time.sleep(self.delay)
        if self.redirect_to is not None:
            return 302, {"Location": self.redirect_to}, b""
        if self.garbage:
            return 200, {"Content-Type": "text/html"}, b"<html><body>Welcome to nginx!</body></html>"
        route = urllib.parse.urlsplit(path)
        query = dict(urllib.parse.parse_qsl(route.query))
        return getattr(self, f"_{self.cloud}")(method, route.path, query, headers)

    def _notice(self) -> Any:
        with self._lock:
            return self.notice if len(self.requests) > self.quiet_for else None

    def _aws(self, method: str, path: str, _query: dict[str, str], headers: dict[str, str]) -> tuple[int, dict, bytes]:
        if path == "/latest/api/token" and method == "PUT":
            if self.imdsv2 == "absent":
                return 404, {}, b"Not Found"
            time.sleep(self.token_delay)
            ttl = headers.get(AWS_TOKEN_TTL_HEADER.lower(), "")
            if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return 400, {}, b"Bad Request"
            with self._lock:
                token = f"token-{len(self.tokens)}-{time.monotonic_ns()}"
                self.tokens.add(token)
            return 200, {AWS_TOKEN_TTL_HEADER: ttl}, token.encode()
        if path == "/latest/meta-data/spot/instance-action" and method == "GET":
            token = headers.get(AWS_TOKEN_HEADER.lower())
            with self._lock:
                known = token in self.tokens
            if (token is not None and not known) or (token is None and self.imdsv2 == "required"):
                return 401, {}, b"Unauthorized"
            notice = self._notice()
            if notice is None:
                return 404, {}, b"Not Found"
            return 200, {"Content-Type": "text/plain"}, json.dumps(notice).encode()
        return 404, {}, b"Not Found"

    def _gce(self, method: str, path: str, _query: dict[str, str], headers: dict[str, str]) -> tuple[int, dict, bytes]:
        flavor = {"Metadata-Flavor": "Google"}
        if headers.get("metadata-flavor") != "Google" or "x-forwarded-for" in headers:
            return 403, flavor, b"Missing Metadata-Flavor:Google header."
        if path == "/computeMetadata/v1/instance/preempted" and method == "GET":
            return 200, {**flavor, "Content-Type": "application/text"}, b"TRUE" if self._notice() else b"FALSE"
        return 404, flavor, b"Not Found"

    def _azure(self, method: str, path: str, query: dict[str, str], headers: dict[str, str]) -> tuple[int, dict, bytes]:
        if headers.get("metadata") != "true":
            return 400, {}, json.dumps({"error": "Bad request. Required metadata header not specified"}).encode()
        if "api-version" not in query:
            return 400, {}, json.dumps({"error": "Bad request. api-version was not specified in the request"}).encode()
        if path == "/metadata/instance/compute/name" and query.get("format") == "text":
            return 200, {"Content-Type": "text/plain"}, self.vm_name.encode()
        if path == "/metadata/scheduledevents" and method == "GET":
            events = self._notice() or []
            document = {"DocumentIncarnation": len(events), "Events": events}
            return 200, {"Content-Type": "application/json"}, json.dumps(document).encode()
        return 404, {}, b"Not Found"


def _handler(server: MetadataServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def _serve(self) -> None:
            status, headers, body = server.answer(self.command, self.path, dict(self.headers.items()))
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
                self.wfile.write(body)

        do_GET = do_PUT = _serve

        def log_message(self, *_: object) -> None:  # the test reads server.requests instead
            pass

    return Handler
