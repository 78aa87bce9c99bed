"""The collector around a large built state (kernel/heap.py): paused while it is built, frozen
while it is worked over, and as it was afterwards."""
from __future__ import annotations

import gc
import weakref

import pytest

from linkpass.kernel import heap


def test_collector_paused_restores_the_collector_also_on_error():
    assert gc.isenabled()
    with heap.collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with heap.collector_paused():
            raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()  # a caller that had it off: left off
    try:
        with heap.collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_frozen_thaws_so_later_garbage_cycles_are_collected():
    class Node:
        pass

    before = gc.get_freeze_count()
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    gone = weakref.ref(a)
    with heap.frozen():
        assert gc.get_freeze_count() > before  # the cycle too, among everything
    assert gc.get_freeze_count() == 0
    del a, b
    gc.collect()
    assert gone() is None  # thawed: the dropped cycle is found and freed


def test_localization_runs_with_the_collector_paused(monkeypatch):
    from linkpass.core.fabric import rail_optimized
    from linkpass.core.localize import Localizer, Observation
    from linkpass.core.shards import Part, ShardMap

    model = rail_optimized(8, 1, 4, 2)
    loc = Localizer(model, pause=heap.collector_paused)  # as the coordinator and the simulator make theirs
    loc.update(Observation("h0", "h0/0", model.node_path("h0", "h5", 0, 1), None, True, "forward"))
    seen = []
    greedy = Localizer._greedy
    monkeypatch.setattr(Localizer, "_greedy", lambda self, *a: seen.append(gc.isenabled()) or greedy(self, *a))
    loc.findings()
    named = Localizer.named
    monkeypatch.setattr(Localizer, "named", lambda self: seen.append(gc.isenabled()) or named(self))
    Part(model, ShardMap(model, 2), 0, pause=heap.collector_paused).cleared()
    assert seen == [False, False] and gc.isenabled()


def test_the_coordinator_and_its_shards_localize_with_the_collector_paused():
    from linkpass.coordinator.coordinator import Coordinator
    from linkpass.coordinator.shard import PartHost
    from linkpass.coordinator.store import Store
    from linkpass.core.fabric import rail_optimized
    from linkpass.core.shards import ShardMap

    model = rail_optimized(8, 1, 4, 2)
    assert Coordinator(Store(":memory:"), model, wall_s=0.0).localizer.pause is heap.collector_paused
    assert PartHost(ShardMap(model, 2), 0).part.loc.pause is heap.collector_paused
