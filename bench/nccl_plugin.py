"""Benchmark: the NCCL net plugin's ring all-reduce, against one TCP connection per peer and raw TCP.

On the default testbed (4 hosts × 2 planes), a 4-rank ring all-reduce (rdma/nccl/allreduce.c)
that uses only the plugin API, every byte checked, one rank per host:

- `busbw-1M|16M|256M`: bus bandwidth (nccl-tests' busbw = algbw × 2(N-1)/N) of each iteration,
  on one channel (device 0, plane 0), over libnccl-net-linkpass.so; the peer is the same ring over
  libnccl-net-single-tcp.so (one TCP connection per peer, as NCCL's Socket transport), measured
  in the same run; extras: raw TCP (one stream per neighbour on plane 0, each rank sending while
  it receives: the ring's traffic without any plugin) and the plugin's ratio to it (target ≥ 0.9).
  p99 is the busbw of the p99-slowest iteration.
- `<fault>-with-agent`: the demo's six faults (each aimed at the link carrying the most of the
  ring's bytes) under the ring on both planes, with an agent per host writing the entropy table
  the plugin reads; `<fault>-plugin-only`: the same with no agent (the plugin's own stuck-lane
  detection). Metric `stall` (longest all-reduce step while the fault was on, beyond the pre-fault
  median; ms), peer: the single-TCP ring under the same faults; and `errors` (errors the plugin
  returned, each of which would end an NCCL communicator: the job's restarts). Targets with
  agents: ≤ 20 ms hard, ≤ 200 ms gray.

    python bench/nccl_plugin.py [--quick] [--rounds N] [--faults KINDS] [--json FILE]
"""
from __future__ import annotations

# what this benchmark measures: a change to any of these after a run makes the figures quoted
# from it stale (tests/unit/test_benchmark_freshness.py lists them)
MEASURES = (
    "rdma/nccl/lp_plugin.c",
    "rdma/nccl/lp_lanes.c",
    "rdma/nccl/lp_policy.c",
    "rdma/nccl/lp_netload.c",
    "rdma/nccl/lp_shims.c",
    "rdma/nccl/allreduce.c",
    "bench/nccl_plugin.py",
)


import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "sim"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "rdma"))

from linkpass_sim import report  # noqa: E402
from linkpass_sim.report import row  # noqa: E402
from linkpass.console.output import table  # noqa: E402
from linkpass.core.names import host_name  # noqa: E402
from linkpass.demo import timeline  # noqa: E402
from linkpass.demo.run import BASELINE, HOSTS, PLUGIN, Demo  # noqa: E402
from linkpass.demo.script import select  # noqa: E402
from linkpass_rdma import nccl  # noqa: E402

SIZES = {"1M": 1 << 20, "16M": 16 << 20, "256M": 256 << 20}
TARGET_STALL_MS = {"hard": 20.0, "gray": 200.0}


def _run_ranks(fab, work: str, argv_of, env_of, timeout_s: float) -> list[subprocess.CompletedProcess]:
    """One process per host in its namespace; waits for all; their outputs."""
    procs = []
    for r, h in enumerate(HOSTS):
        procs.append(subprocess.Popen(["ip", "netns", "exec", fab.netns(host_name(h)), *argv_of(r, h)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_of(h)))
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            o, e = p.communicate()
        out.append(subprocess.CompletedProcess(p.args, p.returncode, o, e))
    return out


def ring_iterations(fab, work: str, plugin: str, size: int, iters: int) -> list[float]:
    """Per-iteration seconds of the ring on one channel (device 0) over `plugin`."""
    d = tempfile.mkdtemp(dir=work)
    trace = os.path.join(d, "trace")
    exe = nccl.allreduce()

    def argv(r, h):
        return [exe, "--plugin", plugin, "--rank", str(r), "--nranks", str(len(HOSTS)), "--dir", d,
                "--sizes", str(size), "--iters", str(iters), "--warmup", "2", "--channels", "1"] + \
               (["--trace", trace] if r == 0 else [])

    def env(h):
        return {**os.environ, "LINKPASS_NICS": ",".join(fab.nic_addr(h, p) for p in range(fab.spec.planes)),
                "LINKPASS_ENTROPY_TABLE": "/nonexistent/linkpass-entropy"}
    res = _run_ranks(fab, work, argv, env, 600)
    bad = [r for r in res if r.returncode != 0]
    if bad:
        raise RuntimeError(f"ring over {os.path.basename(plugin)} failed: exit {bad[0].returncode}: {bad[0].stderr[-800:]}")
    recs = [json.loads(line) for line in open(trace)]
    return [(x["end_ns"] - x["start_ns"]) / 1e9 for x in recs[2:]]  # the timed ones, after the warm-up


def raw_gbps(fab, work: str, size: int, iters: int) -> float:
    d = tempfile.mkdtemp(dir=work)
    exe = nccl.allreduce()

    def argv(r, h):
        return [exe, "--raw-tcp", fab.nic_addr(h, 0), "--rank", str(r), "--nranks", str(len(HOSTS)), "--dir", d,
                "--sizes", str(size), "--iters", str(iters)]
    res = _run_ranks(fab, work, argv, lambda h: None, 600)
    if res[0].returncode != 0:
        raise RuntimeError(f"raw TCP ring failed: {res[0].stderr[-500:]}")
    line = [ln for ln in res[0].stdout.splitlines() if ln.strip() and not ln.startswith("#")][-1]
    return float(line.split()[2])


def busbw(size: int, seconds: float) -> float:
    n = len(HOSTS)
    return size / seconds / 1e9 * 2 * (n - 1) / n


def busbw_rows(demo: Demo, work: str, quick: bool) -> list[dict]:
    rows = []
    for name, size in SIZES.items():
        iters = {"1M": 50, "16M": 20, "256M": 5}[name] // (5 if quick else 1) or 1
        if quick and name == "256M":
            continue
        demo.progress(f"busbw {name}: {iters} iterations each over the plugin, single TCP and raw TCP")
        mine = ring_iterations(demo.fab, work, nccl.plugin(), size, iters)
        peer = ring_iterations(demo.fab, work, nccl.baseline(), size, iters)
        raw = raw_gbps(demo.fab, work, size, iters)
        bw, pbw = [busbw(size, t) for t in mine], [busbw(size, t) for t in peer]
        med = statistics.median(bw)
        rows.append(row(f"busbw-{name}", "busbw", "GB/s", bw, "single-tcp", pbw, better="higher", q=0.01,
                        raw_tcp=round(raw, 4), ratio_vs_raw=round(med / raw, 3) if raw else None, channels=1,
                        note="p99: the busbw of the p99-slowest iteration (the 1st percentile); raw_tcp: "
                             "one stream per neighbour on plane 0, GB/s each way"))
    return rows


def fault_runs(demo: Demo, kinds_run: tuple[str, ...], rounds: int, linkpass: bool, label: str):
    jobs = demo.start_jobs(label, linkpass, kinds=kinds_run)
    faults = []
    for r in range(rounds):
        demo.progress(f"{label}: round {r + 1}/{rounds}")
        faults += demo.run_script(jobs, linkpass)
    out = demo.finish_run(label, jobs, faults, linkpass)
    return {k: (out[k], jobs[k]) for k in kinds_run}


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 1) if xs else None


