#!/usr/bin/env python3
"""Clock sync on the testbed: estimated offsets and drifts against the ground truth.

    python sim/bench/clock.py [--quick] [--seconds S] [--json FILE]

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

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from linkpass_sim import report  # noqa: E402
from linkpass.core.clock import Exchange, MeshCorrector, PairEstimator, PurePairFilter, SyntheticClock  # noqa: E402
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


def run_case(fab, args, seconds: float, case: str, loaded: bool) -> tuple[list[dict], dict]:
    H = fab.spec.hosts
    start = time.time_ns()
    clocks = {i: SyntheticClock.random(args.seed * 100 + i, wander_ppm_per_sqrt_s=0.01, start_ns=start - 10**9)
              for i in range(H)}
    estimators = {(a, b): PairEstimator() for a in range(H) for b in range(H) if a != b}
    filters = {k: PurePairFilter(tolerance_ns=int(args.pair_tolerance_us * 1000)) for k in estimators}
    pending: dict[tuple[int, int], Exchange] = {}
    sync_paths = [(a, b, 0, 49152 + a * H + b) for a in range(H) for b in range(H) if a != b]

    def on_exchange(host: int, rec) -> None:
        pair = (host, rec.peer_id - 1)
        ex = Exchange(rec.t1, rec.t2, rec.t3, rec.t4)
        if rec.seq % 2 == 0:
            pending[pair] = (rec.seq, ex)
            return
        first = pending.pop(pair, None)
        if first is None or first[0] != rec.seq - 1:
            return  # the pair's other half was lost
        for pure in filters[pair].accept(first[1], ex):
            estimators[pair].add(pure)

    mesh = Mesh.start(fab, sync_paths, KEY, interval_s=0.01, pair_gap_s=PAIR_GAP_S,
                      clocks={i: c.segment for i, c in clocks.items()}, on_exchange=on_exchange)
    stop = threading.Event()
    loader = threading.Thread(target=background_load, args=(fab, stop), daemon=True)
    if loaded:
        into_h3 = fab.uplink(host_name(3), 0)  # congested where its leaf sends to h3
        faults.apply(fab.prefix, faults.FaultSpec("congest", into_h3.name, into_h3.b,
                                                  {"rate": "200mbit", "queue": "2ms"}))
        loader.start()
    errors, ntp_errors, mesh_errors, drift_errors, early_drift_errors = [], [], [], [], []
    converged_at: dict[tuple[int, int], float] = {}
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < seconds:
            mesh.run(0.1)
            elapsed = time.monotonic() - t0
            now = time.time_ns()
            corrector = MeshCorrector(reference=0)
            for (a, b), est in estimators.items():
                if est.converged:
                    corrector.add(a, b, est.offset_at(clocks[a].read(now)), est.drift_ppm)
            solution = corrector.solve() if all(e.converged for e in estimators.values()) else None
            for (a, b), est in estimators.items():
                if not est.converged:
                    continue
                ts = clocks[a].read(now)
                truth = clocks[b].read(now) - ts
                err = abs(est.offset_at(ts) - truth)
                if (a, b) not in converged_at and err <= CONVERGED_NS:
                    converged_at[(a, b)] = elapsed
                errors.append(err / 1e3)  # every sample once the estimator calls itself converged
                ntp_errors.append(abs(est.ntp_offset_at(ts) - truth) / 1e3)
                da, db = clocks[a].drift_ppm_at(now), clocks[b].drift_ppm_at(now)
                true_drift = ((1 + db * 1e-6) / (1 + da * 1e-6) - 1) * 1e6  # b's rate seen from a's clock
                (drift_errors if est.window_count >= est.history_windows else early_drift_errors).append(
                    abs(est.drift_ppm - true_drift))
                if solution is not None:
                    mesh_errors.append(abs(solution.offset(a, b) - truth) / 1e3)
            if int(elapsed) != int(elapsed - 0.1):  # progress once a second
                print(f"{elapsed:5.1f}/{seconds:.0f} s: {len(converged_at)}/{len(estimators)} pairs within 2 us, "
                      f"{len(errors)} error samples", file=sys.stderr, flush=True)
    finally:
        stop.set()
        if loaded:
            loader.join()
            faults.clear(fab.prefix)
        mesh.close()

    if not errors:
        print(f"{case}: no pair converged", file=sys.stderr)
        return [], {"pairs": len(estimators), "converged": 0}
    rejected = sum(f.rejected for f in filters.values())
    em, pm = statistics.median(errors), statistics.median(ntp_errors)
    e99, p99_ = report.tail(errors, 0.99), report.tail(ntp_errors, 0.99)
    m99 = report.tail(mesh_errors, 0.99)
    rows = [
        # what LinkPass reports: pairwise estimates made loop-consistent across the mesh
        {"case": case, "metric": "offset_error", "unit": "us", "n": len(mesh_errors),
         "median": round(statistics.median(mesh_errors), 3) if mesh_errors else None, "p99": m99,
         "peer": "ntp-midpoint", "peer_median": round(pm, 3), "peer_p99": p99_,
         "ratio": round(p99_ / m99, 1) if m99 and p99_ else None},
        {"case": f"{case}-pairwise", "metric": "offset_error", "unit": "us", "n": len(errors), "median": round(em, 3),
         "p99": e99, "peer": "ntp-midpoint", "peer_median": round(pm, 3), "peer_p99": p99_,
         "ratio": round(p99_ / e99, 1) if e99 and p99_ else None},
        {"case": case, "metric": "drift_error", "unit": "ppm", "n": len(drift_errors),
         "median": round(statistics.median(drift_errors), 4) if drift_errors else None,
         "p99": report.tail(drift_errors, 0.99)},
        {"case": f"{case}-before-full-history", "metric": "drift_error", "unit": "ppm", "n": len(early_drift_errors),
         "median": round(statistics.median(early_drift_errors), 4) if early_drift_errors else None,
         "p99": report.tail(early_drift_errors, 0.99)},
        {"case": case, "metric": "converge", "unit": "s", "n": len(converged_at),
         "median": round(statistics.median(converged_at.values()), 2) if converged_at else None,
         "p99": report.tail(list(converged_at.values()), 0.99),
         "max": round(max(converged_at.values()), 2) if converged_at else None},
    ]
    for r in rows:
        for k in ("p99", "peer_p99"):
            if isinstance(r.get(k), float):
                r[k] = round(r[k], 4)
    notes = {"pairs": len(estimators), "pairs_within_2us": len(converged_at), "pure_pair_rejections": rejected,
             "seconds": seconds, "background_load": loaded,
             "clock_offsets_ms": {host_name(i): round(c.offset_at(start) / 1e6, 3) for i, c in clocks.items()},
             "clock_drifts_ppm": {host_name(i): round(c.drift_ppm_at(start), 2) for i, c in clocks.items()}}
    return rows, notes


if __name__ == "__main__":
    sys.exit(main())
