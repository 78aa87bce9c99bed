"""ECMP path discovery in the manner of Paris traceroute, inside host namespaces.

For every (local NIC, peer) the sweep sends UDP probes to the peer's address on that plane,
destination port 4791 (RoCEv2's, so they hash like RDMA traffic), one flow per source port with
a fixed 5-tuple, TTL 1, 2, 3, ... Routers answer with ICMP time exceeded; the kernel queues those
on the probing socket (IP_RECVERR) with the offender address, which on the testbed's routers
(icmp_errors_use_inbound_ifaddr=1) is the interface the probe came in on: the hop names a link.
The peer ends a trace with ICMP port unreachable (nothing listens on 4791), or, with a
reflector, with a datagram that the `reached` hook recognises.

How it is driven:

- One socket per (host, NIC, source port), bound to the NIC address and port and to the device
  (SO_BINDTODEVICE); all peers of that NIC share it, unconnected. The error queue hands back the
  probe's original destination (msg_name) and its quoted payload: the destination picks the
  flow, the payload picks the TTL. Sockets are created in batches, one namespace entry per
  batch, and at most `max_sockets` are open at once (bigger fabrics run in waves).
- Each flow keeps up to `window` TTLs in flight, set per probe with an IP_TTL control message,
  so one flow costs about one round trip rather than one per hop. A probe is sent only when its
  payload can be told apart from the probes of its flow still in flight: with a fixed payload
  (bytes) the window shrinks to one TTL at a time, as in the classic tool.
- The first port of each NIC scouts: the other ports' flows to a peer wait until the scout hears
  from that peer (or times out once), then send only the TTLs up to the peer's distance (lifted
  if their path turns out longer), so probes are not spent past the peer (a same-leaf peer is 2
  TTLs away, not `window`).
- One epoll loop over every socket of every host, bounded by `deadline_s`; a probe unanswered
  after `timeout_s` is resent up to `retries` times, then its TTL counts as lost. A trace ends
  at the first TTL the peer (or an unreachable) answers, after `gap_limit` consecutive lost
  TTLs, or at `max_ttl`.

Everything the network did is counted, never raised: sent, answers, timeouts, retries, lost
TTLs, unmatched/late answers, stray datagrams, send and socket errors (`PathTable.stats`).
"""
from __future__ import annotations

import errno
import heapq
import select
import socket
import struct
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

from ..kernel import netns as ns_io
from ..core import paths as P
from ..core.constants import DISCOVERY_PORTS, PROBE_PORT_BASE, ROCE_PORT
from ..core.names import host_name
from ..core.paths import PathTable

IP_RECVERR = getattr(socket, "IP_RECVERR", 11)
MSG_ERRQUEUE = getattr(socket, "MSG_ERRQUEUE", 0x2000)
SO_BINDTODEVICE = getattr(socket, "SO_BINDTODEVICE", 25)
SO_EE_ORIGIN_ICMP = 2
ICMP_DEST_UNREACH = 3
ICMP_TIME_EXCEEDED = 11
_EE = struct.Struct("=IBBBBII")  # struct sock_extended_err; the offender sockaddr follows it
_TTL_CMSG = [struct.pack("i", t) for t in range(256)]
QUOTE_KEY = 256  # leading payload bytes that identify a probe (Linux quotes up to ~520)
MAX_DRAIN = 512  # bound on reads per socket per wake-up
# errnos a send returns when it only reports an ICMP error queued earlier (sk_err); the send did
# not happen and the error is consumed, so a second try sends
_PENDING_ERRNOS = {errno.EHOSTUNREACH, errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTDOWN,
                   errno.EPROTO, errno.ENOPROTOOPT}

DEFAULT_PORTS = tuple(range(PROBE_PORT_BASE, PROBE_PORT_BASE + DISCOVERY_PORTS))


@dataclass(frozen=True)
class Target:
    """Trace from local NIC `local` (address `src`) to `peer` (its address on that plane)."""

    local: str
    src: str
    peer: str


class Probe(NamedTuple):
    """What the payload factory is told about the probe it is making."""

    local: str
    src: str
    peer: str
    sport: int
    dport: int
    ttl: int
    attempt: int  # 1 for the first send, 2.. for retries


_DEFAULT_PAYLOAD = struct.Struct("!8sBBH")


def default_payload(probe: Probe) -> bytes:
    """12 bytes: a fixed tag, the TTL, the attempt and the source port."""
    return _DEFAULT_PAYLOAD.pack(b"LPPATHS\0", probe.ttl, probe.attempt, probe.sport)


