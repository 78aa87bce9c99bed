"""The agent's Prometheus metrics: every name, type, help text and label set is defined once, in
SPECS; the collectors read plain state at scrape time (never update metric objects per probe).

    TelemetryCollector   per-path probe counters, loss, one-way delay, RTT histogram, drops
    DecisionCollector    path states, transitions, route changes, fail static
    AgentCollector       the agent's own faults: main-loop errors, coordinator answers refused

Names follow `linkpass_<subsystem>_<name>_<unit>`; labels are bounded: peer, plane and path (the
discovered path's index towards that peer), state, direction and drop reason, never a port or a
sequence number.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..core.states import Direction, State
from ..core.telemetry import RTT_BUCKETS_NS

_PATH = ("peer", "plane", "path")
FWD, REV = Direction.FWD.value, Direction.REV.value  # the direction label values


class Spec(NamedTuple):
    kind: type
    help: str
    labels: tuple[str, ...] = ()


SPECS: dict[str, Spec] = {
    # telemetry (the probe engine)
    "linkpass_probe_requests": Spec(CounterMetricFamily, "Probe requests sent", _PATH),
    "linkpass_probe_replies": Spec(CounterMetricFamily, "Authenticated replies received", _PATH),
    "linkpass_probe_lost": Spec(CounterMetricFamily, "Probes lost, by direction of the loss", _PATH + ("direction",)),
    "linkpass_path_loss_ratio": Spec(GaugeMetricFamily,
                                     "Loss over the sliding window: forward, reverse, or any (incl. unanswered)",
                                     _PATH + ("direction",)),
    "linkpass_path_one_way_delay_seconds": Spec(GaugeMetricFamily,
                                                "One-way delay percentiles over the sliding window (needs clock sync)",
                                                _PATH + ("direction", "quantile")),
    "linkpass_probe_rtt_seconds": Spec(HistogramMetricFamily, "Round-trip time without reflector residence", _PATH),
    "linkpass_probe_dropped_packets": Spec(CounterMetricFamily, "Received or sent packets dropped, by reason",
                                           ("reason",)),
    # decisions (the failover loop)
    "linkpass_path_state": Spec(GaugeMetricFamily, "1 for the state each path is in", _PATH + ("state",)),
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
    "linkpass_agent_loop_errors": Spec(CounterMetricFamily,
                                       "Exceptions in a step of the agent's main loop (logged; the loop goes on)",
                                       ("step",)),
    "linkpass_agent_coordinator_answers_rejected": Spec(CounterMetricFamily,
                                                        "Coordinator answers refused whole (shape, sizes, addresses, "
                                                        "peers): none of such an answer is applied"),
}


def family(name: str):
    """An empty metric family of `name`, as SPECS defines it."""
    spec = SPECS[name]
    return spec.kind(name, spec.help, labels=list(spec.labels))


class TelemetryCollector:
    """Reads a `linkpass.agent.api.TelemetryView` at scrape time."""

    def __init__(self, view):
        self.view = view

    def collect(self):
        sent, replies, lost, loss_ratio, owd, rtt, drops = (family(n) for n in (
            "linkpass_probe_requests", "linkpass_probe_replies", "linkpass_probe_lost", "linkpass_path_loss_ratio",
            "linkpass_path_one_way_delay_seconds", "linkpass_probe_rtt_seconds", "linkpass_probe_dropped_packets"))
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
        for reason, n in sorted(self.view.counters()["drops"].items()):
            drops.add_metric([reason], n)
        yield from (sent, replies, lost, loss_ratio, owd, rtt, drops)


class DecisionCollector:
    """Reads the agent's `Failover` at scrape time (through `failover()`: a reload replaces it)."""

    def __init__(self, failover: Callable[[], object]):
        self.failover = failover

    def collect(self):
        fo = self.failover()
        state, trans, changes, deferred, static, entered, planes = (family(n) for n in (
            "linkpass_path_state", "linkpass_path_transitions", "linkpass_route_changes",
            "linkpass_route_changes_deferred", "linkpass_fail_static_peers", "linkpass_fail_static_events",
            "linkpass_route_planes"))
        for row in fo.path_rows():
            for s in State:
                state.add_metric([row["peer"], str(row["plane"]), str(row["path"]), s.value],
                                 1.0 if row["state"] == s.value else 0.0)
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
        yield from (state, trans, changes, deferred, static, entered, planes, allowance, held, absorbed)


class AgentCollector:
    """Reads the agent's own fault counters at scrape time: `counters()` returns
    {"loop_errors": {step: n}, "answers_rejected": n}."""

    def __init__(self, counters: Callable[[], dict]):
        self.counters = counters

    def collect(self):
        c = self.counters()
        errors, rejected = family("linkpass_agent_loop_errors"), family("linkpass_agent_coordinator_answers_rejected")
        for step, n in c["loop_errors"].items():
            errors.add_metric([step], n)
        rejected.add_metric([], c["answers_rejected"])
        yield from (errors, rejected)
