#!/usr/bin/env python3
"""The Python side's cost per on-time reply: the C core's event records through
`CoreProbeEngine.poll()` (decode, telemetry) and `Failover.step()` (clock sync, detector, loss
batches), on a synthetic stream. No sockets, no root: the probe core is a stand-in that hands
out prepared records, so only the agent's Python work per batch is timed.

    python sim/bench/reply_cost.py [--quick] [--trials N] [--peer-rev REV] [--json FILE]

Workloads (one poll per 10 ms of agent time, the daemon's batch, every path's on-time replies
folded into one ANSWERED each by the core, as in judging mode):

- `rail8-h0-mix`: the host_cost.py rail8 host: 88 paths to 7 peers, the 25 paths of its two job
  peers at 1 ms and the rest at 100 ms (idle rates on): ~3 000 events and ~25 600 replies a second.
- `all-1ms`: the same 88 paths all at 1 ms (idle rates off): ~88 000 replies a second.

A trial is 100 polls (1 s of agent time) after 45 s of warm-up (clock sync converged, the delay
baselines learned, the 1-ms paths' sample rings full: a running agent's steady state, not the
garbage collector's extra work while the rings grow); its figure is the main thread's CPU time
over its on-time replies, timed around each poll() + step() only (making the records is not
timed). Background loss 1e-4 a probe, every 100th probe full-size.

Peer: the same workload against the linkpass tree of git revision `--peer-rev` (default HEAD:
the code before an uncommitted change), exported to a temporary folder and run in a process of
its own beside ours, both warm, trials alternating between them so a shared machine's load
falls on both alike. After the trials each goes through a fault phase (10 % loss on one path, a
cut, late replies, a stall of every path to a peer, an idle peer gone dark, a delay step, an MTU
black hole), and both must end with the same decisions: the same events, transitions, log
lines, timeouts pushed, counters, per-path telemetry, detector and clock state
(`same_decisions` in the rows; the run exits 1 if they differ).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
EV = struct.Struct("<IIQIIIIqqqq")  # _probecore.c's ev_t
MS = 1_000_000
T0 = 1_750_000_000 * 10**9  # epoch-sized times, as the agent's clock gives
BATCH_NS = 10 * MS
PEERS = 7
PATHS = 88
WARMUP_POLLS = 4500
POLLS_PER_TRIAL = 100
WORKLOADS = {"rail8-h0-mix": (0, 6), "all-1ms": None}  # job peers at 1 ms (None: every peer)


# ---- the synthetic stream (runs in the worker; no linkpass imports) --------------------------

class Stream:
    """Probes of every path, their fates and the records the C core's judging mode would hand
    Python for each poll (see _probecore.c: track_reply, expire, take_events)."""

    def __init__(self, active_peers, seed: int = 7):
        self.rng = random.Random(seed)
        self.paths = []
        for i in range(PATHS):
            peer = i % PEERS
            active = active_peers is None or peer in active_peers
            interval = MS if active else 100 * MS
            self.paths.append({"pid": i + 1, "peer": peer, "plane": (i // PEERS) % 8, "interval": interval,
                               "next_t1": T0 + self.rng.randrange(interval), "seq": 1000 * (i + 1), "rx": 0,
                               "sent": 0, "pending": []})
        # per peer: its clock's offset from ours and its drift (reflector - sender)
        self.clock = [(self.rng.randrange(-5_000_000, 5_000_000), self.rng.uniform(-20e-6, 20e-6))
                      for _ in range(PEERS)]
        self.rto = {p["pid"]: 5 * MS for p in self.paths}  # the core's, until the detector pushes one
        self.faults = []  # (start, end, pids or None, kind, value)
        self.background_loss = 1e-4

    def theta(self, peer: int, t: int) -> int:
        off, drift = self.clock[peer]
        return off + int((t - T0) * drift)

    def _fate(self, p, t1: int, size: int) -> tuple[bool, int, int]:
        """What the faults do to a probe sent at t1: (request lost, extra forward ns, extra reverse ns)."""
        lf = False
        ef = er = 0
        for start, end, pids, kind, value in self.faults:
            if start <= t1 < end and (pids is None or p["pid"] in pids):
                if kind == "down":
                    lf = True
                elif kind == "loss":
                    lf = lf or self.rng.random() < value
                elif kind == "late":
                    er += value
                elif kind == "delay_fwd":
                    ef += value
                elif kind == "mtu":
                    lf = lf or bool(size)
        return lf, ef, er

    def poll(self, now: int) -> tuple[bytes, int]:
        """The records of one take_events(all=True) at `now`; and the on-time replies in them."""
        ring = []  # (time learned, order, record): misses and late replies, with the flushes before them
        tail = []
        replies = 0
        order = 0
        rng = self.rng
        random, expo = rng.random, rng.expovariate
        for p in self.paths:
            pid, peer = p["pid"], p["peer"]
            th = self.theta(peer, now)  # the peer's clock drifts 200 ns at most in a poll
            while p["next_t1"] <= now:  # probes sent up to now
                t1 = p["next_t1"]
                p["next_t1"] += p["interval"]
                p["seq"] += 1
                p["sent"] += 1
                seq = p["seq"]
                size = 1 if seq % 100 == 0 else 0
                lf, ef, er = self._fate(p, t1, size) if self.faults else (False, 0, 0)
                lr = False
                if random() < self.background_loss:
                    if random() < 0.5:
                        lf = True
                    else:
                        lr = True
                if not lf:
                    p["rx"] += 1
                t2 = t1 + 14_000 + int(expo(1 / 4_000)) + ef + th
                t3 = t2 + 3_000 + int(random() * 2_000)
                t4 = t3 - th + 14_000 + int(expo(1 / 4_000)) + er
                p["pending"].append((seq, t1, t2, t3, t4, p["rx"], size, lf or lr, t1 + self.rto[pid]))
            agg = None
            keep = []
            for probe in p["pending"]:
                seq, t1, t2, t3, t4, rx, size, lost, deadline = probe
                if (deadline if lost else t4) > now:  # not decided yet (a late reply: when it comes)
                    keep.append(probe)
                    continue
                if lost or t4 > deadline:  # a miss (and a late reply): the pending batch goes first
                    if agg is not None:
                        ring.append((deadline, order, agg))
                        order += 1
                        replies += agg[3]
                        agg = None
                    ring.append((deadline, order, (2, pid, seq, 0, 0, size, 0, t1, 0, 0, deadline)))
                    order += 1
                    if not lost:
                        ring.append((t4, order, (3, pid, seq, 0, rx, 0, 0, t1, t2, t3, t4)))
                        order += 1
                    continue
                rtt = t4 - t1
                if agg is None:
                    agg = (1, pid, seq, 1, rx, size, rtt, t1, t2, t3, t4)
                else:
                    agg = (1, pid, seq, agg[3] + 1, rx, agg[5] | size, max(agg[6], rtt), t1, t2, t3, t4)
            p["pending"] = keep
            if agg is not None:
                tail.append(agg)
                replies += agg[3]
        ring.sort(key=lambda r: (r[0], r[1]))
        recs = [r for _, _, r in ring] + tail
        return b"".join(EV.pack(*r) for r in recs), replies

    def add_fault_phase(self, start: int) -> int:
        """The fault scenario from `start`; returns when the phase ends (2 s after the last fault)."""
        s = 1_000_000_000
        a = [p["pid"] for p in self.paths if p["peer"] == 0 and p["interval"] == MS] or [1]
        b = [p["pid"] for p in self.paths if p["peer"] == 6 and p["interval"] == MS] or [7]
        peer1 = [p["pid"] for p in self.paths if p["peer"] == 1]
        self.faults += [
            (start, start + s, [a[0]], "loss", 0.10),  # gray loss, forward
            (start + 2 * s, start + 2 * s + 12 * MS, [b[0]], "down", 0),  # a cut: DOWN, RECOVERING, UP
            (start + 4 * s, start + 4 * s + 4 * MS, [a[1]], "late", 2 * MS),  # late, not lost: spurious DOWN
            (start + 5 * s, start + 5 * s + 5 * MS, b, "late", 6 * MS),  # a stall of every path to a peer
            (start + 6 * s, start + 6 * s + 300 * MS, peer1, "down", 0),  # an idle peer's paths go dark
            (start + 7 * s, start + 9 * s, [a[2]], "delay_fwd", 400_000),  # a delay step: latency
            (start + 9 * s, start + 10 * s, [a[3]], "mtu", 0),  # full-size probes lost: an MTU black hole
        ]
        return start + 12 * s


# ---- the worker: the real engine and decision loop over the stream ----------------------------

class _FakeCore:
    """Stands in for _probecore.Core: hands out the prepared records, remembers the timeouts."""

    def __init__(self, *args, **kwargs):
        self.next = (b"", 0)
        self.sent = {}
        self.rto_calls = []
        self.stream = None

    def add_path(self, pid, *args):
        self.sent[pid] = 0

    def take_events(self, all_answered=True):
        return self.next

    def path_sent(self, pid):
        return self.sent[pid]

    def set_rto(self, pid, rto):
        self.rto_calls.append((pid, rto))
        if self.stream is not None:
            self.stream.rto[pid] = rto

    def track(self, on):
        pass


def worker(tree: str, workload: str, seed: int = 7) -> None:
    """Serve the driver over stdin/stdout: warm up, then `trial` (one trial's figures) and
    `faults` (the fault phase, then the digest of every decision) as asked."""
    sys.path.insert(0, tree)
    import linkpass.probe  # noqa: F401

    fake = types.ModuleType("linkpass.probe._probecore")
    from linkpass.core import wire
    fake.Core, fake.RECORD_SIZE, fake.EVENT_SIZE, fake.MAX_PAD = _FakeCore, 48, EV.size, wire.MAX_PAD
    sys.modules["linkpass.probe._probecore"] = fake
    linkpass.probe._probecore = fake
    assert os.path.realpath(linkpass.probe.__file__).startswith(os.path.realpath(tree))
    from linkpass.agent.config import DETECT
    from linkpass.agent.decide import PathInfo
    from linkpass.agent.failover import Failover
    from linkpass.core.detector import Detector, DetectorConfig
    from linkpass.probe.common import PathSpec
    from linkpass.probe.engine import CoreProbeEngine

    stream = Stream(WORKLOADS[workload], seed)
    engine = CoreProbeEngine(1, bytes(32))
    core = engine.core
    core.stream = stream
    engine.nics["p0"] = (0, None, None)  # a NIC without sockets: add_path() asks only for its name
    detect = {field: default * factor for field, factor, _, _, default in DETECT.values() if default is not None}
    logs = []
    failover = Failover(Detector(DetectorConfig(**detect)), lambda pid: engine.telemetry(pid).loss,
                        lambda kind, **f: logs.append((kind, sorted(f.items()))), set_rto=engine.set_rto)
    for p in stream.paths:
        engine.add_path(PathSpec(p["pid"], "p0", 100 + p["peer"], "198.18.0.1", 50000 + p["pid"],
                                 interval_s=p["interval"] / 1e9))
        failover.add_path(PathInfo(p["pid"], f"h{p['peer'] + 1}", p["plane"], 50000 + p["pid"], "198.18.0.1"))
    digest = hashlib.sha256()
    trans = []
    now = T0
    thread_ns = time.thread_time_ns

    def one_poll() -> tuple[int, int]:
        nonlocal now
        now += BATCH_NS
        data, replies = stream.poll(now)
        core.next = (data, now)
        for p in stream.paths:
            core.sent[p["pid"]] = p["sent"]
        c0 = thread_ns()
        events, evidence = engine.poll(True)
        out = failover.step(events, evidence, now - T0)
        c1 = thread_ns()
        digest.update(repr([tuple(e) for e in events]).encode())
        trans.extend(out)
        return c1 - c0, replies

    def answer(doc: dict) -> None:
        print(json.dumps(doc), flush=True)

    for _ in range(WARMUP_POLLS):
        one_poll()
    answer({"ready": True})
    for line in sys.stdin:
        if line.strip() == "trial":
            cpu = replies = 0
            for _ in range(POLLS_PER_TRIAL):
                c, r = one_poll()
                cpu += c
                replies += r
            answer({"per_reply_us": cpu / 1e3 / replies, "per_poll_us": cpu / 1e3 / POLLS_PER_TRIAL,
                    "rate": replies / (cpu / 1e9)})
        elif line.strip() == "faults":
            end = stream.add_fault_phase(now + BATCH_NS)
            while now < end:
                one_poll()
            answer({"digest": decisions_digest(digest, trans, logs, core, failover, engine, stream, now),
                    "transitions": len(trans), "logs": len(logs)})
            return


def decisions_digest(digest, trans, logs, core, failover, engine, stream, now: int) -> str:
    """Everything the run decided and measured, hashed after the events it saw."""
    state = {
        "transitions": [(t.path, t.old.value, t.new.value, t.event.value, t.reason.value, t.at_ns, t.detail)
                        for t in trans],
        "logs": logs, "rto_calls": core.rto_calls, "counters": sorted(failover.counters.items()),
        "planes": sorted(failover.planes.items()), "rows": failover.path_rows(),
        "fail_static": sorted(failover.fail_static), "peer_silent": sorted(failover.peer_silent),
    }
    for p in stream.paths:
        pid = p["pid"]
        tel = engine.telemetry(pid)
        lc = tel.loss
        off = failover.offset_ns(f"h{p['peer'] + 1}", now)
        d = failover.detector[pid]
        state[f"path{pid}"] = {
            "loss": (lc.start_seq, lc.hi, lc.arrived, lc.replies, lc.reflector_restarts, lc.lost_fwd, lc.lost_rev),
            "sent": tel.sent, "rtt": (tel.rtt_counts, tel.rtt_sum_ns),
            "samples": [(s.seq, s.t4, s.rtt, s.fwd_raw, s.rev_raw) for s in tel.samples],
            "window": tel.window(now - 2_000_000_000, off),
            "detector": (d.state.value, d.since_ns, d.srtt, d.rttvar, d.rto_ns, sorted(d.counters.items()),
                         d.good_run, d.consecutive_misses, d.size_misses, d.penalty(now),
                         sorted(r.value for r in d.faults),
                         [(c.median, c.mad, c.s, list(c.recent), list(c.learning)) for c in d._cusum.values()],
                         [(f.llr, s_.llr) for f, s_ in d._sprt.values()], sorted(d._size_seqs.items())),
            "offset": off,
        }
    digest.update(json.dumps(state, sort_keys=True, default=repr).encode())
    return digest.hexdigest()


# ---- the driver -------------------------------------------------------------------------------

def export_tree(rev: str, dest: str) -> str:
    """The linkpass package as of git revision `rev` (its Python: the worker stands in for the core)."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "linkpass"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    return dest


class Worker:
    """One implementation's worker process, warm, answering one request at a time."""

    def __init__(self, tree: str, workload: str):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", tree, "--workload",
                                      workload], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=tempfile.gettempdir())

    def ask(self, what: str | None = None) -> dict:
        if what:
            self.proc.stdin.write(what + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker exited ({self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main() -> int:
    sys.path.insert(0, os.path.join(HERE, ".."))
    from linkpass_sim import report

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--trials", type=int, default=40, help="per workload and implementation")
    ap.add_argument("--peer-rev", default="HEAD", help="git revision of the peer (the code before a change)")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--worker", metavar="TREE", help=argparse.SUPPRESS)
    ap.add_argument("--workload", default="rail8-h0-mix", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.workload)
        return 0
    trials = 20 if args.quick else args.trials
    rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", args.peer_rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    peer_name = f"linkpass@{rev}"
    rows = []
    with tempfile.TemporaryDirectory(prefix="reply-cost-") as tmp:
        peer_tree = export_tree(args.peer_rev, tmp)
        for workload in WORKLOADS:
            report.progress(f"{workload}: warming up both ({WARMUP_POLLS * BATCH_NS / 1e9:.0f} s of agent time each)")
            workers = {"ours": Worker(ROOT, workload), "peer": Worker(peer_tree, workload)}
            got = {who: {"per_reply_us": [], "per_poll_us": [], "rate": []} for who in workers}
            try:
                for w in workers.values():
                    w.ask()
                report.progress(f"{workload}: {trials} trials each, alternating")
                for k in range(trials):
                    for who in (("ours", "peer") if k % 2 else ("peer", "ours")):  # neither always first
                        t = workers[who].ask("trial")
                        for key, acc in got[who].items():
                            acc.append(round(t[key], 3))
                report.progress(f"{workload}: the fault phase, decisions compared")
                end = {who: w.ask("faults") for who, w in workers.items()}
            finally:
                for w in workers.values():
                    w.close()
            ours, peer = got["ours"], got["peer"]
            same = end["ours"]["digest"] == end["peer"]["digest"]
            extra = dict(same_decisions=same, transitions=end["ours"]["transitions"],
                         peer_transitions=end["peer"]["transitions"])
            rows.append(report.row(workload, "python_per_reply", "us", ours["per_reply_us"], peer=peer_name,
                                   peer_values=peer["per_reply_us"], **extra))
            rows.append(report.row(workload, "python_per_poll", "us", ours["per_poll_us"], peer=peer_name,
                                   peer_values=peer["per_poll_us"]))
            rows.append(report.row(workload, "replies_per_cpu_s", "per_s", ours["rate"], peer=peer_name,
                                   peer_values=peer["rate"], better="higher", q=0.01))
    print(f"{'case':<14} {'metric':<18} {'unit':<6} {'median':>10} {'p99':>10} {'peer':>10} {'peer p99':>10} "
          f"{'ratio':>6}")
    for r in rows:
        print(f"{r['case']:<14} {r['metric']:<18} {r['unit']:<6} {r['median']!s:>10} {r['p99']!s:>10} "
              f"{r.get('peer_median')!s:>10} {r.get('peer_p99')!s:>10} {r.get('ratio', '')!s:>6}")
    bad = [r["case"] for r in rows if r.get("same_decisions") is False]
    if bad:
        print(f"DIFFERENT DECISIONS from the peer's in: {', '.join(bad)}", file=sys.stderr)
    report.write(report.document("reply_cost", rows, peer_rev=rev, polls_per_trial=POLLS_PER_TRIAL), args.json)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