PayloadFactory = Callable[[Probe], bytes]
# Called with every ordinary datagram a probe socket receives (a reflector's answer). Return a
# falsy value if it is not an answer, True if the datagram starts with the echoed probe payload,
# or the echoed probe payload itself: it is matched to the probe (and so the TTL) it answers.
ReachedHook = Callable[[bytes], "bytes | bool | None"]


@dataclass(frozen=True)
class DiscoveryConfig:
    ports: tuple[int, ...] = DEFAULT_PORTS  # source ports swept per (NIC, peer)
    k: int = P.DEFAULT_K  # ports kept per distinct path
    dport: int = ROCE_PORT
    max_ttl: int = 8
    window: int = 4  # TTLs of one flow in flight at once
    timeout_s: float = 0.1  # per probe, before a retry
    retries: int = 2  # resends per TTL before it counts as lost
    gap_limit: int = 3  # consecutive lost TTLs that end a trace
    deadline_s: float = 5.0  # the whole sweep
    max_in_flight: int = 2048  # probes in flight over all flows
    max_sockets: int = 1024  # open probe sockets at once
    payload: PayloadFactory | bytes = default_payload
    reached: ReachedHook | None = None

    def __post_init__(self) -> None:
        if not self.ports or any(not 1 <= p <= 65535 for p in self.ports) or len(set(self.ports)) != len(self.ports):
            raise ValueError(f"ports must be distinct UDP ports 1..65535, got {self.ports!r}")
        for name, lo, hi in (("k", 1, 1 << 16), ("max_ttl", 1, 255), ("window", 1, 255), ("retries", 0, 10),
                             ("gap_limit", 1, 255), ("max_in_flight", 1, 1 << 20), ("max_sockets", 1, 1 << 16),
                             ("dport", 1, 65535)):
            v = getattr(self, name)
            if not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"{name} must be an integer {lo}..{hi}, got {v!r}")
        if not 0 < self.timeout_s <= 10 or not 0 < self.deadline_s <= 600:
            raise ValueError("timeout_s must be in (0, 10] and deadline_s in (0, 600]")


@dataclass(frozen=True)
class Job:
    """One host's sweep: its namespace and its (NIC, peer) targets."""

    host: str
    netns: str | None  # None: the caller's own namespace
    targets: tuple[Target, ...]


_COUNTERS = ("flows", "sockets", "sent", "answers", "timeouts", "retries", "lost_ttls", "unmatched", "late",
             "stray", "other_icmp", "send_errors", "local_errors", "socket_errors", "not_probed", "unfinished")


class _Sock:
    __slots__ = ("job", "local", "src", "sport", "peers", "scout", "sock", "fd", "flows", "open_flows")

    def __init__(self, job: int, local: str, src: str, sport: int, peers: list[str], scout: bool):
        self.job, self.local, self.src, self.sport, self.peers = job, local, src, sport, peers
        self.scout = scout  # the first port of its NIC: its flows measure each peer's distance
        self.sock: socket.socket | None = None
        self.fd = -1
        self.flows: dict[str, _Flow] = {}
        self.open_flows = 0


class _Flow:
    __slots__ = ("sk", "peer", "answers", "inflight", "keys", "lost", "next_ttl", "end_ttl", "done", "probes",
                 "queued", "limit")

    def __init__(self, sk: _Sock, peer: str):
        self.sk, self.peer = sk, peer
        self.answers: dict[int, P.Answer] = {}
        self.inflight: dict[int, int] = {}  # ttl -> latest attempt
        self.keys: dict[bytes, int] = {}  # payload key of an in-flight probe -> ttl
        self.lost: set[int] = set()
        self.next_ttl = 1
        self.end_ttl: int | None = None
        self.done = False
        self.probes = 0
        self.queued = False
        self.limit: int | None = None  # highest TTL to send until it proves too low; None: not started


