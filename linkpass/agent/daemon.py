"""`linkpass agent`: the per-host daemon.

It discovers the ECMP paths to every configured peer, probes them with the C probe core (a
native thread that sends, reflects and timestamps without waiting for Python) or, on an RDMA
host, where the NIC takes every RoCEv2 packet before a socket could, through UD queue pairs
(`probe/verbs_engine.py`; config `probe.engine`), judges every
path with the detector, and rewrites the data path: the routes to peers' service addresses
(whole planes; `routes.py`) and the healthy source ports per (peer, plane) in the entropy table
(single paths; `entropy_writer.py`). `core/failover.py` decides between the two, and
`data_path.py` carries its decisions out.

Lifecycle: SIGTERM/SIGINT stop it cleanly: routes left as decided (a plane known bad stays out
across a rolling restart; every peer keeps at least one plane), entropy table withdrawn, sockets
closed, API down. SIGHUP re-reads the config and applies what can change without dropping probe
or detector state (peers added or removed, probe rates); what cannot
(agent id, fleet key, NICs, detector settings) is logged and left as it was. SIGKILL leaves the
routes as they were; the next start reconciles them with the journal. `--dry-run` decides and
logs everything and touches no route and no table. Logs are JSON lines on stderr, one event each,
with a level (observe/log.py, docs/logs.md).

The main loop survives any one step raising (`LoopErrors`: logged, counted by step); the
coordinator's answers are checked whole before any of them is applied (`answer.py`).

Under systemd (Type=notify, docs/systemd.md) it says READY=1 once the probe thread runs, the
peers' paths are probed and the API listens; RELOADING=1 ... READY=1 around a SIGHUP reload;
STOPPING=1 when it stops; a STATUS= line with its paths; and WATCHDOG=1 from the main loop only
while the probe thread makes progress, so a hung prober (or loop) is restarted by systemd. It
needs no root: CAP_NET_RAW and CAP_NET_ADMIN (`capability_refusal` says when each is needed).
"""
from __future__ import annotations

import faulthandler
import gc
import signal
import sys
import threading
import time
import traceback
from collections import Counter

from ..core.activity import PathKey
from ..core.constants import ENTROPY_HEARTBEAT_S, PROBE_PORT_BASE
from ..core.detector import Detector, DetectorConfig
from ..core.entropy_table import EntropyError
from ..kernel import caps
from ..kernel.rdma import Device, RdmaUnavailable
from ..core.probe_event import EV_MISS
from ..core.states import DARK, HELD_OUT
from ..observe.log import Logger, level_from_env, say
from ..observe.sdnotify import Notifier, Watchdog
from ..probe.common import PathSpec
from ..probe.discovery import DiscoveryConfig, discover, discovery_targets
from ..probe.engine import CoreProbeEngine
from ..control.answers import AnswerRules, Drain, PlanAnswer
from .api import LocalApi, PathLabels, ProbeProgress, TelemetryView, metrics_registry, metrics_routes, serve
from .config import AgentConfig, ConfigError, load_text
from .coordinator_link import CoordinatorLink, probe_budget, tls_context
from ..core.decide import PathInfo, crosses
from ..core.failover import Failover, reported_state
from .hostfacts import read_host_facts
from .keyfile import load_fleet_keys
from .loop_priority import LoopPriority, loop_rt_priority
from .metrics import AgentCollector, DecisionCollector
from .pathcheck_routes import PathCheckRoutes, live_paths
from .rates import Rates
from .data_path import DataPath
from .routes import PeerRoutes, RouteActuator

# one JSON line per event on stderr, with its level (observe/log.py); the coordinator thread logs
# too, and the Logger writes each line in one locked write so two threads' lines never interleave
log = Logger("agent")


