#!/usr/bin/env python3
"""Reliability under hostile input: one function per row, picked by name.

    python bench/reliability.py [--quick] [--rows fuzz,spoof,junk-cost,agent-sigkill,coordinator-flood,actor-kill,soak,chaos] [--json FILE]

Rows (ROWS below maps each name to its function; a function takes `quick` and returns its rows):

- `fuzz`: the probe core's receive path (decoder, size and budget checks, reflector:
  linkpass/probe/probe_rx.h) built with AddressSanitizer and UBSan (linkpass/testbed/fuzz.py),
  fed random, truncated, mutated, over-long (signed too) and replayed packets, with time jumping
  past the reflector's idle timeout: 10^6 inputs in two seeded runs (--quick: 10^5). Metrics
  `inputs` and `crashes` (runs that ended in a sanitizer report or a broken invariant).
- `spoof`: forged (wrong key, made-up sources), corrupted, oversize and replayed probes sent at
  an agent through real sockets, from a raw socket in the other namespace of a two-host testbed
  (`tiny`), while the agent probes its peer: `rejected` (pct of the attack packets that reached
  its socket and should not be answered), `honest_loss` (pct of its own probes unanswered
  meanwhile). Case `spoof-peer-address`: forgeries carrying the peer's own address, the one
  thing a per-source budget cannot tell from the peer: its `honest_loss` is reported as
  measured. Without root, the same packets go through the binding's receive path
  (`Core.receive_test`) instead; each row's `via` says which.
- `junk-cost`: ns per 9 KB junk packet in the receive path (the harness, built as the extension
  is, without sanitizers): dropped for a size nobody expects, and from a source over its budget,
  each against a 9 KB forgery checked in full (ICRC and BLAKE2b: what each of them cost before
  the two checks), measured in the same run; ratio = full check / cheap drop.

- `agent-sigkill` (root): SIGKILL at random moments of route changes, then restart: stale or
  missing routes after the restarts' reconciles (`stale_or_missing_routes` per trial, 100 trials;
  --quick: 10), with the route changes made before the kills and the reconciles' fixes.

- `coordinator-flood`: the real endpoint (`startup.start`, its own process, HTTPS on 127.0.0.1,
  max_connections 256, read_timeout_s 2) with 4 registered agents, flooded by HALF_SENT
  connections that each send part of a request head after the TLS handshake and stop (re-opened
  as the server closes them) plus a client posting unauthenticated drains as fast as it can:
  latency of an authenticated `GET /v1/status` on a fresh connection, during the flood and,
  in the same run, without it (the peer); extras: the flood's connections the server closed
  (eviction or timeout), unauthenticated requests refused and rate-limited per second.

- `actor-kill`: the coordinator as its detached Ray actor (HTTPS, the default testbed's fabric
  model) under load: 4 agent identities registering and then reporting one path change after
  another, each retried until answered, and an operator draining and undraining leaf-spine links;
  the actor's process SIGKILLed at random moments, 20 times (--quick: 3), Ray restarting it.
  Metrics `lost` (per kill: answered changes, registrations and drains whose events are not in
  the store, answered undrains without theirs, drained links not as the answers left them, agents
  whose drains differ from the store's after one more report) and `restart_to_answer` (kill to
  the first 2xx from the new process); extras: requests that failed during the outages (retried,
  not errors) and Ray's own restart time.
- `soak` (root): the demo's setup with both its jobs (gloo and the NCCL plugin's ring) while
  faults of every kind, at random, follow one another for 30 minutes (--quick: 2): per job,
  restarts (failed collectives), wrong results, faults no agent saw; all should be 0.
- `chaos` (root): the soak with every moving part of a deployment and processes killed at
  random moments: a root and 2 shards as Ray actors on PostgreSQL (TLS), Prometheus with the
  alert rules, both jobs, faults of every kind, and in about every other fault's window an agent
  (SIGKILL, half of them mid-change), the root, a shard, PostgreSQL or Prometheus killed and
  started again; 30 minutes (--quick: 3). Figures: collective errors and wrong results per job,
  stale or missing routes after each agent restart, events lost at the coordinator, localization
  after restarts against faults with none near (the peer), alerts still firing at the end, and
  how long each kind of process took to come back (the comment above `Strike` has the rules).

healthy-saturated and cut-saturated are the failover
benchmark's (bench/failover.py). Others are added as functions of the same shape and an
entry in ROWS.
"""
from __future__ import annotations

# what this benchmark measures: a change to any of these after a run makes the figures quoted
# from it stale (tests/unit/test_benchmark_freshness.py lists them)
MEASURES = (
    "linkpass/probe/_probecore.c",
    "linkpass/probe/probe_rx.h",
    "linkpass/probe/probe_wire.h",
    "linkpass/probe/blake2b.h",
    "linkpass/coordinator/http.py",
    "linkpass/coordinator/coordinator.py",
    "linkpass/coordinator/shard.py",
    "linkpass/coordinator/store.py",
    "linkpass/coordinator/ray_actor.py",
    "linkpass/agent/coordinator_link.py",
    "linkpass/core/failover.py",
    "linkpass/agent/routes.py",
    "linkpass/agent/daemon.py",
    "linkpass/agent/rates.py",
    "bench/reliability.py",
)


import argparse
import json
import os
import random
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import struct
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from typing import Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sim"))

from linkpass_sim import report  # noqa: E402
from linkpass_sim.benchkit import A, B  # noqa: E402
from linkpass_sim.report import progress, row  # noqa: E402
from linkpass.coordinator.auth import agent_token, read_agent_secret  # noqa: E402
from linkpass.control.client import Client, Refusal, Unreachable  # noqa: E402
from linkpass.control.tls import build_client_context, lab_dir, lab_paths  # noqa: E402
from linkpass.core import wire as W  # noqa: E402
from linkpass.core.constants import RTPROT_LINKPASS  # noqa: E402
from linkpass.core.names import host_name, leaf_name, link_name  # noqa: E402
from linkpass.testbed import fuzz  # noqa: E402
from linkpass.testbed import build, faults, topology  # noqa: E402
from linkpass.testbed.agents import LINKPASS, write_agent_configs  # noqa: E402
from linkpass.testbed.faults import FaultSpec  # noqa: E402

KEY = bytes(range(32))
WRONG_KEY = b"not-the-fleet-key-at-all-32bytes"


# ---- fuzz ---------------------------------------------------------------------------------------

