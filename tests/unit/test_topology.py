"""The fabric as data: address plan, names, routes, validation. No root needed."""
from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings, strategies as st

from linkpass.testbed import topology as T


TESTBED_RANGES = [ipaddress.ip_network("198.18.0.0/15"), ipaddress.ip_network("fd00::/8")]


def fab_of(hosts=4, planes=2, leaves=2, spines=2, prefix="lp", slot=0):
    spec = T.parse_spec({"hosts": hosts, "planes": planes, "leaves_per_plane": leaves, "spines_per_plane": spines})
    return T.make_fabric(spec, prefix, T.mgmt_subnet_for_slot(slot))


def all_addresses(fab: T.Fabric) -> list[str]:
    addrs = [fab.service_addr(i) for i in range(fab.spec.hosts)]
    addrs += [fab.mgmt_addr(i) for i in range(fab.spec.hosts)] + [fab.mgmt_root_addr]
    for lk in fab.links.values():
        addrs += [lk.a_addr.split("/")[0], lk.b_addr.split("/")[0]]
    return addrs


def owner_of(fab: T.Fabric) -> dict[str, tuple[str, str]]:
    """address -> (node, interface); service addresses live on the host's lo."""
    own = {fab.service_addr(i): (f"h{i}", "lo") for i in range(fab.spec.hosts)}
    for lk in fab.links.values():
        own[lk.a_addr.split("/")[0]] = (lk.a, lk.a_if)
        own[lk.b_addr.split("/")[0]] = (lk.b, lk.b_if)
    return own


def connected(fab: T.Fabric, node: str) -> list[T.Route]:
    out = []
    for lk in fab.links_of(node):
        ifname, addr = lk.end(node)
        out.append(T.Route(str(ipaddress.ip_interface(addr).network), (("", ifname),)))
    return out


_PLAN: list = []  # (fabric, owner map, per node its routes with parsed prefixes) of the last fabric walked


def route_plan(fab: T.Fabric):
    """The owner map and every node's table (connected + planned routes), built once per fabric:
    the walks of one fabric share them instead of re-parsing every prefix at every hop."""
    if not _PLAN or _PLAN[0] is not fab:
        tables = {node: [(ipaddress.ip_network(r.dst), r) for r in connected(fab, node) + fab.routes.get(node, [])]
                  for node in fab.nodes}
        _PLAN[:] = [fab, owner_of(fab), tables]
    return _PLAN[1], _PLAN[2]


def walk(fab: T.Fabric, src: str, dst: str, first_hop_if: str | None, max_hops: int = 8) -> list[str]:
    """Follow the route plan hop by hop (longest prefix match); returns the nodes visited."""
    own, tables = route_plan(fab)
    node, path, out_if = src, [src], first_hop_if
    target = ipaddress.ip_address(dst)
    for _ in range(max_hops):
        if own.get(dst, (None,))[0] == node:
            return path
        matches = [(net, r) for net, r in tables[node] if target in net]
        assert matches, f"{node} has no route to {dst}"
        best = max(matches, key=lambda m: m[0].prefixlen)[1]
        hops = [h for h in best.via if out_if is None or h[1] == out_if]
        assert hops, f"{node}: route {best.dst} has no nexthop on {out_if}"
        gw, ifname = hops[0]
        lk = next(lk for lk in fab.links_of(node) if lk.end(node)[0] == ifname)
        node = lk.other(node)
        path.append(node)
        out_if = None
    raise AssertionError(f"loop or too long path {path}")


def test_default_preset_shape():
    fab = T.make_fabric(T.preset("default"), "lp", "198.19.0.0/24")
    assert (fab.spec.hosts, fab.spec.planes, fab.spec.leaves_per_plane, fab.spec.spines_per_plane) == (4, 2, 2, 2)
    assert len([n for n in fab.nodes.values() if n.role == "host"]) == 4
    assert len(fab.links) == 4 * 2 + 2 * 2 * 2  # host uplinks + leaf-spine links
    assert fab.leaf_of(0, 0) == "p0l0" and fab.leaf_of(3, 1) == "p1l1"


@settings(max_examples=60, deadline=None)
@given(hosts=st.integers(2, 40), planes=st.integers(1, 8), leaves=st.integers(1, 6), spines=st.integers(1, 6),
       slot=st.integers(0, 255))
def test_address_plan_is_unique_and_inside_testbed_ranges(hosts, planes, leaves, spines, slot):
    leaves = min(leaves, hosts)
    fab = fab_of(hosts, planes, leaves, spines, slot=slot)
    addrs = all_addresses(fab)
    assert len(addrs) == len(set(addrs)), "an address is used twice"
    for a in addrs:
        assert any(ipaddress.ip_address(a) in net for net in TESTBED_RANGES), a
    macs = [T.mac_of(a) for a in addrs]
    assert len(macs) == len(set(macs))


@settings(max_examples=40, deadline=None)
@given(hosts=st.integers(2, 24), planes=st.integers(1, 4), leaves=st.integers(1, 5), spines=st.integers(1, 4))
def test_route_plan_delivers_every_pair_over_every_plane(hosts, planes, leaves, spines):
    leaves = min(leaves, hosts)
    fab = fab_of(hosts, planes, leaves, spines)
    for i in range(hosts):
        for j in range(hosts):
            if i == j:
                continue
            for p in range(planes):
                path = walk(fab, f"h{i}", fab.nic_addr(j, p), f"p{p}")
                assert path[-1] == f"h{j}" and all(n.startswith(f"p{p}") for n in path[1:-1])
                path = walk(fab, f"h{i}", fab.service_addr(j), f"p{p}")
                assert path[-1] == f"h{j}" and all(n.startswith(f"p{p}") for n in path[1:-1])