def per_kind(run: timeline.RunSummary, kind: str) -> list[float]:
    return [f.stall_ms for f in run.faults if f.kind == kind and f.stall_ms is not None]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--quick", action="store_true", help="1 round, small sizes only")
    ap.add_argument("--rounds", type=int, default=5, help="fault script rounds per mode (default 5)")
    ap.add_argument("--faults", metavar="KINDS", help="subset of the demo's fault kinds")
    ap.add_argument("--prefix", default="lpbn")
    ap.add_argument("--no-faults", action="store_true", help="only the busbw rows")
    args = ap.parse_args()
    if not report.require_root():
        return 2
    rounds = 1 if args.quick else args.rounds
    work = tempfile.mkdtemp(prefix="linkpass-bench-nccl-")
    dargs = argparse.Namespace(prefix=args.prefix, keep=False, out=work, output="table", faults=args.faults,
                               size_mb=4.0, compute_ms=10.0, job_timeout_s=30.0, interval_ms=5.0, compare=True,
                               rto_min_ms=10, job="nccl-plugin")
    kinds = [s.kind for s in select(args.faults)]
    severity = {s.kind: s.severity for s in select(args.faults)}
    rows: list[dict] = []
    t0 = time.monotonic()
    with ExitStack() as stack:
        demo = Demo(dargs, stack)
        demo.build()
        rows += busbw_rows(demo, work, args.quick)
        if not args.no_faults:
            demo.start_coordinator()
            demo.start_agents()
            with_agent = fault_runs(demo, (PLUGIN,), rounds, True, "with agents")[PLUGIN]
            # the baseline does not read the table and its plane addresses' routes are not LinkPass's:
            # the agents running beside it change nothing for it
            single = fault_runs(demo, (BASELINE,), rounds, True, "single TCP")[BASELINE]
            demo.stop_agents()
            demo.stop_coordinator()
            alone = fault_runs(demo, (PLUGIN,), rounds, False, "plugin only")[PLUGIN]
            for kind in kinds:
                target = TARGET_STALL_MS[severity[kind]]
                for mode, (run, job) in (("with-agent", with_agent), ("plugin-only", alone)):
                    stalls = per_kind(run, kind)
                    agent = {}
                    if mode == "with-agent":  # when the agents' verdict came, against which the plugin's own bound races
                        agent = {f"agent_{k}_median": _median([getattr(f, k) for f in run.faults if f.kind == kind])
                                 for k in ("detect_ms", "reroute_ms")}
                    rows.append({**row(f"{kind}-{mode}", "stall", "ms", stalls, "single-tcp", per_kind(single[0], kind)),
                                 "target_ms": target if mode == "with-agent" else None,
                                 "over_target": sum(1 for x in stalls if x > target), **agent})
                    rows.append({"case": f"{kind}-{mode}", "metric": "errors", "unit": "count", "n": len(stalls),
                                 "median": run.restarts, "p99": None, "wrong_results": run.wrong_results,
                                 "note": "errors the plugin returned over the whole run (each one a job restart)"})
    doc = report.document("nccl_plugin", rows, rounds=rounds, quick=args.quick,
                          setup={"ranks": len(HOSTS), "fault_size_mb": 4.0, "compute_ms": 10.0, "channels_faults": 2,
                                 "agent_interval_ms": 5.0}, seconds=round(time.monotonic() - t0))
    report.write(doc, args.json)
    print(table(["CASE", "METRIC", "N", "MEDIAN", "P99", "PEER", "PEER MEDIAN", "RATIO", "RAW", "VS RAW"],
                [[r["case"], f"{r['metric']} ({r['unit']})", r["n"], r["median"], r["p99"], r.get("peer", ""),
                  r.get("peer_median", ""), r.get("ratio", ""), r.get("raw_tcp", ""), r.get("ratio_vs_raw", "")]
                 for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
