"""The coordinator's endpoint: HTTP/JSON for agents, the CLI and dashboards.

    GET  /v1/healthz                      no token: liveness for probes and load balancers
    GET  /v1/whoami                       the caller's name and role (any valid token)
    GET  /v1/status | /v1/links[?problems=1] | /v1/paths[?host=&peer=] | /v1/agents
         /v1/events[?since=&after=&limit=&kind=] | /v1/plan?host=        role reader, agent or operator
    POST /v1/register | /v1/report                                      role agent
    POST /v1/drain | /v1/undrain   {link, reason, dry_run, force}       role operator
    GET  /metrics                                                       Prometheus (no token)

Bearer tokens (`auth.py`). Refused callers get 401/403 with a message saying which role would
do; refused drains are recorded as events with who and from where. Malformed bodies get 400 and
are counted; nothing a caller sends can stop the server. One lock serialises calls into the
`Coordinator`; a tick thread runs liveness and localization every COORDINATOR_TICK_S and never dies (an
exception is counted and logged, the next tick runs).
"""
from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..core.constants import COORDINATOR_PORT, COORDINATOR_TICK_S
from .auth import Tokens
from .coordinator import Coordinator, CoordinatorError
from .tls import serve_tls

MAX_BODY = 16 << 20


class CoordinatorServer:
    def __init__(self, coordinator: Coordinator, tokens: Tokens, host: str = "127.0.0.1", port: int = COORDINATOR_PORT,
                 log=None, tls=None):
        self.coordinator = coordinator
        self.tokens = tokens
        self.lock = threading.Lock()
        self.log = log or _log
        self.errors = {"bad_request": 0, "unauthenticated": 0, "forbidden": 0, "internal": 0, "tick": 0}
        self.requests = 0
        self.reports = 0
        self._stop = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: agents and the benchmark reuse connections
            # headers and body leave in separate writes: with Nagle and the client's delayed ACK
            # each answer waited ~40 ms (measured: ~70 requests/s per connection)
            disable_nagle_algorithm = True

            def do_GET(self):  # noqa: N802 (http.server's name)
                server._handle(self, "GET")

            def do_POST(self):  # noqa: N802
                server._handle(self, "POST")

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        serve_tls(self.httpd, tls, self.errors)  # HTTPS with an ssl.SSLContext (tls.py); plain HTTP without
        self.scheme = "https" if tls is not None else "http"
        self.httpd.daemon_threads = True
        self.address = self.httpd.server_address
        self.registry = CollectorRegistry()
        self.registry.register(_Metrics(self))
        self._threads = [threading.Thread(target=self.httpd.serve_forever, name="coordinator-http", daemon=True),
                         threading.Thread(target=self._tick_loop, name="coordinator-tick", daemon=True)]
        for t in self._threads:
            t.start()

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address[0]}:{self.address[1]}"

    def close(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def _tick_loop(self) -> None:
        while not self._stop.wait(COORDINATOR_TICK_S):
            try:
                with self.lock:
                    self.coordinator.tick(time.time())
            except Exception:  # noqa: BLE001 - the loop must outlive any one failure
                self.errors["tick"] += 1
                self.log("tick_failed", error=traceback.format_exc(limit=5))

    # ---- requests ----------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        self.requests += 1
        url = urlparse(h.path)
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            body = self._body(h) if method == "POST" else {}
            status, doc = self._route(method, url.path, q, body, h)
        except _HttpError as exc:
            status, doc = exc.status, {"error": exc.message}
        except CoordinatorError as exc:
            self.errors["bad_request"] += exc.status == 400
            status, doc = exc.status, {"error": str(exc)}
        except Exception:  # noqa: BLE001 - one bad request must not take the endpoint down
            self.errors["internal"] += 1
            self.log("request_failed", path=url.path, error=traceback.format_exc(limit=5))
            status, doc = 500, {"error": "internal error in the coordinator (logged); retry, and report it if it persists"}
        if isinstance(doc, bytes):
            payload, ctype = doc, "text/plain; version=0.0.4"
        else:
            payload, ctype = json.dumps(doc, default=str).encode(), "application/json"
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        h.wfile.write(payload)

    def _body(self, h) -> dict:
        try:
            n = int(h.headers.get("Content-Length", "0"))
        except ValueError:
            n = -1
        if not 0 <= n <= MAX_BODY:
            self.errors["bad_request"] += 1
            raise _HttpError(400, f"Content-Length must be 0..{MAX_BODY}")
        raw = h.rfile.read(n)
        try:
            doc = json.loads(raw or b"{}")
        except ValueError as exc:
            self.errors["bad_request"] += 1
            raise _HttpError(400, f"body is not JSON ({exc})") from None
        if not isinstance(doc, dict):
            self.errors["bad_request"] += 1
            raise _HttpError(400, "body must be a JSON object")
        return doc

    def _caller(self, h, action: str, path: str):
        caller = self.tokens.caller(h.headers.get("Authorization"))
        who = h.client_address[0]
        if caller is None:
            self.errors["unauthenticated"] += 1
            self._log_refusal(action, path, f"unauthenticated@{who}", why="no valid token")
            raise _HttpError(401, "no valid token: pass one with `Authorization: Bearer <token>` (the CLI reads "
                                  "$LINKPASS_TOKEN or --token-file)")
        if not caller.may(action):
            self.errors["forbidden"] += 1
            self._log_refusal(action, path, caller.name, why=f"role {caller.role} may not {action}", remote=who)
            need = {"drain": "operator", "report": "agent"}.get(action, "reader")
            raise _HttpError(403, f"{caller.name} has role {caller.role!r}; this needs role {need!r}")
        return caller

    def _log_refusal(self, action: str, path: str, actor: str, **detail) -> None:
        """Refused drains go into the history (who tried, from where, why); refused reads do not."""
        if action == "drain":
            with self.lock:
                self.coordinator.store.event("refused", actor, path, action=path.rsplit("/", 1)[-1], **detail)

    def _route(self, method: str, path: str, q: dict, body: dict, h):
        c = self.coordinator
        now = time.time()
        if method == "GET" and path == "/v1/healthz":
            return 200, {"ok": True}
        if method == "GET" and path == "/metrics":
            return 200, generate_latest(self.registry)
        if method == "GET" and path == "/v1/whoami":  # for `linkpass doctor`: is my token known, with what role
            caller = self._caller(h, "read", path)
            return 200, {"name": caller.name, "role": caller.role}
        if method == "GET":
            self._caller(h, "read", path)
            with self.lock:
                if path == "/v1/status":
                    return 200, c.status(now)
                if path == "/v1/links":
                    return 200, c.links(only_problems=q.get("problems") == "1")
                if path == "/v1/paths":
                    return 200, c.path_rows(q.get("host"), q.get("peer"))
                if path == "/v1/agents":
                    return 200, c.agent_rows(now)
                if path == "/v1/plan":
                    plan = c.plan_for(q.get("host", ""), now)
                    if plan is None:
                        raise _HttpError(404, f"no agent named {q.get('host')!r} is in the current plan "
                                              "(not registered, or joined less than a second ago)")
                    return 200, plan
            if path == "/v1/events":
                kinds = [k for k in q.get("kind", "").split(",") if k]
                return 200, c.store.events(since=_num(q, "since", 0.0), after_id=int(_num(q, "after", 0)),
                                           limit=int(_num(q, "limit", 1000)), kinds=kinds)
            raise _HttpError(404, f"no such endpoint: GET {path}")
        if path in ("/v1/register", "/v1/report"):
            self._caller(h, "report", path)
            with self.lock:
                if path == "/v1/register":
                    out = c.register(body, now)
                else:
                    out = c.report(body, now)
            self.reports += len(body.get("changes", ())) + len(body.get("paths", ()))
            return 200, out
        if path in ("/v1/drain", "/v1/undrain"):
            caller = self._caller(h, "drain", path)
            link = body.get("link")
            if not isinstance(link, str):
                raise _HttpError(400, "link: required, a link name such as p0l0-p0s1")
            with self.lock:
                if path == "/v1/drain":
                    return 200, c.drain(link, str(body.get("reason", "")), caller.name, now,
                                        dry_run=bool(body.get("dry_run")), force=bool(body.get("force")))
                return 200, c.undrain(link, caller.name, now, dry_run=bool(body.get("dry_run")))
        raise _HttpError(404, f"no such endpoint: {method} {path}")


class _HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _num(q: dict, name: str, default: float) -> float:
    try:
        return float(q.get(name, default))
    except ValueError:
        raise _HttpError(400, f"{name}: expected a number, got {q[name]!r}") from None


def _log(event: str, **fields) -> None:
    print(json.dumps({"ts": round(time.time(), 6), "event": event, **fields}, default=str), file=sys.stderr, flush=True)


class _Metrics:
    """Prometheus view, read at scrape time."""

    def __init__(self, server: CoordinatorServer):
        self.server = server

    def collect(self):
        s = self.server
        c = s.coordinator
        with s.lock:
            agents = len(c.agents)
            lost = sum(a.lost for a in c.agents.values())
            states: dict[str, int] = {}
            for rec in c.paths.values():
                states[rec.state] = states.get(rec.state, 0) + 1
            findings, drains = len(c.findings), len(c.drains)
        g = GaugeMetricFamily("linkpass_coordinator_agents", "Registered agents", labels=["status"])
        g.add_metric(["reporting"], agents - lost)
        g.add_metric(["lost"], lost)
        p = GaugeMetricFamily("linkpass_coordinator_paths", "Paths reported, by state", labels=["state"])
        for st, n in sorted(states.items()):
            p.add_metric([st], n)
        f = GaugeMetricFamily("linkpass_coordinator_localized_faults", "Directed links currently localized as faulty")
        f.add_metric([], findings)
        d = GaugeMetricFamily("linkpass_coordinator_drained_links", "Links drained by operators")
        d.add_metric([], drains)
        r = CounterMetricFamily("linkpass_coordinator_path_reports", "Path verdicts received")
        r.add_metric([], s.reports)
        e = CounterMetricFamily("linkpass_coordinator_request_errors", "Requests refused or failed", labels=["kind"])
        for k, v in sorted(s.errors.items()):
            e.add_metric([k], v)
        yield from (g, p, f, d, r, e)
