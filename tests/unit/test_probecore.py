"""The compiled probe core speaks exactly the wire format of linkpass.core.wire, and its receive
path (probe_rx.h) is cheap and bounded under hostile input: sizes nobody expects and sources over
their budget are dropped before hashing, the reflector's entries expire, its windows hold at the
end of the sequence space, and a failed constructor leaves the process's descriptors alone."""
from __future__ import annotations

import gc
import hashlib
import os
from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from linkpass.probe import _probecore
from linkpass.core import wire as W

from support.probes import signed_probe


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
    for key in (b"short", bytes(16), bytes(31), bytes(65)):  # the Python codec's bounds (core/wire.py)
        with pytest.raises(ValueError, match="fleet key must be 32..64 bytes"):
            _probecore.Core(key, 1)
    with pytest.raises(ValueError, match="agent_id"):
        _probecore.Core(KEY, 0)


@pytest.mark.parametrize("pad", [W.MAX_PAD + 1, W.MAX_PAD + 28, 60_000])
def test_c_decoder_bounds_the_padding_before_trusting_the_length(pad):
    """A signed request with more padding than a send slot holds (the reply would be written past
    it) is bad_length in the decoder and in the loop's receive path, never reflected."""
    c = fresh()
    c.declare_pads([W.MAX_PAD])
    data = request(pad=pad)
    assert c_decode(data, PEER, ME, 50000) == "bad_length"
    assert c.receive_test(data, PEER, ME, 50000, T0) == "bad_length"
    assert c.counters()["drops"] == {"bad_length": 1} and c.counters()["reflected"] == 0


def test_c_replay_window_holds_at_the_end_of_the_sequence_space():
    top = 2**64 - 1
    assert core.replay_test([top, top, top - 1, top - 1, top - 4096, top - 4095]) == [
        True, False, True, False, False, True]
    assert core.replay_test([0, top, 0]) == [True, True, False]


@settings(max_examples=200, deadline=None)
@given(seqs=st.lists(st.integers(2**64 - 10_000, 2**64 - 1), max_size=300))
def test_c_replay_window_matches_python_near_the_top(seqs):
    w = W.ReplayWindow(4096)
    assert core.replay_test(seqs) == [w.accept(s) for s in seqs]


def test_a_failed_constructor_closes_no_descriptor_it_did_not_open():
    """Whatever fails in Core(...), the object it leaves closes no descriptor: fd 0 (here a pipe
    put there by the test) is still the same file afterwards."""
    saved = os.dup(0)
    r, w = os.pipe()
    os.dup2(r, 0)
    try:
        before = os.fstat(0)
        for args in [(b"short", 1), (KEY, 0), ("not bytes", 1), (KEY,), (KEY, 1, 2)]:
            with pytest.raises((ValueError, TypeError)):
                _probecore.Core(*args)
        bare = _probecore.Core.__new__(_probecore.Core)  # never initialised
        with pytest.raises(RuntimeError, match="not initialised"):
            bare.counters()
        del bare
        gc.collect()
        after = os.fstat(0)  # EBADF if something closed it
        assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
        with pytest.raises(RuntimeError, match="initialised once"):
            core.__init__(KEY, 9)
    finally:
        os.dup2(saved, 0)
        for fd in (saved, r, w):
            os.close(fd)


# ---- the receive path: what the loop does with each packet -----------------------------------

ME, PEER, OTHER, ATTACKER = b"\xc6\x12\x40\x07", b"\xc6\x12\x40\x01", b"\xc6\x12\x40\x02", b"\xc6\x12\x40\x66"
WRONG_KEY = b"not-the-fleet-key-at-all-32bytes"
T0 = 10**12  # monotonic ns


def fresh() -> _probecore.Core:
    return _probecore.Core(KEY, 7)


def request(sender=3, path=1, seq=1, pad=0, key=KEY, src=PEER, sport=50000) -> bytes:
    """A request to agent 7 (ME) from `src`, signed with `key`, whatever its padding."""
    return signed_probe(key, W.Probe(W.KIND_REQUEST, sender, 7, path, seq, t1=5, flags=1 if pad else 0, pad=pad),
                        src, ME, sport)


