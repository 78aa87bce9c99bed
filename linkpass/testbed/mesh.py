"""A probe mesh across the testbed: one probe engine per host namespace, run from one process.

Glue for the telemetry tests and the clock benchmark, which measure the probe engines without
the agent's decisions: it opens each host's NIC sockets inside the host's namespace, gives every engine its own synthetic clock (all testbed hosts
share one kernel clock, so clock sync needs a clock to estimate), runs the engines in threads
(the C core releases the GIL) and keeps the truth next to the telemetry.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from ..probe.common import ExchangeRecord, PathSpec
from ..probe.engine import CoreProbeEngine
from ..core.names import host_name
from .topology import Fabric, nic_ifname


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
            eng = CoreProbeEngine(i + 1, key, netns=fab.netns(host_name(i)), seed=i + 1,
                                  clock_segment=(clocks or {}).get(i), on_exchange=cb)
            for p in range(fab.spec.planes):
                eng.add_nic(f"p{p}", nic_ifname(p), fab.nic_addr(i, p))
            mesh.engines[i] = eng
        for n, (src, dst, plane, sport) in enumerate(paths, start=1):
            mesh.paths[n] = MeshPath(n, src, dst, plane, sport)
            mesh.engines[src].add_path(PathSpec(n, f"p{plane}", dst + 1, fab.nic_addr(dst, plane), sport, interval_s,
                                                pair_gap_s=pair_gap_s), first_due_s=0.01)
        return mesh

    def run(self, seconds: float) -> None:
        threads = [threading.Thread(target=e.run, args=(seconds,), name=f"agent-{host_name(i)}")
                   for i, e in self.engines.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def telemetry(self, path_id: int):
        return self.engines[self.paths[path_id].src].telemetry(path_id)

    def close(self) -> None:
        for e in self.engines.values():
            e.close()
