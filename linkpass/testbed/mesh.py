"""A probe mesh across the testbed: one probe engine per host namespace, run from one process.

Test and benchmark glue until the agent exists (issue 4): it opens each host's NIC sockets
inside the host's namespace, gives every engine its own synthetic clock (all testbed hosts
share one kernel clock, so clock sync needs a clock to estimate), runs the engines in threads
(the C core releases the GIL) and keeps the truth next to the telemetry.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from ..probe.common import ExchangeRecord, PathSpec
from ..probe.engine import CoreProbeEngine
from ..core.constants import AGENT_API_PORT
from .topology import Fabric


@dataclass(frozen=True)
class MeshPath:
    path_id: int
    src: int  # host index
    dst: int
    plane: int
    sport: int


@dataclass
class Mesh:
    fab: Fabric
    key: bytes
    engines: dict[int, CoreProbeEngine] = field(default_factory=dict)
    paths: dict[int, MeshPath] = field(default_factory=dict)

    @classmethod
    def start(cls, fab: Fabric, paths: list[tuple[int, int, int, int]], key: bytes, interval_s: float = 0.001,
              pair_gap_s: float = 0.0,
              clocks: dict[int, Callable[[int], tuple[int, int, int]]] | None = None,
              on_exchange: Callable[[int, ExchangeRecord], None] | None = None) -> "Mesh":
        """Engines for every host; `paths` as (src, dst, plane, sport). Agent id = host index + 1.

        `clocks[host]` maps true ns to a (base_true, base_local, rate_ppb) segment of that host's
        clock; `on_exchange(src_host, record)` sees every completed exchange.
        """
        mesh = cls(fab, key)
        for i in range(fab.spec.hosts):
            cb = None
            if on_exchange:
                cb = (lambda host: lambda rec: on_exchange(host, rec))(i)
            eng = CoreProbeEngine(i + 1, key, netns=fab.netns(f"h{i}"), seed=i + 1,
                                  clock_segment=(clocks or {}).get(i), on_exchange=cb)
            for p in range(fab.spec.planes):
                eng.add_nic(f"p{p}", f"p{p}", fab.nic_addr(i, p))
            mesh.engines[i] = eng
        for n, (src, dst, plane, sport) in enumerate(paths, start=1):
            mesh.paths[n] = MeshPath(n, src, dst, plane, sport)
            mesh.engines[src].add_path(PathSpec(n, f"p{plane}", dst + 1, fab.nic_addr(dst, plane), sport, interval_s,
                                                pair_gap_s=pair_gap_s), first_due_s=0.01)
        return mesh

    def run(self, seconds: float) -> None:
        threads = [threading.Thread(target=e.run, args=(seconds,), name=f"agent-h{i}") for i, e in self.engines.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def telemetry(self, path_id: int):
        return self.engines[self.paths[path_id].src].telemetry(path_id)

    def close(self) -> None:
        for e in self.engines.values():
            e.close()


def peer_routes(fab: Fabric, host: int):
    """What the route actuator of `host` needs: every other host's service address and, per
    plane, the gateway (the leaf end of our uplink) and device."""
    from ..agent.routes import PeerRoutes
    from .topology import host_link_addrs

    hops = {p: (str(host_link_addrs(p, host)[0]), f"p{p}") for p in range(fab.spec.planes)}
    return {f"h{j}": PeerRoutes(f"h{j}", fab.service_addr(j), hops) for j in range(fab.spec.hosts) if j != host}


def write_agent_configs(fab: Fabric, directory: str, key: bytes, api_port: int = AGENT_API_PORT,
                        interval_ms: float = 1.0, routes: bool = False, entropy: bool = False,
                        detect: dict | None = None, hosts=None, coordinator: dict | None = None,
                        probe: dict | None = None, route_options: dict | None = None) -> dict[int, str]:
    """One `linkpass agent` config per host in `hosts` (default: all), whose peers are the other
    hosts in it, every plane; plus the fleet key file. Route journals and entropy tables go into
    `directory` too (one per host)."""
    import os

    import yaml

    from .topology import host_link_addrs

    os.makedirs(directory, exist_ok=True)
    key_file = os.path.join(directory, "fleet.key")
    with open(key_file, "w") as f:
        f.write(key.hex())
    os.chmod(key_file, 0o600)
    out = {}
    planes = range(fab.spec.planes)
    chosen = list(range(fab.spec.hosts) if hosts is None else hosts)  # agents run here; they are each other's peers
    for i in chosen:
        doc = {
            "agent_id": i + 1, "name": f"h{i}", "fleet_key_file": key_file, "service": fab.service_addr(i),
            "nics": [{"plane": p, "ifname": f"p{p}", "addr": fab.nic_addr(i, p),
                      "gateway": str(host_link_addrs(p, i)[0])} for p in planes],
            "peers": [{"name": f"h{j}", "agent_id": j + 1, "service": fab.service_addr(j),
                       "nics": {p: fab.nic_addr(j, p) for p in planes}} for j in chosen if j != i],
            "probe": {"interval_ms": interval_ms, **(probe or {})}, "api": {"port": api_port},
            "routes": {"enabled": routes, "journal": os.path.join(directory, f"routes-h{i}.journal"),
                       **(route_options or {})},
            "entropy": {"enabled": entropy, "path": os.path.join(directory, f"entropy-h{i}")},
        }
        if detect:
            doc["detect"] = dict(detect)
        if coordinator:
            doc["coordinator"] = dict(coordinator)
        path = os.path.join(directory, f"agent-h{i}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(doc, f, sort_keys=False)
        out[i] = path
    return out
