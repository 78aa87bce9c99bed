"""The agent's Prometheus metrics: every name, type, help text and label set is defined once, in
SPECS; the collectors read plain state at scrape time (never update metric objects per probe).

    TelemetryCollector   probe counters, loss, one-way delay, RTT histogram, drops
    DecisionCollector    paths by state, transitions, route changes, fail static
    AgentCollector       the agent itself: build, probe thread, coordinator link, main-loop errors

Series stay bounded on a host of any size. By default the probe figures are per (peer, plane):
counters summed over the plane's discovered paths, window figures (loss, one-way delay) those of
the plane's worst path, and the RTT histogram per plane. Each path's own series
(`linkpass_path_*`, labelled with the path's index towards that peer) come only with
`metrics.per_path: true`, for a host under investigation. docs/observability.md counts them.

Names follow `linkpass_<subsystem>_<name>_<unit>`; labels never carry a port or a sequence number.
One-way delay percentiles are gauges over the sliding window (`_p50_seconds`, `_p99_seconds`): the
offset between two clocks moves as clock sync learns it, so a cumulative histogram of one-way
delays would mix offsets; RTT needs no offset and is a real histogram.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable, NamedTuple

from ..observe.exposition import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..core.states import Direction, State
from ..core.telemetry import RTT_BUCKETS_NS

_PLANE = ("peer", "plane")
_PATH = ("peer", "plane", "path")
FWD, REV = Direction.FWD.value, Direction.REV.value  # the direction label values
ANY = "any"  # loss with no direction: probes that got no answer at all


class Spec(NamedTuple):
    kind: type
    help: str
    labels: tuple[str, ...] = ()


SPECS: dict[str, Spec] = {
    # telemetry, per (peer, plane): always
    "linkpass_probe_requests": Spec(CounterMetricFamily, "Probe requests sent, over the plane's paths", _PLANE),
    "linkpass_probe_replies": Spec(CounterMetricFamily, "Authenticated replies received, over the plane's paths",
                                   _PLANE),
    "linkpass_probe_lost": Spec(CounterMetricFamily, "Probes lost, by direction of the loss, over the plane's paths",
                                _PLANE + ("direction",)),
    "linkpass_peer_loss_ratio": Spec(GaugeMetricFamily,
                                     "Loss over the sliding window on the plane's worst path: forward, reverse, "
                                     "or any (incl. unanswered)", _PLANE + ("direction",)),
    "linkpass_peer_one_way_delay_p50_seconds": Spec(
        GaugeMetricFamily, "Median one-way delay over the sliding window, the plane's worst path (needs clock sync)",
        _PLANE + ("direction",)),
    "linkpass_peer_one_way_delay_p99_seconds": Spec(
        GaugeMetricFamily, "99th percentile one-way delay over the sliding window, the plane's worst path "
        "(needs clock sync)", _PLANE + ("direction",)),
    "linkpass_probe_rtt_seconds": Spec(HistogramMetricFamily,
                                       "Round-trip time without reflector residence, every path of the plane",
                                       ("plane",)),
    "linkpass_probe_dropped_packets": Spec(CounterMetricFamily, "Received or sent packets dropped, by reason",
                                           ("reason",)),
    "linkpass_probe_packets": Spec(CounterMetricFamily,
                                   "Packets of the probe thread: sent (requests), reflected (answers to peers), "
                                   "received", ("kind",)),
    "linkpass_probe_other_key_packets": Spec(CounterMetricFamily,
                                            "Packets authenticated with the second fleet key accepted during a key "
                                            "rotation (fleet_key_accept_file): peers still, or already, signing with it"),
    "linkpass_probe_confirmation_rounds": Spec(CounterMetricFamily,
                                              "Confirmation rounds: a probe on every path to a peer, sent when a miss "
                                              "makes one of them DOWN (sent), or refused by the per-peer budget "
                                              "(refused)", ("result",)),
    # telemetry, per path: only with metrics.per_path
    "linkpass_path_probe_requests": Spec(CounterMetricFamily, "Probe requests sent on the path", _PATH),
    "linkpass_path_probe_replies": Spec(CounterMetricFamily, "Authenticated replies received on the path", _PATH),
    "linkpass_path_probe_lost": Spec(CounterMetricFamily, "Probes lost on the path, by direction",
                                     _PATH + ("direction",)),
    "linkpass_path_loss_ratio": Spec(GaugeMetricFamily, "Loss over the sliding window on the path", _PATH + ("direction",)),
    "linkpass_path_one_way_delay_p50_seconds": Spec(GaugeMetricFamily, "Median one-way delay over the window",
                                                    _PATH + ("direction",)),
    "linkpass_path_one_way_delay_p99_seconds": Spec(GaugeMetricFamily, "99th percentile one-way delay over the window",
                                                    _PATH + ("direction",)),
    "linkpass_path_rtt_seconds": Spec(HistogramMetricFamily, "Round-trip time on the path", _PATH),
    "linkpass_path_state": Spec(GaugeMetricFamily, "1 for the state the path is in", _PATH + ("state",)),
    # decisions (the failover loop)
    "linkpass_peer_paths": Spec(GaugeMetricFamily, "Discovered paths towards the peer on the plane, by state",
                                _PLANE + ("state",)),
    "linkpass_path_transitions": Spec(CounterMetricFamily, "Path state changes, by new state", ("to",)),
    "linkpass_route_changes": Spec(CounterMetricFamily, "Route rewrites applied (or logged, in dry run)"),
    "linkpass_route_changes_deferred": Spec(CounterMetricFamily, "Route rewrites held back by the rate limit"),
    "linkpass_fail_static_peers": Spec(GaugeMetricFamily,
                                       "Peers with no usable path: their route is kept as it was (never removed)"),
    "linkpass_fail_static_events": Spec(CounterMetricFamily, "Times a peer was left without a usable path"),
    "linkpass_route_planes": Spec(GaugeMetricFamily, "Planes the route to each peer uses now", ("peer",)),
    "linkpass_host_lateness_allowance_seconds": Spec(
        GaugeMetricFamily, "How long a DOWN to each peer must stand before it is acted on: earned by replies late "
        "on every path together (a host kept waiting); 0 on a calm host", ("peer",)),
    "linkpass_downs_held_for_lateness": Spec(CounterMetricFamily,
                                             "DOWNs held back from the data path by the lateness allowance"),
    "linkpass_downs_absorbed": Spec(CounterMetricFamily,
                                    "DOWNs undone by their late replies before the data path moved for them"),
    # the agent itself
    "linkpass_build_info": Spec(GaugeMetricFamily, "1, labelled with the running LinkPass's version and probe engine",
                                ("version", "engine")),
    "linkpass_agent_probe_thread_up": Spec(GaugeMetricFamily,
                                           "1 while the probe thread makes progress (what /healthz answers)"),
    "linkpass_agent_coordinator_up": Spec(GaugeMetricFamily,
                                          "1 while the coordinator answers this agent; 0 while it is away "
                                          "(absent without a coordinator)"),
    "linkpass_agent_fleet_keys": Spec(GaugeMetricFamily,
                                      "Fleet keys this agent accepts: 1, or 2 during a key rotation"),
    "linkpass_agent_probed_paths": Spec(GaugeMetricFamily,
                                        "Paths probed, by rate (probe.idle_rates, docs/agent-cost.md): active, "
                                        "progressing, standby or idle; every path is active while rates are off",
                                        ("rate",)),
    "linkpass_agent_lane_reports": Spec(GaugeMetricFamily,
                                        "Lane reports in probe.lanes_dir at the last look: live, stale (writer "
                                        "silent over a second) or bad (refused: not a report, damaged)", ("state",)),
    "linkpass_agent_lanes": Spec(GaugeMetricFamily, "Lanes the live reports held at the last look"),
    "linkpass_agent_rdma_unreported_planes": Spec(GaugeMetricFamily,
                                                  "Planes whose every path is active because their RDMA device "
                                                  "moves traffic no lane report names (probe.unreported_rdma_pps)"),
    "linkpass_agent_probe_budget_pps": Spec(GaugeMetricFamily,
                                            "The probe budget now: probes/s the agent may send (probe.budget_pps "
                                            "times the CPU governor's factor); 0: no ceiling"),
    "linkpass_agent_probe_pps": Spec(GaugeMetricFamily,
                                     "Probes/s by budget priority class (active, standby, coverage, rest): what the "
                                     "paths' rates want and what the budget grants", ("priority", "kind")),
    "linkpass_agent_probe_budget_degraded": Spec(GaugeMetricFamily,
                                                 "1 while the budget stretches this priority class's rates",
                                                 ("priority",)),
    "linkpass_agent_lanes_unknown": Spec(CounterMetricFamily,
                                         "Lane sightings naming no peer address this agent probes on that plane "
                                         "(ignored)"),
    "linkpass_agent_loop_errors": Spec(CounterMetricFamily,
                                       "Exceptions in a step of the agent's main loop (logged; the loop goes on)",
                                       ("step",)),
    "linkpass_agent_coordinator_answers_rejected": Spec(CounterMetricFamily,
                                                        "Coordinator answers refused whole (shape, sizes, addresses, "
                                                        "peers): none of such an answer is applied"),
    "linkpass_agent_http_connections": Spec(CounterMetricFamily,
                                            "Connections to the agent's HTTP servers (server: local-api, or metrics: "
                                            "/metrics on the management address) by outcome: accepted, "
                                            "refused (503 at the caps), evicted (idle, to make room), timed_out "
                                            "(no request head in time, or an answer not read), accept_failed",
                                            ("server", "outcome")),
}


def family(name: str):
    """An empty metric family of `name`, as SPECS defines it."""
    spec = SPECS[name]
    return spec.kind(name, spec.help, labels=list(spec.labels))


def _worst(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


class _Plane:
    """What the paths towards one peer on one plane add up to (bounded per host)."""

    __slots__ = ("sent", "replies", "lost_fwd", "lost_rev", "loss", "p50", "p99")

    def __init__(self):
        self.sent = self.replies = self.lost_fwd = self.lost_rev = 0
        self.loss = {ANY: None, FWD: None, REV: None}
        self.p50 = {FWD: None, REV: None}
        self.p99 = {FWD: None, REV: None}


def _window_loss(w: dict) -> dict:
    """The window's loss ratios by direction label (None: nothing to judge it on)."""
    pct = {ANY: w["loss_pct"], FWD: w["loss_fwd_pct"], REV: w["loss_rev_pct"]}
    return {d: None if v is None else v / 100 for d, v in pct.items()}


