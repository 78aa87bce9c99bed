"""What a Soft-RoCE guest is told to be (pure): its NICs' MACs are the ones the leaves expect, its
boot script gives it a namespace host's addresses, neighbours, routes and sysctls plus one rxe
device per plane, and QEMU gets one TAP per NIC and the control port."""
from __future__ import annotations

import pytest

from linkpass.testbed import guests
from linkpass.testbed import topology as T


@pytest.fixture
def gfab():
    spec = T.parse_spec({"hosts": 4, "planes": 2, "leaves_per_plane": 2, "spines_per_plane": 2, "rdma_hosts": [3]})
    return T.make_fabric(spec, "g", "198.19.9.0/24")


def test_plane_macs_are_what_the_leaves_have_as_permanent_neighbours(gfab):
    macs = dict(guests.nic_macs(gfab, 3))
    assert list(macs) == ["p0", "p1", "mgmt"]
    for p in range(2):
        leaf = gfab.leaf_of(3, p)
        expected = {mac for ifname, ip, mac in gfab.neighbors(leaf) if ip == gfab.nic_addr(3, p)}
        assert expected == {macs[f"p{p}"]}


def test_the_setup_script_matches_a_namespace_host_and_adds_rxe_per_plane(gfab):
    script = guests.setup_script(gfab, 3)
    lines = script.splitlines()
    assert lines[0] == "set -eu"
    assert f"ip addr add {gfab.service_addr(3)}/32 dev lo" in lines
    for p in range(2):
        assert f"ip addr add {gfab.nic_addr(3, p)}/31 dev p{p}" in lines
        assert f"rdma link add rxe_p{p} type rxe netdev p{p}" in lines
    for ifname, ip, mac in gfab.neighbors("h3"):
        assert f"ip neigh replace {ip} lladdr {mac} dev {ifname} nud permanent" in lines
    ecmp = [ln for ln in lines if ln.startswith("ip route replace 198.18.0.0/20")]
    assert len(ecmp) == 1 and ecmp[0].count("nexthop via") == 2 and "src 198.18.0.4" in ecmp[0]
    assert "echo 0 > /proc/sys/net/ipv4/ip_forward" in lines
    # renames happen before anything names p0/p1/mgmt
    first_use = min(i for i, ln in enumerate(lines) if " dev p0" in ln)
    assert max(i for i, ln in enumerate(lines) if ln.startswith("rename ")) < first_use


def test_qemu_gets_one_tap_per_nic_the_control_port_and_no_default_devices(gfab, tmp_path):
    image = guests.Image(str(tmp_path), "/img/vmlinuz", "/img/initrd.img", {})
    macs = [m for _, m in guests.nic_macs(gfab, 3)]
    argv = guests.qemu_argv("g-h3", image, str(tmp_path), [7, 8, 9], macs)
    assert argv[0] == guests.QEMU and "-nodefaults" in argv and "-no-reboot" in argv
    nets = [argv[i + 1] for i, a in enumerate(argv) if a == "-netdev"]
    assert nets == ["tap,id=n0,fd=7,vhost=off", "tap,id=n1,fd=8,vhost=off", "tap,id=n2,fd=9,vhost=off"]
    devs = [argv[i + 1] for i, a in enumerate(argv) if a == "-device" and argv[i + 1].startswith("virtio-net")]
    assert [d.split("mac=")[1] for d in devs] == macs
    assert any(a == f"virtserialport,chardev=ctl,name={guests.CTL_PORT}" for a in argv)
    assert any("readonly=on" in a and "mount_tag" not in a for a in argv)  # the source tree, read-only


def test_the_systemd_image_boots_systemd_without_soft_roce_or_the_source_share(gfab, tmp_path):
    """Its agent comes from the fleet package at /opt/linkpass and probes through sockets, which
    rxe would starve of every RoCEv2 packet: no rxe device, no source share over the package."""
    rdma = guests.Image(str(tmp_path), "/img/vmlinux", "/img/initrd.img", {})
    sysd = guests.Image(str(tmp_path), "/img/vmlinux", "/img/initrd.img", {}, profile="systemd")
    macs = [m for _, m in guests.nic_macs(gfab, 3)]
    cmdline = {im.profile: guests.qemu_argv("g", im, str(tmp_path), [7, 8, 9], macs) for im in (rdma, sysd)}
    append = {k: argv[argv.index("-append") + 1] for k, argv in cmdline.items()}
    assert "rdinit=/lib/systemd/systemd" in append["systemd"] and "rdinit" not in append["rdma"]
    sizes = {k: (argv[argv.index("-m") + 1], argv[argv.index("-smp") + 1]) for k, argv in cmdline.items()}
    assert sizes == {"rdma": (str(guests.GUEST_MEM_MB), "1"),
                     "systemd": (str(guests.SYSTEMD_GUEST_MEM_MB), str(guests.SYSTEMD_GUEST_CPUS))}
    assert any("mount_tag=lpsrc" in a for a in cmdline["rdma"])
    assert not any("lpsrc" in a or "readonly=on" in a for a in cmdline["systemd"])
    plain = guests.setup_script(gfab, 3, soft_roce=False)
    assert "rdma link" not in plain
    assert plain == "".join(ln + "\n" for ln in guests.setup_script(gfab, 3).splitlines()
                            if not ln.startswith("rdma link"))


def test_a_topologys_guest_image_is_named_or_refused_naming_the_choices():
    base = {"hosts": 4, "planes": 2, "leaves_per_plane": 2, "spines_per_plane": 2, "rdma_hosts": [0]}
    assert T.parse_spec(base).guest_image == "rdma"
    assert T.parse_spec({**base, "guest_image": "systemd"}).guest_image == "systemd"
    with pytest.raises(T.TopologyError, match=r"topology\.guest_image: 'upstart' is not an image; use rdma or systemd"):
        T.parse_spec({**base, "guest_image": "upstart"})