def row_fuzz(quick: bool) -> list[dict]:
    total, runs = (100_000, 2) if quick else (1_000_000, 2)
    with tempfile.TemporaryDirectory() as tmp:
        binary = fuzz.build(tmp)
        results: list[fuzz.FuzzRun] = [None] * runs  # type: ignore[list-item]

        def one(k: int) -> None:
            results[k] = fuzz.fuzz(binary, total // runs, seed=k + 1, timeout_s=3600)

        threads = [threading.Thread(target=one, args=(k,)) for k in range(runs)]  # one per core
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.monotonic() - t0
    crashed = [r for r in results if not r.clean]
    outcomes: Counter = Counter()
    for r in results:
        outcomes.update({k: v for k, v in r.outcomes.items() if isinstance(v, int) and k != "inputs"})
        outcomes.update({f"drop_{k}": v for k, v in r.outcomes.get("drops", {}).items()})
    common = {"via": "fuzz_harness.c (probe_rx.h), -fsanitize=address,undefined", "runs": runs,
              "seconds": round(seconds, 1)}
    rows = [{"case": "fuzz", "metric": "inputs", "unit": "count", "n": runs, "median": total, "p99": None,
             "total": sum(r.inputs for r in results), "outcomes": dict(sorted(outcomes.items())), **common},
            {"case": "fuzz", "metric": "crashes", "unit": "count", "n": runs, "median": len(crashed), "p99": None,
             "reports": [r.report[-2000:] for r in crashed], **common}]
    return rows


# ---- spoof --------------------------------------------------------------------------------------

class Attack:
    """The attack packets: (what, UDP payload, source address, source port, should be answered)."""

    def __init__(self, victim_addr: str, victim_id: int, count: int, seed: int = 7):
        self.victim_addr, self.victim_id = victim_addr, victim_id
        self.rng = random.Random(seed)
        self.forger, self.honest = W.Codec(WRONG_KEY), W.Codec(KEY)
        self.count = count
        self.valid = 0

    def made_up(self) -> str:
        return f"198.19.{self.rng.randrange(200, 250)}.{self.rng.randrange(1, 250)}"

    def packets(self):
        rng, v = self.rng, self.victim_addr
        n = 0
        while n < self.count:
            src, sport = self.made_up(), 49152 + rng.randrange(64)
            seq = rng.randrange(10**9)
            kind = rng.randrange(5)
            if kind == 0:  # a request signed with another key
                p = W.Probe(W.KIND_REQUEST, rng.randrange(1, 99), self.victim_id, rng.randrange(1, 99), seq, t1=1)
                yield "wrong_key_request", self.forger.encode(p, src, v, sport), src, sport, False
            elif kind == 1:  # a reply to the victim's own path, signed with another key
                p = W.Probe(W.KIND_REPLY, self.victim_id, 2, 1, seq, t1=1, t2=2, t3=3, rx_count=5)
                yield "wrong_key_reply", self.forger.encode(p, src, v, 50000), src, 50000, False
            elif kind == 2:  # 8 KB of forgery
                p = W.Probe(W.KIND_REQUEST, 3, self.victim_id, 9, seq, t1=1, flags=1, pad=8000)
                yield "oversize", self.forger.encode(p, src, v, sport), src, sport, False
            elif kind == 3:  # a valid request damaged on the way
                data = bytearray(self.honest.encode(W.Probe(W.KIND_REQUEST, 3, self.victim_id, 9, seq, t1=1), src, v,
                                                    sport))
                data[rng.randrange(W.BTH_LEN + 8, len(data) - 4)] ^= 1 << rng.randrange(8)
                yield "corrupted", bytes(data), src, sport, False
            else:  # a valid request (of one of 50 paths, its sequence rising), then three copies: replays
                self.valid += 1
                data = self.honest.encode(W.Probe(W.KIND_REQUEST, 3, self.victim_id, 1 + self.valid % 50,
                                                  self.valid, t1=1), src, v, sport)
                yield "replay_original", data, src, sport, True
                for _ in range(3):
                    yield "replayed", data, src, sport, False
                n += 3
            n += 1

    def peer_spoof(self, peer_addr: str):
        """Forged replies to the victim's path that carry its peer's own address and port."""
        for _ in range(self.count):
            p = W.Probe(W.KIND_REPLY, self.victim_id, 2, 1, self.rng.randrange(10**9), t1=1, t2=2, t3=3, rx_count=5)
            yield "peer_address", self.forger.encode(p, peer_addr, self.victim_addr, 50000), peer_addr, 50000, False


SEND_DROPS = ("send_buffer_full", "send_error")  # the victim's replies, not what it received


def ip_packet(payload: bytes, src: str, dst: str, sport: int) -> bytes:
    return struct.pack("!BBHHHBBH4s4sHHHH", 0x45, 0, 28 + len(payload), 0, 0x4000, 64, 17, 0, socket.inet_aton(src),
                       socket.inet_aton(dst), sport, W.ROCE_PORT, 8 + len(payload), 0) + payload


def spoof_rows(case: str, via: str, kinds: Counter, should_answer: int, delivered: int, rejected: int,
               answered: int, drops: dict, honest: tuple[int, int] | None = None, seconds: float | None = None) -> list[dict]:
    """`honest`: (probes the victim sent to its peer meanwhile, replies it took)."""
    rows = []
    bad = delivered - should_answer
    extra = {"via": via, "sent": dict(kinds), "drops": drops}
    if seconds:
        extra["attack_per_s"] = round(sum(kinds.values()) / seconds)
    if case == "spoof":
        rows.append({"case": case, "metric": "rejected", "unit": "pct", "n": bad,
                     "median": round(100.0 * rejected / bad, 3) if bad else None, "p99": None,
                     "delivered": delivered, "valid_originals": should_answer, "answered": answered, **extra})
    if honest is not None and honest[0] > 0:
        sent, replies = honest
        rows.append({"case": case, "metric": "honest_loss", "unit": "pct", "n": sent,
                     "median": round(100.0 * max(0, sent - replies) / sent, 3), "p99": None, **extra})
    return rows


def spoof_through_sockets(quick: bool) -> list[dict]:
    from linkpass.kernel import netns as ns_io
    from linkpass.probe.common import PathSpec
    from linkpass.probe.engine import CoreProbeEngine
    from linkpass.testbed import build, topology

    prefix = "brel"
    count = 4_000 if quick else 40_000
    build.clean(prefix)
    fab = build.up(topology.preset("tiny"), prefix)
    victim = CoreProbeEngine(1, KEY, netns=fab.netns("h0"))
    peer = CoreProbeEngine(2, KEY, netns=fab.netns("h1"))
    raw = udp = None
    try:
        v_addr, p_addr = fab.nic_addr(0, 0), fab.nic_addr(1, 0)
        victim.add_nic("p0", "p0", v_addr)
        peer.add_nic("p0", "p0", p_addr)
        victim.add_path(PathSpec(1, "p0", 2, p_addr, 50000, interval_s=0.001))
        peer.start_background()
        victim.start_background()
        raw = ns_io.socket_in_netns(fab.netns("h1"), socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
        # a raw socket does not fragment: packets above the MTU go from a UDP socket (with h1's
        # own address; the size check drops them before anything looks at the source)
        udp = ns_io.socket_in_netns(fab.netns("h1"), socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind((p_addr, 0))
        time.sleep(0.5)
        attack = Attack(v_addr, 1, count)
        rows = []
        for case, packets in (("spoof", attack.packets()), ("spoof-peer-address", attack.peer_spoof(p_addr))):
            before, sent0, t0 = victim.core.counters(), victim.core.path_sent(1), time.monotonic()
            kinds: Counter = Counter()
            originals = 0
            for i, (kind, payload, src, sport, answer) in enumerate(packets):
                try:
                    if 28 + len(payload) > 1500:
                        udp.sendto(payload, (v_addr, W.ROCE_PORT))
                    else:
                        raw.sendto(ip_packet(payload, src, v_addr, sport), (v_addr, 0))
                except BlockingIOError:
                    continue
                kinds[kind] += 1
                originals += answer
                if i % 200 == 199:
                    time.sleep(0.005)  # ~40 000 packets/s at most: the software fabric forwards them
            seconds = time.monotonic() - t0
            time.sleep(0.2)  # the last replies come in
            after, sent1 = victim.core.counters(), victim.core.path_sent(1)
            victim.core.take()
            d = {k: after["drops"].get(k, 0) - before["drops"].get(k, 0) for k in after["drops"]}
            d = {k: v for k, v in d.items() if v}
            replies = after["replies"] - before["replies"]
            delivered = after["received"] - before["received"] - replies
            answered = after["reflected"] - before["reflected"]
            rejected = sum(v for k, v in d.items() if k not in SEND_DROPS) if case == "spoof" else 0
            rows += spoof_rows(case, "sockets (tiny testbed, raw socket in h1)", kinds, originals, delivered,
                               rejected, answered, d, (sent1 - sent0, replies), seconds)
        return rows
    finally:
        for s in (raw, udp):
            if s is not None:
                s.close()
        victim.close()
        peer.close()
        build.down(prefix)


def spoof_through_binding(quick: bool) -> list[dict]:
    from linkpass.probe import _probecore

    count = 4_000 if quick else 40_000
    core = _probecore.Core(KEY, 1)
    v_addr = "198.18.64.1"
    attack = Attack(v_addr, 1, count)
    kinds: Counter = Counter()
    originals = answered = 0
    now = 10**12
    for kind, payload, src, sport, answer in attack.packets():
        now += 25_000  # 40 000 packets/s
        out = core.receive_test(payload, socket.inet_aton(src), socket.inet_aton(v_addr), sport, now)
        kinds[kind] += 1
        originals += answer
        answered += isinstance(out, bytes)
    drops = core.counters()["drops"]
    delivered = sum(kinds.values())
    return spoof_rows("spoof", "binding (Core.receive_test, no sockets: not root)", kinds, originals, delivered,
                      sum(drops.values()), answered, drops)


def row_spoof(quick: bool) -> list[dict]:
    return spoof_through_sockets(quick) if os.geteuid() == 0 else spoof_through_binding(quick)


# ---- junk-cost ----------------------------------------------------------------------------------

def row_junk_cost(quick: bool) -> list[dict]:
    trials, cheap_n, full_n = (5, 100_000, 2_000) if quick else (20, 1_000_000, 10_000)
    with tempfile.TemporaryDirectory() as tmp:
        binary = fuzz.build(tmp, sanitize=False)
        full = [fuzz.cost(binary, "bad_tag", full_n) / 1000 for _ in range(trials)]
        cheap = {kind: [fuzz.cost(binary, kind, cheap_n) / 1000 for _ in range(trials)]
                 for kind in ("unexpected_size", "over_budget")}
    rows = []
    for kind, values in cheap.items():
        m, pm = statistics.median(values), statistics.median(full)
        rows.append({"case": f"junk-9k-{kind.replace('_', '-')}", "metric": "cost_per_packet", "unit": "us",
                     "n": trials, "median": round(m, 4), "p99": report.tail(values),
                     "peer": "full-check (ICRC + BLAKE2b, 9 KB bad tag)", "peer_n": trials, "peer_median": round(pm, 3),
                     "peer_p99": report.tail(full), "ratio": round(pm / m, 1) if m else None,
                     "via": "fuzz_harness.c cost mode, -O2"})
    return rows



# ---- agent-sigkill ------------------------------------------------------------------------------
# Agents on h0 and h2 of the default testbed; h0's plane-0 uplink goes down and up in turn (down
# 120 ms, up 250 ms; hold-down cut to 50 ms), so their routes to each other move several times a
# second. Both agents are SIGKILLed at one random moment 0.3..1.5 s after they started probing
# and started again on their journals (both, so that every trial kills amid route changes at
# both ends). Once each logs `routes_reconciled`, the kernel's routes of ours are compared:
# missing = a configured peer without a route of ours (or of no plane); stale = a route to no
# peer, or whose planes are neither what the reconcile installed nor what a later logged route
# change says.

TRIALS, QUICK_TRIALS = 100, 10
DOWN_S, UP_S = 0.12, 0.25  # the toggled uplink's down and up times
KILL_AFTER_S = (0.3, 1.5)  # the kill's moment after the agent started probing (uniform)
NEAR_CHANGE_NS = 200_000_000
DETECT = {"hold_down_ms": 50, "recovery_good_probes": 20, "flap_half_life_ms": 100}
UPLINK = link_name(host_name(A), leaf_name(0, 0))  # A's plane-0 uplink (A hangs off leaf 0)


class Toggler:
    """Takes A's plane-0 uplink down and up in turn until stopped (a thread of this process)."""

    def __init__(self, prefix: str):
        self.prefix, self._stop = prefix, threading.Event()
        self.toggles, self.errors = 0, []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Toggler":
        self._thread.start()
        return self

    def _run(self) -> None:
        down = False
        while not self._stop.is_set():
            try:
                faults.clear(self.prefix, UPLINK)  # also what the last trial may have left down
                if not down:
                    faults.apply(self.prefix, FaultSpec("down", UPLINK))
            except Exception as exc:  # noqa: BLE001 - counted and reported, the trial goes on
                self.errors.append(repr(exc))
            down = not down
            self.toggles += 1
            self._stop.wait(DOWN_S if down else UP_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def events(path: str, kind: str | None = None) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if kind is None or ev.get("event") == kind:
                    out.append(ev)
    except FileNotFoundError:
        pass
    return out


def start_agent(fab, host: int, config: str, log_path: str) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(["ip", "netns", "exec", fab.netns(host_name(host)), *LINKPASS, "agent",
                                 "--config", config], stdout=subprocess.DEVNULL, stderr=log)


def wait_event(proc: subprocess.Popen, log_path: str, kind: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = events(log_path, kind)
        if got:
            return got[0]
        if proc.poll() is not None:
            raise RuntimeError(f"agent exited with {proc.returncode}: {open(log_path).read()[-1500:]}")
        time.sleep(0.005)
    raise RuntimeError(f"no {kind!r} from the agent within {timeout_s} s")


def kernel_routes(fab, host: int) -> dict[str, tuple[int, ...]]:
    """Our routes in a host's namespace: destination -> planes (by device), as the kernel has them."""
    from pyroute2 import IPRoute

    with IPRoute(netns=fab.netns(host_name(host))) as ipr:
        names = {link["index"]: link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}
        out = {}
        for r in ipr.get_routes(family=2, proto=RTPROT_LINKPASS):
            mp = r.get_attr("RTA_MULTIPATH")
            oifs = [h["oif"] for h in mp] if mp else [r.get_attr("RTA_OIF")]
            out[r.get_attr("RTA_DST")] = tuple(sorted(int(names[o][1:]) for o in oifs if o in names))
        return out


def judge(fab, host: int, kernel: dict, installed: dict, changes: list[dict]) -> tuple[int, int]:
    """(stale, missing) routes of `host` after a reconcile (see the module doc)."""
    service = {host_name(j): fab.service_addr(j) for j in range(fab.spec.hosts) if j != host}
    missing = sum(1 for name, addr in service.items() if not kernel.get(addr))
    stale = sum(1 for addr in kernel if addr not in service.values())
    for name, addr in service.items():
        planes = kernel.get(addr)
        if not planes:
            continue
        allowed = {tuple(installed.get(name, ()))} | {tuple(c["planes"]) for c in changes if c["peer"] == name}
        stale += planes not in allowed
    return stale, missing


class Run:
    """Both agents of the run: their configs, processes and the log of each incarnation."""

    def __init__(self, fab, work: str):
        self.fab, self.work = fab, work
        self.configs = write_agent_configs(fab, work, bytes(range(32)), interval_ms=1.0, routes=True, entropy=True,
                                           detect=DETECT)
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, str] = {}
        self.incarnation = 0

    def start(self) -> dict[int, dict]:
        """Start both agents; their `routes_reconciled` events and, read right after each, the
        kernel's routes."""
        self.incarnation += 1
        got = {}
        for h in (A, B):
            self.logs[h] = os.path.join(self.work, f"agent-{host_name(h)}-{self.incarnation}.log")
            self.procs[h] = start_agent(self.fab, h, self.configs[h], self.logs[h])
        for h in (A, B):
            rec = wait_event(self.procs[h], self.logs[h], "routes_reconciled", 30)
            got[h] = {"reconciled": rec, "kernel": kernel_routes(self.fab, h)}
        for h in (A, B):
            wait_event(self.procs[h], self.logs[h], "started", 30)
        return got

    def kill(self) -> int:
        for h in (A, B):
            self.procs[h].send_signal(signal.SIGKILL)
        killed_ns = time.monotonic_ns()
        for h in (A, B):
            self.procs[h].wait(timeout=10)
        return killed_ns

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def row_agent_sigkill(quick: bool) -> dict:
    """The `agent-sigkill` row: stale or missing routes after SIGKILL + restart + reconcile."""
    trials = QUICK_TRIALS if quick else TRIALS
    prefix = f"rk{os.getpid() % 10000}"
    rng = random.Random(1)
    fab = build.up(topology.preset("default"), prefix)
    work = tempfile.mkdtemp(prefix="linkpass-bench-sigkill-")
    run = Run(fab, work)
    per_trial, stale_total, missing_total, near, fixes, seen, toggles, restart_ms = [], 0, 0, 0, 0, 0, 0, []
    try:
        run.start()
        for k in range(trials):
            toggler = Toggler(prefix).start()
            time.sleep(rng.uniform(*KILL_AFTER_S))
            killed_ns = run.kill()
            toggler.stop()
            toggles += toggler.toggles
            if toggler.errors:
                progress(f"trial {k}: the uplink toggler failed: {toggler.errors[:3]}")
            for h in (A, B):
                changed = events(run.logs[h], "route_change")
                seen += len(changed)
                near += any(0 <= killed_ns - c["mono_ns"] <= NEAR_CHANGE_NS for c in changed)
            t0 = time.monotonic()
            after = run.start()
            restart_ms.append((time.monotonic() - t0) * 1000)
            bad = 0
            for h, got in after.items():
                rec = got["reconciled"]
                stale, missing = judge(fab, h, got["kernel"], rec["installed"], events(run.logs[h], "route_change"))
                stale_total, missing_total, fixes = stale_total + stale, missing_total + missing, fixes + rec["reconciled"]
                bad += stale + missing
                if stale or missing:
                    progress(f"trial {k}, {host_name(h)}: stale {stale}, missing {missing}: kernel {got['kernel']}, "
                             f"installed {rec['installed']}")
            per_trial.append(bad)
            if k % 10 == 9:
                progress(f"{k + 1}/{trials} kills: stale {stale_total}, missing {missing_total}, route changes "
                         f"before the kills {seen}, kills within 200 ms after one {near}, reconcile fixes {fixes}")
    finally:
        run.stop()
        faults.clear(prefix)
        build.down(prefix)
        if os.environ.get("LINKPASS_BENCH_KEEP"):
            progress(f"agent logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    restart_ms.sort()
    return row("agent-sigkill", "stale_or_missing_routes", "count", per_trial, trials=trials, stale=stale_total,
               missing=missing_total, route_changes_before_kills=seen, kills_within_200ms_after_a_route_change=near,
               uplink_toggles=toggles, reconcile_fixes=fixes, hosts_killed_per_trial=2,
               routes_checked_per_trial=2 * (fab.spec.hosts - 1),
               restart_to_started_ms_median=round(restart_ms[len(restart_ms) // 2], 1) if restart_ms else None)


# ---- soak ---------------------------------------------------------------------------------------

SOAK_S = 1800


def row_soak(quick: bool) -> list[dict]:
    """The `soak` rows: the demo's setup (default testbed, coordinator as a Ray actor over mutual
    TLS, an agent per host) with both of its jobs side by side, the gloo job and the NCCL plugin's
    ring, while faults of every kind, picked at random (seeded) and aimed at the busiest link of
    their tier, follow one another for SOAK_S seconds (--quick: 120 s). Per job: restarts (each a
    collective that failed: an error NCCL would have ended the job with), wrong results; all must
    be 0."""
    import argparse as _argparse
    from contextlib import ExitStack

    from linkpass.demo import timeline
    from linkpass.demo.run import Demo
    from linkpass.demo.script import SCRIPT

    seconds = 120 if quick else SOAK_S
    rng = random.Random(17)
    work = tempfile.mkdtemp(prefix="linkpass-bench-soak-")
    dargs = _argparse.Namespace(prefix="lpsoak", keep=False, out=work, output="table", faults=None, size_mb=4.0,
                                plugin_size_mb=1.0, compute_ms=10.0, job_timeout_s=30.0, interval_ms=5.0,
                                compare=False, rto_min_ms=10, job="both")
    with ExitStack() as stack:
        demo = Demo(dargs, stack)
        demo.build()
        demo.start_coordinator()
        demo.start_agents()
        jobs = demo.start_jobs("soak", linkpass=True)
        done: list[timeline.Fault] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sc = rng.choice(SCRIPT)
            demo.wait_steady(jobs, True)
            done.append(demo.inject(jobs, len(done) + 1, sc))
            if len(done) % 10 == 0:
                progress(f"soak: {len(done)} faults, {end - time.monotonic():.0f} s to go")
        demo.wait_steady(jobs, True)
        runs = demo.finish_run("soak", jobs, done, linkpass=True)
    kinds = Counter(f.kind for f in done)
    rows = []
    for job, run in runs.items():
        extra = {"job": job, "seconds": seconds, "faults": len(done), "faults_by_kind": dict(kinds), "steps": run.steps,
                 "stall_ms_median": statistics.median([f.stall_ms for f in run.faults if f.stall_ms is not None] or [0])}
        rows.append({"case": f"soak-{job}", "metric": "restarts", "unit": "count", "n": len(done),
                     "median": run.restarts, "p99": None, **extra})
        rows.append({"case": f"soak-{job}", "metric": "wrong_results", "unit": "count", "n": run.steps,
                     "median": run.wrong_results, "p99": None, "job": job})
        rows.append({"case": f"soak-{job}", "metric": "faults_unseen", "unit": "count", "n": len(done),
                     "median": sum(1 for f in run.faults if f.detect_ms is None), "p99": None, "job": job,
                     "note": "faults no agent judged a path of (the job may not have crossed them)"})
    return rows


# ---- chaos --------------------------------------------------------------------------------------
# The soak's setup made harder: the coordinator is a root and 2 shards (detached Ray actors) on a
# PostgreSQL store (a real server, TLS verify-full), Prometheus scrapes every agent and the root
# with LinkPass's alert rules, and both jobs run. Faults of every kind follow one another at the
# busiest link of their tier; in about every other fault's window one process is killed at a
# random moment (kinds dealt from a shuffled deck, so each comes up as often): an agent (SIGKILL;
# half of them the moment it logs its first route change of the fault, half at a random moment;
# down 0.2-3 s, then started again on its config), the coordinator's root or one shard (SIGKILL of
# the actor's process; Ray restarts it), the PostgreSQL server (stopped at once, every
# connection dropped, started again) or Prometheus (SIGKILL, started again on its data).
#
# What is judged, all from real state (kernel routes, the agents' logs, the coordinator's store
# through its API, Prometheus' ALERTS series):
# - per job: collectives that failed (each a restart of the job) and wrong results;
# - after each agent restart: routes right after its reconcile (missing: a peer without one;
#   stale: planes neither the reconcile's nor a later logged change's) and, at the next calm (the
#   fault cleared, every path back up), every host's routes exactly every peer over both planes;
# - events lost: every interval of >= LOST_MIN_S an agent held a path bad must have a detection
#   at the coordinator for that host's path (or a per-window summary of its detections); those
#   overlapping an outage of the root, a shard or PostgreSQL are counted apart;
# - localization: faults right after a restart of the root, a shard or PostgreSQL named by the
#   coordinator as often as faults with no restart near them (the peer, same run);
# - alerts: how many fired, how many still fire at the end (all cleared is the target).

CHAOS_S, CHAOS_QUICK_S = 1800, 180
STRIKE_SHARE = 0.5  # of the faults' windows in which one process is killed
STRIKES = ("agent", "root", "shard", "postgresql", "prometheus")
COORDINATOR_SIDE = ("root", "shard", "postgresql")
LOST_MIN_S = 1.0  # a bad interval this long is always reported (report_ms is 50)
OUTAGE_GRACE_S = 5.0  # after an outage's end: the agents' backoff and re-registration
CALM_ROUTES_S = 10.0  # at calm, how long a host's routes may take to be whole again


@dataclass
class Strike:
    kind: str  # one of STRIKES
    target: str  # host name, "root", "shard1", "postgresql", "prometheus"
    fault: int  # index of the fault in whose window it fell
    at: float | None = None  # wall clock s of the kill
    back: float | None = None  # ... when it answered again
    mid_change: bool = False  # an agent killed within 50 ms after logging a route change
    stale: int = 0  # routes right after the restart's reconcile (agents)
    missing: int = 0
    error: str | None = None


class Chaos:
    """The chaos soak's moving parts and what each strike left behind."""

    def __init__(self, demo, pg, rng: random.Random):
        self.demo, self.pg, self.rng = demo, pg, rng
        self.strikes: list[Strike] = []
        self.deck: list[str] = []
        self.kills_by_host: dict[int, list[float]] = {h: [] for h in demo.agents.hosts}

    def deal(self) -> str:
        if not self.deck:
            self.deck = list(STRIKES)
            self.rng.shuffle(self.deck)
        return self.deck.pop()

    def strike_in(self, kind: str, fault: int, hold_s: float) -> threading.Thread:
        """Start a thread that kills one process of `kind` during fault `fault`'s window."""
        from linkpass.testbed import faults as F

        target = {"agent": host_name(self.rng.choice(self.demo.agents.hosts)), "shard": f"shard{self.rng.randrange(2)}"
                  }.get(kind, kind)
        s = Strike(kind, target, fault)
        self.strikes.append(s)
        after_change = kind == "agent" and self.rng.random() < 0.5
        delay = self.rng.uniform(0.0, hold_s + 1.0)
        t0 = time.time()

        def run():
            try:
                deadline = time.monotonic() + 60
                while not F.active(self.demo.args.prefix) and time.monotonic() < deadline:
                    time.sleep(0.005)
                if after_change:
                    self._kill_agent(s, t0, until=time.monotonic() + hold_s + 5)
                else:
                    time.sleep(delay)
                    getattr(self, "_kill_" + kind)(s, t0)
            except Exception as exc:  # noqa: BLE001 - recorded on the strike; the soak goes on
                s.error = repr(exc)
                progress(f"strike {kind} {target} failed: {exc!r}")

        th = threading.Thread(target=run, daemon=True)
        th.start()
        return th


    def _kill_agent(self, s: Strike, t0: float, until: float | None = None) -> None:
        agents = self.demo.agents
        if until is not None:  # the host that logs the fault's first route change, the moment it does
            s.target = host_name(first_route_change(agents, until) or int(s.target[1:]))
        h = int(s.target[1:])
        killed_mono = agents.kill(h)
        s.at = time.time() - (time.monotonic_ns() - killed_mono) / 1e9
        self.kills_by_host[h].append(s.at)
        s.mid_change = any(0 <= s.at - e["ts"] <= 0.05 for e in agents.events(h, "route_change"))
        time.sleep(self.rng.uniform(0.2, 3.0))
        before = len(agents.events(h))
        agents.restart(h)
        s.back = time.time()
        kernel = kernel_routes(self.demo.fab, h)
        new = agents.events(h)[before:]
        rec = next(e for e in new if e.get("event") == "routes_reconciled")
        s.stale, s.missing = judge(self.demo.fab, h, kernel, rec["installed"],
                                   [e for e in new if e.get("event") == "route_change"])
        if s.stale or s.missing:
            progress(f"{s.target} after its restart: stale {s.stale}, missing {s.missing}: kernel {kernel}, "
                     f"installed {rec['installed']}")

    def _kill_actor(self, s: Strike, handle) -> None:
        from linkpass.coordinator import ray_actor

        pid = ray_actor.actor_pid(handle)
        os.kill(pid, signal.SIGKILL)
        s.at = time.time()
        ray_actor.wait_restarted(handle, pid, timeout_s=120)
        s.back = time.time()

    def _kill_root(self, s: Strike, t0: float) -> None:
        from linkpass.coordinator import ray_actor

        self._kill_actor(s, ray_actor.existing())

    def _kill_shard(self, s: Strike, t0: float) -> None:
        from linkpass.coordinator import ray_actor

        self._kill_actor(s, ray_actor.shards()[int(s.target[5:])])

    def _kill_postgresql(self, s: Strike, t0: float) -> None:
        s.at = time.time()
        self.pg.restart()
        s.back = time.time()

    def _kill_prometheus(self, s: Strike, t0: float) -> None:
        s.at = time.time()
        self.demo.prom.restart()
        s.back = time.time()

    def outages(self) -> list[tuple[float, float]]:
        """When the root, a shard or PostgreSQL was away, the agents' way back included."""
        return [(s.at, (s.back or s.at) + OUTAGE_GRACE_S) for s in self.strikes
                if s.kind in COORDINATOR_SIDE and s.at is not None]


def first_route_change(agents, until: float) -> int | None:
    """The host whose agent logs a route change first from now on (its log tailed every 2 ms),
    or None by `until` (monotonic s)."""
    offsets = {h: os.path.getsize(agents.log_path(h)) for h in agents.hosts}
    rest = {h: b"" for h in agents.hosts}
    while time.monotonic() < until:
        for h in agents.hosts:
            with open(agents.log_path(h), "rb") as f:
                f.seek(offsets[h])
                chunk = f.read()
            offsets[h] += len(chunk)
            *lines, rest[h] = (rest[h] + chunk).split(b"\n")
            if any(b'"event": "route_change"' in line for line in lines):
                return h
        time.sleep(0.002)
    return None


def calm_routes(fab, hosts: list[int]) -> list[int]:
    """Hosts whose routes are not, within CALM_ROUTES_S, exactly every peer over every plane."""
    planes = tuple(range(fab.spec.planes))
    want = {h: {fab.service_addr(j): planes for j in range(fab.spec.hosts) if j != h} for h in hosts}
    deadline = time.monotonic() + CALM_ROUTES_S
    bad = list(hosts)
    while bad and time.monotonic() < deadline:
        bad = [h for h in bad if kernel_routes(fab, h) != want[h]]
        if bad:
            time.sleep(0.2)
    for h in bad:
        progress(f"{host_name(h)}'s routes at calm: {kernel_routes(fab, h)}")
    return bad


def bad_intervals(evs: list[dict], kills: list[float], until: float) -> list[tuple[int, str, float, float]]:
    """(path, peer, from, to) wall s of each interval an agent held a path bad, from its log: from
    a move to a bad state until the path is good again. Passing states (suspect, recovering) leave
    the evidence standing, as the coordinator reads them, so a path that goes down, recovering and
    degraded again between two reports is one interval. Restarts included: an incarnation's
    intervals end at its kill."""
    from linkpass.core.states import is_bad, is_good

    out, since, incarnation = [], {}, -1
    for e in evs + [{"event": "started", "ts": until}]:
        if e.get("event") == "started":
            end = kills[incarnation] if 0 <= incarnation < len(kills) else e["ts"]
            out += [(p, peer, t, end) for p, (peer, t) in since.items()]
            since, incarnation = {}, incarnation + 1
        elif e.get("event") == "path_state":
            if is_bad(e.get("new")):
                since.setdefault(e["path"], (e["peer"], e["ts"]))
            elif is_good(e.get("new")) and e["path"] in since:
                peer, t = since.pop(e["path"])
                out.append((e["path"], peer, t, e["ts"]))
    return out


def coordinator_history(demo) -> list[dict]:
    """Every detection and recovery in the coordinator's store, per host (the API's page bound
    is the newest 10 000: asked per host so no page is full)."""
    out = []
    with demo.client() as c:
        for h in demo.agents.hosts:
            got = c.get("/v1/events", kind="detection,recovery", host=host_name(h), limit=10000)
            if len(got) >= 10000:
                raise RuntimeError(f"{host_name(h)}: 10 000 events or more; the check would miss some")
            out += got
    return out


def lost_events(demo, chaos: Chaos, end: float) -> dict:
    history = coordinator_history(demo)
    outages = chaos.outages()
    # a path to a host whose agent is down is DOWN here, but no other path to that peer answers to
    # confirm it, so its agent reports it suspect, by design (no evidence against any link)
    peer_down = {host_name(int(s.target[1:])): [] for s in chaos.strikes if s.kind == "agent"}
    for s in chaos.strikes:
        if s.kind == "agent" and s.at is not None:
            peer_down[s.target].append((s.at, (s.back or end) + 1.0))
    checked = in_outage = lost = lost_in_outage = summarized = peer_agent_down = 0
    examples = []
    for h in demo.agents.hosts:
        name = host_name(h)
        for path, peer, a, b in bad_intervals(demo.agents.events(h), chaos.kills_by_host[h], end):
            if b - a < LOST_MIN_S:
                continue
            if any(a <= d_end and d_start <= b for d_start, d_end in peer_down.get(peer, ())):
                peer_agent_down += 1
                continue
            overlaps = any(a - OUTAGE_GRACE_S <= o_end and o_start <= b for o_start, o_end in outages)
            checked += 1
            in_outage += overlaps
            seen = [e for e in history if e["kind"] == "detection" and a - 1 <= e["ts"] <= b + OUTAGE_GRACE_S
                    and (e["subject"] == f"{name}/{path}" or (e["actor"] == name and e["detail"].get("summary")))]
            summarized += bool(seen) and all(e["detail"].get("summary") for e in seen)
            if not seen:
                lost_in_outage += overlaps
                lost += not overlaps
                if len(examples) < 10:
                    examples.append({"host": name, "path": path, "peer": peer, "from": round(a, 3), "to": round(b, 3),
                                     "in_outage": overlaps})
    return {"checked": checked, "in_outage": in_outage, "lost": lost, "lost_in_outage": lost_in_outage,
            "covered_by_summary": summarized, "peer_agent_down_not_checked": peer_agent_down, "examples": examples}


def row_chaos(quick: bool) -> list[dict]:
    """The `chaos` rows (see the comment above Strike)."""
    import argparse as _argparse
    from contextlib import ExitStack

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from support.pgserver import PostgresServer  # the tests' real PostgreSQL server (TLS, SCRAM)

    from linkpass.demo.run import Demo
    from linkpass.demo.script import SCRIPT
    from linkpass.testbed.ports import free_port as lab_port

    seconds = CHAOS_QUICK_S if quick else CHAOS_S
    rng = random.Random(29)

    def unwind(signum, frame):  # a SIGTERM (a timeout, an operator) removes what the soak made
        raise SystemExit(f"stopped by signal {signum}")

    # pyroute2 forks a helper per namespace and SIGTERMs it: in a child the default must stand,
    # or the helper unwinds into this code and runs on as a second soak
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    signal.signal(signal.SIGTERM, unwind)
    work = tempfile.mkdtemp(prefix="linkpass-bench-chaos-")
    dargs = _argparse.Namespace(prefix="lpchao", keep=False, out=work, output="table", faults=None, size_mb=4.0,
                                plugin_size_mb=1.0, compute_ms=10.0, job_timeout_s=30.0, interval_ms=5.0,
                                compare=False, rto_min_ms=10, job="both")
    try:
        with ExitStack() as stack:
            pg = stack.enter_context(PostgresServer(tls=True))
            demo = Demo(dargs, stack)
            demo.build()
            demo.start_coordinator({"shards": 2, "shard_listen": [f"0.0.0.0:{lab_port()}" for _ in range(2)],
                                    **pg.settings})
            demo.start_agents()
            demo.start_prometheus()
            if demo.prom is None:
                raise RuntimeError("the chaos soak needs Prometheus (deploy/install-test-deps.sh installs it)")
            jobs = demo.start_jobs("chaos", linkpass=True)
            chaos = Chaos(demo, pg, rng)
            done, calm_checks, calm_bad, calm_bad_restarted, coordinator_wrong = [], 0, 0, 0, 0
            paths = demo.wait_coordinator(lambda st: True, 30)["paths"]

            def coordinator_calm() -> bool:
                """Whether the coordinator holds every path, up, within CALM_ROUTES_S."""
                return demo.wait_coordinator(lambda st: st["paths"] == paths and
                                             st["paths_by_state"].get("up") == paths, CALM_ROUTES_S) is not None
            restarted: set[int] = set()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                demo.wait_steady(jobs, True)
                bad = calm_routes(demo.fab, demo.agents.hosts)
                calm_checks += 1
                calm_bad += len(bad)
                calm_bad_restarted += len(set(bad) & restarted)
                coordinator_wrong += not coordinator_calm()
                restarted.clear()
                sc = rng.choice(SCRIPT)
                thread = chaos.strike_in(chaos.deal(), len(done) + 1, sc.hold_s) \
                    if rng.random() < STRIKE_SHARE else None
                done.append(demo.inject(jobs, len(done) + 1, sc))
                if thread is not None:
                    thread.join(timeout=180)
                    s = chaos.strikes[-1]
                    if s.kind == "agent":
                        restarted.add(int(s.target[1:]))
                    progress(f"  killed {s.target}" + (f", back after {s.back - s.at:.1f} s" if s.back else "") +
                             (" (mid-change)" if s.mid_change else "") + (f": {s.error}" if s.error else ""))
                if len(done) % 10 == 0:
                    progress(f"chaos: {len(done)} faults, {len(chaos.strikes)} kills, {end - time.monotonic():.0f} s "
                             "to go")
            demo.wait_steady(jobs, True)
            bad = calm_routes(demo.fab, demo.agents.hosts)
            calm_checks, calm_bad, calm_bad_restarted = calm_checks + 1, calm_bad + len(bad), \
                calm_bad_restarted + len(set(bad) & restarted)
            coordinator_wrong += not coordinator_calm()
            lost = lost_events(demo, chaos, time.time())
            lost["coordinator_state_wrong_at_calm"] = coordinator_wrong
            lost["calm_checks"] = calm_checks
            runs = demo.finish_run("chaos", jobs, done, linkpass=True)
            fired = demo.fired
    finally:
        if os.environ.get("LINKPASS_BENCH_KEEP"):
            progress(f"the chaos soak's logs are kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return chaos_rows(seconds, done, chaos, runs, fired, lost, calm_checks, calm_bad, calm_bad_restarted)


def chaos_rows(seconds, done, chaos: Chaos, runs: dict, fired: list[dict], lost: dict, calm_checks: int,
               calm_bad: int, calm_bad_restarted: int) -> list[dict]:
    by_kind = Counter(s.kind for s in chaos.strikes)
    common = {"seconds": seconds, "faults": len(done), "faults_by_kind": dict(Counter(f.kind for f in done)),
              "kills": len(chaos.strikes), "kills_by_kind": dict(by_kind),
              "kills_failed": [f"{s.target}: {s.error}" for s in chaos.strikes if s.error],
              "via": "default testbed, root + 2 shard Ray actors, PostgreSQL (TLS), Prometheus, gloo + plugin jobs"}
    rows = []
    for job, run in runs.items():
        rows.append({"case": f"chaos-{job}", "metric": "collective_errors", "unit": "count", "n": run.steps,
                     "median": run.restarts, "p99": None, "job": job, **common})
        rows.append({"case": f"chaos-{job}", "metric": "wrong_results", "unit": "count", "n": run.steps,
                     "median": run.wrong_results, "p99": None, "job": job})
    agent_kills = [s for s in chaos.strikes if s.kind == "agent" and s.back is not None]
    rows.append({"case": "chaos-agent-restart", "metric": "stale_or_missing_routes", "unit": "count",
                 "n": len(agent_kills), "median": sum(s.stale + s.missing for s in agent_kills)
                 + calm_bad_restarted, "p99": None,
                 "right_after_reconcile": {"stale": sum(s.stale for s in agent_kills),
                                           "missing": sum(s.missing for s in agent_kills)},
                 "restarted_hosts_wrong_at_next_calm": calm_bad_restarted,
                 "killed_mid_change": sum(s.mid_change for s in agent_kills),
                 "any_host_wrong_at_calm": calm_bad, "calm_checks": calm_checks})
    rows.append({"case": "chaos-coordinator", "metric": "lost_events", "unit": "count", "n": lost["checked"],
                 "median": lost["lost"] + lost["lost_in_outage"], "p99": None, **lost,
                 "note": f"agent-held bad intervals of >= {LOST_MIN_S:g} s without a detection at the coordinator"})
    first = runs[next(iter(runs))]  # the faults' localization is the coordinator's, the same for each job
    near = {s.fault for s in chaos.strikes if s.kind in COORDINATOR_SIDE}
    after = [f for f in first.faults if f.index - 1 in near and f.index not in near]
    calm = [f for f in first.faults if f.index not in near and f.index - 1 not in near]
    during = [f for f in first.faults if f.index in near]
    pct = lambda fs: round(100 * sum(f.localized_ms is not None for f in fs) / len(fs), 1) if fs else None  # noqa: E731
    rows.append({"case": "chaos-localization", "metric": "localized_after_restart", "unit": "pct", "n": len(after),
                 "median": pct(after), "p99": None, "peer": "faults with no coordinator-side restart near them",
                 "peer_n": len(calm), "peer_median": pct(calm), "during_outage_n": len(during),
                 "during_outage_pct": pct(during),
                 "after_restart_by_kind": {f"{k}:{'localized' if ok else 'not'}": n for (k, ok), n in
                                           Counter((f.kind, f.localized_ms is not None) for f in after).items()}})
    rows.append({"case": "chaos-alerts", "metric": "still_firing_at_end", "unit": "count",
                 "n": sum(a["fired"] for a in fired), "median": sum(not a["cleared"] for a in fired), "p99": None,
                 "fired": {a["alert"]: a["fired"] for a in fired},
                 "faults_with_their_alert": sum(f.alert is not None for f in first.faults)})
    for kind in STRIKES:
        back = [round(s.back - s.at, 2) for s in chaos.strikes if s.kind == kind and s.back and s.at]
        if back:
            rows.append(row("chaos-restart", f"{kind}_back", "s", back))
    return rows


# ---- coordinator-flood ------------------------------------------------------------------------

HALF_SENT = 1000
MAX_CONNECTIONS = 256
READ_TIMEOUT_S = 2.0


def free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def start_server(work: str, port: int) -> subprocess.Popen:
    settings = {"state_dir": os.path.join(work, "state"), "listen": f"127.0.0.1:{port}",
                "max_connections": MAX_CONNECTIONS, "read_timeout_s": READ_TIMEOUT_S, "idle_timeout_s": 5.0}
    code = ("import time; from linkpass.coordinator import startup; "
            f"startup.start({settings!r}); print('up', flush=True); time.sleep(3600)")
    root = os.path.join(os.path.dirname(__file__), "..")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "sim")])}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    if proc.stdout.readline().strip() != "up":
        raise RuntimeError("the coordinator did not start")
    return proc


class Flood:
    """Half-sent requests kept open, and unauthenticated drains, until stop()."""

    def __init__(self, port: int, tls: ssl.SSLContext):
        self.port = port
        self.tls = tls
        self.stop_ = threading.Event()
        self.refused = 0
        self.reopened = 0
        self.threads = [threading.Thread(target=self._half_sent, daemon=True),
                        threading.Thread(target=self._unauthenticated, daemon=True)]

    def start(self) -> "Flood":
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stop_.set()
        for t in self.threads:
            t.join(timeout=30)

    def _open(self) -> socket.socket | None:
        try:
            # past the TLS handshake: what a flood holds is the request it never finishes
            sk = self.tls.wrap_socket(socket.create_connection(("127.0.0.1", self.port), timeout=5),
                                      server_hostname="127.0.0.1")
            sk.sendall(b"POST /v1/report HTTP/1.1\r\nHost: x\r\nContent-Le")
            sk.setblocking(False)
            return sk
        except OSError:
            return None

    def _half_sent(self) -> None:
        socks = [s for s in (self._open() for _ in range(HALF_SENT)) if s is not None]
        while not self.stop_.wait(0.2):
            for i, sk in enumerate(socks):
                try:
                    closed = sk.recv(1) == b""
                except (BlockingIOError, ssl.SSLWantReadError):
                    continue
                except OSError:
                    closed = True
                if closed:  # the server let it go: open another in its place
                    sk.close()
                    socks[i] = self._open() or sk
                    self.reopened += 1
        for sk in socks:
            sk.close()

    def _unauthenticated(self) -> None:
        c = Client(f"https://127.0.0.1:{self.port}", "not-a-token", timeout_s=5, tls=self.tls)
        while not self.stop_.is_set():
            try:
                c.post("/v1/drain", {"link": "p0l0-p0s0", "reason": "flood"})
            except Refusal:
                self.refused += 1
            except Unreachable:
                time.sleep(0.01)
        c.close()


def status_latencies(url: str, token: str, n: int, tls: ssl.SSLContext) -> tuple[list[float], int]:
    """ms per authenticated status call on a fresh connection; and how many got no answer."""
    out, failed = [], 0
    for _ in range(n):
        t = time.perf_counter()
        try:
            with Client(url, token, timeout_s=30, tls=tls) as c:
                c.get("/v1/status")
            out.append(round((time.perf_counter() - t) * 1000, 3))
        except (Refusal, Unreachable):
            failed += 1
        time.sleep(0.05)
    return out, failed


def error_counts(url: str, tls: ssl.SSLContext) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=30, context=tls).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("linkpass_coordinator_request_errors_total{"):
            kind = line.split('kind="')[1].split('"')[0]
            out[kind] = float(line.rsplit(" ", 1)[1])
    return out


def row_coordinator_flood(quick: bool) -> list[dict]:
    """The `coordinator-flood` row: status latency during a connection flood, against calm."""
    n = 20 if quick else 100
    work = tempfile.mkdtemp(prefix="linkpass-bench-flood-")
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    proc = start_server(work, port)
    try:
        state = os.path.join(work, "state")
        reader = open(os.path.join(state, "reader.token")).read().strip()
        secret = read_agent_secret(os.path.join(state, "agent.secret"))
        tls = build_client_context(lab_paths(lab_dir(state), "ca")[0])  # HTTPS with the lab CA, as agents
        for i in range(4):
            with Client(url, agent_token(secret, host_name(i)), tls=tls) as c:
                c.post("/v1/register", {"name": host_name(i), "agent_id": i + 1, "service": f"198.19.0.{i + 1}",
                                        "nics": {}, "paths": []})
        progress(f"no flood: {n} status calls")
        calm, calm_failed = status_latencies(url, reader, n, tls)
        before = error_counts(url, tls)
        flood = Flood(port, tls).start()
        time.sleep(3.0)  # the flood has filled the server's connections
        progress(f"flood: {HALF_SENT} half-sent connections, unauthenticated drains; {n} status calls")
        t = time.perf_counter()
        busy, busy_failed = status_latencies(url, reader, n, tls)
        flood.stop()
        window = time.perf_counter() - t + 3.0
        after = error_counts(url, tls)
    finally:
        proc.kill()
        proc.wait()
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return [row("coordinator-flood", "status_latency", "ms", busy, "same calls, no flood", calm,
                half_sent=HALF_SENT, max_connections=MAX_CONNECTIONS, read_timeout_s=READ_TIMEOUT_S,
                unanswered=busy_failed + calm_failed, closed_by_server=int(d.get("evicted", 0) + d.get("timeout", 0)),
                reopened=flood.reopened, refused_per_s=round(d.get("unauthenticated", 0) / window, 1),
                rate_limited_per_s=round(d.get("rate_limited", 0) / window, 1))]


# ---- actor-kill ---------------------------------------------------------------------------------
# The coordinator as the detached Ray actor (ray_actor.ensure, HTTPS with its lab CA) on the
# default testbed's fabric model (4 hosts, 2 planes), loaded by 4 agent identities that each
# register and then post one path change after another (down, up, ...; each with a reason no
# other change has) and an operator who drains and undrains leaf-spine links now and then. The
# actor's process is SIGKILLed at a random moment; every client retries the same request until
# it gets an answer, as agents do. Once Ray has restarted it and the load has run on for a
# while, the load pauses and what every 2xx answer promised is looked for: the event of each
# answered change (kind, path, reason), registration and drain; one undrain event per answered
# undrain; the drained links (`/v1/links`) as the operator's answers left them; and, after one
# more report each, every agent holding exactly those drains. Anything absent is `lost`.

ACTOR_KILLS, ACTOR_QUICK_KILLS = 20, 3
ACTOR_KILL_AFTER_S = (0.5, 3.0)  # the kill's moment after the load resumed (uniform)
ACTOR_HOSTS = 4
REPORT_GAP_S = 0.01  # between one agent's reports (~100 reports/s from the four)
RETRY_GAP_S = 0.05  # between a client's attempts while the coordinator does not answer
DRAIN_GAP_S = (0.2, 1.0)  # between the operator's drains and undrains
ANSWER_TIMEOUT_S = 5.0
SETTLE_S = 1.0  # load after the first answer of the new process, before the check


class Outage:
    """One kill: when it was sent, when the old process was gone, the first 2xx to a request
    sent after that, and the requests that failed meanwhile."""

    def __init__(self, kill_at: float):
        self.kill_at, self.dead_at, self.first_ok = kill_at, None, None
        self.failed = 0
        self.lock = threading.Lock()

    def ok(self, sent_at: float, at: float) -> None:
        with self.lock:
            if self.first_ok is None and self.dead_at is not None and sent_at >= self.dead_at:
                self.first_ok = at

    def fail(self) -> None:
        with self.lock:
            self.failed += 1


class LoadClient(threading.Thread):
    """A client that runs `step` until stopped, pausing between steps when `go` is clear; every
    request is retried until it gets an answer (a refusal other than 5xx is raised)."""

    def __init__(self, name: str, url: str, token: str, tls: ssl.SSLContext, go: threading.Event,
                 stop: threading.Event, run: "ActorKillRun"):
        super().__init__(name=name, daemon=True)
        self.client = Client(url, token, timeout_s=ANSWER_TIMEOUT_S, tls=tls)
        self.go, self.stop_, self.run_ = go, stop, run
        self.idle = threading.Event()
        self.answered = 0
        self.error: str | None = None
        self.rng = random.Random(name)

    def call(self, method: str, path: str, body: dict | None = None):
        while not self.stop_.is_set():
            sent = time.monotonic()
            try:
                doc = self.client.post(path, body) if method == "POST" else self.client.get(path)
            except Unreachable:
                self.run_.failed()
                time.sleep(RETRY_GAP_S)
                continue
            except Refusal as exc:
                if exc.status < 500:
                    raise
                self.run_.failed()
                time.sleep(RETRY_GAP_S)
                continue
            self.answered += 1
            self.run_.ok(sent)
            return doc
        raise InterruptedError

    def nap(self, seconds: float) -> None:
        """Sleep, cut short by a pause or the end."""
        deadline = time.monotonic() + seconds
        while self.go.is_set() and not self.stop_.is_set() and time.monotonic() < deadline:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def run(self) -> None:
        try:
            self.setup()
            while not self.stop_.is_set():
                if not self.go.is_set():
                    self.idle.set()
                    while not self.go.wait(0.1):
                        if self.stop_.is_set():
                            return
                    continue
                self.step()
        except InterruptedError:
            pass
        except Exception as exc:  # noqa: BLE001 - reported by the row, the others carry on
            self.error = repr(exc)
        finally:
            self.idle.set()

    def setup(self) -> None:
        pass

    def step(self) -> None:
        raise NotImplementedError


class AgentLoad(LoadClient):
    """One agent identity: registers, then flips one of its paths per report."""

    def __init__(self, host: str, table: list[dict], identity: dict, *args):
        super().__init__(host, *args)
        self.host, self.table, self.identity = host, table, identity
        self.states = {p["id"]: p["state"] for p in table}
        self.expected: list[tuple] = []  # (kind, subject, what) an event must carry for each 2xx
        self.drain_version = self.plan_version = None
        self.drains: set[str] = set()
        self.seq = 0

    def take(self, answer: dict) -> None:
        self.plan_version = answer.get("plan_version")
        if "drains" in answer:
            self.drains = {d["link"] for d in answer["drains"]}
        self.drain_version = answer.get("drain_version")

    def setup(self) -> None:
        self.take(self.call("POST", "/v1/register", {**self.identity, "paths": self.table}))
        self.expected.append(("agent", self.host, "registered"))

    def report(self, changes: list[dict]) -> dict:
        answer = self.call("POST", "/v1/report", {"name": self.host, "changes": changes,
                                                  "drain_version": self.drain_version,
                                                  "plan_version": self.plan_version})
        self.take(answer)
        return answer

    def step(self) -> None:
        pid = self.rng.choice(list(self.states))
        state = "up" if self.states[pid] == "down" else "down"
        self.seq += 1
        reason = f"{self.host}-{self.seq}"
        self.report([{"id": pid, "state": state, "reason": reason}])
        self.states[pid] = state
        self.expected.append(("detection" if state == "down" else "recovery", f"{self.host}/{pid}", reason))
        self.nap(REPORT_GAP_S)


class OperatorLoad(LoadClient):
    """Drains a leaf-spine link of a plane with none drained, or undrains one, now and then."""

    def __init__(self, links_by_plane: dict[int, list[str]], *args):
        super().__init__("operator", *args)
        self.links_by_plane = links_by_plane
        self.drained: dict[int, str] = {}  # plane -> the link drained there, as the answers say
        self.expected: list[tuple] = []  # ("drain", link, reason)
        self.undrains: Counter = Counter()  # link -> answered undrains (each one event)
        self.refused = 0
        self.seq = 0

    def step(self) -> None:
        self.nap(self.rng.uniform(*DRAIN_GAP_S))
        if not self.go.is_set() or self.stop_.is_set():
            return
        free = [p for p in self.links_by_plane if p not in self.drained]
        if self.drained and (not free or self.rng.random() < 0.5):
            plane = self.rng.choice(sorted(self.drained))
            link = self.drained[plane]
            self.call("POST", "/v1/undrain", {"link": link})
            del self.drained[plane]
            self.undrains[link] += 1
            return
        plane = self.rng.choice(free)
        link = self.rng.choice(self.links_by_plane[plane])
        self.seq += 1
        reason = f"actor-kill drain {self.seq}"
        try:  # force: the agents' paths come and go, a drain is not refused for stranding one
            self.call("POST", "/v1/drain", {"link": link, "reason": reason, "force": True})
        except Refusal:  # the blast-radius guard: not an answer that promised anything
            self.refused += 1
            return
        self.drained[plane] = link
        self.expected.append(("drain", link, reason))


class ActorKillRun:
    """The clients, the current outage, and what the store has shown so far."""

    def __init__(self, url: str, state: str, model, tls: ssl.SSLContext):
        from linkpass.core.names import LEAF_SPINE

        self.go, self.stop = threading.Event(), threading.Event()
        self.outage: Outage | None = None
        self.failed_total = 0
        self._lock = threading.Lock()
        secret = read_agent_secret(os.path.join(state, "agent.secret"))
        operator = open(os.path.join(state, "operator.token")).read().strip()
        self.reader = Client(url, open(os.path.join(state, "reader.token")).read().strip(), timeout_s=30, tls=tls)
        common = (url, None, tls, self.go, self.stop, self)
        self.agents = []
        for i, host in enumerate(model.hosts):
            table, pid = [], 1
            for peer in model.hosts:
                for plane in range(model.planes):
                    if peer == host:
                        continue
                    spines = (None,) if model.uplink(host, plane).b == model.uplink(peer, plane).b else (0, 1)
                    for spine in spines:
                        hops, dst = model.hops_of(host, peer, plane, spine)
                        table.append({"id": pid, "peer": peer, "plane": plane, "sport": 49152 + pid, "hops": hops,
                                      "peer_addr": dst, "state": "up", "reason": None})
                        pid += 1
            identity = {"name": host, "agent_id": i + 1, "service": f"198.19.0.{i + 1}",
                        "nics": {str(p): model.uplink(host, p).a_addr for p in range(model.planes)},
                        "version": "actor-kill"}
            args = list(common)
            args[1] = agent_token(secret, host)
            self.agents.append(AgentLoad(host, table, identity, *args))
        by_plane: dict[int, list[str]] = {}
        for lk in model.links.values():
            if lk.kind == LEAF_SPINE:
                by_plane.setdefault(lk.plane, []).append(lk.name)
        args = list(common)
        args[1] = operator
        self.operator = OperatorLoad(by_plane, *args)
        self.clients: list[LoadClient] = [*self.agents, self.operator]
        self.seen: set[tuple] = set()  # (kind, subject, what) of every event read so far
        self.undrain_events: Counter = Counter()
        self.last_id = 0
        self.checked: set[tuple] = set()  # expectations judged by an earlier check
        self.missing_undrains = 0

    def ok(self, sent_at: float) -> None:
        o = self.outage
        if o is not None:
            o.ok(sent_at, time.monotonic())

    def failed(self) -> None:
        o = self.outage
        with self._lock:
            self.failed_total += 1
        if o is not None:
            o.fail()

    def start(self) -> None:
        self.go.set()
        for c in self.clients:
            c.start()

    def pause(self) -> None:
        self.go.clear()
        for c in self.clients:
            if not c.idle.wait(120):
                raise RuntimeError(f"{c.name} did not pause within 120 s")

    def resume(self) -> None:
        for c in self.clients:
            c.idle.clear()
        self.go.set()

    def end(self) -> None:
        self.stop.set()
        self.go.set()
        for c in self.clients:
            c.join(timeout=30)
            c.client.close()
        self.reader.close()

    def read_events(self) -> None:
        while True:
            page = self.reader.get("/v1/events", after=self.last_id, limit=10_000)
            for ev in page:
                self.last_id = max(self.last_id, ev["id"])
                d = ev["detail"]
                if ev["kind"] == "undrain":
                    self.undrain_events[ev["subject"]] += 1
                what = d.get("what") if ev["kind"] == "agent" else d.get("reason")
                self.seen.add((ev["kind"], ev["subject"], what))
            if len(page) < 10_000:
                return

    def check(self) -> dict:
        """With the load paused: what the answers so far promised and the store does not hold."""
        self.read_events()
        expected = [e for c in self.clients for e in c.expected]
        new = [e for e in expected if e not in self.checked]
        missing = [e for e in new if e not in self.seen]
        self.checked.update(new)
        short = sum(max(0, n - self.undrain_events[lk]) for lk, n in self.operator.undrains.items())
        missing_undrains, self.missing_undrains = short - self.missing_undrains, short
        drained = {r["link"] for r in self.reader.get("/v1/links") if r["drain"]}
        want = set(self.operator.drained.values())
        for a in self.agents:  # one more report each: the drains every agent then holds
            a.report([])
        stale = sum(1 for a in self.agents if a.drains != drained)
        return {"missing_events": len(missing), "missing_undrains": missing_undrains,
                "drains_wrong": len(drained ^ want), "agents_with_stale_drains": stale, "examples": missing[:5],
                "answered_expectations": len(new)}


def row_actor_kill(quick: bool) -> list[dict]:
    """The `actor-kill` row: what answered requests lost when the coordinator actor is SIGKILLed."""
    from linkpass.coordinator import ray_actor
    from linkpass.core.fabric import rail_optimized

    kills = ACTOR_QUICK_KILLS if quick else ACTOR_KILLS
    rng = random.Random(3)
    model = rail_optimized(ACTOR_HOSTS, 2, 2, 2, addressed=True)  # the default testbed's shape
    work = tempfile.mkdtemp(prefix="linkpass-bench-actorkill-")
    state = os.path.join(work, "state")
    settings = {"state_dir": state, "listen": f"127.0.0.1:{free_port()}", "fabric_model": model.to_dict()}
    ray_actor.connect(num_cpus=2)
    handle = run = None
    lost, restart_ms, ray_ms, failed, totals = [], [], [], [], Counter()
    examples: list = []
    t_load = time.monotonic()
    try:
        if ray_actor.existing() is not None:
            raise RuntimeError("a coordinator actor already runs in this Ray cluster; the row makes its own")
        handle, url = ray_actor.ensure(settings)
        tls = build_client_context(lab_paths(lab_dir(state), "ca")[0])
        run = ActorKillRun(url, state, model, tls)
        run.start()
        for k in range(kills):
            time.sleep(rng.uniform(*ACTOR_KILL_AFTER_S))
            pid = ray_actor.actor_pid(handle)
            outage = Outage(time.monotonic())
            run.outage = outage
            os.kill(pid, signal.SIGKILL)
            while _alive(pid):
                time.sleep(0.001)
            outage.dead_at = time.monotonic()
            ray_actor.wait_restarted(handle, pid, timeout_s=120)
            ray_ms.append((time.monotonic() - outage.kill_at) * 1000)
            deadline = time.monotonic() + 60
            while outage.first_ok is None and time.monotonic() < deadline:
                time.sleep(0.01)
            if outage.first_ok is None:
                raise RuntimeError(f"kill {k + 1}: no request was answered within 60 s of the restart")
            restart_ms.append(round((outage.first_ok - outage.kill_at) * 1000, 1))
            time.sleep(SETTLE_S)
            run.pause()
            run.outage = None
            failed.append(outage.failed)
            got = run.check()
            bad = got["missing_events"] + got["missing_undrains"] + got["drains_wrong"] + got["agents_with_stale_drains"]
            lost.append(bad)
            totals.update({k2: v for k2, v in got.items() if isinstance(v, int)})
            examples += got["examples"]
            progress(f"kill {k + 1}/{kills}: answer again after {restart_ms[-1]:.0f} ms (Ray: {ray_ms[-1]:.0f} ms), "
                     f"{outage.failed} requests failed meanwhile, lost {bad} "
                     f"({', '.join(f'{n} {v}' for n, v in got.items() if isinstance(v, int) and v)})")
            run.resume()
        seconds = time.monotonic() - t_load
        errors = {c.name: c.error for c in run.clients if c.error}
        if errors:
            raise RuntimeError(f"load clients failed: {errors}")
    finally:
        if run is not None:
            run.end()
        h = ray_actor.existing()
        if h is not None:
            ray_actor.stop(h)
        ray_actor.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    answered = sum(c.answered for c in run.clients)
    common = {"kills": kills, "agents": ACTOR_HOSTS, "requests_answered": answered,
              "answered_per_s": round(answered / seconds, 1), "failed_during_outages": sum(failed),
              "failed_per_outage_median": statistics.median(failed) if failed else None,
              "via": "ray_actor (detached, max_restarts=-1), HTTPS, SIGKILL of the actor's process"}
    return [row("actor-kill", "lost", "count", lost, total=sum(lost), events_answered=totals["answered_expectations"],
                undrains_answered=sum(run.operator.undrains.values()), missing_events=totals["missing_events"],
                missing_undrains=totals["missing_undrains"], drains_wrong=totals["drains_wrong"],
                agents_with_stale_drains=totals["agents_with_stale_drains"], drains_refused=run.operator.refused,
                missing_examples=[list(e) for e in examples[:10]], **common),
            row("actor-kill", "restart_to_answer", "ms", restart_ms,
                ray_restart_ms_median=round(statistics.median(ray_ms), 1) if ray_ms else None, **common)]


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie waiting for Ray to reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


ROWS: dict[str, Callable[[bool], list[dict] | dict]] = {
    "fuzz": row_fuzz,
    "spoof": row_spoof,
    "junk-cost": row_junk_cost,
    "agent-sigkill": row_agent_sigkill,
    "coordinator-flood": row_coordinator_flood,
    "actor-kill": row_actor_kill,
    "soak": row_soak,
    "chaos": row_chaos,
}


def show(rows: list[dict]) -> None:
    print(f"{'case':34} {'metric':16} {'unit':6} {'n':>8} {'median':>12} {'peer median':>12} {'ratio':>8}  via")
    for r in rows:
        print(f"{r['case']:34} {r['metric']:16} {r['unit']:6} {r['n']:>8} {str(r['median']):>12} "
              f"{str(r.get('peer_median', '')):>12} {str(r.get('ratio', '')):>8}  {r.get('via', '')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short runs (smoke test)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from: {', '.join(ROWS)}")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        ap.error(f"--rows: unknown {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    if {"agent-sigkill", "soak", "chaos"} & set(names) and not report.require_root():
        return 2
    rows: list[dict] = []
    for name in names:
        report.progress(f"row {name}")
        out = ROWS[name](args.quick)
        rows += [out] if isinstance(out, dict) else out
    show(rows)
    report.write(report.document("reliability", rows, quick=args.quick), args.json)
    crashed = [r for r in rows if r["case"] == "fuzz" and r["metric"] == "crashes" and r["median"]]
    misfired = [k for r in rows for k in r.get("kills_failed") or ()]  # a chaos strike that did not happen
    for k in misfired:
        report.progress(f"a chaos strike failed: {k}")
    return 1 if crashed or misfired else 0


if __name__ == "__main__":
    sys.exit(main())
