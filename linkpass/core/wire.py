"""The LinkPass probe on the wire: a RoCEv2 packet carrying an authenticated exchange record.

Pure: no sockets, no clock reads. Encoding and decoding take the IP/UDP fields the RoCEv2
invariant CRC covers as arguments.

    IPv4 (DF, id 0) | UDP (dport 4791) | BTH (12) | LinkPass header (64) | padding | tag (16) | ICRC (4)

- **Why RoCEv2.** Switches hash RoCEv2 by the UDP 5-tuple and often classify it by port: a probe
  framed this way takes exactly the path (and queue) of RDMA traffic with the same source port.
  BTH: opcode RC SEND_ONLY, P_Key 0xFFFF, destination QP `LINKPASS_QPN`, PSN = low 24 bits of the
  sequence. The ICRC is computed as RoCEv2 defines it (and as scapy's `contrib.roce` builds it):
  CRC-32 over 8 bytes of 0xFF, the IPv4 header with TOS, TTL and checksum set to all ones, the UDP
  header with its checksum set to all ones, the BTH with FECN, BECN and the 6 reserved bits set to
  ones, and the payload; stored little-endian.
- **IP id 0.** The kernel sends unconnected DF datagrams with IP id 0 (measured on this
  kernel), so the receiver can rebuild the covered IPv4 header from addresses and length alone.
- **Authentication.** A keyed BLAKE2b-128 tag over the LinkPass header and padding, with the
  fleet key. The BTH and ICRC are outside the tag because switches may legally set FECN/BECN.
- **Replays.** `ReplayWindow` keeps a sliding bitmap of sequence numbers per (peer, path).

On RDMA hosts the NIC (or rxe) takes every packet to UDP 4791 before the kernel does, so probes
there are **UD SENDs** that a LinkPass UD QP receives (linkpass/probe/verbs_engine.py):

    IPv4 | UDP (dport 4791) | BTH (UD SEND_ONLY, dest QP) | DETH (Q_Key, src QP) | UD record | ICRC
    UD record: sport (2) | reserved (2) | LinkPass header (64) | padding | tag (16)

The QP hands over only the UD record (and the IPv4 header in its GRH slot; the device checked
the ICRC), so the record names the source port the request was sent with: the reply goes back
with the same port, over the same ECMP path as an RC QP's packets with that port. The tag
covers the port. A peer's probe QP is learned with a **hello** (`encode_hello`): a plain
authenticated UDP exchange on `HELLO_PORT`, since a QP number changes with every start.

Decoding raises `WireError` for anything it does not accept, and only that: its `reason` is one
of `DROP_REASONS`, which the caller counts before dropping the packet, so garbage costs a
counter, not the agent.
"""
from __future__ import annotations

import hashlib
import hmac
import struct
import zlib
from dataclasses import dataclass, replace

from .constants import ROCE_PORT

VERSION = 1
MAGIC = b"LP"
LINKPASS_QPN = 0x4C5001  # "LP" + 1: the destination QP that marks a LinkPass probe
BTH_OPCODE_RC_SEND_ONLY = 0x04
BTH_OPCODE_UD_SEND_ONLY = 0x64
# the Q_Key of LinkPass probe QPs (high bit clear: an unprivileged process may use it)
LINKPASS_QKEY = 0x4C500001
HELLO_PORT = 4792  # UD probe QPs are announced here (UDP, beside RoCEv2's 4791)
PKEY_DEFAULT = 0xFFFF

KIND_REQUEST = 1
KIND_REPLY = 2
FLAG_MTU_PROBE = 0x01  # a full-size probe that tests for an MTU black hole
# the fleet key: the only authentication of probes, so at least 256 bits (BLAKE2b takes up to 64 bytes)
FLEET_KEY_MIN, FLEET_KEY_MAX = 32, 64

_BTH = struct.Struct("!BBHII")  # opcode, se/m/pad/tver, pkey, fecn/becn/resv6/dqpn, ackreq/resv7/psn
_HDR = struct.Struct("!2sBBBBH IIII Q qqqq")
BTH_LEN = _BTH.size  # 12
HEADER_LEN = _HDR.size  # 64
TAG_LEN = 16
ICRC_LEN = 4
IPV4_LEN, UDP_LEN = 20, 8
MIN_PAYLOAD = BTH_LEN + HEADER_LEN + TAG_LEN + ICRC_LEN  # UDP payload of an unpadded probe (96)
_DETH = struct.Struct("!II")  # Q_Key, reserved(8)/source QP(24)
_UD_PREFIX = struct.Struct("!HH")  # the request's source port, reserved
DETH_LEN = _DETH.size
UD_RECORD_MIN = _UD_PREFIX.size + HEADER_LEN + TAG_LEN  # what a UD QP receives of an unpadded probe (84)
UD_MIN_PAYLOAD = BTH_LEN + DETH_LEN + UD_RECORD_MIN + ICRC_LEN  # its UDP payload (108)
_HELLO = struct.Struct("!2sBB II Q")  # magic, version, kind, agent id, QP number, nonce
HELLO_ASK, HELLO_ANSWER = 1, 2
HELLO_LEN = _HELLO.size + TAG_LEN
MAX_PAD = 9000

