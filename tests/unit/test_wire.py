"""Wire format: byte-exact agreement with scapy's RoCE layer, authentication, replay, fuzzing."""
from __future__ import annotations

import ipaddress

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP
from scapy.packet import Raw

from linkpass.core import wire as W

from support.probes import signed_probe


KEY = bytes(range(32))
codec = W.Codec(KEY)

u32 = st.integers(0, 2**32 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
addr = st.integers(int(ipaddress.IPv4Address("198.18.0.0")), int(ipaddress.IPv4Address("198.19.255.255"))).map(
    lambda n: str(ipaddress.IPv4Address(n)))
probes = st.builds(W.Probe, kind=st.sampled_from([W.KIND_REQUEST, W.KIND_REPLY]), sender=u32, reflector=u32,
                   path=u32, seq=st.integers(0, 2**64 - 1), t1=i64, t2=i64, t3=i64, t4=i64, rx_count=u32,
                   flags=st.integers(0, 255), pad=st.integers(0, 600))
ports = st.integers(1, 65535)


def scapy_packet(p: W.Probe, src, dst, sport, dport=W.ROCE_PORT, ttl=64, tos=0, fecn=0, becn=0):
    """What scapy's RoCE layer builds for the same probe (BTH + our body + tag; scapy adds the ICRC)."""
    body_and_tag = codec.encode(p, src, dst, sport, dport)[W.BTH_LEN:-W.ICRC_LEN]
    return (IP(src=src, dst=dst, id=0, flags="DF", ttl=ttl, tos=tos)
            / UDP(sport=sport, dport=dport, chksum=0)
            / BTH(opcode=W.BTH_OPCODE_RC_SEND_ONLY, pkey=0xFFFF, dqpn=W.LINKPASS_QPN, psn=p.seq & 0xFFFFFF,
                  fecn=fecn, becn=becn)
            / Raw(body_and_tag))


@settings(max_examples=150, deadline=None)
@given(p=probes, src=addr, dst=addr, sport=ports)
def test_encoder_produces_exactly_what_scapy_builds(p, src, dst, sport):
    ours = codec.encode(p, src, dst, sport)
    theirs = bytes(scapy_packet(p, src, dst, sport)[UDP].payload)
    assert ours == theirs


@settings(max_examples=150, deadline=None)
@given(p=probes, src=addr, dst=addr, sport=ports, ttl=st.integers(1, 255), tos=st.integers(0, 255),
       fecn=st.integers(0, 1), becn=st.integers(0, 1))
def test_decoder_accepts_what_scapy_builds_whatever_the_masked_fields(p, src, dst, sport, ttl, tos, fecn, becn):
    pkt = IP(bytes(scapy_packet(p, src, dst, sport, ttl=ttl, tos=tos, fecn=fecn, becn=becn)))
    assert pkt[BTH].icrc is not None
    assert codec.decode(bytes(pkt[UDP].payload), src, dst, sport) == p


def test_icrc_matches_scapy_on_a_known_packet():
    p = W.Probe(W.KIND_REQUEST, 1, 2, 3, 0x123456789, t1=10**18)
    pkt = IP(bytes(scapy_packet(p, "198.18.64.1", "198.18.64.7", 50000)))
    assert W.icrc("198.18.64.1", "198.18.64.7", 50000, 4791, bytes(pkt[UDP].payload)[:-4]) == bytes(pkt[UDP].payload)[-4:]
    assert pkt[BTH].psn == 0x456789 and pkt[UDP].dport == 4791


@settings(max_examples=100, deadline=None)
@given(p=probes, src=addr, dst=addr, sport=ports)
def test_round_trip(p, src, dst, sport):
    assert codec.decode(codec.encode(p, src, dst, sport), src, dst, sport) == p


def test_reply_keeps_identity_and_adds_reflector_times():
    req = W.Probe(W.KIND_REQUEST, 7, 9, 3, 42, t1=1000)
    rep = req.reply(t2=2000, t3=2500, rx_count=41)
    assert (rep.kind, rep.sender, rep.reflector, rep.path, rep.seq, rep.t1, rep.t2, rep.t3, rep.rx_count) == (
        W.KIND_REPLY, 7, 9, 3, 42, 1000, 2000, 2500, 41)


def test_mtu_probe_padding_sets_ip_size():
    pad = W.pad_for_ip_size(1500)
    data = codec.encode(W.Probe(W.KIND_REQUEST, 1, 2, 3, 4, flags=W.FLAG_MTU_PROBE, pad=pad), "198.18.0.1", "198.18.0.2", 1)
    assert W.IPV4_LEN + W.UDP_LEN + len(data) == 1500
    with pytest.raises(ValueError):
        W.pad_for_ip_size(100)


# ---- what the network may throw at us ---------------------------------------------------

GOOD = codec.encode(W.Probe(W.KIND_REQUEST, 1, 2, 3, 99, t1=5), "198.18.64.1", "198.18.64.7", 50000)


def reason(data, src="198.18.64.1", dst="198.18.64.7", sport=50000, c=codec):
    with pytest.raises(W.WireError) as err:
        c.decode(data, src, dst, sport)
    assert err.value.reason in W.DROP_REASONS
    return err.value.reason


def test_truncated_packets_are_rejected_at_every_length():
    for n in range(len(GOOD)):
        assert reason(GOOD[:n]) in ("short", "bad_length")


def test_spoofed_packet_without_the_fleet_key_is_rejected():
    other = W.Codec(b"k" * 32)
    forged = other.encode(W.Probe(W.KIND_REPLY, 1, 2, 3, 99), "198.18.64.1", "198.18.64.7", 50000)
    assert reason(forged) == "bad_tag"


def test_modified_payload_with_recomputed_icrc_is_caught_by_the_tag():
    body = bytearray(GOOD[:-4])
    body[W.BTH_LEN + 40] ^= 0x01  # flip a timestamp bit
    forged = bytes(body) + W.icrc("198.18.64.1", "198.18.64.7", 50000, 4791, bytes(body))
    assert reason(forged) == "bad_tag"


def test_bit_flips_on_the_wire_are_caught_by_the_icrc():
    for i in range(W.BTH_LEN + 8, len(GOOD) - 4, 7):
        flipped = bytearray(GOOD)
        flipped[i] ^= 0x80
        assert reason(bytes(flipped)) in ("bad_icrc", "bad_length", "bad_kind")


@pytest.mark.parametrize("pad", [W.MAX_PAD + 1, W.MAX_PAD + 28, 60_000])
def test_padding_beyond_max_pad_is_rejected_even_when_signed(pad):
    """A reply is as long as its request and must fit a send slot of MAX_PAD padding: a longer
    probe is dropped before its tag is checked, even when a peer with the key signed it."""
    src, dst = "198.18.64.1", "198.18.64.7"
    data = signed_probe(KEY, W.Probe(W.KIND_REQUEST, 1, 2, 3, 4, pad=pad), W._ip4(src), W._ip4(dst), 50000)
    assert reason(data) == "bad_length"
    with pytest.raises(ValueError, match="pad: .* outside 0..9000"):
        codec.encode(W.Probe(W.KIND_REQUEST, 1, 2, 3, 4, pad=pad), src, dst, 50000)


def test_wrong_addresses_or_ports_fail_the_icrc():
    assert reason(GOOD, src="198.18.64.3") == "bad_icrc"
    assert reason(GOOD, sport=50001) == "bad_icrc"


def test_other_roce_traffic_and_versions_are_told_apart():
    not_ours = bytearray(GOOD)
    not_ours[7] ^= 0x01  # destination QP
    assert reason(bytes(not_ours)) == "not_roce"
    future = bytearray(GOOD)
    future[W.BTH_LEN + 2] = 9
    assert reason(bytes(future)) == "bad_version"


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(min_size=0, max_size=300))
def test_fuzz_random_bytes_never_crash_the_decoder(data):
    try:
        codec.decode(data, "198.18.64.1", "198.18.64.7", 50000)
    except W.WireError as err:
        assert err.reason in W.DROP_REASONS
    else:  # only a correctly signed probe may be accepted
        assume(False)


