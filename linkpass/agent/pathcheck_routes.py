"""`linkpass probe DST` and `linkpass trace DST --sport N` on any host: the local API's /v1/probe
and /v1/trace, run by the agent from its own NICs towards a peer it knows.

    GET /v1/probe?peer=h3[&plane=P][&base_port=31000][&ports=32][&dport=4791]
    GET /v1/trace?peer=h3&sport=N[&plane=P][&dport=4791]

The agent runs the path check of linkpass/probe/pathcheck.py (it has the NIC addresses, the
peer's addresses per plane and the capability to bind probe sockets to a device) and joins in
what its own authenticated probes see on the same paths: the paths of the sweep with the same
hops (probe), or the agent's path with that very source port (trace). A peer running an agent
answers no stray datagram on 4791, so a swept path the agent's probes get answers over counts
as reached (`reached_by: agent`).

Answers: 200 and the document; 400 naming the query field that is wrong; 404 for a peer the
agent does not probe (naming those it does); 409 when no probe socket could be bound (ports in
use); 429 while another check runs (one at a time: a check sends up to
ports x planes x TTLs datagrams, and the API listens on 127.0.0.1 for any local user).
"""
from __future__ import annotations

import json
import threading
import time
from typing import Callable
from urllib.parse import parse_qs

from ..core.constants import ROCE_PORT
from ..probe import pathcheck as PC
from .config import Nic, Peer

MAX_API_PORTS = 256  # ports one API sweep may take per plane


class BadQuery(Exception):
    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(message)
        self.status, self.field = status, field


Answer = tuple[int, bytes, str]


def _json(status: int, doc: dict) -> Answer:
    return status, json.dumps(doc).encode(), "application/json"


def _int(query: dict[str, list[str]], name: str, default: int | None, lo: int, hi: int) -> int:
    values = query.get(name)
    if not values:
        if default is None:
            raise BadQuery(400, f"{name} is required ({lo}..{hi})", name)
        return default
    try:
        v = int(values[-1])
    except ValueError:
        raise BadQuery(400, f"{name}={values[-1]!r} is not a number; give {lo}..{hi}", name) from None
    if not lo <= v <= hi:
        raise BadQuery(400, f"{name}={v} is outside {lo}..{hi}", name)
    return v


class PathCheckRoutes:
    """The two routes. `nics` and `peers` are read at each request: a reload or a coordinator
    plan changes them while the agent runs. `live(peer)` gives the agent's probed paths to it."""

    def __init__(self, name: str, nics: Callable[[], tuple[Nic, ...]], peers: Callable[[], dict[str, Peer]],
                 live: Callable[[str], PC.Live], netns: str | None = None, log: Callable[..., None] = lambda *a, **k: None):
        self.name, self.nics, self.peers, self.live, self.netns, self.log = name, nics, peers, live, netns, log
        self._busy = threading.Lock()

    def _legs(self, query: dict[str, list[str]]) -> tuple[str, list[PC.Leg]]:
        name = (query.get("peer") or [""])[-1]
        if not name:
            raise BadQuery(400, "peer is required: the peer host to check, e.g. peer=h3", "peer")
        peers = self.peers()
        peer = peers.get(name)
        if peer is None:
            known = ", ".join(sorted(peers)[:20]) or "none yet"
            raise BadQuery(404, f"unknown peer {name!r}: this agent probes {known}", "peer")
        mine = {n.plane: n for n in self.nics()}
        planes = sorted(p for p in peer.nics if p in mine)
        if "plane" in query:
            plane = _int(query, "plane", None, 0, 255)
            if plane not in planes:
                raise BadQuery(400, f"plane={plane}: {name} and this host share planes {planes}", "plane")
            planes = [plane]
        if not planes:
            raise BadQuery(404, f"{name} has no plane in common with this host", "peer")
        return name, [PC.Leg(p, mine[p].ifname, mine[p].addr, peer.nics[p]) for p in planes]

    def _run(self, kind: str, query_string: str, check: Callable[[dict[str, list[str]]], dict]) -> Answer:
        try:
            query = parse_qs(query_string, keep_blank_values=True, max_num_fields=16)
        except ValueError as exc:
            return _json(400, {"error": f"bad query: {exc}"})
        if not self._busy.acquire(blocking=False):
            return _json(429, {"error": "another path check is running on this agent; retry in a few seconds"})
        t0 = time.monotonic()
        try:
            doc = check(query)
        except BadQuery as exc:
            return _json(exc.status, {"error": str(exc), **({"field": exc.field} if exc.field else {})})
        except Exception as exc:  # a bug: the caller and the journal hear of it, the agent runs on
            self.log("path_check_failed", kind=kind, query=query_string[:200], error=f"{type(exc).__name__}: {exc}")
            return _json(500, {"error": f"the {kind} failed inside the agent ({type(exc).__name__}: {exc}); "
                                        "its journal has the details"})
        finally:
            self._busy.release()
        s = doc["summary"]
        self.log("path_check", kind=kind, peer=doc["dst"], planes=s["planes"], paths=s.get("paths", s["planes"]),
                 reached=s.get("paths_reached", s["planes_reached"]), seconds=round(time.monotonic() - t0, 3))
        return _json(200, doc)

    def probe(self, query_string: str) -> Answer:
        def check(q):
            peer, legs = self._legs(q)
            ports_n = _int(q, "ports", PC.PROBE_PORTS, 1, MAX_API_PORTS)
            base = _int(q, "base_port", PC.PROBE_BASE_PORT, 1024, 65536 - ports_n)
            dport = _int(q, "dport", ROCE_PORT, 1, 65535)
            ports = tuple(range(base, base + ports_n))
            doc = PC.probe(self.netns, self.name, peer, {"agent": self.name}, legs, ports, dport,
                           live=lambda: self.live(peer))
            if doc is None:
                raise BadQuery(409, f"could not bind any probe socket on ports {ports[0]}-{ports[-1]} (in use?); "
                                    "try another base_port", "base_port")
            return doc
        return self._run("probe", query_string, check)

    def trace(self, query_string: str) -> Answer:
        def check(q):
            peer, legs = self._legs(q)
            sport = _int(q, "sport", None, 1024, 65535)
            dport = _int(q, "dport", ROCE_PORT, 1, 65535)
            doc = PC.trace(self.netns, self.name, peer, {"agent": self.name}, legs, sport, dport,
                           live=lambda: self.live(peer))
            unprobed = PC.unprobed_planes(doc)
            if unprobed:
                raise BadQuery(409, f"could not trace sport {sport} on plane(s) {unprobed}: the port is in use on "
                                    "that NIC; pick another sport", "sport")
            return doc
        return self._run("trace", query_string, check)


def live_paths(rows: list[dict], hops: dict[int, tuple], peer: str) -> PC.Live:
    """The agent's probed paths to `peer` (its /v1/paths rows and each path's discovered hops)."""
    live = PC.Live()
    for r in rows:
        if r["peer"] != peer:
            continue
        rtt = (r.get("rtt_ns") or {}).get("p50")  # the window's median
        live.paths.setdefault(r["plane"], []).append(PC.LivePath(
            r["sport"], tuple(hops.get(r["path_id"], ())), r.get("state"),
            None if rtt is None else rtt / 1e6, (r.get("window") or {}).get("loss_pct")))
    return live
