"""`linkpass agent`: the per-host daemon.

Today it discovers the ECMP paths to every configured peer, probes them with the C probe core,
reflects its peers' probes, and serves per-path telemetry on the local query API and /metrics.
It detects nothing and changes no route yet: the detector and the route actuator exist
(linkpass/core/detector.py, linkpass/agent/routes.py) but are not wired in (issue 4).

Lifecycle: SIGTERM/SIGINT stop it cleanly (sockets closed, API down); SIGHUP re-reads the config
and applies what can change without dropping probe state (peers added or removed, probe rates);
what cannot (agent id, fleet key, NICs) is logged and left as it was. Logs are JSON lines on
stderr, one event each.
"""
from __future__ import annotations

import json
import signal
import sys
import threading
import time

from ..probe.discovery import DiscoveryConfig, Target, discover
from ..probe.engine import CoreProbeEngine, PathSpec
from ..probe.service import LocalApi, PathLabels, TelemetryView
from .config import AgentConfig, ConfigError, load_text, read_fleet_key

DISCOVERY_BASE_PORT = 49152


def log(event: str, **fields) -> None:
    fields = {"ts": round(time.time(), 6), "event": event, **fields}
    print(json.dumps(fields, default=str), file=sys.stderr, flush=True)


def load(path: str) -> tuple[AgentConfig, bytes]:
    try:
        with open(path) as f:
            cfg = load_text(f.read(), path)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror})") from None
    try:
        with open(cfg.fleet_key_file, "rb") as f:
            key = read_fleet_key(f.read(), cfg.fleet_key_file)
    except OSError as exc:
        raise ConfigError(f"fleet_key_file: cannot read {cfg.fleet_key_file} ({exc.strerror})") from None
    return cfg, key


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


class Agent:
    def __init__(self, cfg: AgentConfig, key: bytes):
        self.cfg = cfg
        self.key = key
        self.engine = CoreProbeEngine(cfg.agent_id, key)
        self.labels: dict[int, PathLabels] = {}
        self.paths_of_peer: dict[str, list[int]] = {}
        self._next_path_id = 1
        for nic in cfg.nics:
            self.engine.add_nic(f"p{nic.plane}", nic.ifname, nic.addr)
        self.view = TelemetryView(self.engine, self.labels)
        self.api: LocalApi | None = None
        self.stopping = threading.Event()
        self.reload_requested = False

    # ---- paths ---------------------------------------------------------------------------
    def _discovery_config(self) -> DiscoveryConfig:
        ports = tuple(range(DISCOVERY_BASE_PORT, DISCOVERY_BASE_PORT + self.cfg.discovery_ports))
        return DiscoveryConfig(ports=ports, k=self.cfg.ports_per_path)

    def add_peers(self, peers) -> int:
        """Discover and start probing the paths to `peers`; returns how many paths were added."""
        my = {n.plane: n for n in self.cfg.nics}
        targets = [Target(f"p{plane}", my[plane].addr, addr) for p in peers for plane, addr in p.nics.items()
                   if plane in my]
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
                for index, path in enumerate(distinct_paths(table.paths(addr, f"p{plane}"))):
                    for sport in path.ports[: self.cfg.ports_per_path]:
                        pid = self._next_path_id
                        self._next_path_id += 1
                        self.engine.add_path(PathSpec(pid, f"p{plane}", peer.agent_id, addr, sport,
                                                      self.cfg.interval_ms / 1000), first_due_s=0.01)
                        self.labels[pid] = PathLabels(peer.name, plane, index, sport)
                        ids.append(pid)
                        added += 1
            self.paths_of_peer[peer.name] = ids
            log("peer_added", peer=peer.name, paths=len(ids))
        log("discovery", targets=len(targets), paths=added, seconds=round(time.monotonic() - t0, 3),
            stats={k: v for k, v in table.stats.items() if v})
        return added

    def remove_peer(self, name: str) -> None:
        for pid in self.paths_of_peer.pop(name, []):
            self.engine.remove_path(pid)
            self.labels.pop(pid, None)
        log("peer_removed", peer=name)

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self.add_peers(self.cfg.peers)
        self.api = LocalApi(self.view, port=self.cfg.api_port)
        log("started", agent_id=self.cfg.agent_id, name=self.cfg.name, api_port=self.api.port,
            paths=len(self.labels), nics=[n.ifname for n in self.cfg.nics])

    def reload(self, new: AgentConfig, key: bytes) -> None:
        fixed = [f for f in ("agent_id", "name", "nics", "service") if getattr(new, f) != getattr(self.cfg, f)]
        if key != self.key:
            fixed.append("fleet_key_file (contents)")
        if fixed:
            log("reload_partial", needs_restart=fixed, note="these fields change only on a restart; kept as they were")
        old_peers = {p.name: p for p in self.cfg.peers}
        new_peers = {p.name: p for p in new.peers}
        for name in old_peers.keys() - new_peers.keys():
            self.remove_peer(name)
        changed = [p for n, p in new_peers.items() if n in old_peers and old_peers[n] != p]
        for p in changed:
            self.remove_peer(p.name)
        self.cfg = AgentConfig(**{**new.__dict__, **{f: getattr(self.cfg, f) for f in ("agent_id", "name", "nics",
                                                                                       "service")}})
        self.add_peers([p for n, p in new_peers.items() if n not in old_peers] + changed)
        for pid in self.labels:
            self.engine.set_interval(pid, self.cfg.interval_ms / 1000)
        log("reloaded", peers=len(new_peers), paths=len(self.labels))

    def run(self, config_path: str, max_seconds: float | None = None) -> None:
        end = None if max_seconds is None else time.monotonic() + max_seconds
        while not self.stopping.is_set() and (end is None or time.monotonic() < end):
            if self.reload_requested:
                self.reload_requested = False
                try:
                    self.reload(*load(config_path))
                except ConfigError as exc:
                    log("reload_rejected", error=str(exc), note="running on with the previous config")
            self.engine.run(0.05)  # detection and failover are not wired in yet (issue 4)

    def stop(self) -> None:
        if self.api:
            self.api.close()
        self.engine.close()
        log("stopped", stats=self.engine_stats())

    def engine_stats(self) -> dict:
        return {"counters": self.engine.stats, "drops": self.engine.drops}


def main(config_path: str, max_seconds: float | None = None) -> int:
    try:
        cfg, key = load(config_path)
    except ConfigError as exc:
        print(f"linkpass agent: config error: {exc}", file=sys.stderr)
        return 2
    agent = Agent(cfg, key)

    def on_term(_sig, _frm):
        agent.stopping.set()

    def on_hup(_sig, _frm):
        agent.reload_requested = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGHUP, on_hup)
    try:
        agent.start()
        agent.run(config_path, max_seconds)
    finally:
        agent.stop()
    return 0