DROP_REASONS = ("short", "not_roce", "bad_magic", "bad_version", "bad_kind", "bad_length", "bad_icrc",
                "bad_tag", "replay", "unknown_peer", "unexpected")


class WireError(ValueError):
    """A packet we will not accept; `reason` is one of DROP_REASONS (a counter label)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Probe:
    kind: int
    sender: int  # agent id of the host that sent the request
    reflector: int  # agent id of the host that reflects it
    path: int  # sender's path id (which NIC, peer NIC and source port)
    seq: int
    t1: int = 0  # sender TX, sender clock (ns)
    t2: int = 0  # reflector RX, reflector clock
    t3: int = 0  # reflector TX, reflector clock
    t4: int = 0  # sender RX, sender clock: 0 on the wire, filled in at reception
    rx_count: int = 0  # in replies: requests the reflector has received on this path so far
    flags: int = 0
    pad: int = 0  # padding bytes after the header (full-size probes)

    def reply(self, t2: int, t3: int, rx_count: int) -> "Probe":
        return replace(self, kind=KIND_REPLY, t2=t2, t3=t3, rx_count=rx_count)


def pad_for_ip_size(ip_size: int) -> int:
    """Padding that makes the whole IPv4 packet `ip_size` bytes (for MTU probes)."""
    pad = ip_size - IPV4_LEN - UDP_LEN - MIN_PAYLOAD
    if not 0 <= pad <= MAX_PAD:
        raise ValueError(f"ip_size must be {IPV4_LEN + UDP_LEN + MIN_PAYLOAD}..{IPV4_LEN + UDP_LEN + MIN_PAYLOAD + MAX_PAD}")
    return pad


def ud_pad_for_ip_size(ip_size: int) -> int:
    """Padding that makes a UD probe's IPv4 packet at most `ip_size` bytes (a multiple of 4 below
    it: a UD payload is whole 32-bit words here, so the BTH needs no pad count)."""
    pad = (ip_size - IPV4_LEN - UDP_LEN - UD_MIN_PAYLOAD) & ~3
    if not 0 <= pad <= MAX_PAD:
        raise ValueError(f"ip_size must be {IPV4_LEN + UDP_LEN + UD_MIN_PAYLOAD}.."
                         f"{IPV4_LEN + UDP_LEN + UD_MIN_PAYLOAD + MAX_PAD}")
    return pad


def ud_packet(record: bytes, src: str | bytes, dst: str | bytes, sport: int, dest_qpn: int, src_qpn: int,
              qkey: int = LINKPASS_QKEY, psn: int = 0) -> bytes:
    """The UDP payload of a RoCEv2 UD SEND carrying `record` from src_qpn to dest_qpn: what a UD
    QP would put on the wire, built here so that any source port can be chosen (a UD QP's own
    port is fixed by the device). `record` must be whole 32-bit words."""
    if len(record) % 4:
        raise ValueError(f"UD record of {len(record)} bytes: must be a multiple of 4")
    bth = _BTH.pack(BTH_OPCODE_UD_SEND_ONLY, 0, PKEY_DEFAULT, dest_qpn & 0xFFFFFF, psn & 0xFFFFFF)
    roce = bth + _DETH.pack(qkey, src_qpn & 0xFFFFFF) + record
    return roce + icrc(src, dst, sport, ROCE_PORT, roce)


def _ip4(addr: str | bytes) -> bytes:
    if isinstance(addr, bytes):
        return addr
    parts = addr.split(".")
    return bytes(int(p) for p in parts)


def icrc(src: str | bytes, dst: str | bytes, sport: int, dport: int, roce: bytes) -> bytes:
    """RoCEv2 invariant CRC of a packet whose UDP payload is `roce` (BTH .. payload, no ICRC).

    The IPv4 header is the one the kernel builds for our probes: no options, DF, id 0, UDP.
    """
    total = IPV4_LEN + UDP_LEN + len(roce) + ICRC_LEN
    masked_ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0xFF, total, 0, 0x4000, 0xFF, 17, 0xFFFF, _ip4(src), _ip4(dst))
    masked_udp = struct.pack("!HHHH", sport, dport, UDP_LEN + len(roce) + ICRC_LEN, 0xFFFF)
    masked_bth = roce[:4] + b"\xff" + roce[5:BTH_LEN]  # FECN, BECN and resv6 are masked to ones
    crc = zlib.crc32(b"\xff" * 8)
    crc = zlib.crc32(masked_ip, crc)
    crc = zlib.crc32(masked_udp, crc)
    crc = zlib.crc32(masked_bth, crc)
    crc = zlib.crc32(memoryview(roce)[BTH_LEN:], crc)
    return struct.pack("<I", crc)


def _check_header(magic: bytes, version: int, kind: int, kinds: tuple[int, ...]) -> None:
    """What every LinkPass record starts with: the magic, this version, a kind it may have."""
    if magic != MAGIC:
        raise WireError("bad_magic")
    if version != VERSION:
        raise WireError("bad_version", f"version {version}, this agent speaks {VERSION}")
    if kind not in kinds:
        raise WireError("bad_kind", str(kind))


def _check_key(key, what: str) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or not FLEET_KEY_MIN <= len(key) <= FLEET_KEY_MAX:
        raise ValueError(f"{what} must be {FLEET_KEY_MIN}..{FLEET_KEY_MAX} bytes (BLAKE2b key); generate one with "
                         "`python -c 'import secrets; print(secrets.token_hex(32))'`")
    return bytes(key)


class Codec:
    """Encoder/decoder bound to a fleet key: it signs with `key` and accepts what `key` or, during
    a key rotation, `accept_key` signed (docs/security.md, rotating the fleet key). Its one piece
    of mutable state is the count of packets the other key authenticated (`other_key_ok`)."""

    def __init__(self, key: bytes, accept_key: bytes | None = None):
        self._key = _check_key(key, "fleet key")
        self._other = _check_key(accept_key, "the other fleet key") if accept_key else None
        self.other_key_ok = 0

    def _tag(self, data: bytes | memoryview, key: bytes | None = None) -> bytes:
        return hashlib.blake2b(data, key=key or self._key, digest_size=TAG_LEN).digest()

    def _signed(self, data: bytes | memoryview, tag: bytes | memoryview) -> bool:
        """Whether `tag` is `data`'s under the fleet key or the other key accepted."""
        if hmac.compare_digest(self._tag(data), bytes(tag)):
            return True
        if self._other is not None and hmac.compare_digest(self._tag(data, self._other), bytes(tag)):
            self.other_key_ok += 1
            return True
        return False

    def encode(self, p: Probe, src: str | bytes, dst: str | bytes, sport: int, dport: int = ROCE_PORT) -> bytes:
        """UDP payload (BTH .. ICRC) of probe `p` sent from src:sport to dst:dport."""
        if not 0 <= p.pad <= MAX_PAD:
            raise ValueError(f"pad: {p.pad} bytes is outside 0..{MAX_PAD} (decoders drop such a probe as bad_length)")
        bth = _BTH.pack(BTH_OPCODE_RC_SEND_ONLY, 0, PKEY_DEFAULT, LINKPASS_QPN, p.seq & 0xFFFFFF)
        body = _HDR.pack(MAGIC, VERSION, p.kind, p.flags, 0, p.pad, p.sender, p.reflector, p.path, p.rx_count,
                         p.seq, p.t1, p.t2, p.t3, p.t4) + bytes(p.pad)
        roce = bth + body + self._tag(body)
        return roce + icrc(src, dst, sport, dport, roce)

    def decode(self, data: bytes, src: str | bytes, dst: str | bytes, sport: int, dport: int = ROCE_PORT) -> Probe:
        """Parse and verify a UDP payload; raise WireError(reason) for anything we do not accept."""
        n = len(data)
        if n < MIN_PAYLOAD:
            raise WireError("short", f"{n} bytes, a probe has at least {MIN_PAYLOAD}")
        opcode, _, _, fecn_qpn, _ = _BTH.unpack_from(data)
        if opcode != BTH_OPCODE_RC_SEND_ONLY or fecn_qpn & 0xFFFFFF != LINKPASS_QPN:
            raise WireError("not_roce", "BTH is not a LinkPass probe")
        (magic, version, kind, flags, _res, pad, sender, reflector, path, rx_count,
         seq, t1, t2, t3, t4) = _HDR.unpack_from(data, BTH_LEN)
        _check_header(magic, version, kind, (KIND_REQUEST, KIND_REPLY))
        if pad > MAX_PAD:  # bounded before the length is trusted: a reply is as long as its request
            raise WireError("bad_length", f"padding {pad} > {MAX_PAD}")
        if n != MIN_PAYLOAD + pad:
            raise WireError("bad_length", f"{n} bytes for padding {pad}")
        roce = memoryview(data)[: n - ICRC_LEN]
        if icrc(src, dst, sport, dport, bytes(roce)) != data[n - ICRC_LEN:]:
            raise WireError("bad_icrc")
        body_end = n - ICRC_LEN - TAG_LEN
        if not self._signed(roce[BTH_LEN:body_end], data[body_end: n - ICRC_LEN]):
            raise WireError("bad_tag", "not signed with this fleet's key")
        return Probe(kind, sender, reflector, path, seq, t1, t2, t3, t4, rx_count, flags, pad)


    # ---- UD probes (RDMA hosts) ---------------------------------------------------------------
    def encode_ud(self, p: Probe, sport: int) -> bytes:
        """The UD record of probe `p` sent with UDP source port `sport` (ud_packet() frames it)."""
        if not 0 <= p.pad <= MAX_PAD or p.pad % 4:
            raise ValueError(f"pad: {p.pad} bytes; a UD probe's padding is 0..{MAX_PAD}, a multiple of 4")
        body = _UD_PREFIX.pack(sport, 0) + _HDR.pack(MAGIC, VERSION, p.kind, p.flags, 0, p.pad, p.sender,
                                                     p.reflector, p.path, p.rx_count, p.seq, p.t1, p.t2, p.t3,
                                                     p.t4) + bytes(p.pad)
        return body + self._tag(body)

    def decode_ud(self, data: bytes | memoryview) -> tuple[Probe, int]:
        """(probe, the source port it was sent with) from a UD record a probe QP received; raises
        WireError(reason) for anything not accepted (the device already checked the ICRC)."""
        n = len(data)
        if n < UD_RECORD_MIN:
            raise WireError("short", f"{n} bytes, a UD probe has at least {UD_RECORD_MIN}")
        sport, _ = _UD_PREFIX.unpack_from(data)
        (magic, version, kind, flags, _res, pad, sender, reflector, path, rx_count,
         seq, t1, t2, t3, t4) = _HDR.unpack_from(data, _UD_PREFIX.size)
        _check_header(magic, version, kind, (KIND_REQUEST, KIND_REPLY))
        if pad > MAX_PAD or n != UD_RECORD_MIN + pad:
            raise WireError("bad_length", f"{n} bytes for padding {pad}")
        body = memoryview(data)[: n - TAG_LEN]
        if not self._signed(body, data[n - TAG_LEN:]):
            raise WireError("bad_tag", "not signed with this fleet's key")
        return Probe(kind, sender, reflector, path, seq, t1, t2, t3, t4, rx_count, flags, pad), sport

    def encode_hello(self, kind: int, agent_id: int, qpn: int, nonce: int) -> bytes:
        """An ask (qpn 0: "which QP do you probe with?") or an answer naming the probe QP; the
        answer repeats the ask's nonce, so a recorded answer cannot be replayed to a new ask."""
        body = _HELLO.pack(MAGIC, VERSION, kind, agent_id, qpn, nonce)
        return body + self._tag(body)

    def decode_hello(self, data: bytes) -> tuple[int, int, int, int]:
        """(kind, agent id, qpn, nonce) of a hello; WireError for anything else."""
        if len(data) != HELLO_LEN:
            raise WireError("bad_length", f"hello of {len(data)} bytes, expected {HELLO_LEN}")
        magic, version, kind, agent_id, qpn, nonce = _HELLO.unpack_from(data)
        _check_header(magic, version, kind, (HELLO_ASK, HELLO_ANSWER))
        if not self._signed(data[:_HELLO.size], data[_HELLO.size:]):
            raise WireError("bad_tag", "not signed with this fleet's key")
        return kind, agent_id, qpn, nonce


class ReplayWindow:
    """Anti-replay window over sequence numbers (as IPsec's): accept each seq once, and none
    older than `size` behind the highest seen."""

    __slots__ = ("size", "top", "bits")

    def __init__(self, size: int = 4096):
        if size < 1:
            raise ValueError("size must be >= 1")
        self.size = size
        self.top = -1
        self.bits = 0  # bit i set: seq (top - i) seen

    def accept(self, seq: int) -> bool:
        if seq > self.top:
            shift = seq - self.top
            self.bits = ((self.bits << shift) | 1) & ((1 << self.size) - 1) if shift < self.size else 1
            self.top = seq
            return True
        back = self.top - seq
        if back >= self.size:
            return False
        mask = 1 << back
        if self.bits & mask:
            return False
        self.bits |= mask
        return True
