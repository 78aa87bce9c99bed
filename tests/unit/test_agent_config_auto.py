"""One config for a whole fleet: `auto` identity, service address, NICs and metrics address,
derived from what the host shows (agent/config.py: HostFacts), and errors that name the field."""
from __future__ import annotations

import pytest
import yaml

from linkpass.agent.config import ConfigError, HostFacts, agent_id_of, load_text, parse


TEMPLATE = yaml.safe_load("""
agent_id: auto
name: auto
service: auto
fleet_key_file: /etc/linkpass/fleet.key
nics: auto
host:
  service_subnet: 198.18.0.0/24
  management_subnet: 198.19.0.0/24
  planes:
    - {plane: 0, subnet: 198.18.64.0/18}
    - {plane: 1, subnet: 198.18.128.0/18}
metrics: {address: auto, port: 9472}
peers:
  - {name: h0, agent_id: 3323068417, service: 198.18.0.1, nics: {0: 198.18.64.1, 1: 198.18.128.1}}
  - {name: h1, agent_id: 3323068418, service: 198.18.0.2, nics: {0: 198.18.64.3, 1: 198.18.128.3}}
  - {name: h2, agent_id: 3323068419, service: 198.18.0.3, nics: {0: 198.18.64.9, 1: 198.18.128.9}}
""")


def host(i: int, **kw) -> HostFacts:
    """Host hI of the template's fleet: service 198.18.0.(I+1), a /31 per plane, management 198.19.0.(I+1)."""
    nic = {0: "198.18.64.{}", 1: "198.18.128.{}"}
    last = {0: 1, 1: 3, 2: 9}[i]
    addrs = (("lo", f"198.18.0.{i + 1}/32"), ("mgmt", f"198.19.0.{i + 1}/24"),
             ("p0", nic[0].format(last) + "/31"), ("p1", nic[1].format(last) + "/31"), ("p1", "fe80::1/64"))
    return HostFacts(kw.get("hostname", f"h{i}"), kw.get("addrs", addrs), kw.get("next_hops", ()))


def test_one_template_gives_each_host_its_own_identity_nics_and_peers():
    cfgs = [parse(TEMPLATE, host(i)) for i in range(3)]
    assert [c.name for c in cfgs] == ["h0", "h1", "h2"]
    assert [c.service for c in cfgs] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
    assert [c.agent_id for c in cfgs] == [3323068417, 3323068418, 3323068419]  # the service address as a number
    c1 = cfgs[1]
    assert [(n.plane, n.ifname, n.addr, n.gateway) for n in c1.nics] == [
        (0, "p0", "198.18.64.3", "198.18.64.2"), (1, "p1", "198.18.128.3", "198.18.128.2")]  # the /31's other end
    assert c1.metrics_address == "198.19.0.2"
    assert [p.name for p in c1.peers] == ["h0", "h2"]  # itself left out of the fleet-wide list


def test_gateway_from_a_30_and_from_the_interfaces_routes():
    doc = dict(TEMPLATE, metrics={"port": 9472})
    addrs = (("lo", "198.18.0.1/32"), ("p0", "198.18.64.1/30"), ("p1", "198.18.128.5/24"))
    cfg = parse(doc, HostFacts("h0", addrs, (("p1", "198.18.128.1"), ("p1", "198.18.128.1"), ("eth0", "10.0.0.1"))))
    assert [n.gateway for n in cfg.nics] == ["198.18.64.2", "198.18.128.1"]
    # no /31, no route: no gateway, which routes.enabled then asks for by name
    bare = HostFacts("h0", addrs)
    assert [n.gateway for n in parse(doc, bare).nics] == ["198.18.64.2", None]
    with pytest.raises(ConfigError, match=r"nics\[1\]\.gateway: required when routes.enabled"):
        parse(dict(doc, routes={"enabled": True}), bare)


@pytest.mark.parametrize("change, facts, words", [
    ({}, None, "name: auto is derived from this host.s addresses"),
    ({"host": {"planes": [{"plane": 0, "subnet": "198.18.64.0/18"}]}}, "h0", "service: auto needs host.service_subnet"),
    ({"nics": "auto", "host": {"service_subnet": "198.18.0.0/24"}, "metrics": {}}, "h0",
     "nics: auto needs host.planes"),
    ({"metrics": {"address": "auto"}, "host": {"service_subnet": "198.18.0.0/24", "planes": []}}, "h0",
     "metrics.address: auto needs host.management_subnet"),
    ({"host": dict(TEMPLATE["host"], service_subnet="10.9.0.0/16")}, "h0",
     r"service: auto found no address in 10.9.0.0/16 on this host \(its addresses: lo 198.18.0.1/32"),
    ({"host": dict(TEMPLATE["host"], planes=[{"plane": 0, "subnet": "198.18.0.0/16"}])}, "h0",
     r"nics \(plane 0\): auto found 3 addresses"),
    ({"host": dict(TEMPLATE["host"], planes=[{"plane": 0, "subnet": "nope"}])}, "h0",
     r"host.planes\[0\].subnet: 'nope' is not a subnet"),
    ({"host": {"subnets": []}}, "h0", "host.subnets: unknown field"),
    ({"host": dict(TEMPLATE["host"], planes=[{"plane": 0, "subnet": "198.18.64.0/18"},
                                             {"plane": 0, "subnet": "198.18.128.0/18"}])}, "h0",
     "host.planes: plane listed twice"),
])
def test_auto_errors_name_the_field_and_the_fix(change, facts, words):
    with pytest.raises(ConfigError, match=words):
        parse(dict(TEMPLATE, **change), host(0) if facts else None)


def test_a_host_without_a_name_and_an_id_of_zero_are_refused():
    with pytest.raises(ConfigError, match="name: auto, but this host has no host name"):
        parse(TEMPLATE, host(0, hostname=""))
    with pytest.raises(ConfigError, match="agent_id: auto gives 0"):
        agent_id_of("::")
    assert agent_id_of("fd00::1:2") == 0x10002


def test_explicit_values_need_no_host_facts_and_win_over_nothing():
    doc = {k: v for k, v in TEMPLATE.items() if k not in ("host", "metrics")}
    doc.update(agent_id=7, name="gpu-7", service="198.18.0.7",
               nics=[{"plane": 0, "ifname": "p0", "addr": "198.18.64.13"}])
    cfg = load_text(yaml.safe_dump(doc), "agent.yaml")  # no facts needed: nothing is auto
    assert (cfg.agent_id, cfg.name, len(cfg.peers)) == (7, "gpu-7", 3)
