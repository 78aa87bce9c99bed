"""What an agent's probes know, for people and for Prometheus: the local query API.

`TelemetryView` turns an engine's per-path telemetry (plus clock-sync offsets, when known) into
plain rows. `LocalApi` serves them over HTTP on 127.0.0.1 inside the host's namespace:

    GET /metrics      Prometheus exposition (linkpass/agent/metrics.py)
    GET /v1/paths     JSON rows, one per probed path (what `linkpass paths -o json` prints)
    GET /v1/counters  engine counters and drops by reason
    GET /healthz      "ok", or 503 saying why when the probe thread has stalled (liveness)
    GET /readyz       "ready ...", or 503 saying what it waits for: the probe thread stalled, or
                      the coordinator's first probe plan when the agent has no peers of its own
    GET /v1/probe     a path check of every ECMP path to a peer, and /v1/trace of one flow
                      (`linkpass probe DST`, `linkpass trace DST`: linkpass/agent/pathcheck_routes.py)

The agent serves /metrics and /healthz a second time on `metrics.address:metrics.port` (the
host's management address, for a Prometheus elsewhere); the /v1 routes stay on 127.0.0.1.

Both servers are bounded (`HttpLimits`, `AgentHTTPServer`): one loop reads every request head,
which must arrive within `read_timeout_s` of connecting; a thread answers only a complete head.
At `max_connections` open, or `max_per_client` from one address (on 127.0.0.1 every local user
shares one), the connection that has waited longest without a complete head is closed to make
room, so idle or trickling clients evict each other, not /healthz; with every slot answering, a
new connection gets a quick 503. accept() failing for lack of descriptors closes the
longest-waiting head to make room, or with none pauses accepting (backing off up to
ACCEPT_BACKOFF_MAX_S) instead of spinning. `server.stats` counts what happened.
"""
from __future__ import annotations

import errno
import io
import json
import selectors
import socket
import threading
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Callable

from ..observe.exposition import (CONTENT_TYPE_LATEST, CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector,
                               generate_latest)

from ..kernel import netns as ns_io
from ..core.constants import AGENT_API_PORT
from ..core.telemetry import LossSnapshot
from .metrics import HttpCollector, TelemetryCollector

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


def metrics_registry(view: TelemetryView, collectors=(), per_path: Callable[[], bool] = lambda: False,
                     http: HttpCollector | None = None):
    """The agent's exposition: its own collectors and its HTTP servers' connections (`http`; by
    default every AgentHTTPServer of this process), plus the process's CPU, memory and file
    descriptors and the Python runtime (what node-level dashboards expect of every daemon)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TelemetryCollector(view, per_path))
    for c in collectors:
        registry.register(c)
    registry.register(http or HttpCollector(lambda: list(AgentHTTPServer.live)))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


Route = Callable[[], tuple[int, bytes, str]]  # status, body, content type
QueryRoute = Callable[[str], tuple[int, bytes, str]]  # called with the query string


@dataclass(frozen=True)
class HttpLimits:
    """What idle, slow or many clients may cost one of the agent's HTTP servers."""

    max_connections: int = 64  # open at once, waiting for their head or being answered
    max_per_client: int = 16  # of those, from one client address
    read_timeout_s: float = 2.0  # the request head must arrive within this of connecting
    send_timeout_s: float = 10.0  # an answer's head, then its body, must be taken by the client within this
    max_head_bytes: int = 64 << 10  # request line and headers; beyond: 431


ACCEPT_BATCH = 8  # connections accepted per turn of the loop, between reads of waiting heads
ACCEPT_BACKOFF_S = 0.05  # accept() out of descriptors: pause accepting this long, doubling ...
ACCEPT_BACKOFF_MAX_S = 1.0  # ... up to this, until an accept succeeds
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_BUSY_BODY = b"too many open connections; retry\n"
_BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
         b"Connection: close\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))
_TOO_LARGE = (b"HTTP/1.0 431 Request Header Fields Too Large\r\nContent-Length: 0\r\n"
              b"Connection: close\r\n\r\n")


