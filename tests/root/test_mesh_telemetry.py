"""The probe mesh on the real testbed: loss and delay show up on the right paths, in the right
direction. Truth comes from the fabric itself: which spine each (source, destination, port)
crosses, read from interface counters (traffic.spine_for_sport)."""
from __future__ import annotations

import threading

import pytest

from linkpass.testbed import faults, traffic
from linkpass.testbed.faults import FaultSpec
from linkpass.testbed.mesh import Mesh

KEY = bytes(range(32))
PORTS = range(50000, 50004)


@pytest.fixture(scope="module")
def spines(fabric):
    """{(src, dst, sport): spine or None} on plane 0 for every ordered host pair."""
    H = fabric.spec.hosts
    return {(a, b, sp): traffic.spine_for_sport(fabric, a, b, 0, sp, packets=10)
            for a in range(H) for b in range(H) if a != b for sp in PORTS}


def crosses(fab, spines, src, dst, sport, leaf, spine):
    """Does traffic src->dst with this port go up from `leaf` to `spine`?"""
    return fab.leaf_of(src, 0) == leaf and spines[(src, dst, sport)] == spine


def test_loss_on_one_link_direction_shows_only_on_its_paths_and_direction(clean_faults, spines):
    fab = clean_faults
    faults.apply(fab.prefix, FaultSpec("loss", "p0l0-p0s0", "p0l0", {"pct": 30}))
    mesh = Mesh.start(fab, [(a, b, 0, sp) for (a, b, sp) in spines], KEY, interval_s=0.002)
    try:
        mesh.run(2.0)
        checked_fwd = checked_rev = 0
        for pid, mp in mesh.paths.items():
            loss = mesh.telemetry(pid).loss
            assert loss.answered > 500, f"path {mp} barely probed"
            fwd = 100 * loss.lost_fwd / loss.answered
            rev = 100 * loss.lost_rev / loss.arrived
            # the request crosses the faulty direction, or the reply (dst -> src, same port) does
            want_fwd = crosses(fab, spines, mp.src, mp.dst, mp.sport, "p0l0", "p0s0")
            want_rev = crosses(fab, spines, mp.dst, mp.src, mp.sport, "p0l0", "p0s0")
            assert fwd == pytest.approx(30, abs=10) if want_fwd else fwd < 3, (mp, fwd)
            assert rev == pytest.approx(30, abs=10) if want_rev else rev < 3, (mp, rev)
            checked_fwd += want_fwd
            checked_rev += want_rev
        assert checked_fwd >= 2 and checked_rev >= 2  # the mesh did cover the link both ways
    finally:
        mesh.close()


def test_congestion_delay_shows_in_the_direction_it_happens(clean_faults, spines):
    fab = clean_faults
    faults.apply(fab.prefix, FaultSpec("congest", "p0l0-p0s0", "p0l0", {"rate": "10mbit", "queue": "30ms"}))
    # keep the queue full: 32 Mbit/s of h1 -> h3 traffic through p0l0 -> p0s0 for the whole run
    load_port = next(sp for sp in range(40000, 40100)
                     if traffic.spine_for_sport(fab, 1, 3, 0, sp, packets=10, dport=9) == "p0s0")
    load = threading.Thread(target=traffic.send_flow, args=(fab, 1, 3),
                            kwargs=dict(plane=0, sport=load_port, dport=9, count=10_000, size=1000, interval_s=0.00025))
    paths = [(0, b, 0, sp) for b in (2, 3) for sp in PORTS] + [(b, 0, 0, sp) for b in (2, 3) for sp in PORTS]
    mesh = Mesh.start(fab, paths, KEY, interval_s=0.005)
    try:
        load.start()
        mesh.run(2.0)
        load.join()
        for pid, mp in mesh.paths.items():
            w = mesh.telemetry(pid).window(0, offset_ns=0)  # identity clocks: offset 0 is the truth
            fwd = w["owd_fwd_ns"]["p50"] / 1e6
            rev = w["owd_rev_ns"]["p50"] / 1e6
            want_fwd = crosses(fab, spines, mp.src, mp.dst, mp.sport, "p0l0", "p0s0")
            want_rev = crosses(fab, spines, mp.dst, mp.src, mp.sport, "p0l0", "p0s0")
            assert (fwd > 10) == want_fwd, (mp, fwd)
            assert (rev > 10) == want_rev, (mp, rev)
    finally:
        mesh.close()
