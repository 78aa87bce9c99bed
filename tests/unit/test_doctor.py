"""`linkpass doctor`: the pure checks on fake facts and the rendering against golden files (one
real run inside a testbed host's namespace: tests/root/test_doctor_testbed.py).

Golden files live in tests/golden/doctor_*.txt; regenerate them after an intended change with

    LINKPASS_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_doctor.py -k golden
"""
from __future__ import annotations

import dataclasses
import argparse
from dataclasses import replace

import pytest

from linkpass.cli import doctor as DC
from linkpass.doctor import checks as D
from linkpass.doctor import gather as G

from support.doctor import BASELINE, DEFAULT_ROUTE, NICS, healthy
from support.golden import check_golden


def by_name(checks) -> dict[str, D.Check]:
    return {c.name: c for c in checks}


def test_a_healthy_host_passes_every_check():
    checks = D.run_checks(healthy())
    bad = [c for c in checks if c.status != D.OK]
    assert not bad, bad
    names = [c.name for c in checks]
    assert names == ["sysctl.multipath_hash", "sysctl.rp_filter", "sysctl.icmp_errors", "sysctl.port_range",
                     "cap.net_admin", "cap.net_raw", "cap.sys_nice", "config", "nic.p0", "nic.p1", "rdma",
                     "route.h1", "route.h2", "clock", "agent", "coordinator"]
    assert DC.exit_code(checks) == 0
    c = by_name(checks)
    assert "plane(s) 0,1" in c["route.h1"].detail  # the /20 wins over the default route
    assert "REACHABLE" in c["nic.p0"].detail


def test_failing_checks_say_what_is_wrong_and_how_to_fix_it():
    f = healthy()
    f.sysctl = dict(f.sysctl, **{"net.ipv4.fib_multipath_hash_policy": "0", "net.ipv4.conf.p1.rp_filter": "1"})
    f.links = dict(f.links, p1={"operstate": "DOWN", "flags": ["UP"], "addrs": ["198.18.72.1/31"]})
    f.peer_routes = dict(f.peer_routes, **{"198.18.0.3": [DEFAULT_ROUTE]})
    f.cap_eff = 1 << D.CAP_NET_RAW | 1 << D.CAP_SYS_NICE
    c = by_name(D.run_checks(f))
    assert c["sysctl.multipath_hash"].status == D.FAIL
    assert "fib_multipath_hash_policy=1" in c["sysctl.multipath_hash"].fix
    assert c["sysctl.rp_filter"].status == D.FAIL and "p1" in c["sysctl.rp_filter"].detail
    assert "net.ipv4.conf.p1.rp_filter=2" in c["sysctl.rp_filter"].fix
    assert c["nic.p1"].status == D.FAIL and "no carrier" in c["nic.p1"].detail
    assert c["nic.p0"].status == D.OK
    assert c["route.h2"].status == D.FAIL and "eth0" in c["route.h2"].detail
    assert c["cap.net_admin"].status == D.FAIL and "AmbientCapabilities=CAP_NET_ADMIN" in c["cap.net_admin"].fix
    assert DC.exit_code(list(c.values())) == 2


def test_warnings_make_exit_1():
    f = healthy()
    f.sysctl = dict(f.sysctl, **{"net.ipv4.ip_local_port_range": "32768 60999"})
    f.rdma = []
    f.clock = {"state": 5, "status": 0x40, "esterror_us": 16_000_000, "maxerror_us": 16_000_000}
    checks = D.run_checks(f)
    c = by_name(checks)
    assert c["sysctl.port_range"].status == D.WARN and "49152-49183" in c["sysctl.port_range"].detail
    assert c["rdma"].status == D.WARN
    assert c["rdma"].detail == "no RDMA devices: routes and entropy still work, RDMA QPs cannot be steered"
    assert c["clock"].status == D.WARN and "16 s" in c["clock"].detail
    assert {x.status for x in checks} == {D.OK, D.WARN}
    assert DC.exit_code(checks) == 1


def test_reserved_ports_make_an_overlapping_range_ok():
    f = healthy()
    f.sysctl = dict(f.sysctl, **{"net.ipv4.ip_local_port_range": "32768 60999",
                                 "net.ipv4.ip_local_reserved_ports": "40000,49152-49200"})
    assert D.check_port_range(f).status == D.OK
    f.sysctl["net.ipv4.ip_local_reserved_ports"] = "49152-49160"
    assert D.check_port_range(f).status == D.WARN
    f.discovery_ports = 4  # the agent sweeps only 49152-49155: covered
    assert D.check_port_range(f).status == D.OK


def test_multipath_hash_policy_3_needs_the_port_fields():
    f = healthy()
    f.sysctl = dict(f.sysctl, **{"net.ipv4.fib_multipath_hash_policy": "3",
                                 "net.ipv4.fib_multipath_hash_fields": "55"})  # 0x37, as /proc prints it
    assert D.check_multipath_hash(f).status == D.OK
    f.sysctl["net.ipv4.fib_multipath_hash_fields"] = "0x0007"  # L3 + proto only
    assert D.check_multipath_hash(f).status == D.FAIL


