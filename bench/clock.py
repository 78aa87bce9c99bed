#!/usr/bin/env python3
"""Clock sync on the testbed: estimated offsets and drifts against the ground truth.

    python bench/clock.py [--quick] [--seconds S] [--json FILE]

All testbed hosts share one kernel clock, so each agent gets a synthetic clock (offset up to
±50 ms, drift up to ±100 ppm, a slow random walk) that the C core applies to every timestamp it
takes (kernel RX stamps included). Every host sends coded probe pairs to every other host over
plane 0 (one pair per 10 ms per peer); pure pairs feed a Huygens-style estimator per ordered
pair, and the mesh corrector makes all pairs loop-consistent. Every 100 ms each pair's estimate
is compared with the truth; the NTP-style midpoint estimate of the same exchanges is the peer.

Rows: case `testbed-default`, metrics `offset_error` (us, the mesh-corrected estimate LinkPass
reports; peer `ntp-midpoint`; `-pairwise` rows give the raw pairwise estimate), `drift_error`
(ppm, once the estimator has its full window history — 8 s; the figure before that is its own
row), `converge` (s: from the first probe until the pair's estimate is within 2 us of the
truth; pairs that never get there are counted in `notes`). Errors are sampled for every pair
from the moment its estimator reports itself converged. Targets: offset error p99 <= 2 us and >= 10x better than the midpoint;
drift error <= 0.1 ppm.
"""
from __future__ import annotations

# what this benchmark measures: a change to any of these after a run makes the figures quoted
# from it stale (tests/unit/test_benchmark_freshness.py lists them)
MEASURES = (
    "linkpass/core/clock.py",
    "bench/clock.py",
)


import argparse
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sim"))

from linkpass_sim import report  # noqa: E402
from linkpass.core.clock import Exchange, MeshCorrector, PairEstimator, PurePairFilter, SyntheticClock  # noqa: E402
from linkpass.core.constants import PROBE_PORT_BASE  # noqa: E402
from linkpass.core.names import host_name  # noqa: E402
from linkpass.testbed import build, faults, topology, traffic  # noqa: E402
from linkpass.testbed.mesh import Mesh  # noqa: E402

KEY = bytes(range(32))
CONVERGED_NS = 2_000
PAIR_GAP_S = 0.00005  # 50 µs: longer than one probe's forwarding work through the software fabric


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--prefix", default="bclock")
    ap.add_argument("--pair-tolerance-us", type=float, default=50.0,
                    help="pure-pair tolerance; the software fabric spreads pairs by tens of us (see docs)")
    args = ap.parse_args()
    if not report.require_root():
        return 3
    seconds = 10.0 if args.quick else args.seconds
    build.clean(args.prefix)
    fab = build.up(topology.preset("default"), args.prefix)
    rows, notes = [], {}
    try:
        for case, loaded in (("testbed-default", False), ("testbed-default-loaded", True)):
            print(f"case {case}: {seconds:.0f} s", file=sys.stderr, flush=True)
            case_rows, case_notes = run_case(fab, args, seconds, case, loaded)
            rows += case_rows
            notes[case] = case_notes
    finally:
        build.down(args.prefix)
    doc = report.document("clock", rows, notes=notes)
    print(f"{'case':32} {'metric':13} {'n':>5} {'median':>9} {'p99':>9} {'peer median':>12} {'peer p99':>9} {'ratio':>6}")
    for r in rows:
        cell = lambda k: r.get(k) if r.get(k) is not None else "-"  # noqa: E731
        print(f"{r['case']:32} {r['metric']:13} {r['n']:5} {cell('median'):>9} {cell('p99'):>9} "
              f"{r.get('peer_median', ''):>12} {r.get('peer_p99', '') or '':>9} {r.get('ratio') or '':>6}  {r['unit']}")
    report.write(doc, args.json)
    return 0


def background_load(fab, stop: threading.Event) -> None:
    """On/off bursts towards h3 on plane 0 (100 ms at ~1 Gbit/s into a 200 Mbit/s link, 100 ms
    off): queues build in one direction only, half of the time."""
    while not stop.is_set():
        traffic.send_flow(fab, 1, 3, plane=0, sport=41000, dport=9, count=1500, size=1200, settle_s=0.0)
        stop.wait(0.1)


