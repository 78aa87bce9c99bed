"""What an agent's probes know, for people and for Prometheus: the local query API.

`TelemetryView` turns an engine's per-path telemetry (plus clock-sync offsets, when known) into
plain rows. `LocalApi` serves them over HTTP on 127.0.0.1 inside the host's namespace:

    GET /metrics      Prometheus exposition (linkpass/agent/metrics.py)
    GET /v1/paths     JSON rows, one per probed path (what `linkpass paths -o json` prints)
    GET /v1/counters  engine counters and drops by reason
    GET /healthz      "ok", or 503 saying why when the probe thread has stalled (liveness)
    GET /readyz       "ready ...", or 503 saying what it waits for: the probe thread stalled, or
                      the coordinator's first probe plan when the agent has no peers of its own
    GET /v1/probe     a one-shot check of every ECMP path to a peer, and /v1/trace of one flow
                      (`linkpass probe DST`, `linkpass trace DST`: linkpass/agent/oneshot.py)

The agent serves /metrics and /healthz a second time on `metrics.address:metrics.port` (the
host's management address, for a Prometheus elsewhere); the /v1 routes stay on 127.0.0.1.
"""
from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector,
                               generate_latest)

from ..kernel import netns as ns_io
from ..core.constants import AGENT_API_PORT
from ..core.telemetry import LossSnapshot
from .metrics import TelemetryCollector

IN_FLIGHT_S = 0.2  # a path silent for less than this is late, not lossy; a detector is far faster


@dataclass(frozen=True)
class PathLabels:
    peer: str  # peer host name
    plane: int
    path: int  # index of the discovered path towards that peer on that plane
    sport: int  # shown in JSON, never a metric label


class TelemetryView:
    """Rows of per-path telemetry over a sliding window (default 10 s)."""

    def __init__(self, engine, labels: dict[int, PathLabels], offset_ns: Callable[[int], float | None] | None = None,
                 window_s: float = 10.0, snapshot_every_s: float = 1.0,
                 state_of: Callable[[int], dict] | None = None):
        self.engine = engine
        self.labels = labels
        self.offset_ns = offset_ns or (lambda peer_id: None)
        self.state_of = state_of  # path id -> {"state": ..., "reason": ...} from the detector, if any
        self.window_s = window_s
        self.snapshot_every_s = snapshot_every_s
        self._keep = int(window_s / snapshot_every_s) + 2
        self._snaps: dict[int, deque] = {}  # paths may come and go while the agent runs
        self._lock = threading.Lock()

    def tick(self) -> None:
        """Record each path's loss counters; called every `snapshot_every_s` by LocalApi."""
        now = time.monotonic()
        with self._lock:
            for pid in list(self.labels):
                path = self.engine.paths.get(pid)
                if path is not None:
                    self._snaps.setdefault(pid, deque(maxlen=self._keep)).append((now, LossSnapshot.of(path.telemetry)))
            for pid in [p for p in self._snaps if p not in self.labels]:
                del self._snaps[pid]

    def _window_start(self, pid: int) -> LossSnapshot:
        """The newest snapshot at least `window_s` old (else the oldest we have)."""
        snaps = self._snaps.get(pid)
        if not snaps:
            return LossSnapshot(0, 0, 0, 0)
        cutoff = time.monotonic() - self.window_s
        older = [snap for t, snap in snaps if t <= cutoff]
        return older[-1] if older else snaps[0][1]

    def rows(self) -> list[dict]:
        out = []
        with self._lock:
            for pid, lab in sorted(list(self.labels.items())):  # list(): one atomic copy
                path = self.engine.paths.get(pid)
                if path is None:
                    continue
                tel = path.telemetry
                loss = tel.loss
                now = LossSnapshot.of(tel)
                start = self._window_start(pid)
                # probes of the last IN_FLIGHT_S may still be on their way: not lost (yet)
                rate = (now.sent - start.sent) / self.window_s
                window = now.minus(start, in_flight=int(rate * IN_FLIGHT_S) + 1)
                latest = tel.latest_t4()
                offset = self.offset_ns(path.spec.peer_id)
                stats = tel.window(latest - int(self.window_s * 1e9), offset) if latest is not None else {}
                out.append({
                    "path_id": pid, "peer": lab.peer, "peer_addr": path.spec.peer_addr, "plane": lab.plane,
                    "path": lab.path, "sport": lab.sport,
                    "sent": tel.sent, "replies": loss.replies,
                    "lost_fwd": loss.lost_fwd, "lost_rev": loss.lost_rev,
                    "window_s": self.window_s, "window": window,
                    "rtt_ns": stats.get("rtt_ns"), "jitter_ns": stats.get("jitter_ns"),
                    "owd_fwd_ns": stats.get("owd_fwd_ns"), "owd_rev_ns": stats.get("owd_rev_ns"),
                    "clock_offset_ns": offset,
                    **(self.state_of(pid) if self.state_of else {}),
                })
        return out

    def counters(self) -> dict:
        return {"stats": dict(self.engine.stats), "drops": dict(self.engine.drops)}


