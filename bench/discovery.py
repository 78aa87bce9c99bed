#!/usr/bin/env python3
"""ECMP path discovery time on the default testbed: LinkPass's parallel sweep against the classic
traceroute way (one probe at a time: send TTL t, wait for its answer, then TTL t+1), over the
same flows (every host, NIC, peer and source port), measured in the same run.

    python bench/discovery.py [--quick] [--runs N] [--json FILE]

Case path-discovery, metric time (s): the whole fabric (4 hosts x 2 planes, 2 leaves + 2 spines
per plane, 32 source ports per (NIC, peer)) until every trace has ended. Both sides open their
sockets the same way (one namespace entry per host), so the difference is how they probe. The
peer's traces must give the same path table as ours (checked every run).
Target: every distinct spine path of every (NIC, peer) in <= 1 s.
"""
from __future__ import annotations

# what this benchmark measures: a change to any of these after a run makes the figures quoted
# from it stale (tests/unit/test_benchmark_freshness.py lists them)
MEASURES = (
    "linkpass/probe/discovery.py",
    "linkpass/core/paths.py",
    "bench/discovery.py",
)


import argparse
import os
import select
import socket
import statistics
import struct
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sim"))

from linkpass_sim import report  # noqa: E402
from linkpass.kernel import netns as ns_io  # noqa: E402
from linkpass.core import paths as P  # noqa: E402
from linkpass.core.names import host_name  # noqa: E402
from linkpass.probe import discovery as D  # noqa: E402
from linkpass.testbed import build, topology  # noqa: E402

PEER = "sequential-traceroute"
TARGET_S = 1.0


def classic_trace(sock: socket.socket, t: D.Target, sport: int, cfg: D.DiscoveryConfig) -> P.Trace:
    """One flow, one probe at a time, as traceroute does it (with the same TTL/retry/gap rules)."""
    answers: list[P.Answer] = []
    lost = probes = gap = 0
    poller = select.poll()
    poller.register(sock, select.POLLERR | select.POLLIN)
    for ttl in range(1, cfg.max_ttl + 1):
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, ttl)
        got = None
        for attempt in range(1, cfg.retries + 2):
            payload = D.default_payload(D.Probe(t.local, t.src, t.peer, sport, cfg.dport, ttl, attempt))
            for _ in range(2):  # a first failure may only report an earlier ICMP error
                try:
                    sock.sendto(payload, (t.peer, cfg.dport))
                    break
                except OSError:
                    continue
            probes += 1
            end = time.monotonic() + cfg.timeout_s
            while got is None and time.monotonic() < end:
                if not poller.poll(max(0.0, end - time.monotonic()) * 1000):
                    break
                try:
                    data, anc, _fl, addr = sock.recvmsg(2048, 512, D.MSG_ERRQUEUE)
                except BlockingIOError:
                    continue
                if data != payload or not anc:
                    continue  # an answer to an earlier probe
                ee = anc[0][2]
                _e, origin, itype, _c, _p, _i, _d = struct.unpack_from("=IBBBBII", ee)
                offender = socket.inet_ntoa(ee[20:24])
                if origin == D.SO_EE_ORIGIN_ICMP and itype == D.ICMP_TIME_EXCEEDED:
                    got = P.Answer(ttl, P.TIME_EXCEEDED, offender)
                elif origin == D.SO_EE_ORIGIN_ICMP and itype == D.ICMP_DEST_UNREACH:
                    got = P.Answer(ttl, P.REACHED if offender == t.peer else P.UNREACHABLE, offender)
            if got is not None:
                break
        if got is None:
            lost += 1
            gap += 1
            if gap >= cfg.gap_limit:
                break
            continue
        gap = 0
        answers.append(got)
        if got.kind != P.TIME_EXCEEDED:
            break
    return P.make_trace(t.local, t.src, t.peer, sport, answers, probes=probes, lost=lost)


