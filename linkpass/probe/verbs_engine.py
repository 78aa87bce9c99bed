"""The probe engine of RDMA hosts: probes received by a UD queue pair, not by a socket.

On a RoCE NIC (and with Soft-RoCE) every packet to UDP 4791 goes to the RDMA device, never to a
socket, so the raw-socket engine (engine.py) would hear nothing there. This engine receives
through verbs instead: one UD QP per NIC (Q_Key `wire.LINKPASS_QKEY`), whose completions carry
each probe's UD record and, in the GRH slot, its IPv4 header. Requests and replies are built
here as RoCEv2 UD SENDs to the peer's probe QP (wire.ud_packet) and sent on a raw socket, with
the UDP source port the path needs: a UD QP's own port is fixed by the device (rxe: a hash of
its QP number), and the reply must carry the request's port so that it takes the reverse of the
same ECMP path, as an RC QP's packets with that port do.

The peer's probe QP number changes with every start of its agent, so it is learned with a
hello: an authenticated UDP ask/answer on `wire.HELLO_PORT` (asked again while a peer is silent).

Timestamps are **software** stamps (`TIMESTAMPS`): t2 and t4 are read when the completion is
polled, t1 and t3 when the packet is built. rxe has no completion timestamps; on a NIC that has
them (mlx5: IBV_WC_EX_WITH_COMPLETION_TIMESTAMP) they would replace the polled stamps.

The interface is CoreProbeEngine's, as far as the agent uses it: paths, judging mode (`poll`
returns ProbeEvents judged against each path's deadline, with the evidence time), `wait`, the
background thread (Python here: each guest probes a handful of paths, at a rate set by config).
All state is under one lock, shared by the thread and the agent's loop; everything is bounded:
outstanding requests per path, reflector entries, completions per wake-up, hello answers per
second.
"""
from __future__ import annotations

import os
import random
import secrets
import select
import socket
import struct
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, replace

from ..core import wire
from ..core.probe_event import EV_LATE, EV_MISS, ProbeEvent
from ..core.telemetry import PathTelemetry, feed_events
from ..kernel.rdma import Device, load_pyverbs
from .common import SO_BINDTODEVICE, PathIds, PathSpec, ProbedPath, check_engine_args

TIMESTAMPS = "software"  # how t2 and t4 are taken (see the module doc)
GRH_LEN = 40  # a UD receive buffer starts with the GRH; RoCEv2 puts the IPv4 header in its last 20 bytes
RECV_SLOTS = 256  # receive buffers per NIC
OUT_SLOTS = 128  # requests awaiting a reply per path; older ones are judged missed
MAX_POLL = 64  # completions read per CQ poll
MAX_ROUNDS = 8  # CQ polls per wake-up
MAX_REFLECTED = 65536
HELLO_ASK_EVERY_S = 0.5  # while a peer's QP is unknown
HELLO_REASK_SILENT_S = 1.0  # a peer silent this long may have restarted with a new QP
HELLO_ANSWERS_PER_S = 200  # answers to askers this agent does not probe, all together: a flood costs a counter
HELLO_ANSWERS_PER_SOURCE_PER_S = 5  # answers to one address (a peer asks every 0.5 s while it learns)
HELLO_SOURCES = 4096  # addresses whose answers are counted (the least recent forgotten first)
IDLE_WAKE_NS = 100_000_000  # the loop sleeps at most this long (a change of paths wakes it at once)
# requests due within this window go out together: a wake-up costs far more than a packet in
# Python (the C core coalesces likewise), and it moves a probe by at most this much
COALESCE_NS = 5_000_000
HOUSEKEEPING_NS = 100_000_000  # hellos and the reflector's idle sweep, at most this often
DEFAULT_RTO_NS = 200_000_000
_IP_UDP = struct.Struct("!BBHHHBBH4s4sHHHH")
_IB_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}


