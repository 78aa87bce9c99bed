"""The verbs engine's judging and reflecting (linkpass/probe/verbs_engine.py), without a device:
what it sends is captured from a stand-in NIC (its raw socket and QP number), what it receives is
handed to the same methods a completion reaches. The device part (UD QP, CQ, hellos on the wire)
runs in the Soft-RoCE guests: tests/root/test_rdma_guests.py."""
from __future__ import annotations

import os
import socket
import struct
from types import SimpleNamespace

import pytest

from linkpass.core import wire
from linkpass.core.probe_event import EV_ANSWERED, EV_LATE, EV_MISS
from linkpass.probe import verbs_engine as V
from linkpass.probe.common import PathSpec


KEY = bytes(range(32))
ME, PEER = 1, 2
MY_ADDR, PEER_ADDR = "198.18.64.1", "198.18.64.7"
MY_QPN, PEER_QPN = 0x11, 0x22


class Tx:
    """The stand-in raw socket: keeps every packet sent."""

    def __init__(self):
        self.sent: list[tuple[bytes, str]] = []

    def sendto(self, pkt: bytes, addr) -> int:
        self.sent.append((pkt, addr[0]))
        return len(pkt)


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.setattr(V, "load_pyverbs", lambda: None)
    eng = V.VerbsProbeEngine(ME, KEY)
    nic = SimpleNamespace(name="p0", addr=MY_ADDR, addr_b=socket.inet_aton(MY_ADDR), qp=SimpleNamespace(qp_num=MY_QPN),
                          tx=Tx(), mtu=1024)
    eng.nics["p0"] = nic
    eng.add_path(PathSpec(1, "p0", PEER, PEER_ADDR, 49152, interval_s=0.05))
    eng.peers[PEER_ADDR].qpn = PEER_QPN
    eng.set_rto(1, 100_000_000)
    yield eng
    for fd in (eng._wake_r, eng._wake_w, eng._kick_r, eng._kick_w):
        os.close(fd)


def _sent_record(pkt: bytes):
    """(IPv4 src, dst, UDP sport, BTH dest QP, DETH source QP, decoded probe, its port) of a sent packet."""
    ihl = (pkt[0] & 0xF) * 4
    src, dst = socket.inet_ntoa(pkt[12:16]), socket.inet_ntoa(pkt[16:20])
    sport, dport = struct.unpack_from("!HH", pkt, ihl)
    roce = pkt[ihl + 8:]
    assert dport == wire.ROCE_PORT and roce[0] == wire.BTH_OPCODE_UD_SEND_ONLY
    assert roce[-4:] == wire.icrc(src, dst, sport, dport, roce[:-4])
    dqpn = int.from_bytes(roce[5:8], "big")
    qkey, sqpn = struct.unpack_from("!II", roce, 12)
    assert qkey == wire.LINKPASS_QKEY
    probe, rec_port = wire.Codec(KEY).decode_ud(roce[20:-4])
    return src, dst, sport, dqpn, sqpn & 0xFFFFFF, probe, rec_port


def test_a_request_is_a_ud_send_to_the_peer_qp_with_the_paths_port(engine):
    engine._send_request(engine.paths[1])
    (pkt, to), = engine.nics["p0"].tx.sent
    src, dst, sport, dqpn, sqpn, probe, rec_port = _sent_record(pkt)
    assert (to, src, dst, sport, rec_port) == (PEER_ADDR, MY_ADDR, PEER_ADDR, 49152, 49152)
    assert (dqpn, sqpn) == (PEER_QPN, MY_QPN)
    assert probe.kind == wire.KIND_REQUEST and (probe.sender, probe.reflector, probe.path) == (ME, PEER, 1)


def test_no_request_goes_out_before_the_peer_qp_is_known(engine):
    engine.peers[PEER_ADDR].qpn = 0
    engine._send_request(engine.paths[1])
    assert not engine.nics["p0"].tx.sent and engine.drops["no_peer_qp"] == 1
    assert engine.paths[1].sent == 0  # nothing sent, nothing to judge


def _reply_to(pkt: bytes, t2: int, rx_count: int = 1) -> wire.Probe:
    return _sent_record(pkt)[5].reply(t2=t2, t3=t2 + 1000, rx_count=rx_count)


def test_on_time_replies_fold_into_one_answered_event_a_silent_request_is_a_miss_and_its_reply_late(engine):
    path = engine.paths[1]
    for _ in range(3):
        engine._send_request(path)
    pkts = [p for p, _ in engine.nics["p0"].tx.sent]
    t1s = [_sent_record(p)[5].t1 for p in pkts]
    engine._complete(_reply_to(pkts[0], t1s[0] + 10_000), socket.inet_aton(PEER_ADDR), t1s[0] + 50_000)
    engine._complete(_reply_to(pkts[1], t1s[1] + 10_000, 2), socket.inet_aton(PEER_ADDR), t1s[1] + 60_000)
    # the third has no reply by its deadline: judged at an evidence time past it
    engine._expire(t1s[2] + 100_000_001)
    events, _ = engine.poll()
    assert [e.kind for e in events] == [EV_ANSWERED, EV_MISS], events
    assert events[0].count == 2 and events[0].seq == _sent_record(pkts[1])[5].seq and events[0].rx_count == 2
    assert events[1].seq == _sent_record(pkts[2])[5].seq and events[1].t4 == t1s[2] + 100_000_000
    # its reply after all: LATE, and the engine wakes the agent for it
    engine._complete(_reply_to(pkts[2], t1s[2] + 10_000, 3), socket.inet_aton(PEER_ADDR), t1s[2] + 200_000_000)
    assert engine.wait(0)
    events, _ = engine.poll()
    assert [e.kind for e in events] == [EV_LATE]
    assert engine.telemetry(1).sent == 3