class _Sweep:
    def __init__(self, jobs: Sequence[Job], cfg: DiscoveryConfig):
        self.jobs, self.cfg = list(jobs), cfg
        self.factory: PayloadFactory = (lambda _p, b=bytes(cfg.payload): b) if isinstance(
            cfg.payload, (bytes, bytearray)) else cfg.payload
        # the default payload differs for every (ttl, attempt): no need to look for look-alikes
        self.distinct = cfg.payload is default_payload
        self.stats = [dict.fromkeys(_COUNTERS, 0) for _ in self.jobs]
        self.traces: list[list[P.Trace]] = [[] for _ in self.jobs]
        self.pending: deque[_Sock] = deque()
        for j, job in enumerate(self.jobs):
            by_nic: dict[tuple[str, str], list[str]] = {}
            for t in job.targets:
                peers = by_nic.setdefault((t.local, t.src), [])
                if t.peer not in peers:
                    peers.append(t.peer)
            for (local, src), peers in by_nic.items():
                for n, sport in enumerate(cfg.ports):
                    self.pending.append(_Sock(j, local, src, sport, peers, scout=n == 0))
        self.by_fd: dict[int, _Sock] = {}
        self.ready: deque[_Flow] = deque()
        self.heap: list[tuple[float, int, _Flow, int, int]] = []
        self.seq = 0
        self.in_flight = 0
        self.ep = select.epoll()
        # distance to each (job, NIC, peer) learnt from its scout flow (None: unknown), and the
        # flows waiting for it: they then send only the TTLs up to the peer, not a whole window
        self.hints: dict[tuple[int, str, str], int | None] = {}
        self.parked: dict[tuple[int, str, str], list[_Flow]] = {}

    # ---- sockets -------------------------------------------------------------------------
    def _open_more(self) -> None:
        room = self.cfg.max_sockets - len(self.by_fd)
        if room <= 0 or not self.pending:
            return
        batch = [self.pending.popleft() for _ in range(min(room, len(self.pending)))]
        by_ns: dict[str | None, list[_Sock]] = {}
        for sk in batch:
            by_ns.setdefault(self.jobs[sk.job].netns, []).append(sk)
        for ns, sks in by_ns.items():
            n = len(sks)

            def make(n: int = n) -> list[socket.socket]:
                return [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(n)]

            raw = make() if ns is None else ns_io.run_in_netns(ns, make)
            for sk, s in zip(sks, raw):
                self._configure(sk, s)

    def _configure(self, sk: _Sock, s: socket.socket) -> None:
        st = self.stats[sk.job]
        try:
            s.setsockopt(socket.SOL_SOCKET, SO_BINDTODEVICE, sk.local.encode())
            s.setsockopt(socket.IPPROTO_IP, IP_RECVERR, 1)
            s.setblocking(False)
            s.bind((sk.src, sk.sport))
        except OSError:
            s.close()
            st["socket_errors"] += 1
            st["not_probed"] += len(sk.peers)
            if sk.scout:
                for peer in sk.peers:
                    self._hint((sk.job, sk.local, peer), None)
            return
        sk.sock, sk.fd = s, s.fileno()
        self.by_fd[sk.fd] = sk
        # errors (EPOLLERR) always wake us; ordinary datagrams only matter with a reached hook
        self.ep.register(sk.fd, select.EPOLLIN if self.cfg.reached is not None else 0)
        st["sockets"] += 1
        for peer in sk.peers:
            fl = _Flow(sk, peer)
            sk.flows[peer] = fl
            st["flows"] += 1
            self._enqueue(fl)
        sk.open_flows = len(sk.flows)

    def _close(self, sk: _Sock) -> None:
        if sk.sock is None:
            return
        self.by_fd.pop(sk.fd, None)
        try:
            self.ep.unregister(sk.fd)
        except OSError:
            pass
        sk.sock.close()
        sk.sock = None

    # ---- sending -------------------------------------------------------------------------
    def _enqueue(self, fl: _Flow, front: bool = False) -> None:
        if not fl.queued and not fl.done:
            fl.queued = True
            (self.ready.appendleft if front else self.ready.append)(fl)

    def _pump(self) -> None:
        cap = self.cfg.max_in_flight
        while self.ready and self.in_flight < cap:
            fl = self.ready.popleft()
            fl.queued = False
            if fl.done:
                continue
            if fl.limit is None:
                hk = (fl.sk.job, fl.sk.local, fl.peer)
                if fl.sk.scout or hk in self.hints:
                    fl.limit = self.hints.get(hk) or self.cfg.max_ttl
                else:
                    self.parked.setdefault(hk, []).append(fl)
                    continue
            top = min(fl.end_ttl - 1 if fl.end_ttl else self.cfg.max_ttl, fl.limit)
            while len(fl.inflight) < self.cfg.window and fl.next_ttl <= top and self.in_flight < cap:
                if not self._send(fl, fl.next_ttl, 1):
                    break  # its payload looks like one in flight: wait for an answer
                self.in_flight += 1
                fl.next_ttl += 1
            if self.in_flight >= cap and fl.next_ttl <= top and len(fl.inflight) < self.cfg.window:
                self._enqueue(fl, front=True)

    def _send(self, fl: _Flow, ttl: int, attempt: int) -> bool:
        sk, cfg = fl.sk, self.cfg
        payload = self.factory(Probe(sk.local, sk.src, fl.peer, sk.sport, cfg.dport, ttl, attempt))
        key = bytes(payload[:QUOTE_KEY])
        for k, t in (() if self.distinct else fl.keys.items()):
            if t != ttl and (k == key or (len(k) != len(key) and (k.startswith(key) or key.startswith(k)))):
                return False
        st = self.stats[sk.job]
        anc = [(socket.IPPROTO_IP, socket.IP_TTL, _TTL_CMSG[ttl])]
        # An ICMP error queued since the last send also sets sk_err, which would fail this send
        # (and be consumed by it). Reading SO_ERROR clears it without an exception; the error
        # itself stays in the error queue, where it is read.
        sk.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        for _ in range(2):
            try:
                sk.sock.sendmsg([payload], anc, 0, (fl.peer, cfg.dport))
                break
            except OSError as exc:
                if exc.errno in _PENDING_ERRNOS:
                    continue  # an earlier ICMP error surfaced here; it is consumed now
                st["send_errors"] += 1  # e.g. ENOBUFS, a NIC gone: the probe times out and is retried
                break
        else:
            st["send_errors"] += 1
        st["sent"] += 1
        fl.probes += 1
        fl.keys[key] = ttl
        fl.inflight[ttl] = attempt
        self.seq += 1
        heapq.heappush(self.heap, (time.monotonic() + cfg.timeout_s, self.seq, fl, ttl, attempt))
        return True

    # ---- receiving -----------------------------------------------------------------------
    def _drain(self, sk: _Sock) -> None:
        got = 0
        for _ in range(MAX_DRAIN):
            if sk.sock is None:
                return
            try:
                data, anc, _flags, addr = sk.sock.recvmsg(2048, 512, MSG_ERRQUEUE)
            except BlockingIOError:
                break
            except OSError:
                self.stats[sk.job]["local_errors"] += 1
                break
            got += 1
            self._on_error(sk, data, anc, addr)
        if not got and sk.sock is not None:
            # woken with an empty error queue: sk_err alone (an error the full queue could not
            # hold, or a local one) keeps EPOLLERR up; clear it so the loop does not spin
            sk.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if self.cfg.reached is None:
            return
        for _ in range(MAX_DRAIN):
            if sk.sock is None:
                return
            try:
                data, addr = sk.sock.recvfrom(4096)
            except BlockingIOError:
                break
            except OSError:
                continue  # a pending ICMP error reported by recv (already read from the error queue)
            self._on_datagram(sk, data, addr)

    def _on_error(self, sk: _Sock, data: bytes, anc: list, addr) -> None:
        st = self.stats[sk.job]
        ee = None
        for level, kind, cdata in anc:
            if level == socket.IPPROTO_IP and kind == IP_RECVERR and len(cdata) >= _EE.size:
                ee = cdata
        if ee is None:
            st["local_errors"] += 1
            return
        _errno, origin, itype, _code, _pad, _info, _data = _EE.unpack_from(ee)
        if origin != SO_EE_ORIGIN_ICMP:
            st["local_errors"] += 1  # e.g. EMSGSIZE from the local stack
            return
        offender = socket.inet_ntoa(ee[_EE.size + 4:_EE.size + 8]) if len(ee) >= _EE.size + 8 else "0.0.0.0"
        fl = sk.flows.get(addr[0]) if addr else None
        if fl is None:
            st["unmatched"] += 1
            return
        if itype == ICMP_TIME_EXCEEDED:
            kind = P.TIME_EXCEEDED
        elif itype == ICMP_DEST_UNREACH:
            kind = P.REACHED if offender == fl.peer else P.UNREACHABLE
        else:
            st["other_icmp"] += 1
            return
        self._answer(fl, data, kind, offender)

    def _on_datagram(self, sk: _Sock, data: bytes, addr) -> None:
        st = self.stats[sk.job]
        fl = sk.flows.get(addr[0]) if self.cfg.reached is not None and addr else None
        verdict = self.cfg.reached(data) if fl is not None else None
        if fl is None or not verdict:
            st["stray"] += 1
            return
        self._answer(fl, data if verdict is True else bytes(verdict), P.REACHED, fl.peer)

    def _match(self, fl: _Flow, quoted: bytes) -> int | None:
        q = quoted[:QUOTE_KEY]
        ttl = fl.keys.get(q)
        if ttl is not None:
            return ttl
        found = {t for k, t in fl.keys.items() if q and (k.startswith(q) or q.startswith(k))}
        return found.pop() if len(found) == 1 else None

    def _answer(self, fl: _Flow, quoted: bytes, kind: str, addr: str) -> None:
        st = self.stats[fl.sk.job]
        if fl.done:
            st["late"] += 1
            return
        ttl = self._match(fl, quoted)
        if ttl is None:
            st["unmatched"] += 1  # no probe in flight quotes like this (e.g. one already given up)
            return
        st["answers"] += 1
        fl.answers[ttl] = P.Answer(ttl, kind, addr)
        self._resolve(fl, ttl)
        if kind != P.TIME_EXCEEDED and (fl.end_ttl is None or ttl < fl.end_ttl):
            fl.end_ttl = ttl
            if fl.sk.scout and kind == P.REACHED:
                self._hint((fl.sk.job, fl.sk.local, fl.peer), ttl)  # release the ports waiting for it
            for t in [t for t in fl.inflight if t > ttl]:
                self._resolve(fl, t)  # beyond the end: answers to them no longer matter
        self._progress(fl)

    def _resolve(self, fl: _Flow, ttl: int) -> None:
        if fl.inflight.pop(ttl, None) is not None:
            self.in_flight -= 1
            for k in [k for k, t in fl.keys.items() if t == ttl]:
                del fl.keys[k]

    def _hint(self, hk: tuple[int, str, str], distance: int | None) -> None:
        if hk in self.hints:
            return
        self.hints[hk] = distance
        for fl in self.parked.pop(hk, []):
            self._enqueue(fl)

    def _progress(self, fl: _Flow) -> None:
        cfg = self.cfg
        if fl.limit is not None and fl.limit < cfg.max_ttl and fl.end_ttl is None and (
                fl.limit in fl.answers or fl.limit in fl.lost):
            fl.limit = cfg.max_ttl  # the peer is further than the hint said: probe on
        if fl.end_ttl is not None:
            done = all(t in fl.answers or t in fl.lost for t in range(1, fl.end_ttl))
        else:
            r = 0
            while r < cfg.max_ttl and (r + 1 in fl.answers or r + 1 in fl.lost):
                r += 1
            done = r == cfg.max_ttl or (r >= cfg.gap_limit and all(t in fl.lost for t in range(r - cfg.gap_limit + 1, r + 1)))
        if done:
            self._finish(fl)
        else:
            self._enqueue(fl)

    def _finish(self, fl: _Flow, unfinished: bool = False) -> None:
        sk = fl.sk
        for t in list(fl.inflight):
            self._resolve(fl, t)
        fl.done = True
        st = self.stats[sk.job]
        sk.open_flows -= 1
        if sk.open_flows <= 0:
            self._close(sk)
        if unfinished and fl.probes == 0:
            st["not_probed"] += 1  # the deadline came first: no trace rather than an empty one
            return
        if unfinished:
            st["unfinished"] += 1
        tr = P.make_trace(sk.local, sk.src, fl.peer, sk.sport, fl.answers.values(), probes=fl.probes,
                          lost=len(fl.lost))
        self.traces[sk.job].append(tr)
        if sk.scout:
            self._hint((sk.job, sk.local, fl.peer), tr.end_ttl if tr.reached else None)

    def _expire(self, now: float) -> None:
        cfg = self.cfg
        while self.heap and self.heap[0][0] <= now:
            _, _, fl, ttl, attempt = heapq.heappop(self.heap)
            if fl.done or fl.inflight.get(ttl) != attempt:
                continue
            self._drain(fl.sk)  # the answer may be waiting behind this wake-up
            if fl.done or fl.inflight.get(ttl) != attempt:
                continue
            st = self.stats[fl.sk.job]
            st["timeouts"] += 1
            if fl.sk.scout:  # trouble on the scout's path: the others go without a distance
                self._hint((fl.sk.job, fl.sk.local, fl.peer), None)
            if attempt <= cfg.retries:
                st["retries"] += 1
                if self._send(fl, ttl, attempt + 1):
                    continue
            self._resolve(fl, ttl)
            fl.lost.add(ttl)
            st["lost_ttls"] += 1
            self._progress(fl)

    # ---- the loop ------------------------------------------------------------------------
    def run(self) -> tuple[list[list[P.Trace]], float, bool]:
        t0 = time.monotonic()
        deadline = t0 + self.cfg.deadline_s
        hit = False
        try:
            while True:
                self._open_more()
                if not self.by_fd and not self.pending:
                    break
                now = time.monotonic()
                if now >= deadline:
                    hit = True
                    break
                self._pump()
                wake = min(self.heap[0][0] if self.heap else deadline, deadline)
                for fd, _ev in self.ep.poll(max(0.0, wake - time.monotonic()), 1024):
                    sk = self.by_fd.get(fd)
                    if sk is not None:
                        self._drain(sk)
                self._expire(time.monotonic())
        finally:
            for sk in list(self.by_fd.values()):
                for fl in sk.flows.values():
                    if not fl.done:
                        self._finish(fl, unfinished=True)
                self._close(sk)
            for sk in self.pending:
                self.stats[sk.job]["not_probed"] += len(sk.peers)
            self.pending.clear()
            self.ep.close()
        return self.traces, time.monotonic() - t0, hit