def load(path: str) -> tuple[AgentConfig, bytes, bytes | None]:
    """The config (its `auto` values read off this host), the fleet key and the other key accepted
    during a rotation (or None); ConfigError naming the field for anything wrong."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror})") from None
    cfg = load_text(text, path, read_host_facts)
    if cfg.coordinator is not None:
        tls_context(cfg.coordinator)  # a bad CA or certificate file stops the start, with its field named
    return (cfg, *load_fleet_keys(cfg.fleet_key_file, cfg.fleet_key_accept_file))


GIL_SWITCH_S = 0.0005
LOOP_STEPS = ("reload", "plan", "drains", "poll", "decide", "priority", "rates", "entropy")  # the main loop's steps, in order


class LoopErrors:
    """Exceptions in the main loop's steps. Each is counted per step (the metric
    linkpass_agent_loop_errors_total) and logged with where it was raised; the same fault of a
    step is logged again only after LOG_EVERY_S, since it usually recurs on every pass."""

    LOG_EVERY_S = 10.0

    def __init__(self, log, clock=time.monotonic):
        self.log, self.clock = log, clock
        self.counts: Counter = Counter(dict.fromkeys(LOOP_STEPS, 0))
        self._logged: dict[str, tuple[str, float]] = {}  # step -> (its last fault logged, when)

    def run(self, step: str, fn, *args):
        """fn(*args)'s value, or None if it raised (counted and logged)."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - one bad step must not stop failover for every peer
            self.counts[step] += 1
            text, now = repr(exc), self.clock()
            last = self._logged.get(step)
            if last is None or last[0] != text or now - last[1] >= self.LOG_EVERY_S:
                self._logged[step] = (text, now)
                frame = traceback.extract_tb(exc.__traceback__)[-1]
                self.log("loop_error", step=step, error=text, at=f"{frame.filename}:{frame.lineno} in {frame.name}",
                         count=self.counts[step], note="the loop goes on; the data path keeps its last good state")
            return None


# fields a reload cannot change: they shape sockets, identities or the detector's state
FIXED_ON_RELOAD = ("agent_id", "name", "nics", "service", "detect", "rt_priority", "idle_rates", "routes_enabled",
                   "routes_journal",
                   "entropy_enabled", "entropy_path", "engine", "metrics_address", "metrics_port")


def probe_engine_kind(cfg: AgentConfig) -> str:
    """"verbs" or "sockets": the config's choice, or for `auto`, verbs where every NIC address
    has a RoCE v2 RDMA device (there, sockets would never see a probe)."""
    if cfg.engine != "auto":
        return cfg.engine
    try:
        for nic in cfg.nics:
            Device.for_address(nic.addr)
    except RdmaUnavailable:
        return "sockets"
    return "verbs"


def capability_refusal(cfg: AgentConfig, dry_run: bool, cap_eff: int | None, engine_kind: str) -> str | None:
    """Why this agent cannot start with the effective capabilities `cap_eff`, in one line that
    says how to grant them, or None. CAP_NET_RAW always (the probes leave through raw sockets);
    CAP_NET_ADMIN for the socket engine's receive buffers (SO_RCVBUFFORCE) and for route changes
    (unless dry run). CAP_SYS_NICE is not required: without it (or a high enough RLIMIT_RTPRIO)
    the probe thread runs at normal priority, which `rt_priority_refused` reports."""
    if cap_eff is None:
        return None  # not readable here: the kernel refuses what is missing, with its own error
    need: dict[int, list[str]] = {caps.CAP_NET_RAW: ["raw probe sockets"]}
    if engine_kind == "sockets":
        need.setdefault(caps.CAP_NET_ADMIN, []).append("probe receive buffers")
    if cfg.routes_enabled and not dry_run:
        need.setdefault(caps.CAP_NET_ADMIN, []).append("route changes")
    missing = [(cap, why) for cap, why in sorted(need.items(), key=lambda kv: -kv[0]) if not caps.has(cap_eff, cap)]
    if not missing:
        return None
    names = ", ".join(f"{caps.NAMES[c]} ({' and '.join(w)})" for c, w in missing)
    short = ",".join(f"+{caps.NAMES[c][4:].lower()}" for c, _ in missing)
    return (f"missing {names}: run it under the shipped unit (linkpass-agent.service grants them "
            f"to the linkpass user as ambient capabilities), as root, or from root with `setpriv --reuid=linkpass "
            f"--regid=linkpass --init-groups --inh-caps={short} --ambient-caps={short} linkpass agent ...`")


def make_engine(cfg: AgentConfig, key: bytes, accept_key: bytes | None = None):
    if probe_engine_kind(cfg) == "verbs":
        from ..probe.verbs_engine import VerbsProbeEngine
        return VerbsProbeEngine(cfg.agent_id, key, accept_key=accept_key)
    return CoreProbeEngine(cfg.agent_id, key, accept_key=accept_key)


def distinct_paths(found):
    """Paths by the routers they cross. Traces that end differently (a peer agent on 4791 answers
    nothing, so traces end by timeout) or miss one ICMP answer under load are views of a path
    already seen, not paths of their own: group by the answered hops, prefer complete views."""
    best = {}
    for p in sorted(found, key=lambda p: (None in p.hops, -p.seen)):
        key = tuple(h for h in p.hops if h is not None)
        if not any(key == k or (None in p.hops and set(key) <= set(k)) for k in best):
            best[key] = p
    return list(best.values())


