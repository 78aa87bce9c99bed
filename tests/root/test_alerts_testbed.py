"""A real Prometheus on the testbed: it scrapes every agent over the management network and the
coordinator over HTTPS, with the project's rules (LAB durations); each kind of fault fires its
alert and the alert clears once the fabric has healed, and a healthy fabric fires nothing.

Agents probe every 10 ms (four agents and the software fabric share two cores); the coordinator
runs in this process (the Ray actor runs the same server: tests/root/test_coordinator_fleet.py)."""
from __future__ import annotations

import os
import time

import pytest

from linkpass.coordinator import startup
from linkpass.control.tls import lab_dir
from linkpass.core.constants import AGENT_METRICS_PORT
from linkpass.testbed.prometheus import for_lab
from linkpass.testbed import faults
from linkpass.testbed.agents import Agents
from linkpass.testbed.faults import FaultSpec

from support.coordinator import coordinator_on_testbed
from support.ports import free_port
from support.waiting import wait_until

HOSTS = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def lab(fabric, tmp_path_factory):
    faults.clear(fabric.prefix)
    d = tmp_path_factory.mktemp("alerts")
    port = free_port()
    settings, link = coordinator_on_testbed(fabric, str(d / "state"), port)
    server = startup.start(settings)
    agents = prom = None
    try:
        agents = Agents(fabric, str(d / "agents"), HOSTS, interval_ms=10.0, coordinator=link,
                        detect={"flap_half_life_ms": 2000}, tls_dir=lab_dir(settings["state_dir"])).start()
        prom = for_lab([f"{fabric.mgmt_addr(h)}:{AGENT_METRICS_PORT}" for h in HOSTS],
                       f"{fabric.mgmt_root_addr}:{port}", lab_dir(settings["state_dir"]),
                       os.path.join(settings["state_dir"], "reader.token"))
        wait_until(lambda: (lambda t: len(t) == 5 and all(t.values()))(prom.targets_up()), 30,
                   "Prometheus to scrape 4 agents and the coordinator", prom.targets_up)
        yield fabric, agents, prom
    finally:
        if prom is not None:
            prom.close()
        codes = agents.stop() if agents is not None else {}
        faults.clear(fabric.prefix)
        if agents is not None:
            agents.remove_routes()  # the shared fabric's other tests expect hosts without LinkPass routes
        server.close()
        server.service.coordinator.store.close()
        assert all(c == 0 for c in codes.values()), codes


def settle(lab) -> None:
    """Every path up and no alert pending or firing: the start of each case."""
    fab, agents, prom = lab
    assert agents.wait_healthy(timeout_s=90), agents.not_up()
    wait_until(lambda: not prom.alerts(), 90, "every alert to clear", prom.alerts)


def test_a_healthy_fabric_fires_nothing(lab):
    prom = lab[2]
    settle(lab)
    start = time.time()
    time.sleep(20)
    # Nothing on its way to firing either. A path seen down at a single scrape (probes lost or late
    # while this shared 2-core host is busy) is pending for one evaluation and clears well
    # before its `for`; a state that stays pending would fire, and any that fired is in the spans.
    wait_until(lambda: not [a for a in prom.alerts() if a["state"] == "pending"], 15,
               "every pending alert to clear", prom.alerts)
    fired = prom.firing_spans(start, time.time())
    assert not fired, fired


# (fault, the alert it must fire): one of each kind the testbed makes
CASES = [
    (FaultSpec("down", "h1-p0l0"), "LinkPassPlaneDown"),  # a host's only uplink on plane 0
    (FaultSpec("down", "p1l0-p1s0"), "LinkPassPathDown"),  # one of a leaf's two spine links
    # gray loss as it hurts collectives: light, one way. Heavy loss (tens of %) also drops three probes
    # in a row and flaps paths: LinkPassPathFlapping's, and GrayLoss keeps quiet after an outage
    (FaultSpec("loss", "p0l0-p0s1", direction="p0l0", params={"pct": 2}), "LinkPassGrayLoss"),
    (FaultSpec("flap", "h2-p1l1", params={"period": "200ms", "duration": "20s"}), "LinkPassPathFlapping"),
    (FaultSpec("mtu", "p0l1-p0s0", params={"bytes": 1200}), "LinkPassPathDegraded"),
]


@pytest.mark.parametrize("fault,alert", CASES, ids=[f"{f.kind}-{a}" for f, a in CASES])
def test_each_fault_fires_its_alert_and_clears_after(lab, fault, alert):
    fab, agents, prom = lab
    settle(lab)
    t0 = time.time()
    faults.apply(fab.prefix, fault)
    try:
        wait_until(lambda: alert in prom.firing(), 45, f"{alert} to fire for {fault}", prom.alerts)
        fired_after = time.time() - t0
        if fault.kind in ("down", "loss"):  # the coordinator names the link once several hosts see it
            wait_until(lambda: "LinkPassLinkLocalized" in prom.firing(), 45, "the link to be localized", prom.alerts)
            got = [a["labels"] for a in prom.alerts() if a["labels"]["alertname"] == "LinkPassLinkLocalized"]
            assert any(fault.link in (lbl["link"], f'{lbl["b"]}-{lbl["a"]}') or
                       {lbl["a"], lbl["b"]} == set(fault.link.split("-")) for lbl in got), got
    finally:
        faults.clear(fab.prefix)
    wait_until(lambda: alert not in prom.firing(), 90, f"{alert} to clear", prom.alerts)
    now = time.time()
    spans, instances = prom.firing_spans(t0, now), prom.firing_spans(t0, now, merge=False)
    assert alert in spans and spans[alert][0][0] >= t0 - 1, spans
    assert len(instances[alert]) >= len(spans[alert]) and instances[alert][0][0] == spans[alert][0][0], instances
    print(f"{fault.kind} {fault.link}: {alert} fired {fired_after:.1f} s after the fault; spans {spans}")