def classic_sweep(fab, cfg: D.DiscoveryConfig) -> dict[str, P.PathTable]:
    tables = {}
    for i in range(fab.spec.hosts):
        targets = D.fabric_targets(fab, i)
        flows = [(t, sport) for t in targets for sport in cfg.ports]
        socks = ns_io.run_in_netns(fab.netns(host_name(i)), lambda n=len(flows): [
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(n)])
        traces = []
        try:
            for s, (t, sport) in zip(socks, flows):
                s.setsockopt(socket.SOL_SOCKET, D.SO_BINDTODEVICE, t.local.encode())
                s.setsockopt(socket.IPPROTO_IP, D.IP_RECVERR, 1)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # one flow per socket, same sport per peer
                s.bind((t.src, sport))
                s.setblocking(False)
                traces.append(classic_trace(s, t, sport, cfg))
                s.close()
        finally:
            for s in socks:
                s.close()
        tables[host_name(i)] = P.build_table(traces, cfg.k, host=host_name(i))
    return tables


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 runs each")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--prefix", default="bdisc")
    args = ap.parse_args()
    if not report.require_root():
        return 3
    runs = 2 if args.quick else args.runs
    cfg = D.DiscoveryConfig()
    build.clean(args.prefix)
    ours: list[float] = []
    peer: list[float] = []
    counters: dict = {}
    fab = build.up(topology.preset("default"), args.prefix)
    try:
        D.discover_fabric(fab, cfg)  # warm-up: first-use costs (imports, neighbour caches)
        for r in range(runs):
            print(f"path-discovery: run {r + 1}/{runs}", file=sys.stderr, flush=True)
            t = time.perf_counter()
            tables = D.discover_fabric(fab, cfg)
            ours.append(time.perf_counter() - t)
            counters = D.total_stats(tables)
            assert not counters["deadline_hit"], counters
            t = time.perf_counter()
            ref = classic_sweep(fab, cfg)
            peer.append(time.perf_counter() - t)
            for h in tables:  # both sides must find the same paths and ports
                d = P.diff_tables(ref[h], tables[h])
                assert not d.changed, (h, d.to_dict())
        paths = sum(len(e.paths) for t in tables.values() for e in t.entries.values())
        pairs = sum(len(t) for t in tables.values())
    finally:
        build.down(args.prefix)
    m, pm = statistics.median(ours), statistics.median(peer)
    rows = [{"case": "path-discovery", "metric": "time", "unit": "s", "n": runs,
             "median": round(m, 4), "p99": report.tail(ours, 0.99), "max": round(max(ours), 4),
             "peer": PEER, "peer_median": round(pm, 4), "peer_p99": report.tail(peer, 0.99),
             "ratio": round(pm / m, 2) if m else None,
             "pairs": pairs, "paths": paths, "ports_per_pair": len(cfg.ports),
             "probes": counters.get("sent"), "timeouts": counters.get("timeouts"),
             "lost_ttls": counters.get("lost_ttls"), "target_s": TARGET_S, "met": m <= TARGET_S}]
    doc = report.document("discovery", rows)
    print(f"{'case':15} {'metric':6} {'n':>3} {'median':>9} {'max':>9} {'peer median':>12} {'ratio':>7}")
    for r in rows:
        print(f"{r['case']:15} {r['metric']:6} {r['n']:3} {r['median']:8.3f}s {r['max']:8.3f}s "
              f"{r['peer_median']:11.3f}s {r['ratio']:6.1f}×")
    print(f"{pairs} (NIC, peer) pairs, {paths} distinct paths, {len(cfg.ports)} ports each, "
          f"{counters.get('sent')} probes per sweep ({counters.get('timeouts')} timeouts)")
    print(f"target: every path of the default testbed in <= {TARGET_S:.0f} s -> {m:.3f} s "
          f"({'met' if m <= TARGET_S else 'MISSED'})")
    report.write(doc, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
