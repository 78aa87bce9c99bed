"""Fleet-scale simulator: a 16 384-GPU fabric's failures, LinkPass's real decisions, the job's goodput.

    python -m linkpass_sim.fleet [--gpus 16384] [--days 1] [--scenario llama3|clockwork|stress]
                                 [--seed 1] [--report DIR] [-o json]

One machine cannot run 2 048 agents probing at 1 kHz for a day (4·10^12 probes), but it does not
need to: a path's detector only has something to decide while a fault touches it. So:

    failures.draw ─► failures in time order (published rates; failures.py)
    each network failure ─► the fabric effects it has (which directed links drop what, when)
        ─► every path (probe plan + the job's own peers) crossing those links ─► their agents
        ─► per agent: the real Failover/Detector/decide code, on virtual time, over every path to
           the peers concerned, probed at 1 kHz from ~3 s before the fault (virtual.py)
        ─► transitions, plane and port decisions ─► the job's stall (its flows' paths vs. the
           fault) ─► reports at the agents' cadence ─► the real Localizer (fleet-wide, holding
           every healthy path) at the coordinator's tick ─► when and what it names
    every failure ─► a job Hit, with and without LinkPass ─► jobmodel.run ─► goodput

Healthy paths far from any fault are not stepped: their detectors would only confirm UP. Their
false-alarm rate is the testbed's soak measure, not this simulator's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import numpy as np

from linkpass.agent.config import AgentConfig, CoordinatorLinkConfig
from linkpass.core.decide import PathInfo
from linkpass.core import wire
from linkpass.core.activity import ACTIVE, IDLE, PROGRESSING, RATES, STANDBY, Activity, LaneSeen, PathKey
from linkpass.core.constants import COORDINATOR_TICK_S, PROBE_PORT_BASE, REPORT_HEARTBEAT_S
from linkpass.core.detector import DetectorConfig
from linkpass.kernel import heap
from linkpass.core.fabric import DOWN, HOST_LEAF, LEAF_SPINE, UP, FabricError, FabricModel, directed, generated, split_directed
from linkpass.core.names import plane_of
from linkpass.core.localize import Localizer, Observation, path_evidence
from linkpass.core.plan import plan_probes
from linkpass.core.shards import ShardedLocalizer, ShardError, ShardMap
from linkpass.core.telemetry import percentile

from . import failures as fm
from . import jobmodel
from .failures import Failure, Shape
from .virtual import MS, Effect, Rtt, VirtualAgent, VirtualPath, peer_addr

NS = 1_000_000_000


@dataclass(frozen=True)
class SimConfig:
    interval_ns: int = round(AgentConfig.interval_ms * MS)  # the agent's default: 1 kHz
    job_paths_per_peer: int = 4  # ECMP paths (spines) the job's QPs to one peer spread over, all probed
    size_every: int = AgentConfig.size_probe_every
    rtt: Rtt = Rtt(8_000, 2_000)  # three switches and two NICs at 400 Gb/s
    # paths start probing at random within the first half of this before the fault: more than a
    # cycle of the sensitive loss test (~1.2 s) later, its phase is random (calibration.py)
    warm_ns: int = 3_000_000_000
    report_ns: int = CoordinatorLinkConfig.report_ms * MS  # agents report changes this often
    tick_ns: int = round(COORDINATOR_TICK_S * 1e9)  # the coordinator localizes this often
    hard_window_ns: int = 1 * NS  # longest a hard fault is followed (detection takes ms)
    gray_window_ns: int = 3 * NS  # gray faults: the sensitive SPRT needs ~1.5 s at 1 % loss
    resume_ms: float = 35.0  # after the move, the transport resends (demo, TCP: stall - reroute)
    go_back_n_packets: int = 100  # ASSUMED: packets RoCE resends per loss (BDP of 400G x 8 us / 4 KB)
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    shards: int = 1  # coordinator shards the evidence is split over (core/shards.py); 1: one localizer


class SimPath(NamedTuple):  # a tuple: the 131 072-GPU fleet makes 1.5 million of them
    reporter: str
    peer: str
    plane: int
    spine: int | None
    core: int | None
    key: str
    forward: tuple[str, ...]
    reverse: tuple[str, ...]
    job: bool  # the job's traffic uses it (else a probe-plan path)


class Fleet:
    """The model, the real probe plan, the job's ring peers and every path an agent probes."""

    def __init__(self, shape: Shape, config: SimConfig | None = None, seed: int = 0):
        self.shape = shape
        self.config = config or SimConfig()
        with heap.collector_paused():  # millions of paths, none of them garbage (linkpass/kernel/heap.py)
            self._build(seed)

    def _build(self, seed: int) -> None:
        shape = self.shape
        self.model: FabricModel = generated(shape.layout())
        self.plan = plan_probes(self.model, seed=seed)
        self.paths: list[SimPath] = []
        self.by_link: dict[str, list[int]] = defaultdict(list)
        by_link = self.by_link
        self.by_pair: dict[tuple[str, str], list[int]] = defaultdict(list)
        by_pair = self.by_pair
        seen: set[tuple] = set()
        m = self.model
        hosts = m.hosts
        spines, cores = shape.spines_per_pod, max(1, shape.cores_per_group)
        k_paths = min(self.config.job_paths_per_peer, spines * cores)
        # each host's leaf per plane and each leaf's pod, looked up once (millions of paths ask)
        leaf = {(h, p): m.leaf_of(h, p) for h in hosts for p in range(m.planes)}
        pod = {}
        for lf in set(leaf.values()):
            try:
                pod[lf] = m.pod_of(lf)
            except FabricError:  # a leaf meeting no spine: in no pod
                pass

        def add(reporter, peer, plane, spine, core, job):
            # keyed on the ECMP choice asked for, as the 16 384-GPU figures were made: a same-leaf
            # peer gets one path per choice, all crossing the same links
            key = (reporter, peer, plane, spine, core)
            if key in seen:
                return
            seen.add(key)
            a, b = leaf[reporter, plane], leaf[peer, plane]
            if a == b:
                spine = core = None
            elif pod.get(a) == pod.get(b):
                core = None
            fwd = m.node_path(reporter, peer, plane, spine, core)
            rev = m.reversed_path(fwd)  # the replies return the same way
            i = len(self.paths)
            self.paths.append(SimPath(reporter, peer, plane, spine, core, f"{reporter}/{i}", fwd, rev, job))
            for d in fwd + rev:  # no link is in both, nor twice in one: they go opposite ways
                by_link[d].append(i)
            by_pair[(reporter, peer)].append(i)

        n = len(hosts)
        for i, h in enumerate(hosts):  # the job: a ring over hosts on every rail, both neighbours
            if n < 2:
                break
            for peer in sorted({hosts[(i + 1) % n], hosts[(i - 1) % n]} - {h}):  # stable keys across processes
                for plane in range(shape.rails):
                    for k in range(k_paths):
                        route = (i + plane) * cores + k * spines * cores // k_paths  # spread over spines
                        add(h, peer, plane, route // cores % spines, route % cores, True)
        for h, planned in self.plan.paths.items():
            for p in planned:
                add(h, p.peer, p.plane, 0 if p.spine is None else p.spine, 0 if p.core is None else p.core, False)
        self.localizer = (Localizer(self.model, pause=heap.collector_paused) if self.config.shards == 1 else
                          ShardedLocalizer(self.model, ShardMap(self.model, self.config.shards),
                                           pause=heap.collector_paused))
        for sp in self.paths:
            self.localizer.update(Observation(sp.reporter, sp.key, sp.forward, None, False))
        if isinstance(self.localizer, ShardedLocalizer):
            self.localizer.send()  # the parts take the healthy fleet in now, as shards do when agents register

    # ---- what a failure does to the fabric -----------------------------------------------------
    def effects(self, f: Failure, t0_ns: int) -> list[Effect]:
        m = self.model
        end = t0_ns + int(f.duration_s * NS)
        if f.kind in ("cable", "nic", "flap"):
            host, plane = f.target
            name = m.uplink(host, plane).name
            both = frozenset({directed(name, UP), directed(name, DOWN)})
            if f.kind == "flap":
                return [Effect(both, "flap", t0_ns, end, flap_ns=int(f.flap_half_ms * MS))]
            return [Effect(both, "down", t0_ns, end)]
        if f.kind == "switch":
            (leaf,) = f.target
            plane = plane_of(leaf)
            names = [m.uplink(h, plane).name for h in m.hosts_of_leaf(leaf)]
            names += [m.leaf_spine(leaf, s).name for s in range(m.spines_per_pod(plane))]
            return [Effect(frozenset(directed(n, d) for n in names for d in (UP, DOWN)), "down", t0_ns, end)]
        if f.kind == "gray":
            link, direction = f.target
            return [Effect(frozenset({directed(link, direction)}), "loss", t0_ns, end, loss=f.loss)]
        raise ValueError(f"failure kind {f.kind!r} acts on no link")


@dataclass
class Outcome:
    """What LinkPass did about one network failure, as the simulation saw it."""

    kind: str
    t_s: float
    paths: int = 0  # paths crossing the faulted links
    agents: int = 0
    detect_ms: list = field(default_factory=list)  # per crossing path that turned unusable
    localized_ms: float | None = None  # None: no finding named a faulted link
    false_findings: int = 0
    stall_ms: float = 0.0  # the job's flows stalled (union over its flows) + the transport's resume
    exposed_ms: float = 0.0  # gray: the job's flows crossed the lossy link this long
    exposed_at_end: bool = False  # gray: and still did when the window ended (not detected)
    unrecovered: bool = False  # a job flow still crossed a dead link when the window ended
    lost_share: float = 0.0  # the worst host's bandwidth share left out afterwards
    reports: int = 0  # path state changes the agents sent the coordinator
    findings_ms: list = field(default_factory=list)  # wall time of each Localizer.findings() call
    wall_s: float = 0.0

    @property
    def localized(self) -> bool:
        return self.localized_ms is not None


def _window_end(f: Failure, t0: int, cfg: SimConfig) -> int:
    if f.kind == "flap":
        return t0 + int(f.duration_s * NS)
    if f.kind == "gray":
        return t0 + min(int(f.duration_s * NS), cfg.gray_window_ns)
    return t0 + min(int(f.duration_s * NS), cfg.hard_window_ns)


def simulate(fleet: Fleet, f: Failure, rng: np.random.Generator) -> Outcome:
    """Run LinkPass's agents and localizer against one network failure (see the module doc)."""
    wall = time.perf_counter()
    cfg = fleet.config
    t0 = cfg.warm_ns + int(rng.integers(0, cfg.interval_ns))
    effects = fleet.effects(f, t0)
    end = _window_end(f, t0, cfg)
    bad_links = frozenset().union(*(e.links for e in effects))
    crossing = sorted({i for d in bad_links for i in fleet.by_link.get(d, ())})
    out = Outcome(f.kind, f.t_s, paths=len(crossing))
    by_reporter: dict[str, set[str]] = {}
    for i in crossing:
        sp = fleet.paths[i]
        by_reporter.setdefault(sp.reporter, set()).add(sp.peer)
    out.agents = len(by_reporter)
    crossing_set = set(crossing)
    grid = np.arange(t0, end, 100_000, dtype=np.int64)  # 0.1 ms: the stall's resolution
    stalled = np.zeros(len(grid), bool)
    exposed = np.zeros(len(grid), bool)
    timeline: list[tuple[int, int, str, str]] = []  # (time, path index, state, reason) of every transition
    for reporter in sorted(by_reporter):
        agent, local = _agent(fleet, reporter, sorted(by_reporter[reporter]), effects, rng)
        watched = [pid for pid, i in local.items() if i in crossing_set]

        def settled(agent=agent, watched=watched):
            fo = agent.failover
            # detected everywhere and decided: nothing more happens until the fault changes
            return (agent.now_ns > t0 and f.kind != "flap" and not fo._pending
                    and all(not agent.state(pid).usable for pid in watched))

        agent.run_until(t0 - 20 * MS, batch_ns=100 * MS)
        agent.run_until(end, stop=settled)
        for t in agent.transitions:
            timeline.append((t.at_ns, local[t.path], t.new.value, t.reason.value))
        first_bad: dict[int, int] = {}
        for t in agent.transitions:
            if t.at_ns >= t0 and not t.new.usable and t.path in watched and t.path not in first_bad:
                first_bad[t.path] = t.at_ns
        out.detect_ms += [(first_bad[pid] - t0) / MS for pid in watched if pid in first_bad]
        s, x = _job_stall(fleet, agent, local, crossing_set, effects, grid)
        stalled |= s
        exposed |= x
    episodes = int(np.count_nonzero(stalled[1:] & ~stalled[:-1]) + (1 if len(stalled) and stalled[0] else 0))
    out.stall_ms = float(np.count_nonzero(stalled)) / 10 + episodes * cfg.resume_ms
    out.exposed_ms = float(np.count_nonzero(exposed)) / 10
    # still on a dead path when the window closes: NCCL will give up (a flap burst ends instead)
    out.unrecovered = bool(len(grid) and stalled[-1]) and f.kind != "flap"
    out.exposed_at_end = bool(len(grid) and exposed[-1])
    out.lost_share = _lost_share(fleet, f)
    _localize(fleet, out, timeline, t0, end, bad_links, rng)
    out.wall_s = time.perf_counter() - wall
    return out


def _agent(fleet: Fleet, reporter: str, peers: list[str], effects: list[Effect], rng):
    """A VirtualAgent for `reporter` with every path to `peers`; returns it and pid -> path index."""
    cfg = fleet.config
    agent = VirtualAgent(reporter, cfg.detector, rng, cfg.interval_ns, batch_phase_ns=int(rng.integers(0, 10 * MS)))
    local: dict[int, int] = {}
    for peer in peers:
        for i in fleet.by_pair[(reporter, peer)]:
            sp = fleet.paths[i]
            pid = len(local) + 1
            local[pid] = i
            info = PathInfo(pid, peer, sp.plane, PROBE_PORT_BASE + pid, peer_addr(peer, sp.plane))
            vp = VirtualPath(info, sp.forward, sp.reverse, cfg.interval_ns,
                             int(rng.integers(0, cfg.warm_ns // 2)), cfg.size_every, cfg.rtt,
                             size_offset=int(rng.integers(0, cfg.size_every)))
            vp.fwd_effects = [e for e in effects if e.links.intersection(sp.forward)]
            vp.rev_effects = [e for e in effects if e.links.intersection(sp.reverse)]
            agent.add_path(vp)
    return agent, local


def _dead(sp: SimPath, effects: list[Effect], grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dropping everything, lossy) over the grid for one path, either way."""
    dead = np.zeros(len(grid), bool)
    lossy = np.zeros(len(grid), bool)
    links = set(sp.forward) | set(sp.reverse)
    for e in effects:
        if e.links & links:
            dead |= e.dropping(grid)
            if e.kind == "loss":
                lossy |= e.active(grid)
    return dead, lossy


def _job_stall(fleet: Fleet, agent: VirtualAgent, local: dict[int, int], crossing: set[int],
               effects: list[Effect], grid: np.ndarray):
    """When the job's flows from this agent's host crossed a dead (or lossy) path. The job talks
    to the peers it has job paths to; a flow to a peer uses, on every plane the agent routes to
    that peer, every port its entropy entry lists (the QPs spread over them)."""
    stalled = np.zeros(len(grid), bool)
    exposed = np.zeros(len(grid), bool)
    paths = agent.failover.paths
    job_peers = {paths[pid].peer for pid, i in local.items() if fleet.paths[i].job}
    hit_peers = {paths[pid].peer for pid, i in local.items() if i in crossing} & job_peers
    for peer in sorted(hit_peers):
        for plane in sorted({paths[pid].plane for pid in local if paths[pid].peer == peer}):
            ids = [pid for pid in local if paths[pid].peer == peer and paths[pid].plane == plane]
            if not any(local[pid] in crossing for pid in ids):
                continue
            in_use = _in_use(agent, peer, plane, ids, grid)
            for pid in ids:
                if local[pid] in crossing:
                    dead, lossy = _dead(fleet.paths[local[pid]], effects, grid)
                    stalled |= in_use[pid] & dead
                    exposed |= in_use[pid] & lossy
    return stalled, exposed


def _in_use(agent: VirtualAgent, peer: str, plane: int, ids: list[int], grid: np.ndarray) -> dict[int, np.ndarray]:
    """Per path: whether the job's traffic to `peer` uses it, over the grid (from the agent's
    plane choices and entropy entries, as the data path would apply them)."""
    changes: list[tuple[int, int, object]] = []  # (time, order, ("planes", tuple) | ("ports", set))
    addr = peer_addr(peer, plane)
    for n, (t, p, planes) in enumerate(agent.plane_log):
        if p == peer:
            changes.append((t, n, ("planes", planes)))
    for n, (t, a, pl, path_ids, flags) in enumerate(agent.entropy_log):
        if a == addr and pl == plane:
            changes.append((t, n, ("ports", set(path_ids))))
    changes.sort(key=lambda c: (c[0], c[1]))
    use = {pid: np.zeros(len(grid), bool) for pid in ids}
    planes: tuple = ()
    ports: set = set(ids)
    bounds = [c[0] for c in changes] + [int(grid[-1]) + 1 if len(grid) else 0]
    start = int(grid[0]) if len(grid) else 0
    for j, (t, _, (what, value)) in enumerate(changes):
        if what == "planes":
            planes = value
        else:
            ports = value
        lo = max(t, start)
        hi = bounds[j + 1]
        if hi <= lo:
            continue
        a, b = np.searchsorted(grid, lo), np.searchsorted(grid, hi)
        if plane in planes or not planes:  # no plane usable: the installed route stays (fail static)
            for pid in ids:
                if pid in ports:
                    use[pid][a:b] = True
    return use


def _lost_share(fleet: Fleet, f: Failure) -> float:
    """Bandwidth share the worst host loses while the failure lasts (LinkPass keeps it out)."""
    if f.kind in ("cable", "nic", "switch", "flap"):
        return 1 / fleet.shape.rails  # a host loses one plane of its rails
    if f.kind == "gray":
        name, _ = f.target
        kind = fleet.model.link(name).kind
        shape = fleet.shape
        if kind == HOST_LEAF:
            return 1 / shape.rails
        if kind == LEAF_SPINE:
            return 1 / (shape.rails * shape.spines_per_pod)
        return 1 / (shape.rails * shape.spines_per_pod * shape.cores_per_group)  # one of a pod's (spine, core) routes
    return 0.0


def _localize(fleet: Fleet, out: Outcome, timeline, t0: int, end: int, bad_links: frozenset, rng) -> None:
    """Feed the agents' reports to the fleet-wide localizer at the coordinator's cadence; record
    when a finding first names a faulted link, and what else it named at the end."""
    cfg = fleet.config
    loc = fleet.localizer
    reporters = sorted({fleet.paths[i].reporter for _, i, _, _ in timeline})
    phase = {r: int(rng.integers(0, cfg.report_ns)) for r in reporters}
    updates: list[tuple[int, int, tuple]] = []  # (arrival at the coordinator, path index, evidence)
    last: dict[int, tuple] = {}
    for t, i, state, reason in sorted(timeline):
        r = fleet.paths[i].reporter
        at = t + (phase[r] - t) % cfg.report_ns + MS  # next report, ~1 ms on the wire
        ev = path_evidence(state, reason)
        out.reports += 1
        if ev is not None:
            updates.append((at, i, ev))
    updates.sort()
    tick = t0 + int(rng.integers(0, cfg.tick_ns))
    horizon = end + cfg.report_ns + 2 * cfg.tick_ns
    touched: set[int] = set()
    bad_names = {split_directed(d)[0] for d in bad_links}
    k = 0
    findings = []
    while tick <= horizon:
        dirty = False
        while k < len(updates) and updates[k][0] <= tick:
            _, i, (bad, direction) = updates[k]
            k += 1
            if last.get(i) == (bad, direction):
                continue
            last[i] = (bad, direction)
            sp = fleet.paths[i]
            loc.update(Observation(sp.reporter, sp.key, sp.forward, None, bad, direction))
            touched.add(i)
            dirty = True
        if dirty:
            t = time.perf_counter()
            findings = loc.findings()
            out.findings_ms.append((time.perf_counter() - t) * 1000)
            if out.localized_ms is None and any(
                    split_directed(d)[0] in bad_names for fd in findings for d in (fd.directed, *fd.alternatives)):
                out.localized_ms = (tick - t0) / MS
        if k >= len(updates) and tick >= end:
            break
        tick += cfg.tick_ns
    out.false_findings = sum(1 for fd in findings
                             if not any(split_directed(d)[0] in bad_names for d in (fd.directed, *fd.alternatives)))
    for i in touched:  # the fault is repaired before the next one: back to the healthy fleet
        sp = fleet.paths[i]
        loc.update(Observation(sp.reporter, sp.key, sp.forward, None, False))


# ---- a whole run --------------------------------------------------------------------------------

@dataclass
class RunResult:
    scenario: str
    gpus: int
    days: float
    seed: int
    failures: dict
    outcomes: list
    with_linkpass: jobmodel.JobResult
    without: jobmodel.JobResult
    params: jobmodel.JobParams
    hits_with: list
    hits_without: list
    setup_s: float
    wall_s: float
    probe: dict


def hits_for(f: Failure, o: Outcome | None, params: jobmodel.JobParams, cfg: SimConfig) -> tuple[list, list]:
    """(with LinkPass, without) job hits of one failure."""
    Hit = jobmodel.Hit
    if not f.network:
        h = Hit(f.t_s, "restart", detect_s=params.other_detect_s, cause=f.kind)
        return [h], [h]
    slow = jobmodel.degraded_fraction(params, o.lost_share) if o else 0.0
    if f.kind == "gray":
        gray = min(1.0, f.loss * cfg.go_back_n_packets) * params.comm_fraction
        without = [Hit(f.t_s, "slowdown", slow_fraction=gray, slow_s=f.duration_s, cause="gray")]
        moved = o is not None and not o.exposed_at_end
        with_ = [Hit(f.t_s, "slowdown", slow_fraction=gray, slow_s=o.exposed_ms / 1000 if moved else f.duration_s,
                     cause="gray")]
        if moved and o.detect_ms:
            with_.append(Hit(f.t_s, "slowdown", slow_fraction=slow, slow_s=f.duration_s, cause="gray-degraded"))
        return with_, without
    if f.kind == "flap":  # Alibaba HPN: a flap halts single-homed training for more than 9 s
        without = [Hit(f.t_s, "stall", stall_s=9.0, cause="flap")]
    else:  # single-homed NICs: the job halts until NCCL gives up, then restarts (HPN §9.3)
        without = [Hit(f.t_s, "restart", detect_s=params.nccl_timeout_s, cause=f.kind)]
    if o is None or o.unrecovered:
        return without, without
    with_ = [Hit(f.t_s, "stall", stall_s=o.stall_ms / 1000, cause=f.kind),
             Hit(f.t_s, "slowdown", slow_fraction=slow, slow_s=f.duration_s, cause=f"{f.kind}-degraded")]
    return with_, without


def probe_overhead(fleet: Fleet, link_gbps: float = 400.0) -> dict:
    """Probe packets per second per NIC (sent + reflected, each way) and their share of the link:
    IP sizes as the agent sends them (an unpadded probe; every `size_every`-th one full MTU)."""
    probe_bytes = 28 + wire.MIN_PAYLOAD
    mtu = AgentConfig.mtu
    cfg = fleet.config
    per_nic_out: dict[tuple[str, int], int] = {}
    per_nic_in: dict[tuple[str, int], int] = {}
    for sp in fleet.paths:
        per_nic_out[(sp.reporter, sp.plane)] = per_nic_out.get((sp.reporter, sp.plane), 0) + 1
        per_nic_in[(sp.peer, sp.plane)] = per_nic_in.get((sp.peer, sp.plane), 0) + 1
    rate = NS / cfg.interval_ns
    pps = [(per_nic_out.get(k, 0) + per_nic_in.get(k, 0)) * rate for k in set(per_nic_out) | set(per_nic_in)]
    mean_bytes = probe_bytes + (mtu - probe_bytes) / cfg.size_every if cfg.size_every else probe_bytes
    share = [p * mean_bytes * 8 / (link_gbps * 1e9) for p in pps]
    return {"paths": len(fleet.paths), "paths_per_nic_median": statistics.median(per_nic_out.values()),
            "tx_pps_per_nic_median": statistics.median(pps), "tx_pps_per_nic_max": max(pps),
            "link_share_pct_median": round(100 * statistics.median(share), 5),
            "link_share_pct_max": round(100 * max(share), 5), "link_gbps": link_gbps,
            "note": "each NIC sends its paths' probes and reflects its peers' (both count once per direction)"}


# What one exchange costs a host's CPU, measured (docs/agent-cost.md): sending and judging one,
# the agent's whole process per exchange sent (bench/host_cost.py, rail8-h0 with idle rates:
# 85.8 % of a core for 24 511 exchanges/s); reflecting one, at most what a whole exchange costs
# both ends and the kernel together (bench/probe_core.py: ~67 500 exchanges per CPU-second).
SEND_CPU_US = 35.0
REFLECT_CPU_US_MAX = 14.8


def probe_cost(fleet: Fleet, idle_rates: bool, progressing: bool = True) -> dict:
    """Probe packets per NIC and CPU per host with the agent's rates off (every path at the active
    rate) or on, from the agent's own rate logic (linkpass/core/activity.py). The job's paths are
    its lanes' paths (verbs lanes report each one): `progressing`, their acknowledged bytes
    advance (a collective in flight); otherwise the lanes are quiet between collectives and their
    paths are active. The plan's paths towards the job's peers are standby, the rest idle."""
    cfg = fleet.config
    interval_ms = {ACTIVE: cfg.interval_ns / MS, PROGRESSING: AgentConfig.progress_interval_ms,
                   STANDBY: AgentConfig.standby_interval_ms, IDLE: AgentConfig.idle_interval_ms}
    by_host: dict[str, dict[int, PathKey]] = {}
    lanes: dict[str, list[LaneSeen]] = {}
    now = round(AgentConfig.idle_after_ms * MS)  # lanes that last progressed 1 ms ago, or 10 ms ago (quiet)
    for i, sp in enumerate(fleet.paths):
        by_host.setdefault(sp.reporter, {})[i] = PathKey(sp.peer, sp.plane, i)
        if sp.job:
            lanes.setdefault(sp.reporter, []).append(
                LaneSeen(sp.peer, sp.plane, i, now - (MS if progressing else 10 * MS), waiting=progressing))
    rate_of: dict[int, float] = {}
    classes = dict.fromkeys(RATES, 0)
    for host, paths in by_host.items():
        activity = Activity(round(AgentConfig.idle_after_ms * MS), round(AgentConfig.progress_window_ms * MS))
        if idle_rates:
            activity.saw_lanes(lanes.get(host, ()), now)
            activity.update(paths, now)
        for pid in paths:
            rate = activity.rate.get(pid, ACTIVE)
            classes[rate] += 1
            rate_of[pid] = 1000 / interval_ms[rate]
    sent: dict[str, float] = {}
    reflected: dict[str, float] = {}
    nic_out: dict[tuple[str, int], float] = {}
    for i, sp in enumerate(fleet.paths):
        r = rate_of[i]
        sent[sp.reporter] = sent.get(sp.reporter, 0.0) + r
        reflected[sp.peer] = reflected.get(sp.peer, 0.0) + r
        nic_out[(sp.reporter, sp.plane)] = nic_out.get((sp.reporter, sp.plane), 0.0) + r
        nic_out[(sp.peer, sp.plane)] = nic_out.get((sp.peer, sp.plane), 0.0) + r  # its replies
    hosts = sorted(set(sent) | set(reflected))
    cpu = [100 * (sent.get(h, 0.0) * SEND_CPU_US + reflected.get(h, 0.0) * REFLECT_CPU_US_MAX) / 1e6 for h in hosts]
    return {"idle_rates": idle_rates, "progressing": progressing, "gpus": fleet.shape.gpus, "paths": len(fleet.paths),
            **{f"paths_{rate}": n for rate, n in classes.items()}, "tx_pps_per_nic_median": statistics.median(nic_out.values()),
            "sent_per_host_median": statistics.median(sent.values()),
            "cpu_pct_per_host_median": round(statistics.median(cpu), 1), "cpu_pct_per_host_max": round(max(cpu), 1),
            "cpu_pct_per_host": cpu, "tx_pps_per_nic": list(nic_out.values()),
            "note": f"CPU: {SEND_CPU_US} us per exchange sent (measured, host_cost.json), at most "
                    f"{REFLECT_CPU_US_MAX} us per exchange reflected (probe_core.py's whole-exchange cost)"}


def run(gpus: int = 16_384, days: float = 1.0, scenario: str = "llama3", seed: int = 1,
        params: jobmodel.JobParams | None = None, config: SimConfig | None = None,
        fleet: Fleet | None = None, progress=None) -> RunResult:
    params = params or jobmodel.JobParams()
    t_start = time.perf_counter()
    shape = Shape.for_gpus(gpus)
    fleet = fleet or Fleet(shape, config, seed)
    cfg = fleet.config
    setup_s = time.perf_counter() - t_start
    rng = np.random.default_rng(seed)
    fails = fm.draw(scenario, shape, days, rng)
    outcomes, hits_with, hits_without = [], [], []
    network = [f for f in fails if f.network]
    with heap.frozen():  # the fleet's millions of paths out of the collector's passes (kernel/heap.py)
        for f in fails:
            o = None
            if f.network:
                o = simulate(fleet, f, rng)
                outcomes.append(o)
                if progress is not None:
                    progress(f"{len(outcomes)}/{len(network)} network failures simulated ({f.kind} at "
                             f"{f.t_s / 3600:.1f} h: stall {o.stall_ms:.0f} ms, {o.agents} agents)")
            w, wo = hits_for(f, o, params, cfg)
            hits_with += w
            hits_without += wo
    wall = days * fm.DAY_S
    counts: dict[str, int] = {}
    for f in fails:
        counts[f.kind] = counts.get(f.kind, 0) + 1
    return RunResult(scenario, gpus, days, seed, counts, outcomes, jobmodel.run(hits_with, wall, params),
                     jobmodel.run(hits_without, wall, params), params, hits_with, hits_without, setup_s,
                     time.perf_counter() - t_start, probe_overhead(fleet))


def summary(r: RunResult) -> dict:
    def dist(values):
        if not values:
            return {"n": 0, "median": None, "p99": None}
        return {"n": len(values), "median": round(statistics.median(values), 3),
                "p99": round(percentile(sorted(values), 0.99), 3)}

    kinds = sorted({o.kind for o in r.outcomes})
    per_kind = {}
    for k in kinds:
        os_ = [o for o in r.outcomes if o.kind == k]
        per_kind[k] = {"failures": len(os_),
                       "detect_ms": dist([d for o in os_ for d in o.detect_ms]),
                       "stall_ms": dist([o.stall_ms for o in os_]),
                       "localized_ms": dist([o.localized_ms for o in os_ if o.localized_ms is not None]),
                       "localized_pct": round(100 * sum(o.localized for o in os_) / len(os_), 1),
                       "false_findings": sum(o.false_findings for o in os_),
                       "unrecovered": sum(o.unrecovered for o in os_),
                       "agents": dist([o.agents for o in os_])}
    gpu_h = r.gpus * r.days * 24

    def job(j: jobmodel.JobResult):
        return {"goodput_pct": round(100 * j.goodput, 3), "restarts": j.restarts,
                "lost_gpu_hours": round(j.lost_s / 3600 * r.gpus, 1),
                "lost_by_gpu_hours": {k: round(v / 3600 * r.gpus, 1) for k, v in sorted(j.lost_by.items())}}

    return {"scenario": r.scenario, "gpus": r.gpus, "days": r.days, "seed": r.seed, "paid_gpu_hours": gpu_h,
            "failures": r.failures, "with_linkpass": job(r.with_linkpass), "without_linkpass": job(r.without),
            "per_kind": per_kind, "job_params": asdict(r.params), "probe_overhead": r.probe,
            "coordinator_load": coordinator_load(r),
            "sim_wall_s": round(r.wall_s, 2), "setup_s": round(r.setup_s, 2)}


def coordinator_load(r: RunResult) -> dict:
    """What the coordinator takes: agents' heartbeats and digests (a whole table only when a digest
    does not match, after a lost report: none in steady state), and the change reports the
    simulated failures caused; and the rows whole tables every summary_s would carry."""
    hosts = Shape.for_gpus(r.gpus).hosts
    paths = r.probe["paths"]
    summary_s, heartbeat_s = CoordinatorLinkConfig.summary_s, REPORT_HEARTBEAT_S
    calls = [ms for o in r.outcomes for ms in o.findings_ms]
    return {"agents": hosts, "reports_per_s_steady": round(hosts / heartbeat_s + hosts / summary_s, 1),
            "path_rows_per_s_steady": 0.0, "digests_per_s_steady": round(hosts / summary_s, 1),
            "path_rows_per_s_whole_tables": round(paths / summary_s, 1),
            "agents_reporting_per_failure_median": statistics.median([o.agents for o in r.outcomes]) if r.outcomes else 0,
            "path_changes_per_failure_median": statistics.median([o.reports for o in r.outcomes]) if r.outcomes else 0,
            "findings_ms_median": round(statistics.median(calls), 2) if calls else None,
            "findings_ms_max": round(max(calls), 2) if calls else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m linkpass_sim.fleet", description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=16_384)
    ap.add_argument("--days", type=float, default=1.0)
    ap.add_argument("--scenario", choices=fm.SCENARIOS, default="llama3")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--checkpoint-min", type=float, default=30.0, help="checkpoint interval (default 30)")
    ap.add_argument("--restart-min", type=float, default=10.0, help="restart overhead (default 10)")
    ap.add_argument("--shards", type=int, default=1,
                    help="coordinator shards the evidence is split over, as the sharded coordinator does (default 1)")
    ap.add_argument("--report", metavar="DIR", help="write summary.json, report.md and plots here")
    ap.add_argument("-o", "--output", choices=("text", "json"), default="text")
    a = ap.parse_args(argv)
    if a.days <= 0:
        ap.error("--days must be > 0")
    try:
        params = jobmodel.JobParams(checkpoint_s=a.checkpoint_min * 60, restart_s=a.restart_min * 60)
        Shape.for_gpus(a.gpus)
    except ValueError as exc:
        ap.error(str(exc))

    def progress(msg):
        print(f"  {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)

    progress(f"building a {a.gpus}-GPU fabric, its probe plan and every probed path")
    try:
        r = run(a.gpus, a.days, a.scenario, a.seed, params, config=SimConfig(shards=a.shards), progress=progress)
    except ShardError as exc:  # a shard count the fabric cannot take, found once the fabric is built
        ap.error(str(exc))
    s = summary(r)
    if a.report:
        from . import fleet_report
        fleet_report.write(a.report, r, s)
        progress(f"report written to {a.report}/report.md")
    if a.output == "json":
        print(json.dumps(s, indent=2))
    else:
        print(text(s))
    return 0


def text(s: dict) -> str:
    w, wo = s["with_linkpass"], s["without_linkpass"]
    lines = [f"{s['gpus']} GPUs, {s['days']:g} day(s), scenario {s['scenario']}, seed {s['seed']}: "
             f"{sum(s['failures'].values())} failures ({', '.join(f'{k} {v}' for k, v in sorted(s['failures'].items()))})",
             f"goodput with LinkPass {w['goodput_pct']:.2f} %  ({w['restarts']} restarts, {w['lost_gpu_hours']:.0f} GPU-h lost)",
             f"goodput without       {wo['goodput_pct']:.2f} %  ({wo['restarts']} restarts, {wo['lost_gpu_hours']:.0f} GPU-h lost)",
             "", f"{'failure':<8} {'n':>4} {'detect p50/p99 ms':>18} {'stall p50 ms':>13} {'localized':>10} {'p50 ms':>8}"]
    for k, d in s["per_kind"].items():
        det = d["detect_ms"]
        lines.append(f"{k:<8} {d['failures']:>4} {str(det['median']) + ' / ' + str(det['p99']):>18} "
                     f"{str(d['stall_ms']['median']):>13} {str(d['localized_pct']) + ' %':>10} "
                     f"{str(d['localized_ms']['median']):>8}")
    p = s["probe_overhead"]
    lines += ["", f"probes: {p['paths']} paths, {p['tx_pps_per_nic_median']:.0f} packets/s per NIC (median), "
                  f"{p['link_share_pct_median']} % of a {p['link_gbps']:.0f} Gb/s link",
              f"simulated in {s['sim_wall_s']} s (setup {s['setup_s']} s)"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