@dataclass
class _Nic:
    name: str
    addr: str
    addr_b: bytes
    dev: Device
    ctx: object
    pd: object
    channel: object
    channel_fd: int | None
    cq: object
    qp: object
    mr: object
    slot: int
    tx: socket.socket
    hello: socket.socket
    mtu: int  # the largest UD message the device takes (its active RoCE MTU)
    recv_wrs: list  # one receive WR per buffer slot


@dataclass
class _Path(ProbedPath):
    nic: _Nic | None = None
    peer_b: bytes = b""
    next_due_ns: int = 0
    first_seq: int = 0  # replies are to requests in [first_seq, next_seq)
    next_seq: int = 0
    sent: int = 0
    rto_ns: int = DEFAULT_RTO_NS
    size_every: int = 0
    size_count: int = 0
    size_pad: int = 0
    out: "OrderedDict[int, tuple[int, int, int]]" = field(default_factory=OrderedDict)  # seq -> t1, deadline, size
    agg: list | None = None  # pending ANSWERED: [seq, count, rx_count, size, worst, t1, t2, t3, t4]
    replay: wire.ReplayWindow = field(default_factory=lambda: wire.ReplayWindow(4096))


@dataclass
class _Peer:
    """A peer NIC address: its probe QP once a hello answered, and when we last heard from it."""

    agent_id: int
    qpn: int = 0
    nonces: tuple = ()  # the last asks' nonces: an answer slower than the ask interval still counts
    asked_ns: int = 0
    heard_ns: int = 0


def _channel_fd(make):
    """Make a completion channel and find its file descriptor (pyverbs does not expose it): the
    one new descriptor that is an RDMA event file. None if it cannot be told (then the loop polls)."""
    def event_fds() -> set[int]:
        out = set()
        for name in os.listdir("/proc/self/fd"):
            try:
                if "infinibandevent" in os.readlink(f"/proc/self/fd/{name}"):
                    out.add(int(name))
            except OSError:
                continue
        return out

    before = event_fds()
    channel = make()
    new = event_fds() - before
    return channel, (new.pop() if len(new) == 1 else None)


