"""Probe engine and reflector of one agent: the per-packet data path, in Python (for now).

Per local NIC it owns two sockets, opened inside the host's namespace:

- a UDP socket bound to NIC:4791 that receives both requests from peers and replies to our
  own probes, with kernel RX timestamps (SO_TIMESTAMPNS);
- a raw IPv4 socket bound to the NIC (IP_HDRINCL) that sends requests and replies with any
  source port: the source port is what picks the fabric path. Headers are built as the kernel
  builds an unconnected DF datagram (IP id 0), which is what the RoCEv2 ICRC covers.

A request goes NIC_a:sport -> NIC_b:4791; the reply goes NIC_b:sport -> NIC_a:4791, so both
directions are RoCEv2 (destination port 4791) and the reverse path is fixed by the same port.

Timestamps: t2 and t4 are kernel RX stamps; t1 and t3 are read just before the send call (user
space; kernel TX stamps are a planned refinement). All four pass through the agent's clock
function, which is the identity in production and a synthetic clock on the testbed, where all
agents share one kernel clock.

Bounded everywhere: per-path rings, a reflector table capped at `max_reflected_paths`, at most
`batch` packets per socket per wake-up, and `run()` stops at its deadline. Nothing waits on a
peer: sockets are non-blocking, a full send buffer is a counted drop.

Measured on this machine (sim/bench/probe_core.py): see docs/architecture.md. The hot loop is
meant to move into a compiled core behind this same interface.
"""
from __future__ import annotations

import heapq
import os
import random
import select
import selectors
import socket
import struct
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable

from ..kernel import netns as ns_io
from ..core import wire
from ..core.probe_event import ProbeEvent
from ..core.telemetry import PathTelemetry, feed_events

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
SO_BINDTODEVICE = getattr(socket, "SO_BINDTODEVICE", 25)
_IP_UDP = struct.Struct("!BBHHHBBH4s4sHHHH")
_TS = struct.Struct("qq")

Clock = Callable[[int], int]


def _identity(t: int) -> int:
    return t


def _check_engine_args(agent_id: int, jitter: float) -> None:
    if not 0 < agent_id < 2**32:
        raise ValueError(f"agent_id must be 1..{2**32 - 1}, got {agent_id}")
    if not 0 <= jitter < 1:
        raise ValueError("jitter must be in [0, 1): a fraction of the interval")


