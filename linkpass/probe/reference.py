"""The reference probe engine and reflector: the C core's protocol, in Python.

`CoreProbeEngine` (engine.py, over linkpass/probe/_probecore.c) is what the agent runs. This
engine does the same per-packet work (send due probes, reflect peers' probes, match replies,
feed telemetry) in plain Python, so the C core has something to be tested against
(tests/root/test_engine_robustness.py runs both) and measured against (bench/probe_core.py:
see docs/architecture.md for the figures). Sockets: see common.py.

Timestamps: t2 and t4 are kernel RX stamps; t1 and t3 are read just before the send call (user
space). All four pass through the engine's clock function, which is the identity in production
and a synthetic clock on the testbed, where all agents share one kernel clock.

Bounded everywhere: per-path rings, a reflector table capped at `max_reflected_paths`, at most
`batch` packets per socket per wake-up, and `run()` stops at its deadline. Nothing waits on a
peer: sockets are non-blocking, a full send buffer is a counted drop.
"""
from __future__ import annotations

import heapq
import random
import selectors
import socket
import struct
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable

from ..core import wire
from ..core.telemetry import PathTelemetry
from .common import SO_TIMESTAMPNS, ExchangeRecord, PathSpec, ProbedPath, check_engine_args, open_nic_sockets

_IP_UDP = struct.Struct("!BBHHHBBH4s4sHHHH")
_TS = struct.Struct("qq")

Clock = Callable[[int], int]


def _identity(t: int) -> int:
    return t


@dataclass
class _Nic:
    name: str
    ifname: str
    addr: str
    addr_b: bytes
    rx: socket.socket
    tx: socket.socket


@dataclass
class _Path(ProbedPath):
    replay: wire.ReplayWindow = field(default_factory=lambda: wire.ReplayWindow(4096))
    next_seq: int = 0