def _histogram(counts, sum_ns: int) -> tuple[list, float]:
    acc, buckets = 0, []
    for bound, count in zip(list(RTT_BUCKETS_NS) + [float("inf")], counts):
        acc += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound / 1e9), acc))
    return buckets, sum_ns / 1e9


class TelemetryCollector:
    """Reads a `linkpass.agent.api.TelemetryView` at scrape time; `per_path()` says whether each
    path's own series are wanted too (the config's metrics.per_path, which a reload may change)."""

    def __init__(self, view, per_path: Callable[[], bool] = lambda: False):
        self.view = view
        self.per_path = per_path

    def collect(self):
        per_path = self.per_path()
        planes: dict[tuple[str, str], _Plane] = defaultdict(_Plane)
        rtt: dict[str, list] = {}  # plane -> [bucket counts, sum ns]
        names = ("linkpass_path_probe_requests", "linkpass_path_probe_replies", "linkpass_path_probe_lost",
                 "linkpass_path_loss_ratio", "linkpass_path_one_way_delay_p50_seconds",
                 "linkpass_path_one_way_delay_p99_seconds", "linkpass_path_rtt_seconds")
        p_sent, p_replies, p_lost, p_loss, p_p50, p_p99, p_rtt = (family(n) for n in names)
        for row in self.view.rows():
            path = self.view.engine.paths.get(row["path_id"])
            if path is None:  # removed since rows() was taken
                continue
            plane = str(row["plane"])
            agg = planes[(row["peer"], plane)]
            agg.sent += row["sent"]
            agg.replies += row["replies"]
            agg.lost_fwd += row["lost_fwd"]
            agg.lost_rev += row["lost_rev"]
            loss = _window_loss(row["window"])
            for d, v in loss.items():
                agg.loss[d] = _worst(agg.loss[d], v)
            owd = {}
            for d, key in ((FWD, "owd_fwd_ns"), (REV, "owd_rev_ns")):
                s = row[key]
                if s and s["p50"] is not None:
                    owd[d] = (s["p50"] / 1e9, s["p99"] / 1e9)
                    agg.p50[d] = _worst(agg.p50[d], owd[d][0])
                    agg.p99[d] = _worst(agg.p99[d], owd[d][1])
            tel = path.telemetry
            acc = rtt.setdefault(plane, [[0] * len(tel.rtt_counts), 0])
            acc[0] = [a + b for a, b in zip(acc[0], tel.rtt_counts)]
            acc[1] += tel.rtt_sum_ns
            if per_path:
                lv = [row["peer"], plane, str(row["path"])]
                p_sent.add_metric(lv, row["sent"])
                p_replies.add_metric(lv, row["replies"])
                p_lost.add_metric(lv + [FWD], row["lost_fwd"])
                p_lost.add_metric(lv + [REV], row["lost_rev"])
                for d, v in loss.items():
                    if v is not None:
                        p_loss.add_metric(lv + [d], v)
                for d, (p50, p99) in owd.items():
                    p_p50.add_metric(lv + [d], p50)
                    p_p99.add_metric(lv + [d], p99)
                p_rtt.add_metric(lv, *_histogram(tel.rtt_counts, tel.rtt_sum_ns))
        names = ("linkpass_probe_requests", "linkpass_probe_replies", "linkpass_probe_lost", "linkpass_peer_loss_ratio",
                 "linkpass_peer_one_way_delay_p50_seconds", "linkpass_peer_one_way_delay_p99_seconds",
                 "linkpass_probe_rtt_seconds")
        sent, replies, lost, loss_ratio, p50, p99, rtt_h = (family(n) for n in names)
        for (peer, plane), agg in sorted(planes.items()):
            lv = [peer, plane]
            sent.add_metric(lv, agg.sent)
            replies.add_metric(lv, agg.replies)
            lost.add_metric(lv + [FWD], agg.lost_fwd)
            lost.add_metric(lv + [REV], agg.lost_rev)
            for d, v in agg.loss.items():
                if v is not None:
                    loss_ratio.add_metric(lv + [d], v)
            for fam, values in ((p50, agg.p50), (p99, agg.p99)):
                for d, v in values.items():
                    if v is not None:
                        fam.add_metric(lv + [d], v)
        for plane, (counts, sum_ns) in sorted(rtt.items()):
            rtt_h.add_metric([plane], *_histogram(counts, sum_ns))
        drops, packets = family("linkpass_probe_dropped_packets"), family("linkpass_probe_packets")
        counters = self.view.counters()
        for reason, n in sorted(counters["drops"].items()):
            drops.add_metric([reason], n)
        for kind in ("sent", "reflected", "received"):
            if kind in counters["stats"]:
                packets.add_metric([kind], counters["stats"][kind])
        other_key = family("linkpass_probe_other_key_packets")
        other_key.add_metric([], counters["stats"].get("other_key", 0))
        confirm = family("linkpass_probe_confirmation_rounds")
        for result, key in (("sent", "confirm_rounds"), ("refused", "confirm_refused")):
            if key in counters["stats"]:
                confirm.add_metric([result], counters["stats"][key])
        yield from (sent, replies, lost, loss_ratio, p50, p99, rtt_h, drops, packets, other_key, confirm)
        if per_path:
            yield from (p_sent, p_replies, p_lost, p_loss, p_p50, p_p99, p_rtt)


