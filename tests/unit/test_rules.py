"""The Prometheus rules in deploy/prometheus/: generated from linkpass/observe/rules.py, valid for
`promtool check rules`, and each alert fired (and cleared) by `promtool test rules` on series
shaped as the agents and the coordinator export them, with the summary on-call reads; nothing
fires on a healthy fleet. Every alert has its runbook section."""
from __future__ import annotations

import os
import re

import pytest
import yaml

from linkpass.observe import rules as R
from linkpass.testbed.prometheus import promtool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RULES_FILE = os.path.join(ROOT, "deploy", "prometheus", "linkpass-rules.yml")
RUNBOOKS = os.path.join(ROOT, "docs", "runbooks.md")
A = 'job="linkpass-agent",instance="h0:9472"'
C = 'job="linkpass-coordinator",instance="198.19.0.1:9470"'
AL = {"job": "linkpass-agent", "instance": "h0:9472"}
CL = {"job": "linkpass-coordinator", "instance": "198.19.0.1:9470"}
STATES = ("up", "suspect", "down", "degraded", "damped", "recovering")


def paths(peer: str, plane: int, **values: str) -> list[dict]:
    """linkpass_peer_paths of one (peer, plane): `values` per state, the others 0."""
    return [{"series": f'linkpass_peer_paths{{{A},peer="{peer}",plane="{plane}",state="{s}"}}',
             "values": values.get(s, "0x40")} for s in STATES]


def healthy() -> list[dict]:
    """A calm fleet: every series the alerts read, at good values, for 40 minutes."""
    return [*paths("h1", 0, up="2x40"), *paths("h1", 1, up="2x40"),
            {"series": f'linkpass_peer_loss_ratio{{{A},peer="h1",plane="0",direction="forward"}}', "values": "0x40"},
            {"series": f'linkpass_peer_loss_ratio{{{A},peer="h1",plane="0",direction="reverse"}}', "values": "0x40"},
            {"series": f"linkpass_fail_static_peers{{{A}}}", "values": "0x40"},
            {"series": f"up{{{A}}}", "values": "1x40"},
            {"series": f"up{{{C}}}", "values": "1x40"},
            {"series": f"linkpass_agent_probe_thread_up{{{A}}}", "values": "1x40"},
            {"series": f'linkpass_coordinator_agent_up{{{C},host="h3"}}', "values": "1x40"},
            {"series": f"linkpass_coordinator_requests_pending{{{C}}}", "values": "1x40"},
            {"series": f"linkpass_coordinator_requests_pending_limit{{{C}}}", "values": "64x40"},
            {"series": f"linkpass_route_changes_total{{{A}}}", "values": "0+2x40"},
            {"series": f"linkpass_route_changes_deferred_total{{{A}}}", "values": "0x40"},
            {"series": f"process_cpu_seconds_total{{{A}}}", "values": "0+3x40"},  # 5 % of a core
            {"series": f'linkpass_probe_dropped_packets_total{{{A},reason="bad_length"}}', "values": "0+1x40"}]


