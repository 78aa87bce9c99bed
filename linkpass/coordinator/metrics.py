"""The coordinator endpoint's Prometheus view, read at scrape time.

- `CountsCollector` (no token needed): counts that name no host or link, read without the lock
  (the coordinator keeps them as paths change);
- `NamedCollector` (a reader's token): the series that name hosts and links, read under the lock;
- `ShardCollector`: a shard's own view (its agents, what it answered, queued, forwarded);
- every view adds the endpoint's own families: refusals by kind, connections, pending
  requests, request latency by endpoint, build info.
"""
from __future__ import annotations

import bisect
import threading
from ..observe.exposition import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .. import __version__
from .service import shard_parts

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RequestLatency:
    """Time from a request's head read to its answer ready, per endpoint path (a bounded set: the
    routes; anything else is not timed), as cumulative histogram counts. Called from the loop."""

    def __init__(self, paths):
        self._lock = threading.Lock()
        self._by_path = {p: [[0] * (len(LATENCY_BUCKETS_S) + 1), 0.0] for p in paths}

    def observe(self, path: str, seconds: float) -> None:
        h = self._by_path.get(path)
        if h is None:
            return
        with self._lock:
            h[0][bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
            h[1] += seconds

    def family(self) -> HistogramMetricFamily:
        fam = HistogramMetricFamily("linkpass_coordinator_request_duration_seconds",
                                    "Time from a request's head to its answer (waiting for a worker included), "
                                    "by endpoint", labels=["path"])
        with self._lock:
            rows = [(p, list(c), total) for p, (c, total) in sorted(self._by_path.items())]
        for path, counts, total in rows:
            acc, buckets = 0, []
            for bound, n in zip(LATENCY_BUCKETS_S + (float("inf"),), counts):
                acc += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), acc))
            fam.add_metric([path], buckets, total)
        return fam


def _endpoint_families(s):
    """The endpoint's own families: refusals, connections, pending requests, latency, version."""
    e = CounterMetricFamily("linkpass_coordinator_request_errors", "Requests refused or failed", labels=["kind"])
    with s._count_lock:
        errors = dict(s.errors)
    errors["tick"] = s.service.tick_failures  # the service's guarded steps
    errors = sorted(errors.items())
    for k, v in errors:
        e.add_metric([k], v)
    o = GaugeMetricFamily("linkpass_coordinator_connections", "Open client connections")
    o.add_metric([], len(s._conns))
    q = GaugeMetricFamily("linkpass_coordinator_requests_pending",
                          "Requests holding a body, waiting for or in a worker (beyond the limit: 503)")
    q.add_metric([], s.pending)
    ql = GaugeMetricFamily("linkpass_coordinator_requests_pending_limit", "The endpoint's max_pending")
    ql.add_metric([], s.limits.max_pending)
    n = CounterMetricFamily("linkpass_coordinator_requests", "Requests whose head was read")
    n.add_metric([], s.requests)
    b = GaugeMetricFamily("linkpass_build_info", "1, labelled with the running LinkPass's version",
                          labels=["version"])
    b.add_metric([__version__], 1.0)
    yield from (e, o, q, ql, n, s.latency.family(), b)


# a shard's part of localization: (family, name, help, its key in ShardFront.status())
_SHARD_PART_FAMILIES = (
    (GaugeMetricFamily, "linkpass_coordinator_shard_localization_paths",
     "Paths whose evidence this shard's part of localization holds (sent by the root)", "part_paths"),
    (CounterMetricFamily, "linkpass_coordinator_shard_localization_rounds",
     "The root's localization rounds this shard answered", "part_rounds"),
    (CounterMetricFamily, "linkpass_coordinator_shard_localization_seconds",
     "Seconds this shard spent answering them", "part_seconds"),
)


class ShardCollector:
    """A shard's Prometheus view: its agents and what it answered, forwarded, redirected."""

    def __init__(self, server):
        self.server = server

    def collect(self):
        s = self.server
        st = s.service.shard.status()  # under the shard's own lock
        labels = [str(st["shard"])]
        a = GaugeMetricFamily("linkpass_coordinator_shard_agents", "Agents whose verdicts this shard holds",
                              labels=["shard"])
        a.add_metric(labels, st["agents"])
        yield a
        c = CounterMetricFamily("linkpass_coordinator_shard_reports",
                                "Agents' reports and registrations, by what this shard did with them",
                                labels=["shard", "outcome"])
        for outcome in ("answered", "queued", "forwarded", "registrations", "redirected", "queue_full",
                        "refused_by_root", "root_unreachable"):
            c.add_metric(labels + [outcome], st.get(outcome, 0))
        yield c
        q = GaugeMetricFamily("linkpass_coordinator_shard_queue", "Reports this shard answered and holds for the root",
                              labels=["shard"])
        q.add_metric(labels, st["queue"])
        yield q
        ql = GaugeMetricFamily("linkpass_coordinator_shard_queue_limit", "The shard's max_queue (beyond: 503)",
                               labels=["shard"])
        ql.add_metric(labels, st["max_queue"])
        yield ql
        for family, name, doc, key in _SHARD_PART_FAMILIES:
            m = family(name, doc, labels=["shard"])
            m.add_metric(labels, st[key])
            yield m
        yield from _endpoint_families(s)


