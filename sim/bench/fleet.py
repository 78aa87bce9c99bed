#!/usr/bin/env python3
"""Fleet simulator: a 16 384-GPU fabric's failures against LinkPass's real decision code.

    python sim/bench/fleet.py [--quick] [--seeds N] [--json FILE]

No root, no testbed: everything runs in the simulator (sim/linkpass_sim/fleet.py), which drives
the agent's Failover/Detector/decide code and the coordinator's Localizer on virtual time.

Rows:
  gpus-16384-day            wall (s): one simulated day, 1 kHz probing, scenario clockwork (every
                            NIC-to-leaf link at a 5-year MTTF: the heaviest published rates), set-up
                            included; target <= 60 s. gpus-16384-day-stress: the same with the
                            assumed flap and gray-loss rates on top (not a target).
  gpus-16384-30d-with       goodput (pct) over 30 days, scenario llama3 (Llama 3's interruption
                            mix), one run per seed; peer: the same failures without LinkPass
                            (checkpoint-restart). gpus-16384-30d-without: that peer as its own row.
  gpus-16384-30d-clockwork-with / -without: the same under the clockwork scenario.
  detect-calibration        error (pct): per testbed case, |sim median - testbed median| / testbed
                            median (n = cases; every case must be <= 20 %).
  detect-<kind>, stall-<kind>, localize-<kind> (ms) over every simulated failure of the runs above;
  probe-overhead            packets/s per NIC and share of a 400 Gb/s link.
"""
from __future__ import annotations

# what this benchmark measures: a change to any of these after a run makes the figures quoted
# from it stale (tests/unit/test_benchmark_freshness.py lists them)
MEASURES = (
    "sim/linkpass_sim",
    "linkpass/core/detector.py",
    "linkpass/core/failover.py",
    "linkpass/core/decide.py",
    "sim/bench/fleet.py",
)


import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from linkpass_sim import calibration, fleet  # noqa: E402
from linkpass_sim import report  # noqa: E402
from linkpass_sim.failures import Shape  # noqa: E402
from linkpass_sim.report import progress, row  # noqa: E402

GPUS = 16_384
DAY_TARGET_S = 60.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed, 3-day goodput runs (smoke test)")
    ap.add_argument("--seeds", type=int, default=None, help="runs per row (default 5)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    seeds = args.seeds or (1 if args.quick else 5)
    long_days = 3 if args.quick else 30
    rows: list[dict] = []
    outcomes = []

    # -- one day, timed from nothing (the fabric, plan and localizer are built inside)
    day_walls = []
    for seed in range(1, seeds + 1):
        t = time.perf_counter()
        r = fleet.run(GPUS, 1.0, "clockwork", seed)
        day_walls.append(time.perf_counter() - t)
        outcomes += r.outcomes
        progress(f"day {seed}/{seeds} (clockwork): {day_walls[-1]:.1f} s, {len(r.outcomes)} network failures")
    rows.append(row(f"gpus-{GPUS}-day", "wall", "s", [round(w, 2) for w in day_walls], scenario="clockwork",
                    target_s=DAY_TARGET_S, met=max(day_walls) <= DAY_TARGET_S, probe_interval_ms=1.0))
    t = time.perf_counter()
    r = fleet.run(GPUS, 1.0, "stress", 1)
    stress_wall = time.perf_counter() - t
    outcomes += r.outcomes
    progress(f"day (stress): {stress_wall:.1f} s, {len(r.outcomes)} network failures")
    rows.append(row(f"gpus-{GPUS}-day-stress", "wall", "s", [round(stress_wall, 2)], scenario="stress",
                    failures=r.failures, note="assumed flap and gray-loss rates on top of clockwork; not a target"))

    # -- goodput over 30 days, the fabric built once
    fleet_16k = fleet.Fleet(Shape.for_gpus(GPUS))
    for scenario, case in (("llama3", f"gpus-{GPUS}-{long_days}d"), ("clockwork", f"gpus-{GPUS}-{long_days}d-clockwork")):
        with_, without, restarts_with, restarts_without = [], [], [], []
        for seed in range(1, seeds + 1):
            r = fleet.run(GPUS, long_days, scenario, seed, fleet=fleet_16k)
            outcomes += r.outcomes
            with_.append(round(100 * r.with_linkpass.goodput, 3))
            without.append(round(100 * r.without.goodput, 3))
            restarts_with.append(r.with_linkpass.restarts)
            restarts_without.append(r.without.restarts)
            progress(f"{scenario} {long_days} d seed {seed}: goodput {with_[-1]} % with, {without[-1]} % without "
                     f"({r.wall_s:.0f} s)")
        extra = dict(scenario=scenario, days=long_days, gpus=GPUS, job=vars(r.params),
                     restarts_median=statistics.median(restarts_with))
        rows.append(row(f"{case}-with", "goodput", "pct", with_, "checkpoint-restart", without, better="higher",
                        q=0.01, **extra))
        rows.append(row(f"{case}-without", "goodput", "pct", without, q=0.01, scenario=scenario, days=long_days,
                        restarts_median=statistics.median(restarts_without)))

    # -- calibration against the testbed's measured detection times
    cal = calibration.calibrate(trials=40 if args.quick else 200, progress=progress)
    errors = [c["error_pct"] for c in cal if c["error_pct"] is not None]
    rows.append(row("detect-calibration", "error", "pct", errors, cases=cal, tolerance_pct=calibration.TOLERANCE_PCT,
                    max_error_pct=max(errors) if errors else None,
                    met=bool(errors) and max(errors) <= calibration.TOLERANCE_PCT and len(errors) == len(cal),
                    reference=os.path.relpath(calibration.TESTBED_JSON)))

    # -- distributions over every simulated failure
    for kind in sorted({o.kind for o in outcomes}):
        os_ = [o for o in outcomes if o.kind == kind]
        rows.append(row(f"detect-{kind}", "detect", "ms", [round(d, 3) for o in os_ for d in o.detect_ms],
                        failures=len(os_)))
        rows.append(row(f"stall-{kind}", "stall", "ms", [round(o.stall_ms, 2) for o in os_], failures=len(os_),
                        unrecovered=sum(o.unrecovered for o in os_)))
        loc = [round(o.localized_ms, 1) for o in os_ if o.localized_ms is not None]
        rows.append(row(f"localize-{kind}", "localize", "ms", loc, failures=len(os_),
                        localized_pct=round(100 * len(loc) / len(os_), 1),
                        false_findings=sum(o.false_findings for o in os_)))
    p = fleet.probe_overhead(fleet_16k)
    rows.append(row("probe-overhead", "tx_packets", "per_s", [p["tx_pps_per_nic_median"]], **p))

    print(f"\n{'case':34} {'metric':10} {'n':>5} {'median':>10} {'p99':>10} {'peer median':>12} {'ratio':>6}")
    for x in rows:
        print(f"{x['case']:34} {x['metric']:10} {x['n']:>5} {str(x['median']):>10} {str(x['p99']):>10} "
              f"{str(x.get('peer_median')):>12} {str(x.get('ratio')):>6}")
    report.write(report.document("fleet", rows, gpus=GPUS, probe_interval_ms=1.0), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
