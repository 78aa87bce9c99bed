"""Benchmark: how long a real all-reduce stalls when a link fails, with LinkPass and without.

The demo's setup (default testbed, coordinator as a Ray actor, an agent per host probing every
5 ms, a 4-rank torch gloo job with 4 MB all-reduces, bit-checked), but the fault script runs
`--rounds` times with LinkPass, then as many times with LinkPass off (agents and coordinator
stopped, their routes removed: the testbed's own ECMP routes, like a fabric without failover).
Every fault is aimed at the link of its tier carrying the most of the job's traffic.

Rows per fault kind: the job's stall (longest all-reduce beyond the pre-fault median) with the
LinkPass-off run as the peer, time back to 95 % throughput, and for LinkPass the fault → route
time; plus the all-reduce time without faults in both runs (what running LinkPass on the same
two cores costs the job here).

    python bench/demo.py [--quick] [--rounds N] [--faults KINDS] --json FILE
"""
from __future__ import annotations

# what this benchmark measures: a change to any of these after a run makes the figures quoted
# from it stale (tests/unit/test_benchmark_freshness.py lists them)
MEASURES = (
    "linkpass/demo",
    "linkpass/core/detector.py",
    "linkpass/core/failover.py",
    "linkpass/agent/routes.py",
    "rdma/nccl/lp_plugin.c",
    "rdma/nccl/lp_lanes.c",
    "bench/demo.py",
)


import argparse
import os
import sys
import tempfile
from contextlib import ExitStack

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "sim"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from linkpass_sim import report  # noqa: E402
from linkpass_sim.report import row  # noqa: E402
from linkpass.demo import timeline  # noqa: E402
from linkpass.demo.run import Demo  # noqa: E402
from linkpass.demo.script import select  # noqa: E402
from linkpass.console.output import table  # noqa: E402

OFF = "linkpass-off (testbed ECMP routes, no failover)"


def rounds_of(demo: Demo, jobs: dict, rounds: int, linkpass: bool, label: str) -> list[timeline.Fault]:
    done = []
    for r in range(rounds):
        demo.progress(f"{label}: round {r + 1}/{rounds}")
        done += demo.run_script(jobs, linkpass)
    return done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--quick", action="store_true", help="2 rounds")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--faults", metavar="KINDS", help="subset of the demo's fault kinds")
    ap.add_argument("--prefix", default="lpbd")
    ap.add_argument("--rto-min-ms", type=int, default=10)
    ap.add_argument("--no-compare", action="store_true", help="skip the LinkPass-off rounds")
    args = ap.parse_args()
    if not report.require_root():
        return 2
    rounds = 2 if args.quick else args.rounds
    out = tempfile.mkdtemp(prefix="linkpass-bench-demo-")
    dargs = argparse.Namespace(prefix=args.prefix, keep=False, out=out, output="table", faults=args.faults,
                               size_mb=4.0, compute_ms=10.0, job_timeout_s=30.0, interval_ms=5.0, compare=True,
                               rto_min_ms=args.rto_min_ms, job="gloo")
    kinds = [s.kind for s in select(args.faults)]
    with ExitStack() as stack:
        demo = Demo(dargs, stack)
        demo.build()
        demo.start_coordinator()
        demo.start_agents()
        jobs = demo.start_jobs("linkpass", linkpass=True)
        job = jobs["gloo"]
        on_faults = rounds_of(demo, jobs, rounds, True, "LinkPass on")
        job.stop()
        on = timeline.summarise("linkpass", job.steps(), job.wrong_results(), job.restarts, on_faults,
                                demo.agent_events(), demo.coordinator_events(), demo.fab.spec.planes)
        on_steps = job.steps()
        off, off_steps = timeline.RunSummary("off", 0, 0, 0, None, None), []
        if not args.no_compare:
            demo.stop_agents()
            demo.stop_coordinator()
            jobs = demo.start_jobs("off", linkpass=False)
            job = jobs["gloo"]
            off_faults = rounds_of(demo, jobs, rounds, False, "LinkPass off")
            job.stop()
            off = timeline.summarise("off", job.steps(), job.wrong_results(), job.restarts, off_faults, [], [],
                                     demo.fab.spec.planes)
            off_steps = job.steps()

    def per_kind(run: timeline.RunSummary, kind: str, field: str) -> list[float]:
        return [getattr(f, field) for f in run.faults if f.kind == kind and getattr(f, field) is not None]

    def quiet(steps: list[dict], run: timeline.RunSummary) -> list[float]:
        """All-reduce times away from any fault (more than 1 s from one)."""
        return [timeline.allreduce_ms(s) for s in timeline.quiet_steps(steps, run.faults)]

    rows = []
    for kind in kinds:
        peer = None if args.no_compare else OFF
        rows.append(row(kind, "stall", "ms", per_kind(on, kind, "stall_ms"), peer, per_kind(off, kind, "stall_ms")))
        rows.append(row(kind, "back_to_95pct", "s", per_kind(on, kind, "recovered_s"), peer,
                        per_kind(off, kind, "recovered_s")))
        rows.append(row(kind, "fault_to_reroute", "ms", per_kind(on, kind, "reroute_ms")))
        rows.append(row(kind, "fault_to_localized", "ms", per_kind(on, kind, "localized_ms")))
        mine = [f for f in on.faults if f.kind == kind]
        rows.append({"case": kind, "metric": "targets_missed", "unit": "count", "n": len(mine),
                     "median": sum(1 for f in mine if not f.met), "p99": None,
                     # which measure missed: the stall, or the time back to 95 % (or never back)
                     "stall_over": sum(1 for f in mine if not timeline.stall_within_target(f)),
                     "recovery_over": sum(1 for f in mine if not timeline.recovered_within_target(f))})
    q_on, q_off = quiet(on_steps, on), quiet(off_steps, off)
    # what the STALL measure reads over fault-free windows as long as a fault's: the noise floor
    peer = None if args.no_compare else OFF
    rows.append(row("no-fault", "stall_in_2.5s_window", "ms", timeline.noise_stalls(on_steps, on.faults), peer,
                    timeline.noise_stalls(off_steps, off.faults)))
    # ratio < 1 here: the job is slower with LinkPass, whose agents and coordinator share its 2 cores
    rows.append({**row("no-fault", "allreduce", "ms", q_on, peer, q_off),
                 "note": "away from faults; LinkPass's agents, coordinator and Ray share the job's 2 cores here"})
    doc = report.document("demo", rows, rounds=rounds, wrong_results={"on": on.wrong_results, "off": off.wrong_results},
                          restarts={"on": on.restarts, "off": off.restarts},
                          setup={"ranks": 4, "size_mb": 4.0, "compute_ms": 10.0, "agent_interval_ms": 5.0})
    report.write(doc, args.json)
    print(table(["CASE", "METRIC", "N", "MEDIAN", "P99", "OFF MEDIAN", "OFF P99", "RATIO"],
                [[r["case"], f"{r['metric']} ({r['unit']})", r["n"], r["median"], r["p99"], r.get("peer_median", ""),
                  r.get("peer_p99", ""), r.get("ratio", "")] for r in rows]))
    print(f"wrong results: {on.wrong_results} with, {off.wrong_results} without; "
          f"restarts: {on.restarts} with, {off.restarts} without")
    return 0


if __name__ == "__main__":
    sys.exit(main())