@settings(max_examples=300, deadline=None)
@given(cut=st.integers(0, len(GOOD)), flips=st.lists(st.tuples(st.integers(0, len(GOOD) - 1), st.integers(1, 255)), max_size=4))
def test_fuzz_mutated_probes_never_crash_and_never_pass_changed(cut, flips):
    data = bytearray(GOOD)
    for i, x in flips:
        data[i] ^= x
    data = bytes(data[:cut] if cut < len(GOOD) else data)
    try:
        p = codec.decode(data, "198.18.64.1", "198.18.64.7", 50000)
    except W.WireError as err:
        assert err.reason in W.DROP_REASONS
    else:
        # only BTH fields outside our identity (FECN/BECN, which switches may set) can change
        assert p == codec.decode(GOOD, "198.18.64.1", "198.18.64.7", 50000)


def test_fleet_key_is_validated():
    for key in (b"short", bytes(16), bytes(31), bytes(65)):
        with pytest.raises(ValueError, match="fleet key must be 32..64 bytes"):
            W.Codec(key)
    assert W.Codec(bytes(32)) and W.Codec(bytes(64))


def test_replay_window_accepts_each_sequence_once():
    w = W.ReplayWindow(64)
    assert all(w.accept(s) for s in (5, 3, 4, 100, 99))
    assert not w.accept(5)  # seen, and now 95 behind the top: outside the window anyway
    assert not w.accept(100) and not w.accept(99)
    assert not w.accept(36)  # 64 behind the top
    assert w.accept(37) and not w.accept(37)
    assert w.accept(10_000) and not w.accept(100)


