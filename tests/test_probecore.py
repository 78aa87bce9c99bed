"""The compiled probe core speaks exactly the wire format of linkpass.core.wire."""
from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings, strategies as st

from linkpass.probe import _probecore
from linkpass.core import wire as W

pytestmark = pytest.mark.unit

KEY = bytes(range(32))
core = _probecore.Core(KEY, 7)
codec = W.Codec(KEY)
u32 = st.integers(0, 2**32 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
addr4 = st.binary(min_size=4, max_size=4)
probes = st.builds(W.Probe, kind=st.sampled_from([W.KIND_REQUEST, W.KIND_REPLY]), sender=u32, reflector=u32,
                   path=u32, seq=st.integers(0, 2**64 - 1), t1=i64, t2=i64, t3=i64, t4=i64, rx_count=u32,
                   flags=st.integers(0, 255), pad=st.integers(0, 700))


def c_encode(p: W.Probe, src, dst, sport, dport=4791, c=core):
    return c.encode(p.kind, p.flags, p.pad, p.sender, p.reflector, p.path, p.seq, p.t1, p.t2, p.t3, p.t4,
                    p.rx_count, src, dst, sport, dport)


def c_decode(data, src, dst, sport, dport=4791):
    out = core.decode(data, src, dst, sport, dport)
    return out if isinstance(out, str) else W.Probe(*out)


@settings(max_examples=300, deadline=None)
@given(p=probes, src=addr4, dst=addr4, sport=st.integers(1, 65535))
def test_c_encoder_is_byte_identical_to_python(p, src, dst, sport):
    assert c_encode(p, src, dst, sport) == codec.encode(p, src, dst, sport)


@settings(max_examples=200, deadline=None)
@given(p=probes, src=addr4, dst=addr4, sport=st.integers(1, 65535))
def test_c_decoder_accepts_python_encoding(p, src, dst, sport):
    assert c_decode(codec.encode(p, src, dst, sport), src, dst, sport) == p


@pytest.mark.parametrize("pad", [0, 28, 29, 156, 157, 700])  # body crossing BLAKE2b block boundaries
def test_blake2b_block_boundaries(pad):
    p = W.Probe(W.KIND_REQUEST, 1, 2, 3, 4, pad=pad)
    data = c_encode(p, b"\xc6\x12\x40\x01", b"\xc6\x12\x40\x07", 5)
    body = data[W.BTH_LEN:-W.ICRC_LEN - W.TAG_LEN]
    assert data[-W.ICRC_LEN - W.TAG_LEN:-W.ICRC_LEN] == hashlib.blake2b(body, key=KEY, digest_size=16).digest()


@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=300))
def test_c_decoder_rejects_garbage_with_the_python_reason(data):
    src, dst = b"\xc6\x12\x40\x01", b"\xc6\x12\x40\x07"
    ours = c_decode(data, src, dst, 50000)
    try:
        expected = codec.decode(data, src, dst, 50000)
    except W.WireError as err:
        expected = err.reason
    assert ours == expected


@settings(max_examples=300, deadline=None)
@given(p=probes, flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=3),
       cut=st.integers(0, 2000))
def test_c_decoder_agrees_on_mutated_probes(p, flips, cut):
    src, dst = b"\xc6\x12\x40\x01", b"\xc6\x12\x40\x07"
    data = bytearray(codec.encode(p, src, dst, 7))
    for i, x in flips:
        data[i % len(data)] ^= x
    data = bytes(data[:cut])
    try:
        expected = codec.decode(data, src, dst, 7)
    except W.WireError as err:
        expected = err.reason
    assert c_decode(data, src, dst, 7) == expected


@settings(max_examples=200, deadline=None)
@given(seqs=st.lists(st.integers(0, 20_000), max_size=300))
def test_c_replay_window_matches_python(seqs):
    w = W.ReplayWindow(4096)
    assert core.replay_test(seqs) == [w.accept(s) for s in seqs]


def test_constructor_validates():
    with pytest.raises(ValueError, match="fleet key"):
        _probecore.Core(b"short", 1)
    with pytest.raises(ValueError, match="agent_id"):
        _probecore.Core(KEY, 0)