class DecisionCollector:
    """Reads the agent's `Failover` at scrape time (through `failover()`: a reload replaces it)."""

    def __init__(self, failover: Callable[[], object], per_path: Callable[[], bool] = lambda: False):
        self.failover = failover
        self.per_path = per_path

    def collect(self):
        fo = self.failover()
        names = ("linkpass_peer_paths", "linkpass_path_state", "linkpass_path_transitions", "linkpass_route_changes",
                 "linkpass_route_changes_deferred", "linkpass_fail_static_peers", "linkpass_fail_static_events",
                 "linkpass_route_planes")
        paths, state, trans, changes, deferred, static, entered, planes = (family(n) for n in names)
        per_path = self.per_path()
        by_plane: dict[tuple[str, str], dict[str, int]] = {}
        for row in fo.path_rows():
            key = (row["peer"], str(row["plane"]))
            counts = by_plane.setdefault(key, dict.fromkeys((s.value for s in State), 0))
            counts[row["state"]] += 1
            if per_path:
                for s in State:
                    state.add_metric([*key, str(row["path"]), s.value], 1.0 if row["state"] == s.value else 0.0)
        for key, counts in sorted(by_plane.items()):
            for s, n in counts.items():
                paths.add_metric([*key, s], n)
        for s in State:
            trans.add_metric([s.value], fo.counters.get(f"transition_{s.value}", 0))
        changes.add_metric([], fo.counters.get("route_changes", 0))
        deferred.add_metric([], fo.counters.get("route_deferred", 0))
        static.add_metric([], len(fo.fail_static))
        entered.add_metric([], fo.counters.get("fail_static", 0))
        for peer, pl in sorted(fo.planes.items()):
            planes.add_metric([peer], len(pl))
        allowance, held, absorbed = (family(n) for n in (
            "linkpass_host_lateness_allowance_seconds", "linkpass_downs_held_for_lateness", "linkpass_downs_absorbed"))
        for peer in sorted(fo.by_peer):
            allowance.add_metric([peer], fo.allowance_ns(peer) / 1e9)
        held.add_metric([], fo.counters.get("down_held_for_lateness", 0))
        absorbed.add_metric([], fo.counters.get("lateness_absorbed", 0))
        yield from (paths, trans, changes, deferred, static, entered, planes, allowance, held, absorbed)
        if per_path:
            yield state


