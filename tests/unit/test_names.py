"""One generator of node and link names: the testbed fabric and the coordinator's model agree."""
from __future__ import annotations

import pathlib
import re

import pytest
from hypothesis import given, strategies as st

from linkpass.core import names as N
from linkpass.core.fabric import FabricError, from_testbed, rail_optimized
from linkpass.testbed.topology import PRESETS, TopologyError, make_fabric, preset


ROOT = pathlib.Path(__file__).resolve().parents[2]


def attachment(fab_or_model, hosts, planes) -> dict[tuple[str, int], str]:
    return {(h, p): fab_or_model.uplink(h, p).b for h in hosts for p in range(planes)}


def ends(links) -> dict[str, tuple[str, str, str, int]]:
    return {lk.name: (lk.kind, lk.a, lk.b, lk.plane) for lk in links}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_has_the_same_links_and_attachment_in_testbed_and_model(name):
    spec = preset(name)
    fab = make_fabric(spec, "lpn", "198.19.210.0/24")
    model = from_testbed(fab)
    assert list(model.links) == list(fab.links)
    assert ends(model.links.values()) == ends(fab.links.values())
    assert model.hosts == fab.hosts == [f"h{i}" for i in range(spec.hosts)]
    assert attachment(model, fab.hosts, spec.planes) == attachment(fab, fab.hosts, spec.planes)
    assert all(fab.leaf_of(i, p) == model.leaf_of(f"h{i}", p) for i in range(spec.hosts) for p in range(spec.planes))
    for p in range(spec.planes):
        assert model.spines(p) == [f"p{p}s{s}" for s in range(spec.spines_per_plane)]
        for leaf in range(spec.leaves_per_plane):
            for s in range(spec.spines_per_plane):
                assert fab.leaf_spine(f"p{p}l{leaf}", s).name == model.leaf_spine(f"p{p}l{leaf}", s).name
    if spec.hosts % spec.leaves_per_plane == 0:  # a rail-optimized fabric of the same shape
        generated = rail_optimized(spec.hosts, spec.planes, spec.hosts // spec.leaves_per_plane, spec.spines_per_plane)
        assert list(generated.links) == list(fab.links)
        assert ends(generated.links.values()) == ends(fab.links.values())
        assert attachment(generated, fab.hosts, spec.planes) == attachment(fab, fab.hosts, spec.planes)


def test_every_preset_is_rail_optimized_shaped():
    """So the rail_optimized comparison above runs for each of them."""
    assert all(s["hosts"] % s["leaves_per_plane"] == 0 for s in PRESETS.values())


@given(hosts=st.integers(1, 64), leaves=st.integers(1, 8))
def test_blocks_and_racks_agree_when_the_leaves_divide_the_hosts(hosts, leaves):
    blocks = N.LeafSpine.blocks(hosts * leaves, 2, leaves, 3)
    racks = N.LeafSpine.racks(hosts * leaves, 2, hosts, 3)
    assert blocks == racks
    assert list(blocks.links()) == list(racks.links())


def test_uplink_takes_a_host_name_in_both_models():
    fab = make_fabric(preset("default"), "lpn", "198.19.210.0/24")
    model = from_testbed(fab)
    assert fab.uplink("h2", 1).name == model.uplink("h2", 1).name == "h2-p1l1"
    with pytest.raises(TopologyError, match="hosts h0..h3"):
        fab.uplink(2, 1)
    with pytest.raises(FabricError, match="no uplink"):
        model.uplink(2, 1)


def test_names_parse_back():
    assert [N.host_index(N.host_name(i)) for i in (0, 7, 31)] == [0, 7, 31]
    assert N.plane_of(N.leaf_name(3, 1)) == 3 and N.plane_of(N.spine_name(5, 0)) == 5
    assert N.link_name(N.host_name(1), N.leaf_name(0, 0)) == "h1-p0l0"
    assert N.plane_of(N.core_name(2, 9)) == 2 and N.link_ends("p0s1-p0c4") == ("p0s1", "p0c4")
    for bad in ("p0l0", "h", "hx", "x3"):
        with pytest.raises(ValueError):
            N.host_index(bad)
    with pytest.raises(ValueError):
        N.plane_of("h0")


def test_generation_order_is_uplinks_then_leaf_spine_links_per_plane():
    got = [lk.name for lk in N.LeafSpine.racks(3, 2, 2, 2).links()]
    assert got == ["h0-p0l0", "h1-p0l0", "h2-p0l1", "p0l0-p0s0", "p0l0-p0s1", "p0l1-p0s0", "p0l1-p0s1",
                   "h0-p1l0", "h1-p1l0", "h2-p1l1", "p1l0-p1s0", "p1l0-p1s1", "p1l1-p1s0", "p1l1-p1s1"]


def test_three_tier_generation_order_and_pods():
    t = N.ThreeTier(hosts=5, planes=1, hosts_per_leaf=2, leaves_per_pod=2, spines_per_pod=2, cores_per_group=1)
    assert (t.leaves_per_plane, t.pods, t.spines_per_plane, t.cores_per_plane) == (3, 2, 4, 2)
    got = [lk.name for lk in t.links()]
    assert got == ["h0-p0l0", "h1-p0l0", "h2-p0l1", "h3-p0l1", "h4-p0l2",
                   "p0l0-p0s0", "p0l0-p0s1", "p0l1-p0s0", "p0l1-p0s1", "p0l2-p0s2", "p0l2-p0s3",
                   "p0s0-p0c0", "p0s1-p0c1", "p0s2-p0c0", "p0s3-p0c1"]
    assert len(got) == t.link_count and t.host_leaf == (0, 0, 1, 1, 2)
    assert [r for _, r, _ in t.nodes()].count(N.CORE) == 2
    with pytest.raises(ValueError, match="leaves_per_pod >= 1"):
        N.ThreeTier(4, 1, 2, 0, 2, 2)


# f-strings that would spell a host, leaf or spine name (or a link between them) by hand
_SPELLED = re.compile(r"""f["'][^"']*(\bh\{|p\{[^}]*\}[lsc]\{)""")


def test_only_the_generator_spells_node_and_link_names():
    offenders = []
    for base in ("linkpass", "sim", "rdma"):
        for path in sorted((ROOT / base).rglob("*.py")):
            if path == ROOT / "linkpass" / "core" / "names.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if _SPELLED.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "use linkpass.core.names:\n" + "\n".join(offenders)