class ProbeProgress:
    """Whether the probe thread is alive: with paths to probe, its packet counters must move
    within `stall_s` (every path sends at least at its idle rate). Sampled by the API's ticker;
    what /healthz answers and linkpass_agent_probe_thread_up shows."""

    def __init__(self, engine, stall_s: float = 3.0, clock=time.monotonic):
        self.engine, self.stall_s, self.clock = engine, stall_s, clock
        self._last: tuple[int, ...] | None = None
        self._moved = clock()

    def tick(self) -> None:
        stats = self.engine.stats
        now = tuple(stats.get(k, 0) for k in ("sent", "received", "reflected"))
        if now != self._last:
            self._last, self._moved = now, self.clock()

    def stalled_s(self) -> float | None:
        """Seconds without progress while there are paths to probe; None when it is fine."""
        if not self.engine.paths:
            return None
        idle = self.clock() - self._moved
        return idle if idle >= self.stall_s else None

    def health(self) -> tuple[int, bytes]:
        idle = self.stalled_s()
        if idle is None:
            return 200, b"ok\n"
        return 503, (f"probe thread stalled: no probe sent or received for {idle:.0f} s while "
                     f"{len(self.engine.paths)} paths are configured\n").encode()


def metrics_registry(view: TelemetryView, collectors=(), per_path: Callable[[], bool] = lambda: False):
    """The agent's exposition: its own collectors, plus the process's CPU, memory and file
    descriptors and the Python runtime (what node-level dashboards expect of every daemon)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TelemetryCollector(view, per_path))
    for c in collectors:
        registry.register(c)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


Route = Callable[[], tuple[int, bytes, str]]  # status, body, content type
QueryRoute = Callable[[str], tuple[int, bytes, str]]  # called with the query string


def serve(host: str, port: int, routes: dict[str, Route], netns: str | None = None,
          name: str = "http", query_routes: dict[str, QueryRoute] | None = None) -> ThreadingHTTPServer:
    """A small HTTP server for `routes` and `query_routes` (GET only) on (host, port), in `netns`
    if given, its thread started. Unknown paths are 404 naming the known ones."""
    query_routes = query_routes or {}
    known = ", ".join(sorted([*routes, *query_routes]))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            path, _, query = self.path.partition("?")
            if path in query_routes:
                status, body, ctype = query_routes[path](query)
            elif path in routes:
                status, body, ctype = routes[path]()
            else:
                self.send_error(404, f"unknown path; try {known}")
                return
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # requests are not worth a log line each
            pass

    make = lambda: ThreadingHTTPServer((host, port), Handler)  # noqa: E731
    server = ns_io.run_in_netns(netns, make) if netns else make()
    threading.Thread(target=server.serve_forever, daemon=True, name=name).start()
    return server


# what a service manager or Kubernetes asks: alive (the probe thread moves) and ready (it also
# probes the peers it should; a peer's paths are discovered before the API listens)
PROBE_PATHS = ("/healthz", "/readyz")


def readiness_route(waiting_for: Callable[[], str | None], progress: ProbeProgress | None) -> Route:
    """/readyz: 200 "ready", or 503 naming what the agent waits for (`waiting_for()`, or a stalled
    probe thread)."""
    def ready():
        if progress is not None and progress.stalled_s() is not None:
            return 503, progress.health()[1], "text/plain"
        why = waiting_for()
        if why:
            return 503, f"not ready: {why}\n".encode(), "text/plain"
        return 200, b"ready\n", "text/plain"

    return ready


def metrics_routes(registry, progress: ProbeProgress | None) -> dict[str, Route]:
    def health():
        status, body = progress.health() if progress is not None else (200, b"ok\n")
        return status, body, "text/plain"

    return {"/metrics": lambda: (200, generate_latest(registry), CONTENT_TYPE_LATEST), "/healthz": health}


class LocalApi:
    """HTTP on 127.0.0.1:`port` inside `netns` (or here); a ticker snapshots loss counters and
    samples the probe thread's progress."""

    def __init__(self, view: TelemetryView, netns: str | None = None, port: int = AGENT_API_PORT,
                 host: str = "127.0.0.1", collectors=(), extra_routes: dict | None = None,
                 registry=None, progress: ProbeProgress | None = None,
                 waiting_for: Callable[[], str | None] = lambda: None,
                 query_routes: dict[str, QueryRoute] | None = None):
        self.view = view
        self.registry = registry if registry is not None else metrics_registry(view, collectors)
        self.progress = progress
        routes: dict[str, Route] = {
            **metrics_routes(self.registry, progress),
            "/readyz": readiness_route(waiting_for, progress),
            "/v1/paths": lambda: (200, json.dumps(self.view.rows()).encode(), "application/json"),
            "/v1/counters": lambda: (200, json.dumps(self.view.counters()).encode(), "application/json"),
            **{path: (lambda fn=fn: (200, json.dumps(fn()).encode(), "application/json"))
               for path, fn in (extra_routes or {}).items()}}
        self.server = serve(host, port, routes, netns, name="local-api", query_routes=query_routes)
        self.port = self.server.server_address[1]
        self._stop = threading.Event()
        threading.Thread(target=self._tick, daemon=True, name="telemetry-ticker").start()

    def _tick(self) -> None:
        while not self._stop.wait(self.view.snapshot_every_s):
            self.view.tick()
            if self.progress is not None:
                self.progress.tick()

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