@settings(max_examples=200, deadline=None)
@given(seqs=st.lists(st.integers(0, 5000), max_size=200), size=st.integers(1, 256))
def test_replay_window_property(seqs, size):
    w = W.ReplayWindow(size)
    seen, top = set(), -1
    for s in seqs:
        expected = s not in seen and (s > top or top - s < size)
        assert w.accept(s) == expected
        if expected:
            seen.add(s)
            top = max(top, s)


# ---- UD probes (RDMA hosts) ----------------------------------------------------------------

@given(probes.filter(lambda p: p.pad % 4 == 0), ports)
def test_a_ud_record_round_trips_with_the_port_it_was_sent_with(p, sport):
    record = codec.encode_ud(p, sport)
    assert len(record) == W.UD_RECORD_MIN + p.pad and len(record) % 4 == 0
    assert codec.decode_ud(record) == (p, sport)


def test_a_ud_record_is_refused_when_anything_under_its_tag_changes():
    record = bytearray(codec.encode_ud(W.Probe(W.KIND_REQUEST, 1, 2, 3, 4, t1=5), 49152))
    for at in (0, 1, 10, W.UD_RECORD_MIN - W.TAG_LEN - 1):  # the port, the header, the last covered byte
        bad = bytearray(record)
        bad[at] ^= 1
        with pytest.raises(W.WireError) as err:
            codec.decode_ud(bytes(bad))
        assert err.value.reason in ("bad_tag", "bad_magic", "bad_version", "bad_kind", "bad_length")
    with pytest.raises(W.WireError, match="short"):
        codec.decode_ud(bytes(record[:W.UD_RECORD_MIN - 1]))
    with pytest.raises(W.WireError, match="bad_length"):
        codec.decode_ud(bytes(record) + b"\0\0\0\0")
    with pytest.raises(W.WireError, match="bad_tag"):
        W.Codec(bytes(32)).decode_ud(bytes(record))


def test_a_ud_packet_is_a_roce_ud_send_to_the_peer_qp_with_a_valid_icrc():
    record = codec.encode_ud(W.Probe(W.KIND_REQUEST, 1, 2, 3, 4), 50000)
    pkt = W.ud_packet(record, "198.18.64.1", "198.18.64.7", 50000, dest_qpn=0x123456, src_qpn=0x11, psn=7)
    assert pkt[0] == W.BTH_OPCODE_UD_SEND_ONLY and pkt[5:8] == bytes.fromhex("123456")
    assert pkt[12:16] == W.LINKPASS_QKEY.to_bytes(4, "big") and pkt[17:20] == bytes.fromhex("000011")
    assert pkt[20:-4] == record
    assert pkt[-4:] == W.icrc("198.18.64.1", "198.18.64.7", 50000, W.ROCE_PORT, pkt[:-4])
    with pytest.raises(ValueError, match="multiple of 4"):
        W.ud_packet(record + b"x", "198.18.64.1", "198.18.64.7", 50000, 1, 1)


def test_ud_padding_fills_an_ip_packet_to_at_most_the_size_asked():
    for size in (136, 1076, 1500, 1501):
        pad = W.ud_pad_for_ip_size(size)
        total = W.IPV4_LEN + W.UDP_LEN + W.UD_MIN_PAYLOAD + pad
        assert pad % 4 == 0 and size - 4 < total <= size
    with pytest.raises(ValueError):
        W.ud_pad_for_ip_size(100)


def test_a_hello_round_trips_and_a_forged_or_altered_one_is_refused():
    ask = codec.encode_hello(W.HELLO_ASK, 7, 0, 2**64 - 1)
    assert codec.decode_hello(ask) == (W.HELLO_ASK, 7, 0, 2**64 - 1)
    answer = codec.encode_hello(W.HELLO_ANSWER, 8, 0x1234, 99)
    assert codec.decode_hello(answer) == (W.HELLO_ANSWER, 8, 0x1234, 99)
    for bad, reason in ((answer[:-1], "bad_length"), (W.Codec(bytes(32)).encode_hello(W.HELLO_ANSWER, 8, 1, 99), "bad_tag"),
                        (answer[:8] + bytes([answer[8] ^ 1]) + answer[9:], "bad_tag")):
        with pytest.raises(W.WireError) as err:
            codec.decode_hello(bad)
        assert err.value.reason == reason