class AgentService:
    """The agent's side of the service manager's protocol (observe/sdnotify.py; docs/systemd.md):
    READY=1 when started, RELOADING=1 / READY=1 around a reload, STOPPING=1, a STATUS= line of
    its paths every few seconds, and WATCHDOG=1 from the main loop only while the probe thread
    makes progress (`ProbeProgress`). Without $NOTIFY_SOCKET every call does nothing."""

    STATUS_EVERY_S = 5.0

    def __init__(self, agent: "Agent", notifier: Notifier | None = None, clock=time.monotonic):
        self.agent, self.clock = agent, clock
        self.notifier = notifier if notifier is not None else Notifier()
        self.watchdog = Watchdog(self.notifier, self._problem, clock, on_withheld=self._withheld,
                                 on_resumed=self._resumed)
        self._next_status = 0.0
        self._status: str | None = None

    @property
    def watchdog_s(self) -> float | None:
        return self.notifier.watchdog_s

    def _problem(self) -> str | None:
        idle = self.agent.progress.stalled_s()
        if idle is None:
            return None
        return (f"probe thread stalled: no probe sent or received for {idle:.0f} s while "
                f"{len(self.agent.engine.paths)} paths are configured")

    def _withheld(self, why: str) -> None:
        log("watchdog_withheld", reason=why, watchdog_s=self.watchdog_s,
            note="no more watchdog pings: systemd restarts the agent when its watchdog timeout runs out")
        self._set_status(f"{why}; watchdog pings withheld")

    def _resumed(self) -> None:
        log("watchdog_resumed", note="the probe thread moves again; watchdog pings resumed")

    def status_line(self) -> str:
        """What `systemctl status` shows: paths, peers, and how many are down or held out."""
        a = self.agent
        detectors = a.failover.detector.paths
        states = [d.state for d in (detectors.get(pid) for pid in list(a.labels)) if d is not None]
        peers = sum(1 for ids in list(a.paths_of_peer.values()) if ids)
        paths = len(a.labels)
        line = (f"probing {paths} path{'' if paths == 1 else 's'} to {peers} peer{'' if peers == 1 else 's'}, "
                f"{sum(s in DARK for s in states)} down")
        held = sum(s in HELD_OUT for s in states)
        if held:
            line += f", {held} held out"
        return line + (" (dry run)" if a.dry_run else "")

    def _set_status(self, text: str) -> None:
        if text != self._status:
            self._status = text
            self.notifier.status(text)

    def ready(self) -> None:
        if not self.notifier.enabled:
            return
        self._status = self.status_line()
        self.notifier.ready(self._status)
        self._next_status = self.clock() + self.STATUS_EVERY_S

    def reloading(self) -> None:
        self.notifier.reloading()

    def stopping(self) -> None:
        self._status = "stopping: routes stay as decided, the entropy table is withdrawn"
        self.notifier.stopping(self._status)

    def tick(self) -> None:
        """Called on every pass of the main loop: a due watchdog ping, a changed STATUS line."""
        if not self.notifier.enabled:
            return
        self.watchdog.tick()
        now = self.clock()
        if now >= self._next_status and self.watchdog.withheld is None:
            self._next_status = now + self.STATUS_EVERY_S
            self._set_status(self.status_line())