def test_icmp_errors_matter_only_when_forwarding():
    f = healthy()
    f.sysctl = dict(f.sysctl, **{"net.ipv4.icmp_errors_use_inbound_ifaddr": "0"})
    assert D.check_icmp_errors(f).status == D.OK
    f.sysctl["net.ipv4.ip_forward"] = "1"
    assert D.check_icmp_errors(f).status == D.WARN


def test_rp_filter_all_strict_without_config_warns():
    f = D.Facts(sysctl={"net.ipv4.conf.all.rp_filter": "1", "net.ipv4.conf.default.rp_filter": "1"})
    assert D.check_rp_filter(f).status == D.WARN
    f.nics = NICS  # with fabric NICs known, all=1 makes each of them strict
    assert D.check_rp_filter(f).status == D.FAIL


def test_nic_problems_each_name_their_fix():
    f = healthy()
    f.links = {"p1": {"operstate": "DOWN", "flags": [], "addrs": []}}
    c = by_name(D.check_nics(f))
    assert c["nic.p0"].status == D.FAIL and "does not exist" in c["nic.p0"].detail
    assert c["nic.p1"].status == D.FAIL and c["nic.p1"].fix == "ip link set p1 up"
    f = healthy()
    f.netns = "lp-h0"
    f.links = dict(f.links, p0={"operstate": "UP", "flags": ["UP", "LOWER_UP"], "addrs": ["10.0.0.1/24"]})
    f.neigh = {"p1": {"198.18.72.0": ["FAILED"]}}
    c = by_name(D.check_nics(f))
    assert "lacks 198.18.64.1" in c["nic.p0"].detail and c["nic.p0"].fix.startswith("ip -n lp-h0 addr add")
    assert c["nic.p1"].status == D.FAIL and "does not answer ARP" in c["nic.p1"].detail
    f.neigh = {}
    f.gw_route = {"198.18.72.0": {"dst": "198.18.72.0", "dev": "p1"}}
    assert D.check_nics(f)[1].status == D.OK  # no ARP entry yet, but on-link


def test_routes_over_fewer_planes_warn_and_say_which():
    f = healthy()
    dead = {"dst": "198.18.0.0/20", "nexthops": [{"gateway": "198.18.64.0", "dev": "p0", "flags": []},
                                                 {"gateway": "198.18.72.0", "dev": "p1", "flags": ["linkdown"]}]}
    agent = {"dst": "198.18.0.3", "protocol": "176", "gateway": "198.18.64.0", "dev": "p0", "flags": []}
    f.peer_routes = {"198.18.0.2": [dead], "198.18.0.3": [BASELINE, agent]}
    c = by_name(D.check_routes(f))
    assert c["route.h1"].status == D.WARN and "only plane(s) 0" in c["route.h1"].detail
    assert "dead/linkdown" in c["route.h1"].detail
    assert c["route.h2"].status == D.WARN and "set by the agent" in c["route.h2"].detail  # /32 beats the /20
    f.peer_routes = {"198.18.0.2": [{"type": "unreachable", "dst": "198.18.0.2"}]}
    c = by_name(D.check_routes(f))
    assert c["route.h1"].status == D.FAIL and "unreachable route" in c["route.h1"].detail
    assert c["route.h2"].status == D.FAIL and "no route" in c["route.h2"].detail


def test_capabilities_missing_sys_nice_only_warns():
    f = healthy()
    f.cap_eff = (1 << D.CAP_NET_ADMIN) | (1 << D.CAP_NET_RAW)
    c = by_name(D.check_caps(f))
    assert [c[n].status for n in ("cap.net_admin", "cap.net_raw", "cap.sys_nice")] == [D.OK, D.OK, D.WARN]


def test_agent_states():
    f = healthy()
    f.agent_rows, f.agent_error = None, "Connection refused"
    a = D.check_agent(f)
    assert a.status == D.WARN and "no agent answers on 127.0.0.1:9471" in a.detail
    f.agent_rows = [{"peer": "h1", "plane": 0, "state": "down"}, {"peer": "h1", "plane": 1, "state": "up"},
                    {"peer": "h2", "plane": 0, "state": "recovering"}]
    a = D.check_agent(f)
    assert a.status == D.WARN and "3 paths, 1 down, 1 degraded/recovering (h1/p0)" in a.detail
    f.agent_rows = [{"peer": "h1", "plane": 0, "state": "damped"}]
    assert D.check_agent(f).status == D.FAIL
    f.agent_rows = []
    assert D.check_agent(f).status == D.WARN


def test_without_config_the_config_checks_skip_and_count_for_nothing():
    f = replace(healthy(), config_path=None, nics=(), peers=())
    checks = D.run_checks(f)
    assert by_name(checks)["config"].status == D.SKIP
    assert not any(c.name.startswith(("nic.", "route.")) for c in checks)
    assert DC.exit_code(checks) == 0


