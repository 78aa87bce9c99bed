#!/usr/bin/env python3
"""RDMA on Soft-RoCE guests: does a steered QP carry its port, and how long does a QP's traffic
stall when its path dies — LinkPass's channel (standby QP, short QP timeout) against a QP with
NCCL's defaults (timeout 20, retry count 7) on the same fault in the same run.

    python sim/bench/rdma.py [--quick] [--trials N] [--json FILE]

Two hosts of the default testbed are QEMU guests with rdma_rxe (TCG emulation: every time here
is guest time under emulation, far slower than a real NIC; the rows say so). Rows:
  port-choice   QPs whose packets carried exactly the port they were steered to (capture on the
                leaf), n of n, both directions
  spine-cut     longest gap between two acknowledged messages of a stream whose active QP's
                spine link is taken down: LinkPass channel vs NCCL-default QP (peer)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "rdma"))

from linkpass_sim import report  # noqa: E402
from linkpass_sim.report import row  # noqa: E402
from linkpass.cli.output import table  # noqa: E402
from linkpass.core.names import host_name  # noqa: E402
from linkpass.testbed import build, guests, roce_paths, topology  # noqa: E402
from linkpass_rdma import channel  # noqa: E402

A, B = 0, 3
PEER = f"nccl-default-qp (timeout {channel.NCCL_TIMEOUT}, retry {channel.NCCL_RETRY})"
STUCK_S = 60.0  # a message stuck this long ends the trial (NCCL's QP takes longer than that to give up here)
EMULATED = "guest time under QEMU TCG emulation with rdma_rxe; a real NIC is orders of magnitude faster"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 trial each, 8 ports")
    ap.add_argument("--trials", type=int, default=None, help="fault trials per side (default 5; quick 1)")
    ap.add_argument("--prefix", default="rb")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    if not report.require_root():
        return 2
    trials = args.trials or (1 if args.quick else 5)
    ports = list(range(49152, 49152 + (8 if args.quick else 24)))
    t0 = time.monotonic()
    build.clean(args.prefix)
    spec = topology.preset("default")
    spec = type(spec)(**{**spec.__dict__, "rdma_hosts": (A, B)})
    report.progress(f"testbed {args.prefix} with Soft-RoCE guests {host_name(A)}, {host_name(B)}")
    fab = build.up(spec, args.prefix, progress=report.progress)
    rows = []
    try:
        ca, cb = guests.Control(fab.prefix, A), guests.Control(fab.prefix, B)
        report.progress(f"steering {len(ports)} QPs, one per port, captured on both leaves")
        paths = roce_paths.map_ports(fab, A, B, ports, ca, cb)
        good = [p for p, pp in paths.items() if pp.reported == p and len(pp.forward) == 1 and len(pp.reverse) == 1
                and not pp.foreign]
        rows.append({"case": "port-choice", "metric": "qps_on_their_port", "unit": "count", "n": len(paths),
                     "median": len(good), "p99": None, "note": "n of n: every packet of the QP (both directions) "
                     "carried the steered port and stayed on one spine", "emulated": EMULATED})
        via = {p: pp.forward[0] for p, pp in paths.items() if p in good and pp.forward == pp.reverse}
        s0 = [p for p, s in via.items() if s == "s0"]
        s1 = [p for p, s in via.items() if s == "s1"]
        leaf_a, _ = roce_paths.spine_ports(fab, A, 0)
        cut = fab.leaf_spine(leaf_a, 0).name
        ours, peer, moved_ok = [], [], 0
        stuck = {"linkpass": 0, "nccl-default": 0}
        for i in range(trials):
            use = [s0[i % len(s0)]] + s1
            for side, knobs, out in (("linkpass", {}, ours),
                                     ("nccl-default", {"timeout": channel.NCCL_TIMEOUT, "retry": channel.NCCL_RETRY},
                                      peer)):
                report.progress(f"trial {i + 1}/{trials} {side}: active port {use[0]} via s0, cut {cut}")
                run = roce_paths.channel_under_fault(fab, A, B, ca, cb, use, cut, count=200, limit_s=STUCK_S + 60,
                                                     deadline_s=STUCK_S, **knobs)
                out.append(run.result["longest_gap_ms"])
                stuck[side] += bool(run.result.get("stuck"))
                moves = [e for e in run.result["events"] if e["event"] == "moved"]
                if side == "linkpass" and moves and moves[0]["from"] == use[0] and via.get(moves[0]["to"]) == "s1" \
                        and run.served.get("delivered") == 200:
                    moved_ok += 1
                report.progress(f"  longest gap {run.result['longest_gap_ms']} ms, moves {run.result['moves']}")
        rows.append({**row("spine-cut", "longest_gap", "ms", ours, PEER, peer), "emulated": EMULATED,
                     "moved_to_other_spine": f"{moved_ok} of {trials}",
                     "stuck": stuck, "stuck_note": f"a stuck stream gave up after {STUCK_S:.0f} s without its QP "
                     "erroring or moving: its gap is a lower bound",
                     "settings": f"timeout {channel.FAST_TIMEOUT}, retry {channel.FAST_RETRY}, standby QP"})
    finally:
        build.down(args.prefix)
    doc = report.document("rdma", rows, trials=trials, ports=len(ports), seconds=round(time.monotonic() - t0))
    report.write(doc, args.json)
    print(table(["CASE", "METRIC", "N", "MEDIAN", "P99", "PEER", "PEER MEDIAN", "RATIO"],
                [[r["case"], f"{r['metric']} ({r['unit']})", r["n"], r["median"], r["p99"], r.get("peer", ""),
                  r.get("peer_median", ""), r.get("ratio", "")] for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