class Agent:
    service: AgentService | None = None  # the service manager's protocol, once main() attaches it
    plan_applied = False  # a coordinator probe plan was taken (what an agent without peers of its own waits for)
    deciding = False  # a failure is in flight (Failover.in_flight, as of the last step)

    def __init__(self, cfg: AgentConfig, key: bytes, dry_run: bool = False, accept_key: bytes | None = None):
        self.cfg = cfg
        self.key, self.accept_key = key, accept_key
        self.dry_run = dry_run
        self.engine = make_engine(cfg, key, accept_key)
        self.engine_kind = self.engine.info()["engine"]
        self.labels: dict[int, PathLabels] = {}
        self.paths_of_peer: dict[str, list[int]] = {}
        for nic in cfg.nics:
            self.engine.add_nic(f"p{nic.plane}", nic.ifname, nic.addr)
        self.engine.track(True)
        # peers' full-size probes are as large as ours (the fleet shares one MTU): expected from
        # the start, before discovery gives this agent paths of its own
        self.expected_sizes = [cfg.mtu]
        self.engine.expect_sizes(self.expected_sizes)
        self.routes = self._route_actuator(cfg, dry_run)
        self.entropy = None
        if cfg.entropy_enabled and not dry_run:
            from .entropy_writer import EntropyWriter
            self.entropy = EntropyWriter(cfg.entropy_path)
            if self.entropy.replaced:
                log("entropy_table_replaced", path=cfg.entropy_path, why=self.entropy.replaced)
        self.failover = Failover(Detector(DetectorConfig(**cfg.detect)), lambda pid: self.engine.telemetry(pid).loss,
                                 entropy=self.entropy is not None)
        self.data_path = DataPath(self.routes, self.entropy, self.engine.set_rto, log)
        c_core = hasattr(self.engine, "set_confirm")  # the verbs engine has no confirmation rounds
        if c_core:
            self.engine.set_confirm(self.failover.detector.config.miss_threshold,
                                    spread_ns=self.failover.stall_spread_ns)
        # the verbs engine judges in a Python thread of normal priority: a real-time loop would
        # wait for the answers it preempts
        self.loop_priority = LoopPriority(loop_rt_priority(cfg.rt_priority) if c_core else 0, log)
        self.view = TelemetryView(self.engine, self.labels, offset_ns=self._offset_of_peer, state_of=self._state_of)
        self.api: LocalApi | None = None
        self.metrics_server = None
        self.progress = ProbeProgress(self.engine)
        self.stopping = threading.Event()
        self.reload_requested = False
        self.hops: dict[int, tuple] = {}  # path -> routers on the way (for the coordinator's fleet view)
        self.link: CoordinatorLink | None = None
        # handed over by the coordinator thread, applied by the main loop (Failover is single-threaded)
        self.pending_drains: tuple[Drain, ...] | None = None
        self.pending_plan: PlanAnswer | None = None
        self.drain_addrs: tuple[Drain, ...] = ()
        self.config_peers = {p.name: p for p in cfg.peers}
        self.errors = LoopErrors(log)
        self.rates = Rates(lambda: self.cfg, self.engine, self.labels, lambda peer: peer in self.config_peers,
                           self.errors, self.stopping, dry_run, log)

    @staticmethod
    def _route_actuator(cfg: AgentConfig, dry_run: bool) -> RouteActuator | None:
        if not (cfg.routes_enabled or dry_run) or any(n.gateway is None for n in cfg.nics):
            return None
        hops = {n.plane: (n.gateway, n.ifname) for n in cfg.nics}
        peers = {p.name: PeerRoutes(p.name, p.service, {pl: h for pl, h in hops.items() if pl in p.nics})
                 for p in cfg.peers}
        return RouteActuator(None, cfg.service, peers, cfg.routes_journal, rto_min_ms=cfg.rto_min_ms,
                             max_changes_per_s=cfg.max_route_changes_per_s, dry_run=dry_run, log=log)

    def _offset_of_peer(self, peer_id: int) -> float | None:
        """The peer's clock offset now (once synced): one-way delays in /v1/paths and metrics."""
        name = next((p.name for p in self.cfg.peers if p.agent_id == peer_id), None)
        return None if name is None else self.failover.offset_ns(name, time.time_ns())

    def _state_of(self, pid: int) -> dict:
        d = self.failover.detector.paths.get(pid)
        last = self.failover.last_transition.get(pid)
        return {"rate": self.rates.rate_of(pid),
                "state": d.state.value if d else None, "reason": last.reason.value if last else None,
                "held": self.failover.held_back(pid), "waiting_for": self.failover.waiting_for(pid)}

    # ---- paths ---------------------------------------------------------------------------
    def _discovery_config(self) -> DiscoveryConfig:
        ports = tuple(range(PROBE_PORT_BASE, PROBE_PORT_BASE + self.cfg.discovery_ports))
        return DiscoveryConfig(ports=ports, k=self.cfg.ports_per_path)

    def add_peers(self, peers) -> int:
        """Discover and start probing the paths to `peers`; returns how many paths were added."""
        my = {n.plane: n for n in self.cfg.nics}
        targets = discovery_targets(self.cfg.nics, peers)
        if not targets:
            return 0
        t0 = time.monotonic()
        table = discover(None, targets, self._discovery_config(), host=self.cfg.name)
        added = 0
        for peer in peers:
            ids = []
            for plane, addr in sorted(peer.nics.items()):
                if plane not in my:
                    continue
                for index, path in enumerate(distinct_paths(table.paths(addr, my[plane].ifname))):
                    for sport in path.ports[: self.cfg.ports_per_path]:
                        pid = self.engine.new_path_id()  # removed paths' ids are reused
                        self.engine.add_path(PathSpec(pid, f"p{plane}", peer.agent_id, addr, sport,
                                                      self.cfg.interval_ms / 1000), first_due_s=0.01)
                        if self.cfg.size_probe_every:
                            self.engine.set_size_probe(pid, self.cfg.size_probe_every, self.cfg.mtu)
                        self.labels[pid] = PathLabels(peer.name, plane, index, sport)
                        self.rates.add_path(pid, PathKey(peer.name, plane, sport))
                        self.hops[pid] = tuple(path.hops)
                        self.failover.add_path(PathInfo(pid, peer.name, plane, sport, addr))
                        ids.append(pid)
                        added += 1
            self.paths_of_peer[peer.name] = ids
            log("peer_added", peer=peer.name, paths=len(ids))
        log("discovery", targets=len(targets), paths=added, seconds=round(time.monotonic() - t0, 3),
            stats={k: v for k, v in table.stats.items() if v})
        self.rates.paths_added()
        return added

    def remove_peer(self, name: str) -> None:
        self.data_path.carry_out(self.failover, self.failover.remove_peer(name), time.monotonic_ns())
        for pid in self.paths_of_peer.pop(name, []):
            self.engine.remove_path(pid)
            self.labels.pop(pid, None)
            self.rates.remove_path(pid)
            self.hops.pop(pid, None)
        log("peer_removed", peer=name)

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        if self.routes is not None:
            installed = self.routes.reconcile()
            log("routes_reconciled", installed={k: list(v) for k, v in installed.items()},
                reconciled=self.routes.stats["reconciled"], dry_run=self.dry_run)
        # the reflector runs before discovery: peers probing us meanwhile must not see us dark
        refused = self.engine.start_background(self.cfg.rt_priority)
        if refused:
            fix = (None if self.engine_kind == "verbs" else
                   f"grant CAP_SYS_NICE or an RLIMIT_RTPRIO of at least {self.cfg.rt_priority} (the unit's "
                   "LimitRTPRIO=), or set probe.rt_priority: 0")
            log("rt_priority_refused", priority=self.cfg.rt_priority, error=refused,
                note="probe thread runs at normal priority: on a busy host, expect late replies", fix=fix)
        self.add_peers(self.cfg.peers)
        per_path = lambda: self.cfg.metrics_per_path  # noqa: E731 - a reload may change it
        registry = metrics_registry(self.view, [DecisionCollector(lambda: self.failover, per_path),
                                                AgentCollector(self.health_counters)], per_path)
        checks = PathCheckRoutes(self.cfg.name, lambda: self.cfg.nics, lambda: {p.name: p for p in self.cfg.peers},
                         lambda peer: live_paths(self.view.rows(), dict(self.hops), peer), log=log)
        self.api = LocalApi(self.view, port=self.cfg.api_port, registry=registry, progress=self.progress,
                            extra_routes={"/v1/state": self.failover.path_rows}, waiting_for=self.waiting_for,
                            query_routes={"/v1/probe": checks.probe, "/v1/trace": checks.trace})
        self.metrics_server = serve(self.cfg.metrics_address, self.cfg.metrics_port,
                                    metrics_routes(registry, self.progress), name="metrics")
        if self.cfg.coordinator is not None:
            self.link = CoordinatorLink(self.cfg.coordinator, self.identity, self.report_rows, self._take_drains,
                                        self._take_plan, log, rules=self.answer_rules(),
                                        budget=lambda: probe_budget(self.cfg)).start()
        self.rates.start()
        log("started", agent_id=self.cfg.agent_id, name=self.cfg.name, api_port=self.api.port,
            metrics=f"{self.cfg.metrics_address}:{self.metrics_server.server_address[1]}",
            paths=len(self.labels), nics=[n.ifname for n in self.cfg.nics], routes=self.routes is not None,
            entropy=self.entropy is not None, dry_run=self.dry_run,
            probes=self.engine.info(), watchdog_s=self.service.watchdog_s if self.service is not None else None)

    def waiting_for(self) -> str | None:
        """What keeps the agent from being ready (/readyz), or None. Its own peers' paths are
        discovered before the API listens; an agent with none waits for the coordinator's plan."""
        follows = self.cfg.coordinator is not None and self.cfg.coordinator.follow_plan
        if not self.config_peers and follows and not self.plan_applied:
            return "no peers yet: waiting for the coordinator's probe plan"
        return None

    def health_counters(self) -> dict:
        """The agent's own faults, for /metrics: loop errors by step, coordinator answers refused."""
        return {"loop_errors": dict(self.errors.counts),
                "answers_rejected": self.link.stats["answers_rejected"] if self.link is not None else 0,
                "probe_thread_up": self.progress.stalled_s() is None,
                "coordinator_up": (self.link.registered and self.link.reachable) if self.link is not None else None,
                "engine": self.engine_kind, "fleet_keys": 2 if self.accept_key else 1,
                **self.rates.health()}

    # ---- the coordinator ---------------------------------------------------------------
    def identity(self) -> dict:
        from .. import __version__

        return {"name": self.cfg.name, "agent_id": self.cfg.agent_id, "service": self.cfg.service,
                "nics": {str(n.plane): n.addr for n in self.cfg.nics}, "api_port": self.cfg.api_port,
                "version": __version__}

    def report_rows(self) -> list[dict]:
        """The path table as the coordinator wants it (called from the coordinator thread)."""
        out = []
        for r in self.failover.path_rows():
            info = self.failover.paths.get(r["path"])
            if info is None:
                continue
            out.append({"id": r["path"], "peer": r["peer"], "plane": r["plane"], "sport": r["sport"],
                        "hops": list(self.hops.get(r["path"], ())), "peer_addr": info.peer_addr,
                        "state": reported_state(r), "reason": r["reason"]})
        return out

    def _take_drains(self, drains: tuple[Drain, ...]) -> None:
        self.pending_drains = drains

    def _take_plan(self, plan: PlanAnswer) -> None:
        if self.cfg.coordinator is not None and self.cfg.coordinator.follow_plan:
            self.pending_plan = plan

    def answer_rules(self) -> AnswerRules:
        """What the coordinator's answers are checked against (answer.py): this agent and the
        peers of its config file."""
        own = frozenset([self.cfg.service, *(n.addr for n in self.cfg.nics)])
        max_peers = self.cfg.coordinator.max_plan_peers if self.cfg.coordinator is not None else 0
        return AnswerRules(self.cfg.name, self.cfg.agent_id, max_peers, own, dict(self.config_peers))

    def apply_drains(self, drains: tuple[Drain, ...]) -> None:
        """Steer away from paths crossing a drained link (drains checked whole by answer.py)."""
        self.drain_addrs = drains
        addrs = [a for d in drains for a in d.addrs]
        drained = [pid for pid, info in list(self.failover.paths.items())
                   if addrs and crosses(self.hops.get(pid, ()), info.peer_addr, addrs)]
        mono_ns = time.monotonic_ns()
        self.data_path.carry_out(self.failover, self.failover.set_drained(drained, mono_ns), mono_ns)
        log("drains_applied", links=[d.link for d in drains], paths=len(drained))

    def apply_plan(self, plan: PlanAnswer) -> None:
        """Probe exactly the peers the plan names (discovery for new ones runs here, in this loop).
        The plan was checked whole (answer.py): it names no peer of the config file differently."""
        want = {p.name: p for p in plan.peers}
        have = {p.name: p for p in self.cfg.peers}
        # the peers of the config file stay probed whatever the plan says (their routes, if
        # managed, could not be moved back without probes; and a plan made while the fleet is
        # still joining may not name them yet): a plan adds peers and removes only its own
        want.update(self.config_peers)
        gone = [n for n in have if n not in want]
        new = [p for n, p in want.items() if have.get(n) != p]
        if not gone and not new:
            self.plan_applied = True
            return
        for n in gone:
            self.remove_peer(n)
        for p in new:
            if p.name in have or p.name in self.paths_of_peer:  # changed, or half-added by a failed plan
                self.remove_peer(p.name)
        self.add_peers(new)
        # only now: a plan whose discovery raised leaves these peers out of the config, so the
        # next plan adds them again
        self.cfg = AgentConfig(**{**self.cfg.__dict__, "peers": tuple(want.values())})
        if self.drain_addrs:
            self.apply_drains(self.drain_addrs)
        self.plan_applied = True
        log("plan_applied", version=plan.version, peers=len(want), added=[p.name for p in new], removed=gone)

    def reload(self, new: AgentConfig, key: bytes, accept_key: bytes | None = None) -> None:
        fixed = [f for f in FIXED_ON_RELOAD if getattr(new, f) != getattr(self.cfg, f)]
        if (key, accept_key) != (self.key, self.accept_key):
            # a round of a key rotation (docs/security.md): the probe loop switches under its lock
            self.engine.set_keys(key, accept_key)
            log("fleet_keys_changed", signing_key_changed=key != self.key, keys_accepted=2 if accept_key else 1)
            self.key, self.accept_key = key, accept_key
        if fixed:
            log("reload_partial", needs_restart=fixed, note="these fields change only on a restart; kept as they were")
        old_peers = {p.name: p for p in self.cfg.peers}
        new_peers = {p.name: p for p in new.peers}
        for name in old_peers.keys() - new_peers.keys():
            self.remove_peer(name)
        changed = [p for n, p in new_peers.items() if n in old_peers and old_peers[n] != p]
        for p in changed:
            self.remove_peer(p.name)
        self.cfg = AgentConfig(**{**new.__dict__, **{f: getattr(self.cfg, f) for f in FIXED_ON_RELOAD}})
        self.config_peers = new_peers
        if self.link is not None:
            self.link.rules = self.answer_rules()
        if self.cfg.mtu not in self.expected_sizes:  # the old size too: peers not reloaded yet still send it
            self.expected_sizes = (self.expected_sizes + [self.cfg.mtu])[-8:]
            self.engine.expect_sizes(self.expected_sizes)
        self.add_peers([p for n, p in new_peers.items() if n not in old_peers] + changed)
        self.rates.reconfigured()
        log("reloaded", peers=len(new_peers), paths=len(self.labels))

    def run(self, config_path: str, max_seconds: float | None = None) -> None:
        """The main loop. Each step runs under `self.errors`: one that raises is logged and counted
        and the loop goes on; the data path keeps what the last good step left."""
        end = None if max_seconds is None else time.monotonic() + max_seconds
        self._next_beat = self.rates.next_batch = self.rates.next_cpu = 0.0
        try:
            self._loop(end, config_path)
        finally:  # in the loop's own thread: the scheduling switch is per thread
            self.loop_priority.set(False)
            self.data_path.flush_logs()

    def _loop(self, end: float | None, config_path: str) -> None:
        run = self.errors.run
        while not self.stopping.is_set() and (end is None or time.monotonic() < end):
            if self.service is not None:  # the watchdog pings from here: a hung loop stops them too
                run("service", self.service.tick)  # (counted as step "service" only if it ever fails)
            if self.reload_requested:
                self.reload_requested = False
                if self.service is not None:
                    self.service.reloading()
                run("reload", self._reload, config_path)
                if self.service is not None:
                    self.service.ready()  # also after a refused config: the agent runs on with the old one
            if self.pending_plan is not None:
                plan, self.pending_plan = self.pending_plan, None
                run("plan", self.apply_plan, plan)
            if self.pending_drains is not None:
                drains, self.pending_drains = self.pending_drains, None
                run("drains", self.apply_drains, drains)
            polled = run("poll", self._poll)
            if polled is None:
                self.stopping.wait(self.cfg.batch_ms / 1000)  # a failing engine must not turn this loop into a spin
                continue
            run("decide", self._decide, *polled)
            run("priority", self._prioritize)
            if not self.deciding:  # a rates look (up to ~1 ms) waits for the decision in flight
                self.rates.tick(run)
            if self.entropy is not None and time.monotonic() >= self._next_beat:
                self._next_beat = time.monotonic() + ENTROPY_HEARTBEAT_S
                run("entropy", self.entropy.heartbeat)

    def _decide(self, events: list, evidence_ns: int) -> None:
        mono_ns = time.monotonic_ns()
        self.data_path.carry_out(self.failover, self.failover.step(events, evidence_ns, mono_ns), mono_ns)

    def _prioritize(self) -> None:
        """Real time while a failure is being decided (agent/loop_priority.py)."""
        self.deciding = self.failover.in_flight()
        self.loop_priority.set(self.deciding)

    def _reload(self, config_path: str) -> None:
        try:
            self.reload(*load(config_path))
        except ConfigError as exc:
            log("reload_rejected", error=str(exc), note="running on with the previous config")

    def _poll(self) -> tuple[list, int]:
        """Sleep until the C loop reports a miss or a late reply, or the next batch is due, or a
        DOWN held back from the data path can be decided by fresh answers; the events and their
        evidence time."""
        rates = self.rates
        wait_s = rates.next_batch - time.monotonic()
        decide_ns = self.failover.decision_wait_ns()
        if decide_ns is not None:
            wait_s = min(wait_s, max(decide_ns / 1e9, self.cfg.interval_ms / 1000))
        rates_wait = rates.wait_s()
        if rates_wait is not None and not self.deciding:
            wait_s = min(wait_s, rates_wait)
        # asleep at real time: the probe core's wake-up (a miss or a late reply, where a failure
        # may be starting, or the answers a DOWN waits for) is served at once, not after the
        # wait for a CPU that switching at the wake-up cost (measured: up to 0.9 ms); a timer's
        # wake-up goes back to normal scheduling for its routine step
        self.loop_priority.set(True)
        if not self.engine.wait(wait_s) and not self.deciding:
            self.loop_priority.set(False)
        now = time.monotonic()
        batch = now >= rates.next_batch  # on-time replies come in batches; misses at once
        if batch:
            rates.next_batch = now + rates.batch_s
        events, evidence = self.engine.poll(batch or decide_ns is not None)
        if not batch and any(e.kind == EV_MISS for e in events):
            # a miss: decide on fresh answers of every path (is the peer heard elsewhere?)
            more, evidence = self.engine.poll(True)
            events += more
        return events, evidence

    def stop(self) -> None:
        """Clean stop: the routes stay as the last decisions left them (a plane known bad stays
        out; every peer keeps at least one plane, as always), the entropy table is withdrawn."""
        self.stopping.set()  # also after --max-seconds: the sampler thread ends with the loop
        if self.link is not None:
            self.link.stop()
        if self.routes is not None:
            try:
                left = self.routes.leave()
                log("routes_left", installed={k: list(v) for k, v in left.items()},
                    note="kept as decided; the next start reconciles them with the journal")
            finally:
                self.routes.close()
        if self.entropy is not None:
            self.entropy.close(unlink=True)
        self.rates.stop()
        if self.api:
            self.api.close()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        self.engine.close()
        log("stopped", stats=self.engine_stats(), decisions=dict(self.failover.counters),
            loop_errors={k: v for k, v in self.errors.counts.items() if v},
            coordinator=self.link.stats if self.link is not None else None)

    def engine_stats(self) -> dict:
        return {"counters": self.engine.stats, "drops": self.engine.drops}