class Pairs:
    """Every ordered host pair's pure-pair filter and estimator, and each host's synthetic clock
    (the truth). `on_exchange` takes the mesh's probe exchanges, pairs them up and feeds the
    pure ones to the pair's estimator."""

    def __init__(self, hosts: int, seed: int, tolerance_ns: int, start_ns: int):
        self.clocks = {i: SyntheticClock.random(seed * 100 + i, wander_ppm_per_sqrt_s=0.01, start_ns=start_ns - 10**9)
                       for i in range(hosts)}
        self.estimators = {(a, b): PairEstimator() for a in range(hosts) for b in range(hosts) if a != b}
        self.filters = {k: PurePairFilter(tolerance_ns=tolerance_ns) for k in self.estimators}
        self.pending: dict[tuple[int, int], tuple[int, Exchange]] = {}  # a pair's first half, by its seq

    def on_exchange(self, host: int, rec) -> None:
        pair = (host, rec.peer_id - 1)
        ex = Exchange(rec.t1, rec.t2, rec.t3, rec.t4)
        if rec.seq % 2 == 0:
            self.pending[pair] = (rec.seq, ex)
            return
        first = self.pending.pop(pair, None)
        if first is None or first[0] != rec.seq - 1:
            return  # the pair's other half was lost
        for pure in self.filters[pair].accept(first[1], ex):
            self.estimators[pair].add(pure)


@dataclass
class Samples:
    """Errors against the truth, one per converged pair and sampling round."""
    errors: list[float] = field(default_factory=list)  # pairwise offset, us
    ntp_errors: list[float] = field(default_factory=list)  # midpoint offset of the same exchanges, us
    mesh_errors: list[float] = field(default_factory=list)  # mesh-corrected offset, us
    drift_errors: list[float] = field(default_factory=list)  # ppm, with the full window history
    early_drift_errors: list[float] = field(default_factory=list)  # ppm, before it
    converged_at: dict[tuple[int, int], float] = field(default_factory=dict)  # pair -> s to within 2 us


def run_case(fab, args, seconds: float, case: str, loaded: bool) -> tuple[list[dict], dict]:
    start = time.time_ns()
    H = fab.spec.hosts
    pairs = Pairs(H, args.seed, int(args.pair_tolerance_us * 1000), start)
    sync_paths = [(a, b, 0, PROBE_PORT_BASE + a * H + b) for a in range(H) for b in range(H) if a != b]
    mesh = Mesh.start(fab, sync_paths, KEY, interval_s=0.01, pair_gap_s=PAIR_GAP_S,
                      clocks={i: c.segment for i, c in pairs.clocks.items()}, on_exchange=pairs.on_exchange)
    stop = threading.Event()
    loader = threading.Thread(target=background_load, args=(fab, stop), daemon=True)
    if loaded:
        into_h3 = fab.uplink(host_name(3), 0)  # congested where its leaf sends to h3
        faults.apply(fab.prefix, faults.FaultSpec("congest", into_h3.name, into_h3.b,
                                                  {"rate": "200mbit", "queue": "2ms"}))
        loader.start()
    try:
        samples = measure(mesh, pairs, seconds)
    finally:
        stop.set()
        if loaded:
            loader.join()
            faults.clear(fab.prefix)
        mesh.close()
    if not samples.errors:
        print(f"{case}: no pair converged", file=sys.stderr)
        return [], {"pairs": len(pairs.estimators), "converged": 0}
    notes = {"pairs": len(pairs.estimators), "pairs_within_2us": len(samples.converged_at),
             "pure_pair_rejections": sum(f.rejected for f in pairs.filters.values()),
             "seconds": seconds, "background_load": loaded,
             "clock_offsets_ms": {host_name(i): round(c.offset_at(start) / 1e6, 3) for i, c in pairs.clocks.items()},
             "clock_drifts_ppm": {host_name(i): round(c.drift_ppm_at(start), 2) for i, c in pairs.clocks.items()}}
    return case_rows(case, samples), notes