class _Waiting:
    """A connection whose request head is still arriving."""

    __slots__ = ("sock", "addr", "deadline", "head")

    def __init__(self, sock: socket.socket, addr, deadline: float):
        self.sock, self.addr, self.deadline, self.head = sock, addr, deadline, bytearray()

    @property
    def host(self) -> str:
        return self.addr[0]

    def add(self, data: bytes) -> bool:
        """Take what arrived; True once the head is complete (searched from the new bytes only:
        a head that trickles in byte by byte costs linear time, not quadratic)."""
        start = max(len(self.head) - 3, 0)
        self.head += data
        return self.head.find(b"\r\n\r\n", start) >= 0 or self.head.find(b"\n\n", start) >= 0


class _Writer(io.BufferedIOBase):
    """An answer's wfile: each write sent whole within the socket's timeout, or TimeoutError (which
    http.server takes as the end of the connection) counted as timed_out."""

    def __init__(self, sock: socket.socket, server: "AgentHTTPServer"):
        self._sock, self._server = sock, server

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        try:
            self._sock.sendall(data)
        except TimeoutError:
            self._server._count("timed_out")
            raise
        return len(data)


class _Handler(BaseHTTPRequestHandler):
    """Answers one request whose head the server's loop has read (`self.request` is its _Waiting)."""

    def setup(self):
        waiting = self.request
        self.connection = waiting.sock
        self.connection.settimeout(self.server.limits.send_timeout_s)
        self.rfile = io.BytesIO(bytes(waiting.head))
        self.wfile = _Writer(self.connection, self.server)

    def log_message(self, *args):  # requests are not worth a log line each
        pass


