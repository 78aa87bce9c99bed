"""The agent's pure decisions: which planes a peer's route uses, which ports a transport may use,
and when a silent path is held against its plane."""
from __future__ import annotations

from hypothesis import given, strategies as st

from linkpass.core.decide import PathInfo, entropy_entry, silence_confirmed, usable_planes
from linkpass.core.detector import State
from linkpass.core.entropy_table import ENTRY_FAIL_STATIC, PORT_VERIFIED


UP, DOWN, SUSPECT, DEGRADED, RECOVERING, DAMPED = (State.UP, State.DOWN, State.SUSPECT, State.DEGRADED,
                                                   State.RECOVERING, State.DAMPED)


def test_a_plane_is_clean_only_if_every_path_of_it_is_usable():
    assert usable_planes({0: [UP, SUSPECT], 1: [UP, DOWN]}).planes == {0}
    assert usable_planes({0: [UP, SUSPECT], 1: [UP, DOWN]}).quality == "clean"


def test_without_a_clean_plane_partial_planes_carry_the_route():
    choice = usable_planes({0: [UP, DOWN], 1: [DEGRADED, DEGRADED], 2: [RECOVERING, UP]})
    assert choice.planes == {0, 2} and choice.quality == "partial"


def test_no_usable_path_means_no_plane_and_the_caller_keeps_the_route():
    choice = usable_planes({0: [DOWN, DAMPED], 1: [DEGRADED]})
    assert choice.planes == frozenset() and choice.quality == "none"
    assert usable_planes({0: []}).quality == "none"  # a plane without paths is not usable


@given(st.dictionaries(st.integers(0, 3), st.lists(st.sampled_from(list(State)), max_size=4), max_size=4))
def test_chosen_planes_always_have_a_usable_path_and_clean_ones_win(states):
    choice = usable_planes(states)
    for plane in choice.planes:
        assert any(s.usable for s in states[plane])
    clean = {p for p, ss in states.items() if ss and all(s.usable for s in ss)}
    if clean:
        assert choice.planes == clean
    elif any(s.usable for ss in states.values() for s in ss):
        assert choice.planes and choice.quality == "partial"


def _path(pid, sport, plane=0):
    return PathInfo(pid, "h2", plane, sport, "198.18.64.5")


def test_entropy_entry_lists_the_ports_of_usable_paths_only():
    e = entropy_entry([(_path(1, 49152), UP), (_path(2, 49155), DOWN), (_path(3, 49160), SUSPECT)])
    assert (e.peer, e.plane, e.ports, e.path_ids, e.flags) == ("198.18.64.5", 0, (49152, 49160), (1, 3), 0)
    assert e.port_flags == (PORT_VERIFIED, PORT_VERIFIED)


def test_entropy_entry_keeps_every_port_flagged_when_none_is_usable():
    e = entropy_entry([(_path(2, 49155), DOWN), (_path(1, 49152), DAMPED)])
    assert e.ports == (49152, 49155) and e.flags == ENTRY_FAIL_STATIC and e.port_flags == (0, 0)


def test_a_down_is_confirmed_only_by_an_on_time_answer_to_a_probe_sent_after_it():
    ms = 1_000_000
    assert silence_confirmed(100 * ms, [103 * ms])
    assert not silence_confirmed(100 * ms, [100 * ms, 99 * ms])  # the peer went quiet everywhere
    assert not silence_confirmed(100 * ms, [])