def test_leaf_spreads_over_every_spine_and_host_over_every_plane():
    fab = fab_of(4, 2, 2, 3)
    leaf_routes = {r.dst: r for r in fab.routes["p0l0"]}
    assert len(leaf_routes[str(T.SERVICE_BLOCK)].via) == 3
    host_routes = {r.dst: r for r in fab.routes["h0"]}
    svc = host_routes[str(T.SERVICE_BLOCK)]
    assert {dev for _, dev in svc.via} == {"p0", "p1"} and svc.src == fab.service_addr(0)


def test_spine_routes_are_summarised_per_leaf():
    fab = fab_of(32, 2, 2, 2)
    # 16 hosts per leaf: NIC /31s collapse to one /27 per leaf; service /32s to a few prefixes
    assert len(fab.routes["p0s0"]) <= 2 * (1 + 5)


def test_interface_and_namespace_names_fit_linux_limits():
    fab = fab_of(253, 8, 4, 4, prefix="abcdef")
    assert len(fab.mgmt_root_if(252)) <= 15 and len(fab.mgmt_bridge) <= 15
    for lk in fab.links.values():
        assert len(lk.a_if) <= 15 and len(lk.b_if) <= 15
    assert all(fab.netns(n).startswith("abcdef-") for n in fab.nodes)


def test_link_lookup_accepts_either_order_and_names_examples_when_unknown():
    fab = fab_of()
    assert fab.link("p0l0-h0").name == "h0-p0l0"
    with pytest.raises(T.TopologyError, match="no link named 'h9-p0l0'.*testbed show"):
        fab.link("h9-p0l0")


@pytest.mark.parametrize("raw, field", [
    ({"hosts": 4, "planes": 2, "leaves_per_plane": 2}, "topology.spines_per_plane: required"),
    ({"hosts": "four", "planes": 2, "leaves_per_plane": 2, "spines_per_plane": 2}, "topology.hosts: expected an integer"),
    ({"hosts": 4, "planes": 9, "leaves_per_plane": 2, "spines_per_plane": 2}, "topology.planes: 9 is out of range"),
    ({"hosts": 4, "planes": 2, "leaves_per_plane": 5, "spines_per_plane": 2}, "topology.leaves_per_plane: 5 is out of range"),
    ({"hosts": 4, "planes": 2, "leaves_per_plane": 2, "spines_per_plane": 2, "spine": 1}, "topology.spine: unknown field"),
    ({"hosts": 4, "planes": 2, "leaves_per_plane": 2, "spines_per_plane": 2, "mtu": 100}, "topology.mtu: 100 is out of range"),
    ({"hosts": 4, "planes": 2, "leaves_per_plane": 2, "spines_per_plane": 2,
      "management": {"subnet": "10.0.0.0/24"}}, "topology.management.subnet: 10.0.0.0/24 must be a /24 inside 198.19.0.0/16"),
    ({"hosts": True, "planes": 2, "leaves_per_plane": 2, "spines_per_plane": 2}, "topology.hosts: expected an integer"),
    (["hosts", 4], "topology: expected a mapping"),
])
def test_invalid_topologies_name_the_field(raw, field):
    with pytest.raises(T.TopologyError) as err:
        T.parse_spec(raw)
    assert str(err.value).startswith(field), str(err.value)


def test_yaml_errors_name_the_file():
    with pytest.raises(T.TopologyError, match=r"^fab.yaml: not valid YAML"):
        T.load_spec_text("hosts: [4\n", "fab.yaml")
    spec = T.load_spec_text("hosts: 6\nplanes: 3\nleaves_per_plane: 3\nspines_per_plane: 2\n", "fab.yaml")
    assert spec.hosts == 6 and spec.planes == 3


@pytest.mark.parametrize("bad", ["", "Lp", "1a", "toolong7", "a-b", "a_b"])
def test_prefix_rules(bad):
    with pytest.raises(T.TopologyError, match="prefix"):
        T.check_prefix(bad)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(T.TopologyError, match="default"):
        T.preset("nope")


# ---- Soft-RoCE guests as hosts ------------------------------------------------------------------

_SHAPE = {"hosts": 4, "planes": 2, "leaves_per_plane": 2, "spines_per_plane": 2}


@pytest.mark.parametrize("value,expected", [([3, 0], (0, 3)), ("0, 3", (0, 3)), ([], ()), ((2,), (2,))])
def test_rdma_hosts_are_parsed_sorted(value, expected):
    assert T.parse_spec(dict(_SHAPE, rdma_hosts=value)).rdma_hosts == expected


@pytest.mark.parametrize("value,message", [
    ([4], "rdma_hosts: host 4 does not exist; hosts are 0..3"),
    ([1, 1], "names a host twice"),
    ("a,b", "not a list of host indices; use e.g. 0,3"),
    ([0, 1, 2, 3], "at most 3"),
    (True, "expected a list of host indices"),
    ([0.5], "expected a list of host indices"),
])
def test_bad_rdma_hosts_name_the_field_and_the_fix(value, message):
    with pytest.raises(T.TopologyError, match=message):
        T.parse_spec(dict(_SHAPE, rdma_hosts=value))


def test_a_guest_host_is_known_as_one_and_has_no_namespace_in_the_listing():
    fab = T.make_fabric(T.parse_spec(dict(_SHAPE, rdma_hosts=[3])), "g", "198.19.9.0/24")
    assert fab.is_guest(3) and fab.is_guest("h3") and not fab.is_guest("h0") and not fab.is_guest("p0l1")
    hosts = {h["name"]: h for h in fab.as_dict()["host_list"]}
    assert hosts["h3"]["netns"] is None and hosts["h3"]["kind"] == "soft-roce guest"
    assert hosts["h0"]["netns"] == "g-h0" and hosts["h0"]["kind"] == "namespace"