def discover_many(jobs: Sequence[Job], config: DiscoveryConfig | None = None) -> dict[str, PathTable]:
    """Sweep every job (host) at once, in one loop; one PathTable per host."""
    cfg = config or DiscoveryConfig()
    if len({j.host for j in jobs}) != len(jobs):
        raise ValueError("each job needs its own host name")
    sweep = _Sweep(jobs, cfg)
    traces, elapsed, hit = sweep.run()
    out = {}
    for j, job in enumerate(jobs):
        stats = dict(sweep.stats[j], elapsed_s=round(elapsed, 6), deadline_hit=hit)
        out[job.host] = P.build_table(traces[j], cfg.k, host=job.host, stats=stats)
    return out


def discover(netns: str | None, targets: Iterable[Target], config: DiscoveryConfig | None = None, *,
             host: str | None = None) -> P.PathTable:
    """Sweep one host (inside namespace `netns`) towards every target; return its path table."""
    name = host or netns or "local"
    return discover_many([Job(name, netns, tuple(targets))], config)[name]


# ---- the testbed -----------------------------------------------------------------------

def discovery_targets(nics, peers) -> list[Target]:
    """Every (local NIC, peer address) on the planes both have. `nics` have .plane, .ifname and
    .addr, `peers` a .nics {plane: address}. A target's `local` is the NIC's interface name: the
    probe sockets bind to that device, and the PathTable is keyed by it."""
    mine = {n.plane: n for n in nics}
    return [Target(mine[plane].ifname, mine[plane].addr, addr) for p in peers for plane, addr in sorted(p.nics.items())
            if plane in mine]