class ReferenceEngine:
    """One agent's probes and reflector. Not thread-safe: drive it from one thread."""

    def __init__(self, agent_id: int, key: bytes, netns: str | None = None, clock: Clock = _identity,
                 seed: int = 0, jitter: float = 0.1, batch: int = 256, max_reflected_paths: int = 65536,
                 on_exchange: Callable[[ExchangeRecord], None] | None = None):
        check_engine_args(agent_id, jitter)
        self.agent_id = agent_id
        self.codec = wire.Codec(key)
        self.netns = netns
        self.clock = clock
        self.rng = random.Random(seed)
        self.jitter = jitter
        self.batch = batch
        self.on_exchange = on_exchange
        self.nics: dict[str, _Nic] = {}
        self.paths: dict[int, _Path] = {}
        self.drops: Counter = Counter()  # reason -> count, reasons from wire.DROP_REASONS + send errors
        self.stats: Counter = Counter()  # sent, reflected, replies
        self._reflected: OrderedDict[tuple[int, int], tuple[int, wire.ReplayWindow]] = OrderedDict()
        self._max_reflected = max_reflected_paths
        self._due: list[tuple[float, int]] = []
        self._sel = selectors.DefaultSelector()

    # ---- setup -----------------------------------------------------------------------------
    def add_nic(self, name: str, ifname: str, addr: str) -> None:
        rx, tx = open_nic_sockets(self.netns, ifname, addr)
        nic = _Nic(name, ifname, addr, socket.inet_aton(addr), rx, tx)
        self.nics[name] = nic
        self._sel.register(rx, selectors.EVENT_READ, nic)

    def add_path(self, spec: PathSpec, now: float | None = None) -> None:
        if spec.nic not in self.nics:
            raise ValueError(f"path {spec.path_id}: unknown NIC {spec.nic!r}; add_nic() it first")
        if not 0.0001 <= spec.interval_s <= 60:
            raise ValueError(f"path {spec.path_id}: interval_s must be 0.0001..60, got {spec.interval_s}")
        self.paths[spec.path_id] = _Path(spec, PathTelemetry())
        start = (time.perf_counter() if now is None else now) + self.rng.random() * spec.interval_s
        heapq.heappush(self._due, (start, spec.path_id))

    def set_interval(self, path_id: int, interval_s: float) -> None:
        """Probe a path faster (active: traffic on it) or slower (idle); takes effect at its next probe."""
        path = self.paths[path_id]
        self.paths[path_id] = _Path(replace(path.spec, interval_s=interval_s), path.telemetry, path.replay,
                                    path.next_seq)

    def close(self) -> None:
        for nic in self.nics.values():
            self._sel.unregister(nic.rx)
            nic.rx.close()
            nic.tx.close()
        self.nics.clear()
        self._sel.close()

    # ---- the loop ------------------------------------------------------------------------
    def run(self, duration_s: float) -> None:
        """Probe, reflect and receive for `duration_s` seconds (bounded), then return."""
        end = time.perf_counter() + duration_s
        while True:
            now = time.perf_counter()
            if now >= end:
                return
            self._send_due(now)
            wait = min(end, self._due[0][0] if self._due else end) - time.perf_counter()
            for key, _ in self._sel.select(max(0.0, wait)):
                self._receive(key.data)

    def _send_due(self, now: float) -> None:
        while self._due and self._due[0][0] <= now:
            due, pid = heapq.heappop(self._due)
            path = self.paths.get(pid)
            if path is None:  # removed
                continue
            self._send_request(path)
            iv = path.spec.interval_s
            nxt = due + iv * (1 + self.jitter * (2 * self.rng.random() - 1))
            heapq.heappush(self._due, (max(nxt, now), pid))

    def _send(self, nic: _Nic, dst_b: bytes, dst: str, sport: int, payload: bytes) -> bool:
        total = 28 + len(payload)
        hdr = _IP_UDP.pack(0x45, 0, total, 0, 0x4000, 64, 17, 0, nic.addr_b, dst_b, sport, wire.ROCE_PORT,
                           8 + len(payload), 0)
        try:
            nic.tx.sendto(hdr + payload, (dst, 0))
            return True
        except BlockingIOError:
            self.drops["send_buffer_full"] += 1
        except OSError:
            self.drops["send_error"] += 1  # e.g. ENETUNREACH while a link is down
        return False

    def _send_request(self, path: _Path) -> None:
        s = path.spec
        nic = self.nics[s.nic]
        seq = path.next_seq
        path.next_seq += 1
        t1 = self.clock(time.time_ns())
        probe = wire.Probe(wire.KIND_REQUEST, self.agent_id, s.peer_id, s.path_id, seq, t1=t1,
                           flags=wire.FLAG_MTU_PROBE if s.pad else 0, pad=s.pad)
        payload = self.codec.encode(probe, nic.addr_b, socket.inet_aton(s.peer_addr), s.sport)
        if self._send(nic, socket.inet_aton(s.peer_addr), s.peer_addr, s.sport, payload):
            path.telemetry.on_sent()
            self.stats["sent"] += 1

    def _receive(self, nic: _Nic) -> None:
        for _ in range(self.batch):
            try:
                data, anc, _flags, (src, sport) = nic.rx.recvmsg(65535, 64)
            except BlockingIOError:
                return
            t_rx = None
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    sec, nsec = _TS.unpack_from(payload)
                    t_rx = sec * 1_000_000_000 + nsec
            t_rx = self.clock(t_rx if t_rx is not None else time.time_ns())
            try:
                probe = self.codec.decode(data, src, nic.addr_b, sport)
            except wire.WireError as err:
                self.drops[err.reason] += 1
                continue
            if probe.kind == wire.KIND_REQUEST:
                self._reflect(nic, probe, src, sport, t_rx)
            else:
                self._complete(probe, src, t_rx)

    def _reflect(self, nic: _Nic, req: wire.Probe, src: str, sport: int, t2: int) -> None:
        if req.reflector != self.agent_id:
            self.drops["unexpected"] += 1  # a probe meant for another agent
            return
        key = (req.sender, req.path)
        entry = self._reflected.get(key)
        if entry is None:
            if len(self._reflected) >= self._max_reflected:
                self._reflected.popitem(last=False)
                self.drops["reflector_table_full"] += 1
            entry = (0, wire.ReplayWindow(4096))
        count, window = entry
        if not window.accept(req.seq):
            self.drops["replay"] += 1
            return
        self._reflected[key] = (count + 1, window)
        self._reflected.move_to_end(key)
        t3 = self.clock(time.time_ns())
        reply = req.reply(t2=t2, t3=t3, rx_count=count + 1)
        src_b = socket.inet_aton(src)
        if self._send(nic, src_b, src, sport, self.codec.encode(reply, nic.addr_b, src_b, sport)):
            self.stats["reflected"] += 1

    def _complete(self, rep: wire.Probe, src: str, t4: int) -> None:
        path = self.paths.get(rep.path)
        if rep.sender != self.agent_id or path is None or path.spec.peer_addr != src:
            self.drops["unexpected"] += 1
            return
        if not path.replay.accept(rep.seq):
            self.drops["replay"] += 1
            return
        path.telemetry.on_reply(rep.seq, rep.t1, rep.t2, rep.t3, t4, rep.rx_count)
        self.stats["replies"] += 1
        if self.on_exchange:
            self.on_exchange(ExchangeRecord(rep.path, path.spec.peer_id, rep.seq, rep.t1, rep.t2, rep.t3, t4))

    # ---- reading -------------------------------------------------------------------------
    def telemetry(self, path_id: int) -> PathTelemetry:
        return self.paths[path_id].telemetry
