"""A message channel over RC queue pairs that moves to another fabric path when its path dies.

An RC QP is bound to one source port, hence one path through the fabric, from the moment it
connects. When that path fails, the QP retries until its retry count runs out and then errors;
with NCCL's settings (timeout 20, retry count 7) that takes about half a minute. A `Channel`
instead keeps a **standby QP already connected on another healthy port**, and moves its traffic
there as soon as either
  * the active QP's port leaves the healthy set (the entropy table the LinkPass agent writes, or
    any `ports()` callable), before any timeout, or
  * the active QP reports a failed completion, after its own short timeout (LinkPass's defaults:
    timeout 14 = 67 ms per try, retry count 3: ~0.3 s),
resends what was not acknowledged on the standby, and connects a new standby on a port not known
to be bad. Devices that can re-path a live QP (mlx5) would not need the standby; rxe cannot.

The peers agree on QPs over a control connection (a TCP socket, typically on the management
network, as NCCL's bootstrap is): one JSON line per request. Messages are numbered; the server
side delivers each number once and answers every message on the QP it arrived on, so a message
resent after a move is acknowledged again but not delivered twice.

Run `python3 -m linkpass_rdma.channel serve|stream` for the testbed's tests and benchmark.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterable

from .lanes import KIND_VERBS, Lane, LaneReport
from .qp import Device, JsonLines, SteeredRC, connect_retrying
from linkpass.kernel.rdma import RdmaUnavailable

HEADER = struct.Struct("!QI")  # sequence number, payload length
# 67 ms per try, 4 tries: a dead path errors in ~0.3 s. Shorter trips spuriously on emulated rxe,
# whose replies are sometimes 50 ms late; real NICs answer in microseconds and can go lower.
FAST_TIMEOUT, FAST_RETRY = 14, 3
BAD_HOLD_S = 10.0  # a port that failed is avoided this long unless nothing else is left
NCCL_TIMEOUT, NCCL_RETRY = 20, 7  # NCCL_IB_TIMEOUT / NCCL_IB_RETRY_CNT defaults: ~4.3 s per try, 8 tries


def table_ports(peer_addr: str, plane: int, path: str | None = None, fallback: Iterable[int] = (),
                min_interval_s: float = 0.001) -> Callable[[], tuple[int, ...]]:
    """A `ports()` for a Channel: the healthy ports of (peer, plane) in the entropy table the
    LinkPass agent writes, re-read at most every `min_interval_s`. An entry the agent flagged
    fail-static (no port known healthy), a missing entry or an unreadable table gives `fallback`
    (the ports the application would use without LinkPass) or, without one, the fail-static
    entry's ports or the last ones read: the channel never has nowhere to go."""
    from . import entropy
    from linkpass.core.entropy_table import ENTRY_FAIL_STATIC

    cached: dict = {"at": -1.0, "ports": tuple(fallback)}

    def ports() -> tuple[int, ...]:
        now = time.monotonic()
        if now - cached["at"] >= min_interval_s:
            cached["at"] = now
            try:
                e = entropy.read_table(path or entropy.DEFAULT_PATH).get(peer_addr, plane)
            except Exception:  # the table is advice: unreadable now, keep going on what we have
                e = None
            if e is not None and e.ports and not e.flags & ENTRY_FAIL_STATIC:
                cached["ports"] = tuple(e.ports)  # what the agent knows to be healthy
            elif fallback:
                cached["ports"] = tuple(fallback)
            elif e is not None and e.ports:
                cached["ports"] = tuple(e.ports)  # fail static: every port, none known good
            # else: nothing better known; keep the last ports
        return cached["ports"]

    return ports


def qp_give_up_s(timeout: int, retry: int) -> float:
    """How long an RC QP retries a dead path before it errors: (retry + 1) x 4.096 us x 2^timeout."""
    return (retry + 1) * 4.096e-6 * (1 << timeout)