def fabric_targets(fab, host: int, planes: Iterable[int] | None = None,
                   peers: Iterable[int] | None = None) -> list[Target]:
    """Every (NIC, peer NIC address) of testbed host `host` (all planes, all other hosts by default)."""
    planes = range(fab.spec.planes) if planes is None else planes
    peers = [j for j in range(fab.spec.hosts) if j != host] if peers is None else [j for j in peers if j != host]
    return [Target(f"p{p}", fab.nic_addr(host, p), fab.nic_addr(j, p)) for p in planes for j in peers]


def discover_fabric(fab, config: DiscoveryConfig | None = None,
                    hosts: Iterable[int] | None = None) -> dict[str, P.PathTable]:
    """Discover the paths of every host of a testbed Fabric at once; keyed by host name ('h0', ...)."""
    hosts = range(fab.spec.hosts) if hosts is None else hosts
    jobs = [Job(host_name(i), fab.netns(host_name(i)), tuple(fabric_targets(fab, i))) for i in hosts]
    return discover_many(jobs, config)


def total_stats(tables: Mapping[str, P.PathTable]) -> dict:
    """Counters summed over hosts (elapsed_s and deadline_hit taken as the sweep's)."""
    out: dict = {}
    for t in tables.values():
        for k, v in t.stats.items():
            if k == "elapsed_s":
                out[k] = max(out.get(k, 0.0), v)
            elif k == "deadline_hit":
                out[k] = bool(out.get(k)) or bool(v)
            else:
                out[k] = out.get(k, 0) + v
    return out
