"""RC queue pairs that follow LinkPass: each connects with a source port from the entropy table.

    from linkpass_rdma import qp
    dev = qp.Device.for_address("198.18.64.1")          # the RDMA device of that NIC address
    rc = qp.SteeredRC(dev)                               # an RC QP in INIT, plus a CQ and a buffer
    info = rc.local()                                    # {"qpn", "gid", "psn"}: send it to the peer
    rc.connect(peer_info, sport=qp.port_from_table(...)) # RTR/RTS with the flow label for that port
    rc.send(b"...");  reply = rc.wait(send=True, recv=True)

The port decides the fabric path (the switches hash the 5-tuple); `steer.py` says how a port
becomes a flow label. A QP's port is fixed once it is in RTR on rxe; on mlx5 a live QP can be
re-pathed with `mlx5dv_modify_qp_udp_sport`, which rxe refuses (`repath()` says so): there the
application moves to a new QP on another healthy port.

`python3 -m linkpass_rdma.qp serve|ping` is a small RC ping-pong over this API (connection
details exchanged over TCP, as ibv_rc_pingpong does), used by the testbed's RDMA tests.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import time

from . import steer
from linkpass.kernel.rdma import Device, RdmaUnavailable, ipv4_gid, load_pyverbs  # noqa: F401 (API)

DEFAULT_TIMEOUT = 14  # 4.096 us * 2^14 = 67 ms per try: emulated rxe answers in ~8 ms
DEFAULT_RETRY = 7
BUF = 4096


class SteeredRC:
    """One RC QP with its own PD, CQ and registered buffer, connected on a chosen source port."""

    def __init__(self, dev: Device, depth: int = 16):
        load_pyverbs()
        from pyverbs.cq import CQ
        from pyverbs.device import Context
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
        import pyverbs.enums as e
        self._e = e
        self.dev = dev
        self.ctx = Context(name=dev.name)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, depth * 2)
        cap = QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        self.mr = MR(self.pd, BUF * 2, access)
        attr = QPAttr(port_num=dev.port)
        attr.qp_access_flags = access
        self.qp.to_init(attr)
        self.psn = random.randrange(1 << 24)
        self.sport: int | None = None
        self.flow_label: int | None = None
        self._sends_done = 0  # completed sends no wait() has claimed yet
        self._inbox: list[bytes] = []  # arrived messages no wait() has claimed yet

    def local(self) -> dict:
        gid = self.ctx.query_gid(self.dev.port, self.dev.gid_index)
        return {"qpn": self.qp.qp_num, "gid": str(gid), "psn": self.psn}

    def connect(self, peer: dict, sport: int | None = None, timeout: int = DEFAULT_TIMEOUT,
                retry: int = DEFAULT_RETRY) -> int:
        """INIT -> RTR -> RTS towards `peer` ({"qpn", "gid", "psn"}); with `sport`, the QP's packets
        carry that UDP source port (the flow label is chosen for it), else the kernel's default.
        Returns the port the QP's packets carry."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr
        e = self._e
        fl = steer.flow_label_for_sport(sport) if sport is not None else 0
        gr = GlobalRoute(dgid=GID(peer["gid"]), sgid_index=self.dev.gid_index, hop_limit=64, flow_label=fl)
        attr = QPAttr(port_num=self.dev.port)
        attr.ah_attr = AHAttr(gr=gr, is_global=1, port_num=self.dev.port)
        attr.path_mtu = e.IBV_MTU_1024
        attr.dest_qp_num = int(peer["qpn"])
        attr.rq_psn = int(peer["psn"])
        attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = 12
        self.qp.to_rtr(attr)
        attr.timeout, attr.retry_cnt, attr.rnr_retry = timeout, retry, 7
        attr.sq_psn = self.psn
        attr.max_rd_atomic = 1
        self.qp.to_rts(attr)
        self.flow_label = fl
        self.sport = steer.qp_sport(fl, self.qp.qp_num, int(peer["qpn"]))
        return self.sport

    def repath(self, sport: int) -> None:
        """Move the live QP to another source port. Only mlx5 can (mlx5dv_modify_qp_udp_sport);
        on any other device this raises RdmaUnavailable: connect a new QP on `sport` instead.
        The mlx5 call has not run on hardware here (none on this project's machines)."""
        steer.flow_label_for_sport(sport)  # the port must be reachable at all
        if not self.dev.name.startswith("mlx5"):
            raise RdmaUnavailable(f"{self.dev.name}: re-pathing a live QP needs mlx5 (mlx5dv_modify_qp_udp_sport); "
                                  "this device cannot, so open a new QP on the new port and move traffic to it")
        from pyverbs.providers.mlx5.mlx5dv import Mlx5QP
        Mlx5QP.modify_udp_sport(self.ctx, self.qp, sport)
        self.sport = sport

    def post_recv(self) -> None:
        from pyverbs.wr import SGE, RecvWR
        self.qp.post_recv(RecvWR(num_sge=1, sg=[SGE(self.mr.buf, BUF, self.mr.lkey)]))

    def send(self, data: bytes) -> None:
        from pyverbs.wr import SGE, SendWR
        if len(data) > BUF:
            raise ValueError(f"message of {len(data)} B: at most {BUF}")
        self.mr.write(data, len(data), BUF)
        wr = SendWR(opcode=self._e.IBV_WR_SEND, num_sge=1, sg=[SGE(self.mr.buf + BUF, len(data), self.mr.lkey)])
        self.qp.post_send(wr)

    def step(self) -> tuple[int, list[bytes]]:
        """One look at the CQ: how many sends completed and the messages that arrived (their
        receive buffers posted again). A failed completion raises RuntimeError: the QP is in error."""
        n, wcs = self.cq.poll(num_entries=8)
        sent, got = 0, []
        for wc in wcs[:n]:
            if wc.status != self._e.IBV_WC_SUCCESS:
                raise RuntimeError(f"work completion failed: status {wc.status} (QP {self.qp.qp_num})")
            if wc.opcode == self._e.IBV_WC_SEND:
                sent += 1
            elif wc.opcode == self._e.IBV_WC_RECV:
                got.append(self.mr.read(wc.byte_len, 0))
                self.post_recv()
        return sent, got

    def wait(self, send: bool = False, recv: bool = False, timeout_s: float = 5.0) -> bytes | None:
        """Until a posted send has completed (`send`) and/or a message has arrived (`recv`, which
        is returned). Completions arrive in either order, so what comes before it is wanted is
        kept for the next call, never dropped."""
        deadline = time.monotonic() + timeout_s
        while (send and not self._sends_done) or (recv and not self._inbox):
            sent, got = self.step()
            self._sends_done += sent
            self._inbox += got
            if not sent and not got:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no completion within {timeout_s} s (QP {self.qp.qp_num}, port {self.sport})")
                time.sleep(0.0005)
        if send:
            self._sends_done -= 1
        return self._inbox.pop(0) if recv else None