class AgentCollector:
    """Reads the agent's own state at scrape time: `counters()` returns {"loop_errors": {step: n},
    "answers_rejected": n, "probe_thread_up": bool, "coordinator_up": bool | None, "engine": str,
    "fleet_keys": 1 or 2, "paths_by_rate": {rate: n}, "lanes": the lane reader's counts or None,
    "rdma_unreported_planes": planes active for unreported RDMA traffic, or None (rates off),
    "budget": the last core.budget.Apportioned or None}."""

    def __init__(self, counters: Callable[[], dict]):
        self.counters = counters

    def collect(self):
        from .. import __version__

        c = self.counters()
        build = family("linkpass_build_info")
        build.add_metric([__version__, c["engine"]], 1.0)
        thread = family("linkpass_agent_probe_thread_up")
        thread.add_metric([], 1.0 if c["probe_thread_up"] else 0.0)
        keys = family("linkpass_agent_fleet_keys")
        keys.add_metric([], c.get("fleet_keys", 1))
        rates = family("linkpass_agent_probed_paths")
        for rate, n in c.get("paths_by_rate", {}).items():
            rates.add_metric([rate], n)
        yield from (build, thread, keys, rates)
        lanes = c.get("lanes")
        if lanes is not None:  # with rates on
            reports, held, unknown = (family(n) for n in ("linkpass_agent_lane_reports", "linkpass_agent_lanes",
                                                          "linkpass_agent_lanes_unknown"))
            for state in ("live", "stale", "bad"):
                reports.add_metric([state], lanes[f"reports_{state}"])
            held.add_metric([], lanes["lanes"])
            unknown.add_metric([], lanes["lanes_unknown"])
            yield from (reports, held, unknown)
        if c.get("rdma_unreported_planes") is not None:  # with rates on
            unreported = family("linkpass_agent_rdma_unreported_planes")
            unreported.add_metric([], c["rdma_unreported_planes"])
            yield unreported
        budget = c.get("budget")
        if budget is not None:
            ceiling, pps, degraded = (family(n) for n in ("linkpass_agent_probe_budget_pps", "linkpass_agent_probe_pps",
                                                          "linkpass_agent_probe_budget_degraded"))
            ceiling.add_metric([], budget.budget_pps)
            for cls, share in budget.classes.items():
                pps.add_metric([cls, "wanted"], share.wanted_pps)
                pps.add_metric([cls, "granted"], share.granted_pps)
                degraded.add_metric([cls], 1.0 if share.degraded else 0.0)
            yield from (ceiling, pps, degraded)
        if c["coordinator_up"] is not None:
            coord = family("linkpass_agent_coordinator_up")
            coord.add_metric([], 1.0 if c["coordinator_up"] else 0.0)
            yield coord
        errors, rejected = family("linkpass_agent_loop_errors"), family("linkpass_agent_coordinator_answers_rejected")
        for step, n in c["loop_errors"].items():
            errors.add_metric([step], n)
        rejected.add_metric([], c["answers_rejected"])
        yield from (errors, rejected)


class HttpCollector:
    """linkpass_agent_http_connections_total: what each of the agent's HTTP servers (`servers()`:
    objects with `label` and `stats`) saw of its clients."""

    def __init__(self, servers: Callable[[], Iterable]):
        self.servers = servers

    def collect(self):
        conns = family("linkpass_agent_http_connections")
        for server in sorted(self.servers(), key=lambda s: s.label):
            for outcome, n in dict(server.stats).items():
                conns.add_metric([server.label, outcome], n)
        yield conns