# alert -> (series replacing the healthy ones of the same name, eval minute, labels, summary)
FIRES = {
    "LinkPassPlaneDown": (paths("h1", 0, up="2 0x40", down="0 2x40"), 5, {**AL, "peer": "h1", "plane": "0"},
                          "h0:9472 → h1, plane 0: no usable path on this plane; traffic runs on the other planes"),
    "LinkPassPathDown": (paths("h1", 0, up="2 1x40", down="0 1x40"), 5, {**AL, "peer": "h1", "plane": "0"},
                         "h0:9472 → h1, plane 0: 1 path(s) down; traffic moved to the plane's other paths"),
    "LinkPassPathDegraded": (
        paths("h1", 1, up="2 1x40", degraded="0 1x40"), 5, {**AL, "peer": "h1", "plane": "1"},
        "h0:9472 → h1, plane 1: 1 path(s) degraded (gray loss, delay or MTU); traffic moved off"),
    "LinkPassPathFlapping": (paths("h1", 1, up="2 1x40", damped="0 1x40"), 8, {**AL, "peer": "h1", "plane": "1"},
                             "h0:9472 → h1, plane 1: 1 path(s) flapping and held out (damped)"),
    "LinkPassGrayLoss": ([{"series": f'linkpass_peer_loss_ratio{{{A},peer="h1",plane="0",direction="reverse"}}',
                           "values": "0 0.3x40"}], 5, {**AL, "peer": "h1", "plane": "0", "direction": "reverse"},
                         "h0:9472 → h1, plane 0: 30% reverse loss on its worst path"),
    "LinkPassFailStatic": ([{"series": f"linkpass_fail_static_peers{{{A}}}", "values": "0 2x40"}], 5, AL,
                           "h0:9472: 2 peer(s) with no usable path on any plane"),
    "LinkPassLinkLocalized": ([{"series": f'linkpass_coordinator_link_fault{{{C},link="p0l0-p0s1",direction="forward",'
                                          f'a="p0l0",b="p0s1"}}', "values": "0 0.9x40"}], 5,
                              {**CL, "link": "p0l0-p0s1", "direction": "forward", "a": "p0l0", "b": "p0s1"},
                              "Fault localized to link p0l0-p0s1 (p0l0 – p0s1, forward)"),
    "LinkPassAgentDown": ([{"series": f"up{{{A}}}", "values": "1 0x40"}], 5, AL,
                          "Agent h0:9472 does not answer Prometheus"),
    "LinkPassAgentLost": ([{"series": f'linkpass_coordinator_agent_up{{{C},host="h3"}}', "values": "1 0x40"}], 5,
                          {**CL, "host": "h3"}, "Agent h3 stopped reporting to the coordinator"),
    "LinkPassProbeThreadStalled": ([{"series": f"linkpass_agent_probe_thread_up{{{A}}}", "values": "1 0x40"}], 5, AL,
                                   "h0:9472: the probe thread is stalled; this host is blind to link failures"),
    "LinkPassCoordinatorAway": ([{"series": f"up{{{C}}}", "values": "1 0x40"}], 10, {},
                                "The LinkPass coordinator is away"),
    "LinkPassCoordinatorOverloaded": ([{"series": f"linkpass_coordinator_requests_pending{{{C}}}", "values": "60x40"}],
                                      20, CL, "The coordinator is near its request limit or slow to answer reports"),
    "LinkPassCoordinatorShardBackedUp": ([{"series": f'linkpass_coordinator_shard_queue{{{C},shard="3"}}',
                                           "values": "0 6000x40"},
                                          {"series": f'linkpass_coordinator_shard_queue_limit{{{C},shard="3"}}',
                                           "values": "10000x40"}], 10, {**CL, "shard": "3"},
                                         "Coordinator shard 3 holds reports the root does not take"),
    "LinkPassCoordinatorShardNotLocalizing": ([{"series": f"linkpass_coordinator_localization_stood_in{{{C}}}",
                                                "values": "0 2x40"}], 15, CL,
                                              "The coordinator's root localizes 2 shard part(s) itself"),
    "LinkPassRouteChangeStorm": ([{"series": f"linkpass_route_changes_total{{{A}}}", "values": "0+300x40"}], 15, AL,
                                 "h0:9472: route changes are storming"),
    "LinkPassProbeOverload": ([{"series": f"process_cpu_seconds_total{{{A}}}", "values": "0+45x40"}], 25, AL,
                              "h0:9472: the agent is over its probe budget"),
    "LinkPassProbesForged": ([{"series": f'linkpass_probe_dropped_packets_total{{{A},reason="bad_tag"}}',
                               "values": "0+10x40"}], 15, AL, "h0:9472: probe packets fail authentication"),
}
# faults that end: the alert clears once the series is healthy again (eval minute after the end)
CLEARS = {
    "LinkPassPlaneDown": (paths("h1", 0, up="2 0x5 2x30", down="0 2x5 0x30"), 12),
    "LinkPassGrayLoss": ([{"series": f'linkpass_peer_loss_ratio{{{A},peer="h1",plane="0",direction="reverse"}}',
                           "values": "0 0.3x5 0x30"}], 12),
    "LinkPassAgentDown": ([{"series": f"up{{{A}}}", "values": "1 0x5 1x30"}], 12),
}