def test_clock_and_cap_readers_on_this_machine():
    clock = G.read_clock()  # adjtimex with modes=0 reads only
    assert clock["state"] in range(6) and clock["esterror_us"] >= 0
    assert G.read_cap_eff() is not None


def test_gather_reports_a_bad_config_as_a_failed_check(tmp_path):
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("agent_id: 1\nname: h0\n")
    f = G.gather(None, str(cfg), api_port=1, ip_json=lambda *a: [])
    c = by_name(D.run_checks(f))
    assert c["config"].status == D.FAIL and "fleet_key_file: required field is missing" in c["config"].detail
    assert c["agent"].status == D.WARN  # nothing listens on port 1


def mixed_report() -> dict:
    f = healthy()
    f.sysctl = dict(f.sysctl, **{"net.ipv4.fib_multipath_hash_policy": "0",
                                 "net.ipv4.ip_local_port_range": "32768 60999"})
    f.rdma = []
    f.clock = {"state": 5, "status": 0x40, "esterror_us": 16_000_000, "maxerror_us": 16_000_000}
    f.agent_rows, f.agent_error = None, "Connection refused"
    f.netns = "lp-h0"
    f.links = dict(f.links, p1={"operstate": "DOWN", "flags": ["UP"], "addrs": ["198.18.72.1/31"]})
    checks = D.run_checks(f)
    return D.report(checks, "gpu-node-17", "lp-h0", "/etc/linkpass/agent.yaml")


@pytest.mark.parametrize("fmt", ["table", "wide", "json"])
def test_rendering_matches_golden(fmt, monkeypatch, capsys):
    monkeypatch.setenv("NO_COLOR", "1")
    doc = mixed_report()
    DC.emit(doc, fmt, lambda d: DC.render(d, wide=fmt == "wide"))
    check_golden(f"doctor_{fmt}.txt", capsys.readouterr().out)


def test_command_line(monkeypatch, capsys):
    """register() wires the options; a missing namespace is a usage error (exit 3)."""
    ap = argparse.ArgumentParser()
    DC.register(ap.add_subparsers(dest="command"))
    args = ap.parse_args(["doctor", "--netns", "no-such-namespace-xyz", "-o", "json"])
    assert args.func(args) == 3
    assert "no network namespace 'no-such-namespace-xyz'" in capsys.readouterr().err


@pytest.mark.parametrize("change,status,words", [
    ({"coordinator_url": None, "coordinator_whoami": None}, D.SKIP, "fails over alone"),
    ({"coordinator_whoami": None, "coordinator_error": "Connection refused"}, D.WARN, "does not answer"),
    ({"coordinator_whoami": None, "coordinator_refused": True, "coordinator_error": "HTTP 401"}, D.FAIL, "refuses"),
    ({"coordinator_whoami": {"name": "oncall", "role": "operator"}}, D.FAIL, "role 'operator'"),
    ({"coordinator_url": "http://198.19.0.1:9470"}, D.WARN, "over plain HTTP"),
    # an agent token of another host: the coordinator would refuse every report
    ({"agent_name": "h0", "coordinator_whoami": {"name": "h1", "role": "agent", "host": "h1"}}, D.FAIL,
     "reports as 'h0'"),
])
def test_coordinator_check(change, status, words):
    c = D.check_coordinator(dataclasses.replace(healthy(), **change))
    assert c.status == status and words in c.detail, c


@pytest.mark.unit
def test_statuses_derive_their_exit_code_and_colour_from_the_health_levels(monkeypatch):
    """A status says which health level (core/states.py) it counts as, and nothing more: doctor's
    exit code and colours come from the CLI's one table per level (console/output.py). Changing
    that table changes doctor, so no copy of it can hide here."""
    from linkpass.console import output
    from linkpass.core.states import Level

    assert D.OK == Level.OK.value
    assert set(D.LEVEL_OF_STATUS) == set(D.STATUSES)
    assert all(lv is None or isinstance(lv, Level) for lv in D.LEVEL_OF_STATUS.values())
    for level, code in zip(Level, (97, 98, 99)):
        monkeypatch.setitem(output.EXIT_OF_LEVEL, level, code)
    monkeypatch.setitem(output.COLOUR_OF_LEVEL, Level.WARNING, "bold")
    monkeypatch.setattr(output, "use_color", lambda stream=None: True)
    for status, level in D.LEVEL_OF_STATUS.items():
        check = D.Check("c", status, "detail")
        assert DC.exit_code([check]) == output.EXIT_OF_LEVEL[level or Level.OK], status
    text = DC.render(D.report([D.Check("c", D.WARN, "d")], "h0", None, None))
    assert "\033[1mwarn\033[0m" in text and "\033[1mready, with warnings\033[0m" in text