def reflected(c, data, src=PEER, now=T0) -> W.Probe:
    out = c.receive_test(data, src, ME, 50000, now)
    assert isinstance(out, bytes), out
    return codec.decode(out[28:], ME, src, 50000)


def test_sizes_nobody_sends_or_expects_are_dropped_before_hashing():
    """A 9 KB packet is checked (~30 us of CRC and BLAKE2b) only if some probe here has its size:
    the small probe, a path's padding or full-size padding, or a size the agent declared. Forged
    or not, any other size is unexpected_size, not bad_tag: it was never hashed."""
    c = fresh()
    forged = request(pad=9000, key=WRONG_KEY)
    assert c.receive_test(forged, PEER, ME, 50000, T0) == "unexpected_size"
    assert c.receive_test(request(pad=9000), PEER, ME, 50000, T0) == "unexpected_size"
    assert reflected(c, request(seq=2)).rx_count == 1  # the small probe always passes
    c.declare_pads([9000])
    assert c.receive_test(forged, PEER, ME, 50000, T0) == "bad_tag"  # now it is worth checking
    assert reflected(c, request(seq=3, pad=9000)).pad == 9000
    c.declare_pads([])
    assert c.receive_test(request(seq=4, pad=9000), PEER, ME, 50000, T0) == "unexpected_size"
    r, w = os.pipe()  # a path's own sizes pass: its replies come back as long as its requests
    try:
        c.add_nic(r, w, ME)
        c.add_path(1, 0, 3, PEER, 50000, 10**6, 100, 0)
        c.set_size_probe(1, 10, 1372)
        assert reflected(c, request(seq=5, pad=100)).pad == 100
        assert reflected(c, request(seq=6, pad=1372)).pad == 1372
        c.remove_path(1)
        assert c.receive_test(request(seq=7, pad=1372), PEER, ME, 50000, T0) == "unexpected_size"
    finally:
        os.close(r)
        os.close(w)
    assert c.counters()["drops"] == {"unexpected_size": 4, "bad_tag": 1}


def test_a_sources_forged_packets_are_checked_only_within_its_budget():
    c = fresh()
    c.declare_pads([9000])
    c.set_budget(10_000, 20_000, 10**9, 10**9)  # per source: 20 kB at once, 10 kB/s
    forged = request(pad=9000, key=WRONG_KEY, src=ATTACKER)
    reasons = [c.receive_test(forged, ATTACKER, ME, 50000, T0) for _ in range(6)]
    assert reasons == ["bad_tag"] * 3 + ["source_over_budget"] * 3  # 3 x 9 KB checked, then no more
    assert reflected(c, request(src=PEER)).rx_count == 1  # another source is not held up
    # the budgeted source's own probes wait too (they cannot be told apart unchecked)
    assert c.receive_test(request(src=ATTACKER, sender=4), ATTACKER, ME, 50000, T0) == "source_over_budget"
    later = T0 + 10**9  # refilled
    assert reflected(c, request(src=ATTACKER, sender=4), src=ATTACKER, now=later).rx_count == 1
    assert c.counters()["drops"] == {"bad_tag": 3, "source_over_budget": 4}