class VerbsProbeEngine:
    """One agent's probes and reflector through UD queue pairs; CoreProbeEngine's interface."""

    kind = "verbs"
    LANE_WATCH = False  # its loop is Python's own: the agent looks at lane reports itself
    STATS = ("sent", "reflected", "replies", "received", "reflector_entries", "reflector_expired", "other_key")

    def __init__(self, agent_id: int, key: bytes, seed: int = 1, jitter: float = 0.1,
                 accept_key: bytes | None = None):
        check_engine_args(agent_id, jitter)
        load_pyverbs()
        self.agent_id = agent_id
        self.codec = wire.Codec(key, accept_key)
        self._other_key_before = 0  # other-key packets counted by codecs replaced since
        self.jitter = jitter
        self._rand = random.Random(seed)
        self.nics: dict[str, _Nic] = {}
        self.paths: dict[int, _Path] = {}
        self.path_ids = PathIds()
        self.peers: dict[str, _Peer] = {}
        self.counters: Counter = Counter(dict.fromkeys(self.STATS, 0))
        self.drop_counts: Counter = Counter()
        self._reflected: OrderedDict[tuple[int, int], list] = OrderedDict()  # (sender, path) -> [count, window, seen]
        self._reflector_idle_ns = 10_000_000_000
        self._events: list[ProbeEvent] = []
        self._evidence_ns = 0
        self._seq_floor = 0
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()  # the agent sleeps on it: a MISS or LATE is waiting
        self._kick_r, self._kick_w = os.pipe()  # the loop sleeps on it: paths or rates changed
        for fd in (self._wake_r, self._wake_w, self._kick_r, self._kick_w):
            os.set_blocking(fd, False)
        self._answers = (0, 0)  # (second, answers given in it to askers that are not peers)
        self._answers_to: OrderedDict[str, tuple[int, int]] = OrderedDict()  # address -> (second, answers)
        self._housekeeping_ns = 0  # when hellos and the sweep are next due
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.background = False
        self._last_error = ""

    # ---- setup ---------------------------------------------------------------------------
    def add_nic(self, name: str, ifname: str, addr: str) -> None:
        import pyverbs.enums as e
        from pyverbs.cq import CQ, CompChannel
        from pyverbs.device import Context
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
        from pyverbs.wr import SGE, RecvWR

        dev = Device.for_address(addr)
        ctx = Context(name=dev.name)
        mtu = _IB_MTU_BYTES.get(int(ctx.query_port(dev.port).active_mtu), 1024)
        pd = PD(ctx)
        channel, fd = _channel_fd(lambda: CompChannel(ctx))
        cq = CQ(ctx, RECV_SLOTS * 2, None, channel, 0)
        cap = QPCap(max_send_wr=4, max_recv_wr=RECV_SLOTS, max_send_sge=1, max_recv_sge=1)
        qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_UD, scq=cq, rcq=cq, cap=cap))
        attr = QPAttr(port_num=dev.port)
        attr.qkey = wire.LINKPASS_QKEY
        attr.pkey_index = 0
        qp.to_rts(attr)
        slot = GRH_LEN + mtu
        mr = MR(pd, slot * RECV_SLOTS, e.IBV_ACCESS_LOCAL_WRITE)
        recv_wrs = [RecvWR(wr_id=i, num_sge=1, sg=[SGE(mr.buf + i * slot, slot, mr.lkey)]) for i in range(RECV_SLOTS)]
        for wr in recv_wrs:  # each slot's WR is made once and posted again after every completion
            qp.post_recv(wr)
        cq.req_notify()
        tx = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
        hello = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            tx.setsockopt(socket.SOL_SOCKET, SO_BINDTODEVICE, ifname.encode())
            tx.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
            tx.setblocking(False)
            hello.bind((addr, wire.HELLO_PORT))
            hello.setblocking(False)
        except OSError:
            tx.close()
            hello.close()
            raise
        self.nics[name] = _Nic(name, addr, socket.inet_aton(addr), dev, ctx, pd, channel, fd, cq, qp, mr, slot, tx,
                               hello, mtu, recv_wrs)

    def probe_qp(self, nic: str) -> int:
        """The QP number this engine receives probes on at `nic` (what a hello answers)."""
        return self.nics[nic].qp.qp_num

    def new_path_id(self) -> int:
        return self.path_ids.lowest_free()

    def add_path(self, spec: PathSpec, first_due_s: float = 0.0) -> None:
        nic = self.nics.get(spec.nic)
        if nic is None:
            raise ValueError(f"path {spec.path_id}: unknown NIC {spec.nic!r}; add_nic() it first")
        if not 0.0001 <= spec.interval_s <= 60:
            raise ValueError(f"path {spec.path_id}: interval_s must be 0.0001..60, got {spec.interval_s}")
        with self._lock:
            self.path_ids.claim(spec.path_id)
            # above every sequence this id carried before, now or in an earlier run (the wall
            # clock in ns grows faster than any path's sequence): a peer's replay window accepts it
            seq = max(self._seq_floor, time.time_ns())
            self._seq_floor = seq + 1
            path = _Path(spec, PathTelemetry(), nic=nic, peer_b=socket.inet_aton(spec.peer_addr),
                         next_due_ns=time.monotonic_ns() + int(first_due_s * 1e9), first_seq=seq, next_seq=seq)
            self.paths[spec.path_id] = path
            peer = self.peers.get(spec.peer_addr)
            if peer is None or peer.agent_id != spec.peer_id:
                self.peers[spec.peer_addr] = _Peer(spec.peer_id)
        self._kick()

    def _kick(self) -> None:
        try:
            os.write(self._kick_w, b"k")
        except BlockingIOError:
            pass  # already kicked

    def remove_path(self, path_id: int) -> None:
        with self._lock:
            path = self.paths.pop(path_id)
            self.path_ids.release(path_id)
            self._events = [ev for ev in self._events if ev.path_id != path_id]  # judged for a path now gone
            if not any(p.spec.peer_addr == path.spec.peer_addr for p in self.paths.values()):
                self.peers.pop(path.spec.peer_addr, None)
            self._seq_floor = max(self._seq_floor, path.next_seq)

    def expect_sizes(self, ip_sizes) -> None:
        """Accepted for the agent's sake: the device checks every packet's framing and ICRC before
        a completion exists, so there is no size filter to declare here."""

    def set_reflector_idle(self, idle_s: float) -> None:
        self._reflector_idle_ns = int(idle_s * 1e9)

    def set_interval(self, path_id: int, interval_s: float) -> None:
        with self._lock:
            path = self.paths[path_id]
            path.spec = replace(path.spec, interval_s=interval_s)
            path.next_due_ns = min(path.next_due_ns, time.monotonic_ns() + int(interval_s * 1e9))
        self._kick()

    def set_rto(self, path_id: int, rto_ns: int) -> None:
        with self._lock:
            if path_id in self.paths:
                self.paths[path_id].rto_ns = int(rto_ns)

    def set_size_probe(self, path_id: int, every: int, ip_size: int) -> None:
        """Every `every`-th probe as large as `ip_size`, capped at the largest UD message the
        device takes (its RoCE MTU): RDMA traffic is never larger than that."""
        with self._lock:
            path = self.paths[path_id]
            cap = wire.IPV4_LEN + wire.UDP_LEN + wire.BTH_LEN + wire.DETH_LEN + path.nic.mtu + wire.ICRC_LEN
            try:
                pad = wire.ud_pad_for_ip_size(min(ip_size, cap)) if every else 0
            except ValueError as exc:
                raise ValueError(f"size probe of {ip_size} bytes: {exc}") from None
            path.size_every, path.size_pad, path.size_count = every, pad, 0

    def track(self, on: bool = True) -> None:
        """Judging is this engine's only mode (the agent's)."""

    # ---- the loop ------------------------------------------------------------------------
    def start_background(self, rt_priority: int = 0) -> str | None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="linkpass-verbs-probe", daemon=True)
        self._thread.start()
        self.background = True
        return "the verbs engine's loop is a Python thread; real-time priority is not asked for" if rt_priority \
            else None

    def stop_background(self) -> None:
        self._stop.set()
        self._kick()
        if self._thread is not None:
            self._thread.join(5)
        self.background = False

    def run(self, duration_s: float) -> None:
        """Run the loop in this thread for `duration_s` (tests; the agent uses the background thread)."""
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            self._once(max(0.0, end - time.monotonic()))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._once(IDLE_WAKE_NS / 1e9)
            except Exception as exc:  # noqa: BLE001 - the reflector must keep answering
                self.drop_counts["loop_error"] += 1
                self._last_error = repr(exc)
                time.sleep(0.01)

    def _once(self, max_wait_s: float) -> None:
        now = time.monotonic_ns()
        with self._lock:
            next_ns = self._send_due(now)
            if now >= self._housekeeping_ns:
                self._housekeeping_ns = now + HOUSEKEEPING_NS
                self._ask_peers(now)
                self._sweep_reflector(time.time_ns())
        wait_ns = max(0, min(next_ns - time.monotonic_ns(), int(max_wait_s * 1e9)))
        fds = [self._kick_r] + [n.channel_fd for n in self.nics.values() if n.channel_fd is not None]
        fds += [n.hello.fileno() for n in self.nics.values()]
        if any(n.channel_fd is None for n in self.nics.values()):
            wait_ns = min(wait_ns, 1_000_000)  # no event file: poll the CQ every millisecond
        ready, _, _ = select.select(fds, [], [], wait_ns / 1e9)
        t_check = time.time_ns()
        if self._kick_r in ready:
            try:
                os.read(self._kick_r, 4096)
            except BlockingIOError:
                pass
        all_emptied = True
        for nic in self.nics.values():
            # a CQ whose channel is quiet has had no completion since it was emptied and re-armed
            if nic.channel_fd is None or nic.channel_fd in ready:
                if nic.channel_fd is not None:
                    nic.channel.get_cq_event(nic.cq)
                    nic.cq.ack_events(1)
                    nic.cq.req_notify()
                all_emptied &= self._empty_cq(nic)
            if nic.hello.fileno() in ready:
                self._hellos(nic)
        if all_emptied:
            with self._lock:
                self._evidence_ns = t_check
                self._expire(t_check)

    def _send_due(self, now: int) -> int:
        """Send every due request; the monotonic time the next one is due (or a deadline falls)."""
        nxt = now + IDLE_WAKE_NS
        wall = time.time_ns()
        mono_minus_wall = now - wall
        for path in self.paths.values():
            if path.next_due_ns <= now + COALESCE_NS:
                self._send_request(path)
                iv = int(path.spec.interval_s * 1e9)
                path.next_due_ns = max(now, path.next_due_ns + int(iv * (1 + self.jitter * (2 * self._rand.random() - 1))))
            nxt = min(nxt, path.next_due_ns)
            if path.out:
                nxt = min(nxt, next(iter(path.out.values()))[1] + mono_minus_wall + 1)
        return nxt

    def _ip(self, nic: _Nic, dst_b: bytes, sport: int, udp_payload: bytes) -> bytes:
        return _IP_UDP.pack(0x45, 0, 28 + len(udp_payload), 0, 0x4000, 64, 17, 0, nic.addr_b, dst_b, sport,
                            wire.ROCE_PORT, 8 + len(udp_payload), 0) + udp_payload

    def _send_raw(self, nic: _Nic, dst: str, packet: bytes) -> bool:
        try:
            nic.tx.sendto(packet, (dst, 0))
            return True
        except BlockingIOError:
            self.drop_counts["send_buffer_full"] += 1
        except OSError:
            self.drop_counts["send_error"] += 1  # e.g. ENETUNREACH while a link is down
        return False

    def _send_request(self, path: _Path) -> None:
        s, nic = path.spec, path.nic
        peer = self.peers.get(s.peer_addr)
        if peer is None or not peer.qpn:
            self.drop_counts["no_peer_qp"] += 1  # not sent, so not judged: the hello is under way
            return
        size = 0
        if path.size_every:
            path.size_count += 1
            if path.size_count >= path.size_every:
                path.size_count, size = 0, 1
        pad = path.size_pad if size else 0
        seq = path.next_seq
        path.next_seq += 1
        t1 = time.time_ns()
        probe = wire.Probe(wire.KIND_REQUEST, self.agent_id, s.peer_id, s.path_id, seq, t1=t1,
                           flags=wire.FLAG_MTU_PROBE if size else 0, pad=pad)
        record = self.codec.encode_ud(probe, s.sport)
        pkt = self._ip(nic, path.peer_b, s.sport, wire.ud_packet(record, nic.addr_b, path.peer_b, s.sport, peer.qpn,
                                                                  nic.qp.qp_num, psn=seq))
        if not self._send_raw(nic, s.peer_addr, pkt):
            return
        path.sent += 1
        self.counters["sent"] += 1
        if len(path.out) >= OUT_SLOTS:  # too many in flight: the oldest is judged missed
            old_seq, (old_t1, old_dl, old_size) = path.out.popitem(last=False)
            self._push(path, ProbeEvent.miss(s.path_id, old_seq, old_size, old_t1, old_dl))
        path.out[seq] = (t1, t1 + path.rto_ns, size)

    # ---- receiving -----------------------------------------------------------------------
    def _empty_cq(self, nic: _Nic) -> bool:
        """Read the CQ until empty (bounded); True if it was emptied."""
        for _ in range(MAX_ROUNDS):
            n, wcs = nic.cq.poll(MAX_POLL)
            t_rx = time.time_ns()
            for wc in wcs:
                self._completion(nic, wc, t_rx)
            if n < MAX_POLL:
                return True
        return False

    def _completion(self, nic: _Nic, wc, t_rx: int) -> None:
        self.counters["received"] += 1
        off = wc.wr_id * nic.slot
        try:
            if wc.status != 0:
                self.drop_counts["bad_completion"] += 1
                return
            n = wc.byte_len
            if not GRH_LEN + wire.UD_RECORD_MIN <= n <= nic.slot:
                self.drop_counts["short" if n < GRH_LEN + wire.UD_RECORD_MIN else "bad_length"] += 1
                return
            data = nic.mr.read(n, off)
            src_b = data[32:36]  # the IPv4 header's source, in the GRH slot
            try:
                probe, sport = self.codec.decode_ud(data[GRH_LEN:])
            except wire.WireError as err:
                self.drop_counts[err.reason] += 1
                return
            with self._lock:
                if probe.kind == wire.KIND_REQUEST:
                    self._reflect(nic, probe, src_b, sport, wc.src_qp, t_rx)
                else:
                    self._complete(probe, src_b, t_rx)
        finally:
            nic.qp.post_recv(nic.recv_wrs[wc.wr_id])

    def _reflect(self, nic: _Nic, req: wire.Probe, src_b: bytes, sport: int, src_qpn: int, t2: int) -> None:
        if req.reflector != self.agent_id:
            self.drop_counts["unexpected"] += 1  # a probe meant for another agent
            return
        key = (req.sender, req.path)
        entry = self._reflected.get(key)
        if entry is None:
            if len(self._reflected) >= MAX_REFLECTED:
                self._reflected.popitem(last=False)
                self.drop_counts["reflector_table_full"] += 1
            entry = [0, wire.ReplayWindow(4096), 0]
            self._reflected[key] = entry
        if not entry[1].accept(req.seq):
            self.drop_counts["replay"] += 1
            return
        entry[0] += 1
        entry[2] = t2
        self._reflected.move_to_end(key)
        reply = wire.Probe(wire.KIND_REPLY, req.sender, req.reflector, req.path, req.seq, req.t1, t2, time.time_ns(),
                           0, entry[0], req.flags, req.pad)
        record = self.codec.encode_ud(reply, sport)
        pkt = self._ip(nic, src_b, sport, wire.ud_packet(record, nic.addr_b, src_b, sport, src_qpn, nic.qp.qp_num,
                                                         psn=req.seq))
        if self._send_raw(nic, socket.inet_ntoa(src_b), pkt):
            self.counters["reflected"] += 1

    def _complete(self, rep: wire.Probe, src_b: bytes, t4: int) -> None:
        path = self.paths.get(rep.path)
        if rep.sender != self.agent_id or path is None or path.peer_b != src_b:
            self.drop_counts["unexpected"] += 1
            return
        if not path.first_seq <= rep.seq < path.next_seq:  # never sent: an earlier path with the same id, or forged
            self.drop_counts["unexpected"] += 1
            return
        if not path.replay.accept(rep.seq):
            self.drop_counts["replay"] += 1
            return
        self.counters["replies"] += 1
        peer = self.peers.get(path.spec.peer_addr)
        if peer is not None:
            peer.heard_ns = time.monotonic_ns()
        self._expire_path(path, t4)  # requests whose deadline passed before this reply came are missed
        pending = path.out.pop(rep.seq, None)
        if pending is not None and t4 <= pending[1]:
            a = path.agg
            rtt = min(t4 - rep.t1, 2**32 - 1)  # the whole round trip, the reflector's hold too: the timeout must cover it
            if a is None:
                path.agg = [rep.seq, 1, rep.rx_count, pending[2], rtt, rep.t1, rep.t2, rep.t3, t4]
            else:
                a[1] += 1
                a[3] |= pending[2]
                a[4] = max(a[4], rtt)
                if rep.seq >= a[0]:
                    a[0], a[2], a[5], a[6], a[7], a[8] = rep.seq, rep.rx_count, rep.t1, rep.t2, rep.t3, t4
            return
        if pending is not None:  # arrived after its deadline, before the deadline was judged
            self._push(path, ProbeEvent.miss(rep.path, rep.seq, pending[2], pending[0], pending[1]))
        self._push(path, ProbeEvent.late(rep.path, rep.seq, rep.rx_count, rep.t1, rep.t2, rep.t3, t4))

    def _flush(self, path: _Path) -> None:
        a = path.agg
        if a is not None:
            path.agg = None
            self._events.append(ProbeEvent.answered(path.spec.path_id, a[0], a[1], a[2], a[3], max(0, a[4]),
                                                    a[5], a[6], a[7], a[8]))

    def _push(self, path: _Path, ev: ProbeEvent) -> None:
        self._flush(path)  # the path's on-time replies before it: order is kept
        self._events.append(ev)
        if ev.kind in (EV_MISS, EV_LATE):
            try:
                os.write(self._wake_w, b"!")
            except BlockingIOError:
                pass  # the pipe is full: the agent is awake anyway

    def _expire(self, evidence_ns: int) -> None:
        """Every request whose deadline is before the evidence time and has no reply is missed."""
        for path in self.paths.values():
            self._expire_path(path, evidence_ns)

    def _expire_path(self, path: _Path, until_ns: int) -> None:
        """The path's unanswered requests whose deadline is before `until_ns`, oldest first, are missed."""
        while path.out:
            seq, (t1, deadline, size) = next(iter(path.out.items()))
            if deadline >= until_ns:
                break
            del path.out[seq]
            self._push(path, ProbeEvent.miss(path.spec.path_id, seq, size, t1, deadline))

    def _sweep_reflector(self, now_wall: int) -> None:
        for _ in range(64):
            if not self._reflected:
                return
            key, entry = next(iter(self._reflected.items()))
            if now_wall - entry[2] < self._reflector_idle_ns:
                return
            del self._reflected[key]
            self.counters["reflector_expired"] += 1

    # ---- hellos: learning a peer's probe QP ------------------------------------------------
    def _ask_peers(self, now: int) -> None:
        for addr, peer in self.peers.items():
            silent = now - peer.heard_ns > HELLO_REASK_SILENT_S * 1e9
            every = HELLO_ASK_EVERY_S if not peer.qpn else HELLO_REASK_SILENT_S
            if (not peer.qpn or silent) and now - peer.asked_ns >= every * 1e9:
                nic = next((p.nic for p in self.paths.values() if p.spec.peer_addr == addr), None)
                if nic is None:
                    continue
                nonce = secrets.randbits(64)
                peer.nonces, peer.asked_ns = (peer.nonces + (nonce,))[-3:], now
                try:
                    nic.hello.sendto(self.codec.encode_hello(wire.HELLO_ASK, self.agent_id, 0, nonce),
                                     (addr, wire.HELLO_PORT))
                    self.counters["hello_asks"] += 1
                except OSError:
                    self.drop_counts["hello_send_error"] += 1

    def _hellos(self, nic: _Nic) -> None:
        for _ in range(32):
            try:
                data, (src, _port) = nic.hello.recvfrom(256)
            except (BlockingIOError, InterruptedError):
                return
            try:
                kind, agent_id, qpn, nonce = self.codec.decode_hello(data)
            except wire.WireError as err:
                self.drop_counts[f"hello_{err.reason}"] += 1
                continue
            if kind == wire.HELLO_ASK:
                if not self._may_answer(src, time.monotonic_ns() // 1_000_000_000):
                    self.drop_counts["hello_over_budget"] += 1
                    continue
                try:
                    nic.hello.sendto(self.codec.encode_hello(wire.HELLO_ANSWER, self.agent_id, nic.qp.qp_num, nonce),
                                     (src, wire.HELLO_PORT))
                except OSError:
                    self.drop_counts["hello_send_error"] += 1
                continue
            with self._lock:
                peer = self.peers.get(src)
                if peer is None or nonce not in peer.nonces or agent_id != peer.agent_id or not 0 < qpn < 1 << 24:
                    self.drop_counts["hello_unexpected"] += 1  # not asked, a stale nonce, or another agent
                    continue
                if peer.qpn != qpn:
                    self.counters["peer_qp_learned"] += 1
                peer.qpn, peer.nonces, peer.heard_ns = qpn, (), time.monotonic_ns()

    def _may_answer(self, src: str, second: int) -> bool:
        """An ASK is signed, but one seen can be replayed from anywhere: each address gets a few
        answers a second, and askers this agent does not probe share one budget, so a replayed
        ASK never starves the peers' discovery of their QPs."""
        at, n = self._answers_to.pop(src, (second, 0))
        n = n + 1 if at == second else 1
        self._answers_to[src] = (second, n)
        if len(self._answers_to) > HELLO_SOURCES:
            self._answers_to.popitem(last=False)
        if n > HELLO_ANSWERS_PER_SOURCE_PER_S:
            return False
        if src in self.peers:
            return True
        n = self._answers[1] + 1 if self._answers[0] == second else 1
        self._answers = (second, n)
        return n <= HELLO_ANSWERS_PER_S

    # ---- the agent's side ----------------------------------------------------------------
    def wait(self, timeout_s: float) -> bool:
        ready, _, _ = select.select([self._wake_r], [], [], max(0.0, timeout_s))
        if ready:
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass
        return bool(ready)

    def poll(self, all_answered: bool = True) -> tuple[list[ProbeEvent], int]:
        with self._lock:
            if all_answered:
                for path in self.paths.values():
                    self._flush(path)
            events, self._events = self._events, []
            evidence = self._evidence_ns
            tel = {pid: p.telemetry for pid, p in self.paths.items()}
            sent = {pid: p.sent for pid, p in self.paths.items()}
        feed_events(events, tel)
        for pid, n in sent.items():
            tel[pid].sent = n
        return events, evidence

    @property
    def stats(self) -> dict:
        with self._lock:
            c = dict(self.counters)
            c["reflector_entries"] = len(self._reflected)
            c["other_key"] = self._other_key_before + self.codec.other_key_ok
        return {k: c.get(k, 0) for k in self.STATS}

    def set_keys(self, key: bytes, accept_key: bytes | None = None) -> None:
        """Sign with `key`, accept `accept_key` too (a fleet key rotation, docs/security.md). The
        loop picks the new codec up at its next packet (one attribute, replaced whole)."""
        codec = wire.Codec(key, accept_key)
        with self._lock:
            self._other_key_before += self.codec.other_key_ok
            self.codec = codec

    @property
    def drops(self) -> dict:
        return dict(self.drop_counts)

    def info(self) -> dict:
        """What the agent logs at start: the engine, its timestamps, each NIC's device and probe QP
        (and the loop's last exception, if one was counted as `loop_error`)."""
        return {"engine": self.kind, "timestamps": TIMESTAMPS,
                "nics": {n.name: {"device": n.dev.name, "qpn": n.qp.qp_num, "ud_mtu": n.mtu} for n in self.nics.values()},
                **({"last_loop_error": self._last_error} if self._last_error else {})}

    def telemetry(self, path_id: int) -> PathTelemetry:
        return self.paths[path_id].telemetry

    def close(self) -> None:
        if self.background:
            self.stop_background()
        for nic in self.nics.values():
            nic.tx.close()
            nic.hello.close()
            for obj in (nic.qp, nic.mr, nic.cq, nic.channel, nic.pd, nic.ctx):
                try:
                    obj.close()
                except Exception:  # noqa: BLE001 - best effort at exit; the kernel frees the rest
                    pass
        self.nics.clear()
        for fd in (self._wake_r, self._wake_w, self._kick_r, self._kick_w):
            os.close(fd)