def open_nic_sockets(netns: str | None, ifname: str, addr: str) -> tuple[socket.socket, socket.socket]:
    """(rx, tx) for one NIC, opened inside `netns`: UDP NIC:4791 with kernel RX timestamps, and
    a raw socket bound to the NIC for sending with any source port."""
    def make(*args) -> socket.socket:
        return ns_io.socket_in_netns(netns, *args) if netns else socket.socket(*args)

    rx = make(socket.AF_INET, socket.SOCK_DGRAM)
    tx = make(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    try:
        rx.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
        rx.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        rx.bind((addr, wire.ROCE_PORT))
        rx.setblocking(False)
        tx.setsockopt(socket.SOL_SOCKET, SO_BINDTODEVICE, ifname.encode())
        tx.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        tx.setblocking(False)
    except OSError:
        rx.close()
        tx.close()
        raise
    return rx, tx


@dataclass(frozen=True, slots=True)
class ExchangeRecord:
    """One completed exchange as the engine hands it on (times in the agent's clock, ns)."""

    path_id: int
    peer_id: int
    seq: int
    t1: int
    t2: int
    t3: int
    t4: int


@dataclass(frozen=True)
class PathSpec:
    path_id: int
    nic: str  # local NIC name (the engine's key for it)
    peer_id: int  # agent id of the reflector
    peer_addr: str  # its NIC address
    sport: int
    interval_s: float = 0.001
    pad: int = 0  # padding for full-size probes
    pair_gap_s: float = 0.0  # > 0: coded pairs, a second probe this long after each (clock sync); C core only


@dataclass
class _Nic:
    name: str
    ifname: str
    addr: str
    addr_b: bytes
    rx: socket.socket
    tx: socket.socket


@dataclass
class _Path:
    spec: PathSpec
    telemetry: PathTelemetry
    replay: wire.ReplayWindow = field(default_factory=lambda: wire.ReplayWindow(4096))
    next_seq: int = 0


class ProbeEngine:
    """One agent's probes and reflector. Not thread-safe: drive it from one thread."""

    def __init__(self, agent_id: int, key: bytes, netns: str | None = None, clock: Clock = _identity,
                 seed: int = 0, jitter: float = 0.1, batch: int = 256, max_reflected_paths: int = 65536,
                 on_exchange: Callable[[ExchangeRecord], None] | None = None):
        _check_engine_args(agent_id, jitter)
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


class CoreProbeEngine:
    """The same engine with its per-packet loop in C (linkpass.probe._probecore).

    `run()` hands the loop to C in slices (GIL released) and, between slices, turns the
    completed exchanges into per-path telemetry and `on_exchange` calls. The clock is a linear
    map per slice, `clock_segment(true_ns) -> (base_true_ns, base_local_ns, rate_ppb)`, so a
    synthetic clock's random walk is followed piecewise.
    """

    RECORD = struct.Struct("<IIQqqqq")  # xrec_t: path_id, rx_count, seq, t1..t4
    EVENT = struct.Struct("<IIQIIIIqqqq")  # ev_t: ProbeEvent's fields, in its order
    MAX_KEPT = 1_000_000

    def __init__(self, agent_id: int, key: bytes, netns: str | None = None,
                 clock_segment: Callable[[int], tuple[int, int, int]] | None = None, seed: int = 1,
                 jitter: float = 0.1, slice_s: float = 0.05,
                 on_exchange: Callable[[ExchangeRecord], None] | None = None):
        from . import _probecore

        _check_engine_args(agent_id, jitter)
        self.agent_id = agent_id
        self.netns = netns
        self.core = _probecore.Core(key, agent_id, seed=seed or 1, jitter_ppm=int(jitter * 1e6))
        self.clock_segment = clock_segment
        self.slice_s = slice_s
        self.on_exchange = on_exchange
        self.nics: dict[str, tuple[int, socket.socket, socket.socket]] = {}
        self.paths: dict[int, _Path] = {}
        self._telemetry: dict[int, PathTelemetry] = {}  # path -> its telemetry, what poll() feeds
        self._collect: list[ExchangeRecord] | None = None
        self.background = False
        assert self.RECORD.size == _probecore.RECORD_SIZE and self.EVENT.size == _probecore.EVENT_SIZE
        self.MAX_PAD = _probecore.MAX_PAD

    def add_nic(self, name: str, ifname: str, addr: str) -> None:
        rx, tx = open_nic_sockets(self.netns, ifname, addr)
        index = self.core.add_nic(rx.fileno(), tx.fileno(), socket.inet_aton(addr))
        self.nics[name] = (index, rx, tx)

    def add_path(self, spec: PathSpec, first_due_s: float = 0.0) -> None:
        if spec.nic not in self.nics:
            raise ValueError(f"path {spec.path_id}: unknown NIC {spec.nic!r}; add_nic() it first")
        self.core.add_path(spec.path_id, self.nics[spec.nic][0], spec.peer_id, socket.inet_aton(spec.peer_addr),
                           spec.sport, int(spec.interval_s * 1e9), spec.pad,
                           time.monotonic_ns() + int(first_due_s * 1e9), int(spec.pair_gap_s * 1e9))
        self.paths[spec.path_id] = path = _Path(spec, PathTelemetry())
        self._telemetry[spec.path_id] = path.telemetry

    def remove_path(self, path_id: int) -> None:
        self.core.remove_path(path_id)
        del self.paths[path_id]
        del self._telemetry[path_id]

    def set_interval(self, path_id: int, interval_s: float) -> None:
        """Probe a path faster (active: traffic on it) or slower (idle); a faster rate starts at once."""
        self.core.set_interval(path_id, int(interval_s * 1e9))
        path = self.paths[path_id]
        path.spec = replace(path.spec, interval_s=interval_s)

    def start_background(self, rt_priority: int = 0) -> str | None:
        """Run the loop in a native thread from now on: it keeps receiving, reflecting and
        probing while Python is busy (a paused reflector makes its peers see false misses).
        `rt_priority` > 0 asks for SCHED_FIFO; returns None, or why that was refused."""
        self.core.start(rt_priority)
        self.background = True
        if rt_priority:
            time.sleep(0.01)  # the thread asks first thing
            err = self.core.rt_status()
            if err:
                return os.strerror(err)
        return None

    def stop_background(self) -> None:
        self.core.stop()
        self.background = False

    def run(self, duration_s: float) -> None:
        end = time.monotonic() + duration_s
        if self.background:  # the native thread does the work; keep telemetry current
            while (left := end - time.monotonic()) > 0:
                if self.clock_segment:
                    self.core.set_clock(*self.clock_segment(time.time_ns()))
                time.sleep(min(left, self.slice_s))
                self.absorb()
            return
        while True:
            left = end - time.monotonic()
            if left <= 0:
                break
            if self.clock_segment:
                self.core.set_clock(*self.clock_segment(time.time_ns()))
            self.core.run(int(min(left, self.slice_s) * 1e9))
            self.absorb()

    def take_records(self) -> list[ExchangeRecord]:
        """The exchanges completed since the last call (they also went into telemetry). Keeping
        them starts with the first call; at most `MAX_KEPT` wait, the oldest are dropped."""
        if self._collect is None:
            self._collect = []
        self.absorb()
        out, self._collect = self._collect, []
        return out

    def absorb(self) -> int:
        """Feed the exchanges completed in C into telemetry; returns how many."""
        data = self.core.take()
        for pid, path in self.paths.items():
            path.telemetry.sent = self.core.path_sent(pid)
        for path_id, rx_count, seq, t1, t2, t3, t4 in self.RECORD.iter_unpack(data):
            path = self.paths.get(path_id)
            if path is None:
                continue
            path.telemetry.on_reply(seq, t1, t2, t3, t4, rx_count)
            if self.on_exchange or self._collect is not None:
                rec = ExchangeRecord(path_id, path.spec.peer_id, seq, t1, t2, t3, t4)
                if self._collect is not None:
                    if len(self._collect) >= self.MAX_KEPT:
                        del self._collect[: len(self._collect) // 2]
                    self._collect.append(rec)
                if self.on_exchange:
                    self.on_exchange(rec)
        return len(data) // self.RECORD.size

    def track(self, on: bool = True) -> None:
        """Judging mode: the C loop matches replies to requests against each path's deadline
        (`set_rto`) and `poll()` returns events instead of one record per exchange."""
        self.core.track(on)

    def wait(self, timeout_s: float) -> bool:
        """Sleep until the C loop has a MISS or LATE waiting (True) or `timeout_s` passed."""
        fd = self.core.fileno()
        ready, _, _ = select.select([fd], [], [], max(0.0, timeout_s))
        if ready:
            try:
                os.read(fd, 8)
            except BlockingIOError:
                pass
        return bool(ready)

    def set_rto(self, path_id: int, rto_ns: int) -> None:
        self.core.set_rto(path_id, rto_ns)

    def set_size_probe(self, path_id: int, every: int, ip_size: int) -> None:
        """Make every `every`-th probe of a path an IP packet of `ip_size` bytes (0 = off): full-MTU
        probes find MTU black holes that small probes cross."""
        pad = ip_size - 28 - wire.MIN_PAYLOAD if every else 0
        if every and not 0 <= pad <= self.MAX_PAD:
            raise ValueError(f"size probe of {ip_size} bytes: allowed {28 + wire.MIN_PAYLOAD}.."
                             f"{28 + wire.MIN_PAYLOAD + self.MAX_PAD}")
        self.core.set_size_probe(path_id, every, pad)

    def poll(self, all_answered: bool = True) -> tuple[list[ProbeEvent], int]:
        """Judging mode's events since the last call, in order, already fed into telemetry
        (core/probe_event.py says what each kind carries); and the evidence time: every reply
        that reached a socket before it has been judged. `all_answered=False` leaves on-time
        replies accumulating in C (cheap frequent polls that still see every miss at once).
        Times are on this agent's clock."""
        data, evidence = self.core.take_events(all_answered)
        events = list(map(ProbeEvent._make, self.EVENT.iter_unpack(data)))
        feed_events(events, self._telemetry)
        if all_answered:
            for pid, path in self.paths.items():
                path.telemetry.sent = self.core.path_sent(pid)
        return events, evidence

    @property
    def stats(self) -> dict:
        c = self.core.counters()
        return {k: c[k] for k in ("sent", "reflected", "replies", "received")}

    @property
    def drops(self) -> dict:
        return self.core.counters()["drops"]

    def telemetry(self, path_id: int) -> PathTelemetry:
        return self.paths[path_id].telemetry

    def close(self) -> None:
        if self.background:
            self.stop_background()
        for _, rx, tx in self.nics.values():
            rx.close()
            tx.close()
        self.nics.clear()
