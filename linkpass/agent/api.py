"""What an agent's probes know, for people and for Prometheus: the local query API.

`TelemetryView` turns an engine's per-path telemetry (plus clock-sync offsets, when known) into
plain rows. `LocalApi` serves them over HTTP on 127.0.0.1 inside the host's namespace:

    GET /metrics      Prometheus exposition (collector reads the stats at scrape time)
    GET /v1/paths     JSON rows, one per probed path (what `linkpass paths -o json` prints)
    GET /v1/counters  engine counters and drops by reason
    GET /healthz      "ok"

Metric names follow `linkpass_<subsystem>_<name>_<unit>`; labels are bounded: peer, plane and
path (the discovered path's index towards that peer), and drop reason — never a port or a
sequence number.
"""
from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..kernel import netns as ns_io
from ..core.constants import AGENT_API_PORT
from ..core.states import Direction
from ..core.telemetry import RTT_BUCKETS_NS, LossSnapshot

FWD, REV = Direction.FWD.value, Direction.REV.value  # the metrics' direction label values
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


class _Collector:
    def __init__(self, view: TelemetryView):
        self.view = view

    def collect(self):
        labels = ["peer", "plane", "path"]
        sent = CounterMetricFamily("linkpass_probe_requests", "Probe requests sent", labels=labels)
        replies = CounterMetricFamily("linkpass_probe_replies", "Authenticated replies received", labels=labels)
        lost = CounterMetricFamily("linkpass_probe_lost", "Probes lost, by direction of the loss",
                                   labels=labels + ["direction"])
        loss_ratio = GaugeMetricFamily("linkpass_path_loss_ratio",
                                       "Loss over the sliding window: forward, reverse, or any (incl. unanswered)",
                                       labels=labels + ["direction"])
        owd = GaugeMetricFamily("linkpass_path_one_way_delay_seconds",
                                "One-way delay percentiles over the sliding window (needs clock sync)",
                                labels=labels + ["direction", "quantile"])
        rtt = HistogramMetricFamily("linkpass_probe_rtt_seconds", "Round-trip time without reflector residence",
                                    labels=labels)
        for row in self.view.rows():
            lv = [row["peer"], str(row["plane"]), str(row["path"])]
            sent.add_metric(lv, row["sent"])
            replies.add_metric(lv, row["replies"])
            lost.add_metric(lv + [FWD], row["lost_fwd"])
            lost.add_metric(lv + [REV], row["lost_rev"])
            w = row["window"]
            if w["loss_pct"] is not None:
                loss_ratio.add_metric(lv + ["any"], w["loss_pct"] / 100)
            if w["loss_fwd_pct"] is not None:
                loss_ratio.add_metric(lv + [FWD], w["loss_fwd_pct"] / 100)
            if w["loss_rev_pct"] is not None:
                loss_ratio.add_metric(lv + [REV], w["loss_rev_pct"] / 100)
            for direction, key in ((FWD, "owd_fwd_ns"), (REV, "owd_rev_ns")):
                summary = row[key]
                if summary and summary["p50"] is not None:
                    owd.add_metric(lv + [direction, "0.5"], summary["p50"] / 1e9)
                    owd.add_metric(lv + [direction, "0.99"], summary["p99"] / 1e9)
            path = self.view.engine.paths.get(row["path_id"])
            if path is None:  # removed since rows() was taken
                continue
            tel = path.telemetry
            acc, buckets = 0, []
            for bound, count in zip(list(RTT_BUCKETS_NS) + [float("inf")], tel.rtt_counts):
                acc += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound / 1e9), acc))
            rtt.add_metric(lv, buckets, tel.rtt_sum_ns / 1e9)
        drops = CounterMetricFamily("linkpass_probe_dropped_packets", "Received or sent packets dropped, by reason",
                                    labels=["reason"])
        for reason, n in sorted(self.view.counters()["drops"].items()):
            drops.add_metric([reason], n)
        yield from (sent, replies, lost, loss_ratio, owd, rtt, drops)


class LocalApi:
    """HTTP on 127.0.0.1:`port` inside `netns` (or here); a ticker snapshots loss counters."""

    def __init__(self, view: TelemetryView, netns: str | None = None, port: int = AGENT_API_PORT,
                 host: str = "127.0.0.1", collectors=(), extra_routes: dict | None = None):
        self.view = view
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(view))
        for c in collectors:
            self.registry.register(c)
        extra = {path: (lambda fn=fn: (json.dumps(fn()).encode(), "application/json"))
                 for path, fn in (extra_routes or {}).items()}
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                routes = {"/metrics": lambda: (generate_latest(api.registry), "text/plain; version=0.0.4"),
                          "/v1/paths": lambda: (json.dumps(api.view.rows()).encode(), "application/json"),
                          "/v1/counters": lambda: (json.dumps(api.view.counters()).encode(), "application/json"),
                          "/healthz": lambda: (b"ok\n", "text/plain"), **extra}
                route = routes.get(self.path.split("?")[0])
                if route is None:
                    self.send_error(404, "unknown path; try /v1/paths, /v1/counters or /metrics")
                    return
                body, ctype = route()
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # requests are not worth a log line each
                pass

        make = lambda: ThreadingHTTPServer((host, port), Handler)  # noqa: E731
        self.server = ns_io.run_in_netns(netns, make) if netns else make()
        self.port = self.server.server_address[1]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self.server.serve_forever, daemon=True, name="local-api"),
                         threading.Thread(target=self._tick, daemon=True, name="telemetry-ticker")]
        for t in self._threads:
            t.start()

    def _tick(self) -> None:
        while not self._stop.wait(self.view.snapshot_every_s):
            self.view.tick()

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