def test_made_up_sources_share_one_budget_and_never_starve_a_trusted_peer():
    """Junk from a thousand made-up addresses costs what one source may: they draw on one shared
    budget (and evict each other's seats); a peer that has authenticated keeps its own."""
    c = fresh()
    c.declare_pads([9000])
    c.set_budget(10**6, 10**6, 50_000, 50_000)  # all untrusted sources together: 50 kB
    assert reflected(c, request(src=PEER, seq=1)).rx_count == 1  # PEER is trusted from now on
    made_up = [bytes([198, 18, 100 + i // 250, i % 250 + 1]) for i in range(1000)]
    reasons = Counter(c.receive_test(request(pad=9000, key=WRONG_KEY, src=a), a, ME, 50000, T0) for a in made_up)
    assert reasons == {"bad_tag": 6, "source_over_budget": 994}  # 50 kB / 9 KB checked, the rest not
    for seq in range(2, 50):
        assert reflected(c, request(src=PEER, seq=seq, pad=9000)).rx_count == seq
    assert c.receive_test(request(src=OTHER, sender=5), OTHER, ME, 50000, T0) == "source_over_budget"
    assert reflected(c, request(src=OTHER, sender=5), src=OTHER, now=T0 + 10**9).rx_count == 1


def test_budget_and_declared_sizes_are_validated():
    c = fresh()
    with pytest.raises(ValueError, match="rates must be"):
        c.set_budget(0, 1, 1, 1)
    with pytest.raises(ValueError, match="padding 9001: must be 0..9000"):
        c.declare_pads([9001])
    with pytest.raises(ValueError, match="at most 16 declared"):
        c.declare_pads(list(range(17)))
    with pytest.raises(ValueError, match="idle timeout"):
        c.set_reflector_idle(0)


def test_reflector_entries_expire_and_their_slots_are_reused():
    """A full table answers no new path until its entries have been idle for the timeout; then
    new paths are answered in the freed slots."""
    c = fresh()
    n = _probecore.REFLECT_MAX
    for path in range(1, n + 1):
        assert isinstance(c.receive_test(request(path=path), PEER, ME, 50000, T0), bytes)
    assert c.counters()["reflector_entries"] == n
    assert c.receive_test(request(path=n + 1), PEER, ME, 50000, T0 + 10**9) == "reflector_table_full"
    later = T0 + 11 * 10**9  # the default idle timeout is 10 s
    for path in range(n + 1, n + 1001):
        assert reflected(c, request(path=path), now=later).rx_count == 1
    counters = c.counters()
    assert counters["reflector_expired"] == n and counters["reflector_entries"] == 1000


def test_paths_churning_far_beyond_the_table_are_all_answered():
    """Plan after plan, a sender's paths come and go (here with ids never reused, the worst case):
    40 000 paths through a 12 288-entry table, each answered, while the live ones keep their
    state: a replayed request of a live path is still caught after the moves deletions make."""
    c = fresh()
    c.set_reflector_idle(2 * 10**9)
    path, now = 1, T0
    for plan in range(20):
        live = range(path, path + 2000)
        for rnd in range(3):  # three probes per path, 0.5 s apart
            now += 5 * 10**8
            for p in live:
                assert reflected(c, request(path=p, seq=rnd + 1), now=now).rx_count == rnd + 1
        for p in live[::97]:
            assert c.receive_test(request(path=p, seq=2), PEER, ME, 50000, now) == "replay"
        path += 2000
        now += 3 * 10**9  # the next plan comes after this one's paths went idle
    counters = c.counters()
    assert path - 1 == 40_000 > _probecore.REFLECT_MAX
    assert counters["drops"] == {"replay": 21 * 20} and counters["reflector_entries"] <= 2000 * 2


# ---- path ids: the lowest free one, so a peer's reflector holds only the paths that exist -----

def test_path_ids_are_the_lowest_free_and_reused_after_removal():
    from linkpass.probe.common import PathIds

    ids = PathIds()
    taken = []
    for _ in range(5):
        taken.append(ids.lowest_free())
        ids.claim(taken[-1])
    assert taken == [1, 2, 3, 4, 5]
    ids.release(2)
    ids.release(4)
    assert ids.lowest_free() == 2
    ids.claim(2)
    assert ids.lowest_free() == 4
    ids.claim(9)  # chosen by a caller
    ids.claim(4)
    assert ids.lowest_free() == 6
    with pytest.raises(ValueError, match="path 9 exists"):
        ids.claim(9)
    with pytest.raises(ValueError, match="path id must be 1..4294967295"):
        ids.claim(0)


def test_plan_after_plan_the_path_ids_stay_as_few_as_the_paths():
    """Whatever the churn, ids never exceed the most paths alive at once."""
    import random

    from linkpass.probe.common import PathIds

    ids, live, rng = PathIds(), set(), random.Random(3)
    for _ in range(200):  # plan changes: some paths go, others come
        for pid in rng.sample(sorted(live), k=len(live) // 3):
            ids.release(pid)
            live.discard(pid)
        while len(live) < 300:
            pid = ids.lowest_free()
            ids.claim(pid)
            live.add(pid)
        assert max(live) == 300 == len(ids)


NEXT_KEY = bytes(range(100, 132))


def test_a_key_rotation_accepts_the_other_key_signs_with_the_current_and_counts_it():
    """Mid-rotation (docs/security.md) a core accepts requests signed with either key, replies
    with its own key, and counts what the other key authenticated; a third key stays forged.
    set_keys takes effect at once, without a new core."""
    c = _probecore.Core(KEY, 7, accept_key=NEXT_KEY)
    assert reflected(c, request(seq=1, key=NEXT_KEY)).seq == 1   # signed with the next key: accepted
    assert reflected(c, request(seq=2)).seq == 2                 # with the current one: accepted
    assert c.receive_test(request(seq=3, key=WRONG_KEY), PEER, ME, 50000, T0) == "bad_tag"
    assert c.counters()["other_key"] == 1
    c.set_keys(NEXT_KEY, KEY)  # the switch: sign with the next key, still accept the old one
    out = c.receive_test(request(seq=4), PEER, ME, 50000, T0)
    assert W.Codec(NEXT_KEY).decode(out[28:], ME, PEER, 50000).seq == 4  # the reply is signed with the new key
    with pytest.raises(W.WireError):
        codec.decode(out[28:], ME, PEER, 50000)
    c.set_keys(NEXT_KEY)  # rotation over: the old key is refused
    assert c.receive_test(request(seq=5), PEER, ME, 50000, T0) == "bad_tag"
    assert c.counters()["other_key"] == 2
    with pytest.raises(ValueError, match="fleet key must be"):
        c.set_keys(KEY, b"short")
    with pytest.raises(ValueError, match="fleet key must be"):
        _probecore.Core(KEY, 7, accept_key=b"x" * 65)


def test_a_forged_packet_mid_rotation_costs_its_source_two_checks():
    """With a second key every forged packet is hashed twice: the source's budget pays for both,
    so forgery costs the receiver no more CPU than before a rotation."""
    one, two = fresh(), _probecore.Core(KEY, 7, accept_key=NEXT_KEY)
    for c in (one, two):
        c.set_budget(10_000, 10_000, 10**9, 10**9)
    forged = request(key=WRONG_KEY)
    verdicts = {id(c): Counter(c.receive_test(forged, PEER, ME, 50000, T0) for _ in range(400)) for c in (one, two)}
    checked_one, checked_two = verdicts[id(one)]["bad_tag"], verdicts[id(two)]["bad_tag"]
    assert checked_one > 0 and abs(checked_two * 2 - checked_one) <= 2, verdicts


def test_python_codec_accepts_the_other_key_during_a_rotation():
    p = W.Probe(W.KIND_REQUEST, 3, 7, 1, 9)
    mid = W.Codec(KEY, NEXT_KEY)
    assert mid.decode(W.Codec(NEXT_KEY).encode(p, PEER, ME, 50000), PEER, ME, 50000) == p
    assert mid.decode(codec.encode(p, PEER, ME, 50000), PEER, ME, 50000) == p
    assert mid.other_key_ok == 1
    with pytest.raises(W.WireError, match="bad_tag"):
        mid.decode(W.Codec(WRONG_KEY).encode(p, PEER, ME, 50000), PEER, ME, 50000)
    assert mid.encode(p, PEER, ME, 50000) == codec.encode(p, PEER, ME, 50000)  # signs with its own key
    with pytest.raises(ValueError, match="the other fleet key must be"):
        W.Codec(KEY, b"short")


def test_a_nic_is_added_before_the_loop_runs_never_while():
    """The running loop sized its poll set and send batches by the NICs it started with."""
    c = fresh()
    r, w = os.pipe()
    try:
        c.start()
        with pytest.raises(RuntimeError, match="before start"):
            c.add_nic(r, w, b"\xc6\x12\x00\x01")
        c.stop()
        assert c.add_nic(r, w, b"\xc6\x12\x00\x01") == 0  # stopped: fine again
    finally:
        os.close(r)
        os.close(w)