def test_a_reply_read_after_its_deadline_is_a_miss_then_late_and_a_replayed_or_foreign_one_is_dropped(engine):
    path = engine.paths[1]
    engine._send_request(path)
    pkt = engine.nics["p0"].tx.sent[0][0]
    t1 = _sent_record(pkt)[5].t1
    rep = _reply_to(pkt, t1 + 10)
    engine._complete(rep, socket.inet_aton(PEER_ADDR), t1 + 150_000_000)  # deadline t1 + 100 ms
    engine._complete(rep, socket.inet_aton(PEER_ADDR), t1 + 150_000_001)  # the same reply again
    engine._complete(rep, socket.inet_aton("198.18.64.9"), t1 + 1)  # from an address not the path's peer
    events, _ = engine.poll()
    assert [e.kind for e in events] == [EV_MISS, EV_LATE], events
    assert engine.drops["replay"] == 1 and engine.drops["unexpected"] == 1


def test_more_requests_in_flight_than_slots_judge_the_oldest_missed(engine):
    path = engine.paths[1]
    for _ in range(V.OUT_SLOTS + 2):
        engine._send_request(path)
    events, _ = engine.poll()
    assert [e.kind for e in events] == [EV_MISS, EV_MISS] and len(path.out) == V.OUT_SLOTS


def test_the_reflector_answers_with_the_requests_port_to_its_qp_once_per_sequence(engine):
    req = wire.Probe(wire.KIND_REQUEST, PEER, ME, 7, 1000, t1=5)
    nic = engine.nics["p0"]
    engine._reflect(nic, req, socket.inet_aton(PEER_ADDR), 50123, 0x33, 777)
    engine._reflect(nic, req, socket.inet_aton(PEER_ADDR), 50123, 0x33, 778)  # replayed
    engine._reflect(nic, wire.Probe(wire.KIND_REQUEST, PEER, 99, 7, 1001), socket.inet_aton(PEER_ADDR), 50123, 0x33, 1)
    (pkt, to), = nic.tx.sent
    src, dst, sport, dqpn, sqpn, reply, rec_port = _sent_record(pkt)
    assert (to, dst, sport, rec_port, dqpn, sqpn) == (PEER_ADDR, PEER_ADDR, 50123, 50123, 0x33, MY_QPN)
    assert reply.kind == wire.KIND_REPLY and reply.t2 == 777 and reply.rx_count == 1 and reply.seq == 1000
    assert engine.drops["replay"] == 1 and engine.drops["unexpected"] == 1
    with pytest.raises(wire.WireError, match="bad_tag"):  # signed with the fleet key, no other
        wire.Codec(bytes(32)).decode_ud(pkt[20 + 8 + 20:-4])


def test_size_probes_are_capped_at_the_largest_ud_message_the_device_takes(engine):
    engine.set_size_probe(1, 1, 1500)
    engine._send_request(engine.paths[1])
    pkt = engine.nics["p0"].tx.sent[0][0]
    assert len(pkt) <= wire.IPV4_LEN + wire.UDP_LEN + wire.BTH_LEN + wire.DETH_LEN + 1024 + wire.ICRC_LEN
    assert _sent_record(pkt)[5].flags & wire.FLAG_MTU_PROBE


def test_a_removed_paths_pending_events_are_dropped_with_it(engine):
    path = engine.paths[1]
    engine._send_request(path)
    engine._expire(time_ns_after(path))
    engine.remove_path(1)
    events, _ = engine.poll()
    assert events == [] and 1 not in engine.paths


def time_ns_after(path) -> int:
    """An evidence time past every deadline of the path's requests in flight."""
    return max(deadline for _, deadline, _ in path.out.values()) + 1


class HelloSock:
    """The stand-in hello socket: datagrams to read (then EAGAIN), answers kept."""

    def __init__(self, incoming):
        self.incoming, self.sent = list(incoming), []

    def recvfrom(self, n):
        if not self.incoming:
            raise BlockingIOError
        return self.incoming.pop(0)

    def sendto(self, data, addr):
        self.sent.append((data, addr[0]))


def test_a_replayed_ask_from_one_address_does_not_starve_the_peers_discovery(engine):
    """One signed ASK, seen and replayed a thousand times a second from another address: that
    address gets a few answers, and a peer's own ASK in the same second is still answered."""
    codec = wire.Codec(KEY)
    replayed = codec.encode_hello(wire.HELLO_ASK, 9, 0, 0x5EED)
    flood = [(replayed, ("198.18.64.99", wire.HELLO_PORT))] * 1000
    mine = codec.encode_hello(wire.HELLO_ASK, PEER, 0, 0xABC)
    nic = engine.nics["p0"]
    nic.hello = HelloSock(flood + [(mine, (PEER_ADDR, wire.HELLO_PORT))])
    while nic.hello.incoming:
        engine._hellos(nic)
    to = [dst for _, dst in nic.hello.sent]
    assert to.count("198.18.64.99") == V.HELLO_ANSWERS_PER_SOURCE_PER_S
    assert to.count(PEER_ADDR) == 1
    kind, agent_id, qpn, nonce = codec.decode_hello(nic.hello.sent[-1][0])
    assert (kind, agent_id, qpn, nonce) == (wire.HELLO_ANSWER, ME, MY_QPN, 0xABC)
    assert engine.drop_counts["hello_over_budget"] == 1000 - V.HELLO_ANSWERS_PER_SOURCE_PER_S