def measure(mesh, pairs: Pairs, seconds: float) -> Samples:
    """Run the mesh for `seconds`, comparing every estimate with the truth each 100 ms."""
    samples = Samples()
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        mesh.run(0.1)
        elapsed = time.monotonic() - t0
        sample(pairs, samples, elapsed, time.time_ns())
        if int(elapsed) != int(elapsed - 0.1):  # progress once a second
            print(f"{elapsed:5.1f}/{seconds:.0f} s: {len(samples.converged_at)}/{len(pairs.estimators)} pairs "
                  f"within 2 us, {len(samples.errors)} error samples", file=sys.stderr, flush=True)
    return samples


def sample(pairs: Pairs, samples: Samples, elapsed: float, now: int) -> None:
    """One round: each converged pair's pairwise, midpoint and drift error; the mesh-corrected
    error once every pair has converged."""
    corrector = MeshCorrector(reference=0)
    for (a, b), est in pairs.estimators.items():
        if est.converged:
            corrector.add(a, b, est.offset_at(pairs.clocks[a].read(now)), est.drift_ppm)
    solution = corrector.solve() if all(e.converged for e in pairs.estimators.values()) else None
    for (a, b), est in pairs.estimators.items():
        if not est.converged:
            continue
        ts = pairs.clocks[a].read(now)
        truth = pairs.clocks[b].read(now) - ts
        err = abs(est.offset_at(ts) - truth)
        if (a, b) not in samples.converged_at and err <= CONVERGED_NS:
            samples.converged_at[(a, b)] = elapsed
        samples.errors.append(err / 1e3)  # every sample once the estimator calls itself converged
        samples.ntp_errors.append(abs(est.ntp_offset_at(ts) - truth) / 1e3)
        da, db = pairs.clocks[a].drift_ppm_at(now), pairs.clocks[b].drift_ppm_at(now)
        true_drift = ((1 + db * 1e-6) / (1 + da * 1e-6) - 1) * 1e6  # b's rate seen from a's clock
        (samples.drift_errors if est.window_count >= est.history_windows else samples.early_drift_errors).append(
            abs(est.drift_ppm - true_drift))
        if solution is not None:
            samples.mesh_errors.append(abs(solution.offset(a, b) - truth) / 1e3)


def case_rows(case: str, s: Samples) -> list[dict]:
    em, pm = statistics.median(s.errors), statistics.median(s.ntp_errors)
    e99, p99_ = report.tail(s.errors, 0.99), report.tail(s.ntp_errors, 0.99)
    m99 = report.tail(s.mesh_errors, 0.99)
    converge = list(s.converged_at.values())
    rows = [
        # what LinkPass reports: pairwise estimates made loop-consistent across the mesh
        {"case": case, "metric": "offset_error", "unit": "us", "n": len(s.mesh_errors),
         "median": round(statistics.median(s.mesh_errors), 3) if s.mesh_errors else None, "p99": m99,
         "peer": "ntp-midpoint", "peer_median": round(pm, 3), "peer_p99": p99_,
         "ratio": round(p99_ / m99, 1) if m99 and p99_ else None},
        {"case": f"{case}-pairwise", "metric": "offset_error", "unit": "us", "n": len(s.errors), "median": round(em, 3),
         "p99": e99, "peer": "ntp-midpoint", "peer_median": round(pm, 3), "peer_p99": p99_,
         "ratio": round(p99_ / e99, 1) if e99 and p99_ else None},
        {"case": case, "metric": "drift_error", "unit": "ppm", "n": len(s.drift_errors),
         "median": round(statistics.median(s.drift_errors), 4) if s.drift_errors else None,
         "p99": report.tail(s.drift_errors, 0.99)},
        {"case": f"{case}-before-full-history", "metric": "drift_error", "unit": "ppm", "n": len(s.early_drift_errors),
         "median": round(statistics.median(s.early_drift_errors), 4) if s.early_drift_errors else None,
         "p99": report.tail(s.early_drift_errors, 0.99)},
        {"case": case, "metric": "converge", "unit": "s", "n": len(converge),
         "median": round(statistics.median(converge), 2) if converge else None,
         "p99": report.tail(converge, 0.99),
         "max": round(max(converge), 2) if converge else None},
    ]
    for r in rows:
        for k in ("p99", "peer_p99"):
            if isinstance(r.get(k), float):
                r[k] = round(r[k], 4)
    return rows


if __name__ == "__main__":
    sys.exit(main())