class Channel:
    """The client side: send(data) returns when the peer acknowledged it, moving paths as needed."""

    def __init__(self, dev: Device, control: socket.socket, ports: Callable[[], Iterable[int]],
                 timeout: int = FAST_TIMEOUT, retry: int = FAST_RETRY, log: Callable[[dict], None] | None = None,
                 report: LaneReport | None = None, plane: int = 0):
        self.dev, self.ctl = dev, JsonLines(control)
        # the active QP is reported as a lane (docs/lanes.md): the agent follows its path and progress
        self.report, self.plane = report, plane
        self.lanes: dict[int, Lane] = {}  # qpn -> its lane in the report
        self.peer_addr: str | None = None  # the peer's address on this plane (from its GID)
        self.ports, self.timeout, self.retry = ports, timeout, retry
        self.echo_timeout_s = 2 * qp_give_up_s(timeout, retry) + 0.1
        self.log = log or (lambda ev: None)
        self.bad: dict[int, float] = {}  # port -> until when it is avoided
        self._retired: list[SteeredRC] = []
        self.seq = 0
        self.moves = 0
        self.active = self._open(self._pick())
        self.standby: SteeredRC | None = self._new_standby()

    # ---- QPs ------------------------------------------------------------------------------
    def _pick(self, exclude: set[int] = frozenset()) -> int:
        """The first healthy port (in the order `ports()` gives) not known bad and not excluded."""
        offered = list(self.ports())
        now = time.monotonic()
        healthy = [p for p in offered if self.bad.get(p, 0.0) <= now and p not in exclude]
        if not healthy:
            healthy = [p for p in offered if p not in exclude]  # fail static: never nowhere to go
        if not healthy:
            raise RdmaUnavailable("no healthy source port to open a QP on")
        return healthy[0]

    def _new_standby(self) -> SteeredRC | None:
        """A standby QP on the first healthy port other than the active one; None while the
        table offers no other (one healthy path left): asked again after every message."""
        try:
            return self._open(self._pick(exclude={self.active.sport}))
        except RdmaUnavailable as exc:
            if "no healthy source port" not in str(exc):
                raise
            return None

    def _open(self, sport: int) -> SteeredRC:
        rc = SteeredRC(self.dev)
        for _ in range(8):
            rc.post_recv()
        self.ctl.send(dict(rc.local(), op="open", reverse_sport=sport, timeout=self.timeout, retry=self.retry))
        peer = self.ctl.recv()
        if "error" in peer:
            raise RdmaUnavailable(f"peer refused a QP: {peer['error']}")
        rc.connect(peer, sport, timeout=self.timeout, retry=self.retry)
        self.ctl.send({"op": "ready", "qpn": peer["qpn"]})
        self.ctl.recv()
        self.peer_addr = _gid_address(peer["gid"])
        self.log({"event": "qp_open", "sport": sport, "qpn": rc.qp.qp_num, "t": time.monotonic()})
        return rc

    def _lane(self, rc: SteeredRC) -> Lane | None:
        """The active QP's lane, claimed when it first carries a message."""
        lane = self.lanes.get(rc.qp.qp_num)
        if lane is None and self.report is not None and self.peer_addr:
            lane = self.report.claim(self.peer_addr, self.plane, rc.sport, KIND_VERBS)
            if lane is not None:
                self.lanes[rc.qp.qp_num] = lane
        return lane

    def _move(self, why: str) -> None:
        """Traffic to the standby now; a new standby once the message in flight is through."""
        old = self.active
        lane = self.lanes.pop(old.qp.qp_num, None)
        if lane is not None:
            lane.release()  # what it had sent and not had acknowledged goes with it
        self.bad[old.sport] = time.monotonic() + BAD_HOLD_S
        if self.standby is None:  # a second failure before a new standby was made
            self.standby = self._open(self._pick(exclude={old.sport}))
        self.active, self.standby, self.moves = self.standby, None, self.moves + 1
        self.log({"event": "moved", "why": why, "from": old.sport, "to": self.active.sport, "t": time.monotonic()})
        self._retired.append(old)

    def _port_left(self) -> bool:
        """Move off the active QP if its port is no longer offered as healthy; whether it moved."""
        if self.active.sport in set(self.ports()):
            return False
        self._move("port left the healthy set")
        return True

    def _once(self, msg: bytes, give_up: float) -> bytes | None:
        """One try on the active QP: the echo, or None when the QP failed or its port left the
        healthy set (the caller moves and tries again)."""
        rc = self.active
        lane = self._lane(rc)
        rc.send(msg)
        if lane is not None:
            lane.sent(len(msg))
        sent, echo = False, None
        next_check = 0.0
        # our request may get through and its echo not (the path died in between): the peer's
        # QP errors then, ours never does, so an echo not back within twice the time a QP takes
        # to give up on a path counts as that path failing
        echo_by = time.monotonic() + self.echo_timeout_s
        while not (sent and echo is not None):
            looked = time.monotonic_ns()
            try:
                n_sent, got = rc.step()
            except RuntimeError as exc:
                self._move(f"QP error ({exc})")
                return None
            sent = sent or n_sent > 0
            echo = got[-1] if got else echo
            if lane is not None:
                if got:
                    lane.acked(min(len(msg), lane.bytes_sent - lane.bytes_acked))  # the echo acknowledges it
                lane.report.beat(looked)  # the agent judges a stall at this look
            now = time.monotonic()
            if not n_sent and not got:
                if now > next_check:
                    next_check = now + 0.001
                    if self._port_left():
                        return None
                    if now > echo_by:
                        self._move(f"no answer within {self.echo_timeout_s:.2f} s")
                        return None
                    if now > give_up:
                        raise TimeoutError(f"message {self.seq} not acknowledged in time")
                time.sleep(0.0001)
        return echo

    def send(self, data: bytes, deadline_s: float = 120.0) -> bytes:
        """Send one message and wait for the peer's echo of it; returns the echo's payload."""
        self.seq += 1
        msg = HEADER.pack(self.seq, len(data)) + data
        give_up = time.monotonic() + deadline_s
        while True:
            self._port_left()  # before sending: do not post on a path the agent already took out
            got = self._once(msg, give_up)
            if got is None:
                continue
            seq, n = HEADER.unpack_from(got)
            if seq != self.seq:
                continue  # a stale echo of an earlier try
            if self.standby is None:
                for old in self._retired:
                    self.ctl.send({"op": "close", "qpn": old.qp.qp_num})
                    self.ctl.recv()
                self._retired.clear()
                self.standby = self._new_standby()
            return got[HEADER.size:HEADER.size + n]


