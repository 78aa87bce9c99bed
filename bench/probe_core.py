#!/usr/bin/env python3
"""Probe engine throughput: completed exchanges per CPU-second, beside a minimal C echo.

    python bench/probe_core.py [--quick] [--trials N] [--seconds S] [--json FILE]

On the default testbed, agent h0 probes h1 (same leaf: one router hop each way) over 64 source ports as fast as its loop can go and
h1 reflects; an exchange counts when its authenticated reply is back and in the telemetry.
The peer, measured in the same run over the same fabric path, is `mmsg_echo` (C, sendmmsg/
recvmmsg, no authentication, timestamps or statistics). Rates are per CPU-second of all
processes involved (both agents, or client + server), which includes the kernel's forwarding
through the testbed routers in both cases.

Rows: case `exchanges` (the C core) and `exchanges-python` (the Python engine), metric `rate`
(per_s, peer `c-mmsg-echo`, ratio = ours/peer); case `host-8nic-16path-1khz`, metric
`core_share` (pct): the CPU share one host would need for 8 NICs × 16 paths at 1 kHz at the
measured rate. Target: >= 50 000 exchanges/s per core, so that the host costs <= 15 % of a core.
(The two halves of that target disagree: 128 000 exchanges/s at 50 000/s per core is 2.6 cores;
the figures are reported as measured.)
"""
from __future__ import annotations

# what this benchmark measures: a change to any of these after a run makes the figures quoted
# from it stale (tests/unit/test_benchmark_freshness.py lists them)
MEASURES = (
    "linkpass/probe/_probecore.c",
    "linkpass/probe/probe_rx.h",
    "linkpass/probe/probe_wire.h",
    "linkpass/probe/blake2b.h",
    "linkpass/probe/engine.py",
    "linkpass/probe/reference.py",
    "bench/probe_core.py",
)


import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sim"))

from linkpass_sim import report  # noqa: E402
from linkpass.core.constants import ROCE_PORT  # noqa: E402
from linkpass.core.names import host_name  # noqa: E402
from linkpass.probe.common import PathSpec  # noqa: E402
from linkpass.probe.engine import CoreProbeEngine  # noqa: E402
from linkpass.probe.reference import ReferenceEngine  # noqa: E402
from linkpass.testbed import build, topology  # noqa: E402

KEY = bytes(range(32))
PATHS = 64
HOST_LOAD = 8 * 16 * 1000  # exchanges/s of one host with 8 NICs x 16 paths at 1 kHz


def cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def ours(fab, engine_cls, seconds: float) -> float:
    """Completed exchanges per CPU-second for one trial."""
    a = engine_cls(1, KEY, netns=fab.netns(host_name(0)), jitter=0.0)
    b = engine_cls(2, KEY, netns=fab.netns(host_name(1)), jitter=0.0)
    try:
        a.add_nic("p0", "p0", fab.nic_addr(0, 0))
        b.add_nic("p0", "p0", fab.nic_addr(1, 0))
        for k in range(PATHS):
            a.add_path(PathSpec(k + 1, "p0", 2, fab.nic_addr(1, 0), 50000 + k, interval_s=0.0001))
        threads = [threading.Thread(target=e.run, args=(seconds,)) for e in (a, b)]
        c0 = cpu_self()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        used = cpu_self() - c0
        done = sum(p.telemetry.loss.replies for p in a.paths.values())
        return done / used if used > 0 else 0.0
    finally:
        a.close()
        b.close()


def peer(fab, binary: str, seconds: float) -> float:
    size = 96  # an unpadded probe's UDP payload
    server = subprocess.Popen(["ip", "netns", "exec", fab.netns(host_name(1)), binary, "server", fab.nic_addr(1, 0), str(ROCE_PORT),
                               str(seconds + 0.5)], stdout=subprocess.PIPE, text=True)
    time.sleep(0.1)
    client = subprocess.run(["ip", "netns", "exec", fab.netns(host_name(0)), binary, "client", fab.nic_addr(0, 0),
                             fab.nic_addr(1, 0), str(ROCE_PORT), str(seconds), str(size)], capture_output=True, text=True,
                            timeout=seconds + 10)
    out, _ = server.communicate(timeout=seconds + 10)
    _, trips, _, c_cpu = client.stdout.split()
    _, _, _, s_cpu = out.split()
    used = float(c_cpu) + float(s_cpu)
    return int(trips) / used if used > 0 else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--prefix", default="bprobe")
    args = ap.parse_args()
    if not report.require_root():
        return 3
    trials, seconds = (3, 0.5) if args.quick else (args.trials, args.seconds)
    with tempfile.TemporaryDirectory() as tmp:
        binary = os.path.join(tmp, "mmsg_echo")
        subprocess.run(["gcc", "-O2", "-o", binary, os.path.join(os.path.dirname(__file__), "peers", "mmsg_echo.c")],
                       check=True)
        build.clean(args.prefix)
        fab = build.up(topology.preset("default"), args.prefix)
        try:
            c_rates, py_rates, peer_rates = [], [], []
            for k in range(trials):
                print(f"trial {k + 1}/{trials}", file=sys.stderr, flush=True)
                c_rates.append(ours(fab, CoreProbeEngine, seconds))
                peer_rates.append(peer(fab, binary, seconds))
                py_rates.append(ours(fab, ReferenceEngine, seconds))
        finally:
            build.down(args.prefix)
    pm = statistics.median(peer_rates)
    rows = []
    for case, rates in (("exchanges", c_rates), ("exchanges-python", py_rates)):
        m = statistics.median(rates)
        rows.append({"case": case, "metric": "rate", "unit": "per_s", "n": trials, "median": round(m),
                     "p99": report.tail(rates, 0.01), "min": round(min(rates)), "peer": "c-mmsg-echo", "peer_median": round(pm),
                     "peer_p99": report.tail(peer_rates, 0.01), "ratio": round(m / pm, 3)})
    share = 100.0 * HOST_LOAD / statistics.median(c_rates)
    rows.append({"case": "host-8nic-16path-1khz", "metric": "core_share", "unit": "pct", "n": trials,
                 "median": round(share, 1), "p99": None})
    doc = report.document("probe_core", rows)
    print(f"{'case':24} {'median /s/core':>15} {'min':>10} {'peer (C echo)':>14} {'ratio':>6}")
    for r in rows[:2]:
        print(f"{r['case']:24} {r['median']:15,} {r['min']:10,} {r['peer_median']:14,} {r['ratio']:6.2f}")
    print(f"one host, 8 NICs x 16 paths at 1 kHz: {share:.1f} % of a core (target <= 15 %)")
    report.write(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