def merged(series: list[dict]) -> list[dict]:
    names = {s["series"] for s in series}
    return [s for s in healthy() if s["series"] not in names] + series


def alert_rules() -> dict[str, dict]:
    return {r["alert"]: r for r in R.alerts(R.PRODUCTION)}


def annotations(alert: str, summary: str) -> dict:
    a = alert_rules()[alert]["annotations"]
    return {"summary": summary, "description": a["description"].replace("{{ $value }}", "0.9"),
            "runbook_url": a["runbook_url"]}


def promtool_tests() -> dict:
    tests = []
    for alert, (series, minute, labels, summary) in FIRES.items():
        expected = {"exp_labels": {"severity": alert_rules()[alert]["labels"]["severity"], **labels},
                    "exp_annotations": annotations(alert, summary)}
        tests.append({"interval": "1m", "input_series": merged(series),
                      "alert_rule_test": [{"eval_time": f"{minute}m", "alertname": alert, "exp_alerts": [expected]}]})
    for alert, (series, minute) in CLEARS.items():
        tests.append({"interval": "1m", "input_series": merged(series),
                      "alert_rule_test": [{"eval_time": f"{minute}m", "alertname": alert, "exp_alerts": []}]})
    tests.append({"interval": "1m", "input_series": healthy(),
                  "alert_rule_test": [{"eval_time": f"{m}m", "alertname": a, "exp_alerts": []}
                                      for a in alert_rules() for m in (5, 30)]})
    # the recording rules: fleet health at a glance
    tests.append({"interval": "1m", "input_series": merged(FIRES["LinkPassPlaneDown"][0]),
                  "promql_expr_test": [
                      {"expr": "job:linkpass_peer_planes_unusable:count", "eval_time": "5m",
                       "exp_samples": [{"labels": 'job:linkpass_peer_planes_unusable:count{job="linkpass-agent"}',
                                        "value": 1}]},
                      {"expr": 'job:linkpass_peer_paths:sum{state="down"}', "eval_time": "5m",
                       "exp_samples": [{"labels": 'job:linkpass_peer_paths:sum{job="linkpass-agent",state="down"}',
                                        "value": 2}]}]})
    tests.append({"interval": "1m", "input_series": healthy(),
                  "promql_expr_test": [
                      {"expr": "job:linkpass_peer_planes_unusable:count", "eval_time": "5m",
                       "exp_samples": [{"labels": 'job:linkpass_peer_planes_unusable:count{job="linkpass-agent"}',
                                        "value": 0}]}]})
    return {"rule_files": [RULES_FILE], "evaluation_interval": "1m", "tests": tests}


def test_the_checked_in_rules_are_what_the_generator_makes():
    with open(RULES_FILE) as f:
        assert f.read() == R.render(R.PRODUCTION), "run `python -m linkpass.observe.rules --out " \
                                                   "deploy/prometheus/linkpass-rules.yml`"


@pytest.mark.parametrize("config", [R.PRODUCTION, R.LAB], ids=["production", "lab"])
def test_promtool_checks_the_rules(tmp_path, config):
    f = tmp_path / "rules.yml"
    f.write_text(R.render(config))
    out = promtool("check", "rules", str(f))
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_fires_with_its_summary_and_nothing_fires_on_a_healthy_fleet(tmp_path):
    assert set(FIRES) == set(alert_rules()), "every alert needs a case here"
    f = tmp_path / "linkpass.test.yml"
    f.write_text(yaml.safe_dump(promtool_tests(), sort_keys=False, allow_unicode=True))
    out = promtool("test", "rules", str(f), timeout=120)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_promtool_test_rules_can_fail(tmp_path):
    """The harness is live: a case expecting the wrong summary is reported."""
    doc = promtool_tests()
    case = doc["tests"][0]["alert_rule_test"][0]["exp_alerts"][0]
    case["exp_annotations"]["summary"] = "something else"
    f = tmp_path / "wrong.test.yml"
    f.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    out = promtool("test", "rules", str(f), timeout=120)
    assert out.returncode != 0 and "something else" in out.stdout + out.stderr