def _gid_address(gid: str) -> str | None:
    """The IP address a RoCE v2 GID carries (IPv4-mapped or IPv6), or None."""
    try:
        ip = ipaddress.IPv6Address(gid)
    except ValueError:
        return None
    return str(ip.ipv4_mapped or ip)


def serve(addr: str, port: int) -> int:
    """Accept one channel; answer every message on the QP it came on; deliver each number once."""
    dev = Device.for_address(addr)
    with socket.create_server(("0.0.0.0", port)) as srv:
        print(json.dumps({"listening": port, "device": dev.name}), flush=True)
        conn, _ = srv.accept()
    ctl = JsonLines(conn)
    qps: dict[int, SteeredRC] = {}  # by the client's QPN
    delivered = duplicates = skipped = 0
    ctl.sock.setblocking(False)
    while True:
        try:
            req = ctl.recv()
        except BlockingIOError:
            req = None
        except ConnectionError:
            break
        if req is not None:
            ctl.sock.setblocking(True)
            if req["op"] == "open":
                rc = SteeredRC(dev)
                for _ in range(8):
                    rc.post_recv()
                rc.connect(req, req.get("reverse_sport"), timeout=int(req["timeout"]), retry=int(req["retry"]))
                qps[int(req["qpn"])] = rc
                ctl.send(rc.local())
            elif req["op"] == "ready":
                ctl.send({"ok": True})
            elif req["op"] == "close":
                qps.pop(int(req["qpn"]), None)
                ctl.send({"ok": True})
            ctl.sock.setblocking(False)
        for rc in list(qps.values()):
            try:
                _, arrived = rc.step()
            except RuntimeError:
                continue  # our echo failed on a dead path: the client resends elsewhere
            for got in arrived:
                seq = HEADER.unpack_from(got)[0]
                if seq == delivered + 1:
                    delivered = seq  # the next message: delivered
                elif seq <= delivered:
                    duplicates += 1  # resent after a move: answered again, not delivered again
                else:
                    skipped += 1  # a message missing before it: must never happen
                try:
                    rc.send(got)
                except Exception:
                    pass  # a QP in error: the client moves away from it
        time.sleep(0.0002)
    print(json.dumps({"delivered": delivered, "duplicates": duplicates, "skipped": skipped, "qps": len(qps)}),
          flush=True)
    return 0