# ---- a ping-pong over TCP-exchanged connection details -------------------------------------

def connect_retrying(where: tuple[str, int], wait_s: float = 30.0, **kw) -> socket.socket:
    """A TCP connection to a peer that may still be starting (refused: try again, bounded)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return socket.create_connection(where, timeout=30, **kw)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class JsonLines:
    """One JSON object per line over a stream socket (connection details between peers)."""

    MAX_LINE = 1 << 20

    def __init__(self, sock: socket.socket):
        self.sock, self.buf = sock, b""

    def send(self, doc: dict) -> None:
        self.sock.sendall(json.dumps(doc).encode() + b"\n")

    def recv(self) -> dict:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the peer closed the connection")
            self.buf += chunk
            if len(self.buf) > self.MAX_LINE:
                raise ConnectionError(f"a line over {self.MAX_LINE} bytes from the peer")
        line, self.buf = self.buf.split(b"\n", 1)
        doc = json.loads(line)
        if not isinstance(doc, dict):
            raise ConnectionError("the peer sent something other than a JSON object")
        return doc


def _pingpong(rc: SteeredRC, count: int, size: int, first: bool) -> int:
    msg = os.urandom(size)
    done = 0
    for _ in range(count):
        if first:
            rc.send(msg)
            got = rc.wait(send=True, recv=True)
        else:
            got = rc.wait(recv=True)
            rc.send(got)
            rc.wait(send=True)
        if first and got != msg:
            raise RuntimeError("a reply differs from what was sent")
        done += 1
    return done


def serve(addr: str, port: int, connections: int) -> int:
    dev = Device.for_address(addr)
    with socket.create_server((addr, port)) as srv:
        print(json.dumps({"listening": f"{addr}:{port}", "device": dev.name}), flush=True)
        for _ in range(connections):
            conn, _peer = srv.accept()
            with conn:
                rc = SteeredRC(dev)
                for _ in range(4):
                    rc.post_recv()
                line = JsonLines(conn)
                req = line.recv()
                sport = rc.connect(req, req.get("reverse_sport"))
                line.send(rc.local())
                n = _pingpong(rc, int(req["count"]), int(req["size"]), first=False)
                print(json.dumps({"served": n, "sport": sport, "qpn": rc.qp.qp_num}), flush=True)
    return 0


def ping(addr: str, server: str, sport: int | None, count: int, size: int, reverse_sport: int | None) -> dict:
    dev = Device.for_address(addr)
    host, _, port = server.rpartition(":")
    rc = SteeredRC(dev)
    for _ in range(4):
        rc.post_recv()
    with connect_retrying((host, int(port)), source_address=(addr, 0)) as conn:
        line = JsonLines(conn)
        line.send(dict(rc.local(), count=count, size=size, reverse_sport=reverse_sport))
        peer = line.recv()  # sent once the server's QP is in RTS
        used = rc.connect(peer, sport)
        t0 = time.perf_counter()
        n = _pingpong(rc, count, size, first=True)
        took = time.perf_counter() - t0
    return {"sport": used, "flow_label": rc.flow_label, "qpn": rc.qp.qp_num, "peer_qpn": peer["qpn"],
            "device": dev.name, "count": n, "rtt_ms_mean": round(took / max(1, n) * 1e3, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m linkpass_rdma.qp", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="answer RC ping-pongs")
    s.add_argument("--addr", required=True, help="this host's NIC address (picks the RDMA device)")
    s.add_argument("--port", type=int, default=18515)
    s.add_argument("--connections", type=int, default=1, help="serve this many clients, then exit")
    p = sub.add_parser("ping", help="one RC connection on a chosen source port, N ping-pongs")
    p.add_argument("--addr", required=True, help="this host's NIC address")
    p.add_argument("--server", required=True, metavar="ADDR:PORT")
    p.add_argument("--sport", default=None,
                   help="UDP source port for the QP (49152..65535); a comma list runs one QP per port in turn")
    p.add_argument("--reverse-sport", default=None,
                   help="ask the server's QP to use this port (a comma list pairs with --sport; 'same': each QP's own)")
    p.add_argument("--count", type=int, default=10)
    p.add_argument("--size", type=int, default=256)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "serve":
            return serve(args.addr, args.port, args.connections)
        sports = [int(x) for x in args.sport.split(",")] if args.sport else [None]
        if args.reverse_sport == "same":
            reverse = list(sports)
        elif args.reverse_sport:
            reverse = [int(x) for x in args.reverse_sport.split(",")]
        else:
            reverse = [None] * len(sports)
        if len(reverse) != len(sports):
            raise ValueError(f"--reverse-sport: {len(reverse)} ports for {len(sports)} in --sport")
        for sport, rev in zip(sports, reverse):
            print(json.dumps(ping(args.addr, args.server, sport, args.count, args.size, rev)), flush=True)
        return 0
    except (RdmaUnavailable, ValueError) as exc:
        print(f"linkpass_rdma.qp: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