def test_every_alert_has_severity_summary_and_a_runbook_section():
    with open(RUNBOOKS) as f:
        anchors = {re.sub(r"[^a-z0-9-]", "", line[3:].strip().lower().replace(" ", "-"))
                   for line in f if line.startswith("## ")}
    for name, rule in alert_rules().items():
        assert rule["labels"]["severity"] in ("critical", "warning")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        url = rule["annotations"]["runbook_url"]
        assert url.startswith(R.PRODUCTION.runbook_base + "#") and url.split("#")[1] in anchors, (name, sorted(anchors))


def test_loss_right_after_an_outage_is_not_gray_loss(tmp_path):
    """Probes lost while a plane's paths were down stay in the agent's loss window (10 s) after
    they are back: that is the outage (LinkPassPathDown), and LinkPassGrayLoss keeps quiet about
    it; the same loss with no outage fires. At the lab's durations, where the window outlasts `for:`."""
    rules = tmp_path / "lab.yml"
    rules.write_text(R.render(R.LAB))
    loss = {"series": f'linkpass_peer_loss_ratio{{{A},peer="h1",plane="0",direction="forward"}}',
            "values": "0 0 0 0.4x9 0x30"}
    after_outage = [*paths("h1", 0, up="2 0 0 2x40", down="0 2 2 0x40"), loss]
    no_outage = [*paths("h1", 0, up="2x40"), loss]
    fires = {"exp_labels": {"severity": "warning", **AL, "peer": "h1", "plane": "0", "direction": "forward"},
             "exp_annotations": annotations("LinkPassGrayLoss",
                                            "h0:9472 → h1, plane 0: 40% forward loss on its worst path")}
    doc = {"rule_files": [str(rules)], "evaluation_interval": "1s", "tests": [
        {"interval": "1s", "input_series": series, "alert_rule_test": [
            {"eval_time": "8s", "alertname": "LinkPassGrayLoss", "exp_alerts": expected}]}
        for series, expected in ((after_outage, []), (no_outage, [fires]))]}
    f = tmp_path / "quiet.test.yml"
    f.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    out = promtool("test", "rules", str(f), timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_the_example_prometheus_config_is_valid_and_names_the_rules_jobs(tmp_path):
    """deploy/prometheus/prometheus.yml passes `promtool check config` (its rule file included),
    with its /etc paths pointed at files made here, and scrapes the jobs the rules select."""
    src = os.path.join(ROOT, "deploy", "prometheus")
    etc = tmp_path / "etc" / "prometheus"
    (etc / "linkpass").mkdir(parents=True)
    (etc / "linkpass-agents").mkdir()
    for name in ("ca.crt", "prometheus.crt", "prometheus.key", "reader.token"):
        (etc / "linkpass" / name).write_text("")
    (etc / "linkpass-agents" / "rack1.yml").write_text('- targets: ["198.19.0.2:9472"]\n')
    with open(os.path.join(src, "prometheus.yml")) as f:
        text = f.read()
    doc = yaml.safe_load(text)
    assert [j["job_name"] for j in doc["scrape_configs"]] == ["linkpass-agent", "linkpass-coordinator"]
    assert f'job="{doc["scrape_configs"][0]["job_name"]}"' == R.PRODUCTION.agent
    assert f'job="{doc["scrape_configs"][1]["job_name"]}"' == R.PRODUCTION.coordinator
    (tmp_path / "prometheus.yml").write_text(text.replace("/etc/prometheus/", f"{etc}/"))
    (tmp_path / "linkpass-rules.yml").write_text(open(RULES_FILE).read())
    out = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert out.returncode == 0 and "1 rule files found" in out.stdout, out.stdout + out.stderr