class AgentHTTPServer(HTTPServer):
    """An HTTPServer whose serve_forever is one selector loop over the listening socket and the
    connections still sending their request head; each complete head is answered in a thread of
    its own (HTTP/1.0: one request per connection). Bounded by `limits` (see the module's text).
    `stats`: accepted, refused (503 at the caps), evicted (closed to make room), timed_out (no
    complete head in time, or an answer not read), accept_failed (accept() errors, each followed
    by a pause)."""

    request_queue_size = 1024  # a burst of connects waits in the kernel's queue, not in SYN retries
    live: "weakref.WeakSet[AgentHTTPServer]" = weakref.WeakSet()  # this process's, for /metrics

    def __init__(self, address, handler, limits: HttpLimits | None = None, name: str = "http"):
        self.limits = limits or HttpLimits()
        self.name = name
        self.label = name  # linkpass_agent_http_connections_total{server}
        self.stats = dict.fromkeys(("accepted", "refused", "evicted", "timed_out", "accept_failed"), 0)
        self._waiting: OrderedDict[socket.socket, _Waiting] = OrderedDict()  # oldest first; the loop's own
        self._answering: dict[str, int] = {}  # client address -> connections being answered
        self._lock = threading.Lock()  # _answering and stats: answer threads update them too
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._backoff = 0.0
        self._resume_at: float | None = None
        super().__init__(address, handler)
        self.socket.setblocking(False)
        AgentHTTPServer.live.add(self)

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._waiting) + sum(self._answering.values())

    # ---- the loop ------------------------------------------------------------------------
    def serve_forever(self, poll_interval: float = 0.5) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        sel.register(self.socket, selectors.EVENT_READ, "listen")
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                self._expire(now, sel)
                wait = poll_interval
                if self._waiting:
                    wait = min(wait, next(iter(self._waiting.values())).deadline - now)
                if self._resume_at is not None:
                    wait = min(wait, self._resume_at - now)
                ready = sel.select(max(wait, 0.0))
                listening = False
                for key, _ in ready:  # heads first: a talking client is read before more are let in
                    if isinstance(key.data, _Waiting):
                        self._read(key.data, sel)
                    elif key.data == "listen":
                        listening = True
                    else:
                        self._wake_r.recv(64)
                if listening:
                    self._accept(sel)
                if self._resume_at is not None and time.monotonic() >= self._resume_at:
                    self._resume_at = None
                    sel.register(self.socket, selectors.EVENT_READ, "listen")
        finally:
            for w in self._waiting.values():
                w.sock.close()
            self._waiting.clear()
            sel.close()
            self._stopped.set()

    def shutdown(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._stopped.wait()

    def server_close(self) -> None:
        AgentHTTPServer.live.discard(self)
        super().server_close()
        self._wake_r.close()
        self._wake_w.close()

    def _accept(self, sel) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = self.get_request()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # gone before we took it
                continue
            except OSError as exc:
                self._count("accept_failed")
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._evict(sel, None):
                    continue  # out of descriptors: the longest-waiting head gives its one up to the newcomer
                # nothing of ours to give up, or out of memory: the listening socket stays readable,
                # so retrying at once would spin a core; pause accepting, keep serving the rest
                self._backoff = min(max(2 * self._backoff, ACCEPT_BACKOFF_S), ACCEPT_BACKOFF_MAX_S)
                if exc.errno not in _OUT_OF_RESOURCES:
                    self._backoff = ACCEPT_BACKOFF_MAX_S  # unexpected: the slowest retry
                self._resume_at = time.monotonic() + self._backoff
                sel.unregister(self.socket)
                return
            self._backoff = 0.0
            self._count("accepted")
            sock.setblocking(False)
            self._admit(_Waiting(sock, addr, time.monotonic() + self.limits.read_timeout_s), sel)

    def _admit(self, new: _Waiting, sel) -> None:
        lim = self.limits
        with self._lock:
            answering, mine = sum(self._answering.values()), self._answering.get(new.host, 0)
        mine += sum(1 for w in self._waiting.values() if w.host == new.host)
        if ((mine >= lim.max_per_client and not self._evict(sel, new.host))
                or (len(self._waiting) + answering >= lim.max_connections and not self._evict(sel, None))):
            self._count("refused")
            try:
                new.sock.recv(65536)  # a head that came unread would make the close a reset, losing the 503
            except OSError:
                pass
            try:
                new.sock.send(_BUSY)
            except OSError:
                pass
            new.sock.close()
            return
        self._waiting[new.sock] = new
        sel.register(new.sock, selectors.EVENT_READ, new)
        self._read(new, sel)  # a client that sent its head with the connect is answered now

    def _evict(self, sel, host: str | None) -> bool:
        """Close the connection (of `host`, if given) that has waited longest for its head."""
        for w in self._waiting.values():
            if host is None or w.host == host:
                self._drop(w, sel)
                self._count("evicted")
                return True
        return False

    def _expire(self, now: float, sel) -> None:
        while self._waiting:
            w = next(iter(self._waiting.values()))
            if w.deadline > now:
                return
            self._drop(w, sel)
            self._count("timed_out")

    def _drop(self, w: _Waiting, sel) -> None:
        del self._waiting[w.sock]
        sel.unregister(w.sock)
        w.sock.close()

    def _read(self, w: _Waiting, sel) -> None:
        try:
            data = w.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client went away
            self._drop(w, sel)
            return
        if w.add(data):
            del self._waiting[w.sock]
            sel.unregister(w.sock)
            self._answer(w)
        elif len(w.head) > self.limits.max_head_bytes:
            try:
                w.sock.send(_TOO_LARGE)
            except OSError:
                pass
            self._drop(w, sel)

    # ---- answers -------------------------------------------------------------------------
    def _answer(self, w: _Waiting) -> None:
        with self._lock:
            self._answering[w.host] = self._answering.get(w.host, 0) + 1
        try:
            threading.Thread(target=self._answer_thread, args=(w,), daemon=True, name=f"{self.name}-answer").start()
        except RuntimeError:  # no thread to be had: refused like a full server
            self._done(w)
            self._count("refused")

    def _answer_thread(self, w: _Waiting) -> None:
        try:
            self.finish_request(w, w.addr)
        except OSError:  # the client went away mid-answer
            pass
        except Exception:  # noqa: BLE001 - a route's failure stays with its request
            self.handle_error(w.sock, w.addr)
        finally:
            try:
                w.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            self._done(w)

    def _done(self, w: _Waiting) -> None:
        w.sock.close()
        with self._lock:
            left = self._answering[w.host] - 1
            if left:
                self._answering[w.host] = left
            else:
                del self._answering[w.host]

    def _count(self, what: str) -> None:
        with self._lock:
            self.stats[what] += 1


def serve(host: str, port: int, routes: dict[str, Route], netns: str | None = None,
          name: str = "http", query_routes: dict[str, QueryRoute] | None = None,
          limits: HttpLimits | None = None) -> AgentHTTPServer:
    """A small HTTP server for `routes` and `query_routes` (GET only) on (host, port), in `netns`
    if given, its thread started, bounded by `limits`. Unknown paths are 404 naming the known ones."""
    query_routes = query_routes or {}
    known = ", ".join(sorted([*routes, *query_routes]))

    class Handler(_Handler):
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

    make = lambda: AgentHTTPServer((host, port), Handler, limits, name)  # noqa: E731
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