def stream(addr: str, server: str, ports: list[int], count: int, size: int, timeout: int, retry: int,
           interval_s: float, deadline_s: float = 120.0,
           ports_fn: Callable[[], Iterable[int]] | None = None, plane: int = 0) -> dict:
    """Send `count` messages, one at a time; report every move and the longest gap between two
    acknowledged messages (guest time). A message not through within `deadline_s` ends the stream
    with "stuck": the gap then counts up to the give-up, a lower bound of the real stall.
    `ports_fn` (e.g. table_ports()) offers the healthy ports instead of the fixed `ports`."""
    dev = Device.for_address(addr)
    host, _, p = server.rpartition(":")
    events: list[dict] = []
    ctl = connect_retrying((host, int(p)))
    report = LaneReport.open()  # $LINKPASS_LANES_DIR or the agent's default; None: unreported
    ch = Channel(dev, ctl, ports_fn or (lambda: ports), timeout=timeout, retry=retry, log=events.append,
                 report=report, plane=plane)
    print(json.dumps({"up": True, "active": ch.active.sport, "standby": ch.standby and ch.standby.sport}),
          file=sys.stderr, flush=True)  # for whoever waits to break a link under a running channel
    t_start = time.monotonic()
    acked, stuck = [t_start], False
    for i in range(count):
        data = i.to_bytes(8, "big") * (size // 8)
        try:
            echo = ch.send(data, deadline_s=deadline_s)
        except TimeoutError:
            acked.append(time.monotonic())  # the gap so far: a lower bound
            stuck = True
            break
        if echo != data:
            raise RuntimeError(f"message {i}: the echo differs")
        acked.append(time.monotonic())
        if interval_s:
            time.sleep(interval_s)
    gaps = [b - a for a, b in zip(acked, acked[1:])]
    worst = max(range(len(gaps)), key=gaps.__getitem__) if gaps else None
    ctl.close()
    if report is not None:
        report.close()
    return {"count": len(acked) - 1 - stuck, "stuck": stuck, "moves": ch.moves, "events": events, "ports": ports,
            "longest_gap_ms": round(gaps[worst] * 1e3, 1) if gaps else None,
            "longest_gap_at_s": round(acked[worst] - t_start, 3) if gaps else None,
            "duration_s": round(time.monotonic() - t_start, 3), "first_active": events[0]["sport"] if events else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m linkpass_rdma.channel", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="answer one channel")
    s.add_argument("--addr", required=True, help="this host's NIC address (picks the RDMA device)")
    s.add_argument("--port", type=int, default=18520, help="TCP port of the control connection")
    c = sub.add_parser("stream", help="send messages over a channel, moving paths when one dies")
    c.add_argument("--addr", required=True)
    c.add_argument("--server", required=True, metavar="ADDR:PORT", help="the peer's control address")
    c.add_argument("--ports", required=True, help="healthy source ports, in preference order, e.g. 49152,49160")
    c.add_argument("--count", type=int, default=100)
    c.add_argument("--size", type=int, default=256)
    c.add_argument("--interval", type=float, default=0.01, help="seconds between messages")
    c.add_argument("--timeout", type=int, default=FAST_TIMEOUT, help=f"QP timeout exponent (default {FAST_TIMEOUT})")
    c.add_argument("--retry", type=int, default=FAST_RETRY, help=f"QP retry count (default {FAST_RETRY})")
    c.add_argument("--deadline", type=float, default=120.0,
                   help="give up (and report the stream stuck) when one message takes longer, seconds")
    c.add_argument("--table", metavar="PATH", help="follow the LinkPass agent's entropy table at PATH "
                   "(--ports is then the fallback when it has nothing for this peer)")
    c.add_argument("--peer", metavar="ADDR", help="with --table: the peer's NIC address, its key in the table")
    c.add_argument("--plane", type=int, default=0, help="the plane of the peer's NIC: the table's key with --table, "
                   "and the lane's plane in this process's lane report (default 0)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "serve":
            return serve(args.addr, args.port)
        ports = [int(x) for x in args.ports.split(",") if x.strip()]
        if args.table and not args.peer:
            raise ValueError("--table needs --peer: the peer's NIC address, which keys its entry")
        ports_fn = table_ports(args.peer, args.plane, args.table, fallback=ports) if args.table else None
        print(json.dumps(stream(args.addr, args.server, ports, args.count, args.size, args.timeout, args.retry,
                                args.interval, args.deadline, ports_fn, args.plane)), flush=True)
        return 0
    except (RdmaUnavailable, ValueError) as exc:
        print(f"linkpass_rdma.channel: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