class CountsCollector:
    """Prometheus view, read at scrape time: counts only, which name no host or link, read without
    the lock (the coordinator keeps them as paths change; a copy of a dict is one step for Python)."""

    def __init__(self, server):
        self.server = server

    def collect(self):
        s = self.server
        c = s.service.coordinator
        agents = list(c.agents.values())
        lost = sum(a.lost for a in agents)
        states = dict(c.state_counts)
        unmapped = c.paths_unmapped
        unknown_changes = c.counters["changes_unknown_path"]
        findings, drains = len(c.findings), len(c.drains)
        digests, tables_asked = c.counters["digests"], c.counters["digest_mismatches"]
        parts = shard_parts(c)
        parts = parts and parts.status()
        g = GaugeMetricFamily("linkpass_coordinator_agents", "Registered agents", labels=["status"])
        g.add_metric(["reporting"], len(agents) - lost)
        g.add_metric(["lost"], lost)
        p = GaugeMetricFamily("linkpass_coordinator_paths", "Paths reported, by state", labels=["state"])
        for st, n in sorted(states.items()):
            p.add_metric([st], n)
        f = GaugeMetricFamily("linkpass_coordinator_localized_faults", "Directed links currently localized as faulty")
        f.add_metric([], findings)
        d = GaugeMetricFamily("linkpass_coordinator_drained_links", "Links drained by operators")
        d.add_metric([], drains)
        r = CounterMetricFamily("linkpass_coordinator_path_reports", "Path verdicts received")
        r.add_metric([], s.service.reports)
        dg = CounterMetricFamily("linkpass_coordinator_digests", "Digests of agents' verdicts received")
        dg.add_metric([], digests)
        ta = CounterMetricFamily("linkpass_coordinator_tables_asked",
                                 "Answers asking an agent for its whole table (its digest differed: a lost report)")
        ta.add_metric([], tables_asked)
        um = GaugeMetricFamily("linkpass_coordinator_paths_unmapped",
                               "Paths whose hops fit no path of the fleet model (a stale model, a miscabled link): "
                               "localization cannot use them")
        um.add_metric([], unmapped)
        uc = CounterMetricFamily("linkpass_coordinator_changes_unknown_path",
                                 "Reported changes naming a path the coordinator does not hold (it asks for the table)")
        uc.add_metric([], unknown_changes)
        yield from (g, p, um, f, d, r, dg, ta, uc)
        yield from _endpoint_families(s)
        if parts is not None:
            si = GaugeMetricFamily("linkpass_coordinator_localization_stood_in",
                                   "Shards whose part of localization the root explains itself (they do not answer)")
            si.add_metric([], len(parts["standing_in"]))
            rs = CounterMetricFamily("linkpass_coordinator_localization_parts_sent_whole",
                                     "Times a shard's part was sent its whole evidence: at the root's start, and "
                                     "again after the shard restarted or stopped answering")
            rs.add_metric([], parts.get("parts_sent_whole", 0))
            yield from (si, rs)


class NamedCollector:
    """The series that name hosts and links (each localized link's confidence, each agent's
    liveness): with a token only, read under the lock."""

    def __init__(self, server):
        self.server = server

    def collect(self):
        s = self.server
        c = s.service.coordinator
        with s.service.lock:
            findings_now = [dict(fd) for fd in c.findings.values()]
            agents_now = sorted((a.name, a.lost) for a in c.agents.values())
        lf = GaugeMetricFamily("linkpass_coordinator_link_fault",
                               "Confidence of each directed link localized as faulty (direction: forward, reverse "
                               "or either)", labels=["link", "direction", "a", "b"])
        for fd in findings_now:
            lf.add_metric([fd["link"], fd["direction"], fd["a"], fd["b"]], fd["confidence"])
        au = GaugeMetricFamily("linkpass_coordinator_agent_up", "1 for each registered agent reporting, 0 when lost",
                               labels=["host"])
        for host, is_lost in agents_now:
            au.add_metric([host], 0.0 if is_lost else 1.0)
        yield from (lf, au)