def quiet_collector() -> None:
    """The cyclic garbage collector took a fifth of the main thread's CPU samples on an idle host,
    walking objects made at start that live as long as the agent: they are moved out of its sight,
    and it runs after 20 000 new objects instead of 700 (the loop makes few reference cycles; its
    memory goes back by reference counting)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)


def main(config_path: str, max_seconds: float | None = None, dry_run: bool = False,
         log_level: str | None = None) -> int:
    try:
        log.set_level(level_from_env(log_level))
    except ValueError as exc:
        say(f"linkpass agent: {exc}")
        return 2
    try:
        cfg, key, accept_key = load(config_path)
    except ConfigError as exc:
        say(f"linkpass agent: config error: {exc}")
        return 2
    refusal = capability_refusal(cfg, dry_run, caps.read_cap_eff(), probe_engine_kind(cfg))
    if refusal:
        say(f"linkpass agent: {refusal}")
        return 2
    try:
        agent = Agent(cfg, key, dry_run=dry_run, accept_key=accept_key)
    except EntropyError as exc:  # a table directory others can write, or a live writer on it
        say(f"linkpass agent: entropy table: {exc}")
        return 2
    except RdmaUnavailable as exc:  # probe.engine: verbs without a usable RDMA device
        say(f"linkpass agent: probe engine: {exc} (set probe.engine: sockets on a host without RDMA)")
        return 2

    def on_term(_sig, _frm):
        agent.stopping.set()

    def on_hup(_sig, _frm):
        agent.reload_requested = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGHUP, on_hup)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1` prints every thread's stack: for a stuck agent
    faulthandler.enable()  # and so does the SIGABRT systemd's watchdog sends a hung agent, into the journal
    agent.service = service = AgentService(agent)
    # the loop waits at most this long for the GIL when it wakes while another thread (the sampler's
    # TCP dump, a metrics scrape) holds it: 5 ms by default, longer than a whole reroute
    sys.setswitchinterval(GIL_SWITCH_S)
    try:
        agent.start()
        service.ready()
        quiet_collector()
        agent.run(config_path, max_seconds)
    finally:
        service.stopping()
        agent.stop()
        service.notifier.close()
    return 0
