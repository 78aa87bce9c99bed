"""Which peers this host's TCP connections moved data with lately: the kernel's socket
diagnostics (NETLINK_SOCK_DIAG, what `ss -ti` reads), parsed for just that.

One dump of the established TCP sockets of both address families with their tcp_info (the
inet_diag request that takes no family: the kernel walks its TCP hash table once, where a dump per
family walks it twice; measured here ~1.9 against ~4.8 ms of CPU a sample, mostly the kernel's
walk, which grows with the host's memory, not its sockets); a socket to one of a peer's addresses
whose last data sent or received is at most `within_ms` old marks the peer as moving. A kernel
that refuses that request gets a dump per family. Sockets of every process count (no privilege is needed to see them), so the agent
sees a training job's TCP transports (gloo, NCCL's socket transport) without being told.

The kernel filters the dump: the request carries inet_diag bytecode (what `ss dst ADDR` sends)
that keeps only sockets whose destination is one of the peers' addresses, so a host with many
other connections (any process may open thousands) costs the kernel's walk and its compares, not
their messages copied and parsed here: measured here with 16 000 other sockets and 16 peers,
~22 ms a sample unfiltered against ~2.6 ms. The addresses go as the fewest exact prefixes (peers
numbered in a row share one); above MAX_CONDITIONS prefixes, where the kernel's compares would
cost about what the parse saves, the dump is unfiltered, as is one the kernel refuses. The parse
below checks every address itself either way.

Parsed by hand rather than with pyroute2's generic parser: measured here over 500 established
sockets, pyroute2 took ~35 ms a dump and this ~3 ms (both address families), and the agent
samples once per idle interval.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
TCPDIAG_GETSOCK = 18  # the request without a family (struct inet_diag_req): both families in one walk
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
TCP_ESTABLISHED = 1
INET_DIAG_INFO = 2
INET_DIAG_REQ_BYTECODE = 1
INET_DIAG_BC_JMP, INET_DIAG_BC_D_COND = 1, 8
_NLMSGHDR = struct.Struct("=IHHII")
_REQ = struct.Struct("=BBBxI48s")  # inet_diag_req_v2: family, protocol, ext, pad, states, sockid
_REQ_ANY = struct.Struct("=BBBB48sII")  # inet_diag_req: family (none), src_len, dst_len, ext, sockid, states, dbs
_MSG_LEN = 72  # struct inet_diag_msg
_DST = slice(24, 40)  # idiag_dst inside it (4 + sockid's sport, dport, src)
_NLA = struct.Struct("=HH")
_LAST_DATA = struct.Struct("=I4xI")  # tcpi_last_data_sent (offset 44), tcpi_last_data_recv (52)
_LAST_DATA_AT = 44
_OP = struct.Struct("=BBH")  # inet_diag_bc_op: code, yes, no (bytes forward from this op)
_HOSTCOND = struct.Struct("=BBxxi")  # inet_diag_hostcond: family, prefix_len, port (-1: any); address follows
MAX_MESSAGES = 1_000_000  # bound on one dump (a host has far fewer sockets)
# The kernel runs the conditions in order for every socket of its table (~3.4 ns each measured
# here, against ~1.4 us to copy and parse a socket's message) and audits the program once a dump
# in time quadratic in its length: at 256 prefixes the filtered dump still costs less CPU than the
# unfiltered one (measured here with 16 000 sockets, ~17 against ~22 ms; at 512, ~30 against ~22),
# and none of it holds the interpreter's lock, which the parse does.
MAX_CONDITIONS = 256


def address_key(family: int, raw: bytes) -> bytes:
    """A socket's destination as the 4 (IPv4, also when v4-mapped in an IPv6 socket) or 16 bytes
    `peer_addresses` keys by."""
    if family == socket.AF_INET:
        return raw[:4]
    if raw[:12] == b"\0" * 10 + b"\xff\xff":
        return raw[12:16]
    return raw[:16]


Where = tuple  # (peer name, its plane; None for its service address)


def peer_addresses(peers) -> dict[bytes, Where]:
    """Each peer's addresses (`name`, `service`, `nics` {plane: address}) as packed address ->
    (peer, plane), plane None for the service address: traffic to it takes whichever plane the
    routes choose."""
    out = {ipaddress.ip_address(p.service).packed: (p.name, None) for p in peers}
    out.update({ipaddress.ip_address(a).packed: (p.name, plane) for p in peers for plane, a in p.nics.items()})
    return out


def prefixes(keys) -> list[tuple[int, int, bytes]]:
    """The fewest (family, prefix length, network) that hold exactly the packed addresses `keys`
    (4 or 16 bytes) and nothing else: IPv4 first, then IPv6."""
    out = []
    for family, size in ((socket.AF_INET, 4), (socket.AF_INET6, 16)):
        nets = ipaddress.collapse_addresses(ipaddress.ip_address(k) for k in keys if len(k) == size)
        out += [(family, n.prefixlen, n.network_address.packed) for n in nets]
    return out


def dst_bytecode(keys) -> bytes:
    """The INET_DIAG_REQ_BYTECODE attribute that keeps only sockets whose destination is one of
    the packed addresses `keys` (any port; an IPv4 address also matches as v4-mapped in an IPv6
    socket), or b"" for no filter: no addresses, or more than MAX_CONDITIONS prefixes.

    The program is an OR chain, every jump forward: each condition's `yes` goes to the op right
    after it, a JMP whose `no` (a JMP always takes `no`) goes to the end (the socket is kept),
    and its `no` skips that JMP to the next condition; the last condition's `yes` is the end
    and its `no` 4 bytes past it (the socket is dropped). The kernel keeps a socket when the
    program ends exactly at its end, and accepts a program whose `yes` offsets, followed from
    the start, land on every op and the end, and whose `no` offsets land on one of those."""
    conds = prefixes(keys)
    if not conds or len(conds) > MAX_CONDITIONS:
        return b""
    ops = [_HOSTCOND.pack(family, plen, -1) + addr for family, plen, addr in conds]
    total = sum(_OP.size + len(op) for op in ops) + _OP.size * (len(ops) - 1)
    if _NLA.size + total > 0xFFFF:  # an attribute's length is 16 bits (2 047 IPv6 prefixes fit)
        return b""
    out, at = bytearray(), 0
    for k, cond in enumerate(ops):
        size = _OP.size + len(cond)
        out += _OP.pack(INET_DIAG_BC_D_COND, size, size + _OP.size) + cond
        at += size
        if k < len(ops) - 1:
            out += _OP.pack(INET_DIAG_BC_JMP, _OP.size, total - at)
            at += _OP.size
    return _NLA.pack(_NLA.size + len(out), INET_DIAG_REQ_BYTECODE) + bytes(out)


def parse_dump(data: bytes, by_addr: dict[bytes, Where], within_ms: int, out: set[Where]) -> tuple[bool, int]:
    """Add to `out` the values of `by_addr` (where each peer is) for the sockets in one netlink
    reply buffer that moved data within `within_ms` (each message's own family says how to read
    its address); (True when the dump is complete (NLMSG_DONE), the socket messages read).
    Lengths are checked before use: a malformed message ends the parse (OSError)."""
    off, end, seen = 0, len(data), 0
    while off + _NLMSGHDR.size <= end:
        length, kind, _flags, _seq, _pid = _NLMSGHDR.unpack_from(data, off)
        if length < _NLMSGHDR.size or off + length > end:
            raise OSError("sock_diag: a truncated netlink message")
        if kind == NLMSG_DONE:
            return True, seen
        if kind == NLMSG_ERROR:
            err = struct.unpack_from("=i", data, off + _NLMSGHDR.size)[0] if length >= _NLMSGHDR.size + 4 else 0
            raise OSError(-err, f"sock_diag dump refused: {os.strerror(-err) if err else 'error'}")
        body = off + _NLMSGHDR.size
        if kind in (SOCK_DIAG_BY_FAMILY, TCPDIAG_GETSOCK) and length >= _NLMSGHDR.size + _MSG_LEN:
            seen += 1
            peer = by_addr.get(address_key(data[body], data[body + _DST.start: body + _DST.stop]))
            if peer is not None and peer not in out:
                at, stop = body + _MSG_LEN, off + length
                while at + _NLA.size <= stop:
                    alen, atype = _NLA.unpack_from(data, at)
                    if alen < _NLA.size:
                        break
                    if atype & 0x3FFF == INET_DIAG_INFO and alen >= _NLA.size + _LAST_DATA_AT + _LAST_DATA.size:
                        sent, recv = _LAST_DATA.unpack_from(data, at + _NLA.size + _LAST_DATA_AT)
                        if min(sent, recv) <= within_ms:
                            out.add(peer)
                        break
                    at += (alen + 3) & ~3
        off += (length + 3) & ~3
    return False, seen


# The requests as (one dump for both families, filtered by the kernel), in the order tried: the
# kernel's refusal of one moves to the next for good (a kernel that refuses the bytecode gets the
# one dump without it; one without the compatibility request, a dump per family)
_FALLBACKS = ((True, True), (True, False), (False, True), (False, False))


class TcpActivity:
    """A netlink socket for the dumps, opened in the current network namespace."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
        self.sock.bind((0, 0))
        self.seq = 0
        self.any_family = True  # one dump for both families, until the kernel refuses it
        self.filtering = True  # the kernel filters by destination, until it refuses that
        self._filters: tuple[dict, dict[int, bytes]] = ({}, {})  # (for which by_addr, family -> bytecode)
        self.sockets_read = self.bytes_read = 0  # by the last call of moving()

    def moving(self, by_addr: dict[bytes, Where], within_ms: int) -> set[Where]:
        """Where (values of `by_addr`) a TCP connection moved data in the last `within_ms`."""
        self.sockets_read = self.bytes_read = 0
        if not by_addr:
            return set()
        if self._filters[0] is not by_addr:  # built once per set of peers, not per sample
            self._filters = (by_addr, {socket.AF_UNSPEC: dst_bytecode(by_addr),
                                       socket.AF_INET: dst_bytecode(k for k in by_addr if len(k) == 4)})
        while True:
            try:
                return self._sample(by_addr, within_ms, self._filters[1] if self.filtering else {})
            except OSError as exc:
                step = _FALLBACKS.index((self.any_family, self.filtering)) + 1
                if not exc.errno or step == len(_FALLBACKS):
                    raise  # a malformed reply, not a refusal (the caller starts over), or nothing left to try
                self.any_family, self.filtering = _FALLBACKS[step]

    def _sample(self, by_addr: dict[bytes, Where], within_ms: int, filters: dict[int, bytes]) -> set[Where]:
        out: set[Where] = set()
        self.sockets_read = self.bytes_read = 0
        if self.any_family:
            req = _REQ_ANY.pack(0, 0, 0, 1 << (INET_DIAG_INFO - 1), bytes(48), 1 << TCP_ESTABLISHED, 0)
            self._dump(TCPDIAG_GETSOCK, req + filters.get(socket.AF_UNSPEC, b""), by_addr, within_ms, out)
            return out
        families = {socket.AF_INET6} | ({socket.AF_INET} if any(len(k) == 4 for k in by_addr) else set())
        for family in sorted(families):
            req = _REQ.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 1 << TCP_ESTABLISHED, bytes(48))
            # an IPv6 socket's destination may be a v4-mapped address: its dump takes every condition
            bytecode = filters.get(socket.AF_INET if family == socket.AF_INET else socket.AF_UNSPEC, b"")
            self._dump(SOCK_DIAG_BY_FAMILY, req + bytecode, by_addr, within_ms, out)
        return out

    def _dump(self, kind: int, req: bytes, by_addr: dict[bytes, Where], within_ms: int, out: set[Where]) -> None:
        self.seq += 1
        self.sock.send(_NLMSGHDR.pack(_NLMSGHDR.size + len(req), kind, NLM_F_REQUEST | NLM_F_DUMP, self.seq, 0) + req)
        for _ in range(MAX_MESSAGES):
            data = self.sock.recv(1 << 16)
            done, seen = parse_dump(data, by_addr, within_ms, out)
            self.sockets_read += seen
            self.bytes_read += len(data)
            if done:
                return

    def close(self) -> None:
        self.sock.close()
