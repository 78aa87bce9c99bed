"""LinkPass's Prometheus rules, monitoring-mixin style: recording rules for fleet health and one
alert per fault LinkPass sees, each with a severity, a summary an on-call engineer understands
at 3 a.m. and a `runbook_url` into docs/runbooks.md.

The rules are generated from `RulesConfig` (selectors, thresholds, `for:` durations, the runbook
base), so a site tunes the parameters, not the expressions:

    python -m linkpass.observe.rules --out deploy/prometheus/linkpass-rules.yml       # production
    python -m linkpass.observe.rules --lab --out FILE        # the demo's and tests' short durations

`LAB` is the same rules with durations of seconds: the demo and the testbed tests watch alerts
fire and clear within a fault of ~20 s. tests/unit/test_rules.py runs `promtool check rules` and
`promtool test rules` (tests/prometheus/*.test.yml) on the production file.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace

from ..core.states import USABLE as USABLE_STATES

USABLE = f'state=~"{"|".join(s.value for s in USABLE_STATES)}"'  # the states traffic may use (core/states.py)


@dataclass(frozen=True)
class RulesConfig:
    agent: str = 'job="linkpass-agent"'  # selects every agent's /metrics
    coordinator: str = 'job="linkpass-coordinator"'
    runbook_base: str = "file:///opt/linkpass/docs/runbooks.md"
    rate_window: str = "5m"
    # a path stays out for seconds after a fault (hold-down, recovery probes): alert on what lasts
    path_down_for: str = "2m"
    plane_down_for: str = "1m"
    flapping_for: str = "5m"
    gray_loss_ratio: float = 0.005  # 0.5 % on one direction of one path: RoCE's goodput collapses near 1 %
    gray_loss_for: str = "2m"
    # probes lost while a path was down (or flapping) read as loss for the agent's window (10 s)
    # after it is back: the outage (LinkPassPathDown, LinkPassPathFlapping), not a gray link
    gray_after_down: str = "2m"
    fail_static_for: str = "1m"
    link_localized_for: str = "1m"
    agent_down_for: str = "2m"
    probe_thread_for: str = "1m"
    coordinator_away_for: str = "5m"  # agents fail over alone; the fleet view and drains wait
    route_changes_per_min: float = 120.0  # per host, sustained: a storm, not failover
    route_storm_for: str = "5m"
    probe_cpu_cores: float = 0.5  # an agent above this share of a core is over its budget
    overload_for: str = "15m"
    forged_for: str = "5m"
    coordinator_pending_ratio: float = 0.8
    shard_queue_ratio: float = 0.5  # a shard's queue for the root this full: the root does not keep up
    shard_queue_for: str = "5m"
    shard_stood_in_for: str = "10m"  # a shard's part localized by the root: slower, same findings
    coordinator_latency_p99_s: float = 1.0


PRODUCTION = RulesConfig()
# the demo's faults last 2-3 s: a state must hold for two evaluations (1 s apart), not minutes
LAB = replace(PRODUCTION, rate_window="20s", path_down_for="1s", plane_down_for="1s", flapping_for="1s",
              gray_loss_for="1s", gray_after_down="15s", fail_static_for="1s", link_localized_for="1s",
              agent_down_for="10s",
              probe_thread_for="5s", coordinator_away_for="10s", route_storm_for="10s", overload_for="1m",
              forged_for="10s", shard_queue_for="10s", shard_stood_in_for="10s")


def recording(c: RulesConfig) -> list[dict]:
    """Fleet health at a glance (dashboards and the alerts' context), cheap to query."""
    w = c.rate_window
    return [
        {"record": "job:linkpass_peer_paths:sum", "expr": f"sum by (job, state) (linkpass_peer_paths{{{c.agent}}})"},
        {"record": "job:linkpass_peer_planes_unusable:count",
         "expr": f"count by (job) (sum by (job, instance, peer, plane) (linkpass_peer_paths{{{c.agent},{USABLE}}}) "
                 f"== 0) or sum by (job) (up{{{c.agent}}}) * 0"},
        {"record": "job:linkpass_agents_up:ratio", "expr": f"avg by (job) (up{{{c.agent}}})"},
        {"record": "job:linkpass_fail_static_peers:sum",
         "expr": f"sum by (job) (linkpass_fail_static_peers{{{c.agent}}})"},
        {"record": "job:linkpass_peer_loss_ratio:max",
         "expr": f"max by (job, direction) (linkpass_peer_loss_ratio{{{c.agent}}})"},
        {"record": "instance:linkpass_route_changes:rate" + w,
         "expr": f"sum by (job, instance) (rate(linkpass_route_changes_total{{{c.agent}}}[{w}]))"},
        {"record": "instance:linkpass_agent_cpu:rate" + w,
         "expr": f"rate(process_cpu_seconds_total{{{c.agent}}}[{w}])"},
        {"record": "job:linkpass_coordinator_request_duration_seconds:p99_rate" + w,
         "expr": f"histogram_quantile(0.99, sum by (job, le, path) "
                 f"(rate(linkpass_coordinator_request_duration_seconds_bucket{{{c.coordinator}}}[{w}])))"},
    ]


def _alert(c: RulesConfig, name: str, expr: str, for_: str, severity: str, summary: str, description: str) -> dict:
    return {"alert": name, "expr": expr, "for": for_, "labels": {"severity": severity},
            "annotations": {"summary": summary, "description": description,
                            "runbook_url": f"{c.runbook_base}#{name.lower()}"}}


def alerts(c: RulesConfig) -> list[dict]:
    a, w = c.agent, c.rate_window
    at_peer = "{{ $labels.instance }} → {{ $labels.peer }}, plane {{ $labels.plane }}"
    return [
        _alert(c, "LinkPassPlaneDown",
               f"sum by (job, instance, peer, plane) (linkpass_peer_paths{{{a},{USABLE}}}) == 0 "
               f"and sum by (job, instance, peer, plane) (linkpass_peer_paths{{{a}}}) > 0",
               c.plane_down_for, "critical",
               f"{at_peer}: no usable path on this plane; traffic runs on the other planes",
               "Every discovered path between these two hosts on this plane is down, degraded or damped. "
               "The agent moved the peer's route and RDMA source ports to the remaining planes, so jobs run "
               "with one plane less of bandwidth. Usually one link: a host uplink or a leaf's spine links."),
        _alert(c, "LinkPassPathDown",
               f"sum by (job, instance, peer, plane) (linkpass_peer_paths{{{a},state=\"down\"}}) > 0",
               c.path_down_for, "warning",
               f"{at_peer}: {{{{ $value }}}} path(s) down; traffic moved to the plane's other paths",
               "Probes on these ECMP paths get no answers. The agent keeps traffic off them; the coordinator "
               "localizes the link when several hosts see it (LinkPassLinkLocalized)."),
        _alert(c, "LinkPassPathDegraded",
               f"sum by (job, instance, peer, plane) (linkpass_peer_paths{{{a},state=\"degraded\"}}) > 0",
               c.path_down_for, "warning",
               f"{at_peer}: {{{{ $value }}}} path(s) degraded (gray loss, delay or MTU); traffic moved off",
               "The path answers but drops a share of packets, is slow, or drops full-size packets (an MTU "
               "black hole). `linkpass paths` on the host says which reason."),
        _alert(c, "LinkPassPathFlapping",
               f"sum by (job, instance, peer, plane) (linkpass_peer_paths{{{a},state=\"damped\"}}) > 0",
               c.flapping_for, "warning",
               f"{at_peer}: {{{{ $value }}}} path(s) flapping and held out (damped)",
               "The path went down and up repeatedly; it stays out of use until its flap penalty decays."),
        _alert(c, "LinkPassGrayLoss",
               f"max by (job, instance, peer, plane, direction) "
               f"(linkpass_peer_loss_ratio{{{a},direction=~\"forward|reverse\"}}) > {c.gray_loss_ratio} "
               f"unless on (job, instance, peer, plane) max_over_time(sum by (job, instance, peer, plane) "
               f"(linkpass_peer_paths{{{a},state=~\"down|damped\"}})[{c.gray_after_down}:]) > 0",
               c.gray_loss_for, "warning",
               f"{at_peer}: {{{{ $value | humanizePercentage }}}} {{{{ $labels.direction }}}} loss on its worst path",
               "Probes are lost in one direction only (forward: on the way to the peer; reverse: on the way "
               "back): a gray link that fails nothing outright but stalls collectives. Not raised for a while "
               "after a path of the plane was down or flapping: probes lost during an outage are "
               "LinkPassPathDown's or LinkPassPathFlapping's."),
        _alert(c, "LinkPassFailStatic", f"linkpass_fail_static_peers{{{a}}} > 0", c.fail_static_for, "critical",
               "{{ $labels.instance }}: {{ $value }} peer(s) with no usable path on any plane",
               "The agent found no usable path to these peers on any plane and left their routes as they "
               "were (it never removes the last path). Either the peer host is down or every plane between "
               "the two is broken."),
        _alert(c, "LinkPassLinkLocalized", f"linkpass_coordinator_link_fault{{{c.coordinator}}} > 0",
               c.link_localized_for, "critical",
               "Fault localized to link {{ $labels.link }} ({{ $labels.a }} – {{ $labels.b }}, "
               "{{ $labels.direction }})",
               "The coordinator's evidence from several hosts points at this link and direction (confidence "
               "{{ $value }}). Traffic already avoids it; drain it for repair with `linkpass drain`."),
        _alert(c, "LinkPassAgentDown", f"up{{{a}}} == 0", c.agent_down_for, "warning",
               "Agent {{ $labels.instance }} does not answer Prometheus",
               "Its /metrics endpoint is unreachable: the agent, its host or the management network is down. "
               "Failover on that host stops while the agent is away; its routes stay as they were."),
        _alert(c, "LinkPassAgentLost", f"linkpass_coordinator_agent_up{{{c.coordinator}}} == 0",
               c.agent_down_for, "warning",
               "Agent {{ $labels.host }} stopped reporting to the coordinator",
               "The coordinator has not heard from this agent. Its host may be down, or the agent cannot reach "
               "the coordinator (token, certificate, network)."),
        _alert(c, "LinkPassProbeThreadStalled", f"linkpass_agent_probe_thread_up{{{a}}} == 0",
               c.probe_thread_for, "critical",
               "{{ $labels.instance }}: the probe thread is stalled; this host is blind to link failures",
               "The agent's probe thread sent and received nothing for seconds although it has paths to probe. "
               "/healthz answers 503; restart the agent."),
        _alert(c, "LinkPassCoordinatorAway", f"absent(up{{{c.coordinator}}} == 1)", c.coordinator_away_for,
               "warning", "The LinkPass coordinator is away",
               "Prometheus reaches no coordinator. Agents go on failing over on their own; the fleet view, "
               "localization and drains wait until it is back."),
        _alert(c, "LinkPassCoordinatorOverloaded",
               f"linkpass_coordinator_requests_pending{{{c.coordinator}}} / "
               f"linkpass_coordinator_requests_pending_limit{{{c.coordinator}}} > {c.coordinator_pending_ratio} "
               f"or job:linkpass_coordinator_request_duration_seconds:p99_rate{w}"
               f"{{{c.coordinator},path=\"/v1/report\"}} > {c.coordinator_latency_p99_s}",
               c.overload_for, "warning", "The coordinator is near its request limit or slow to answer reports",
               "Requests queue for its workers (beyond the limit agents get 503 and retry). See how to size it "
               "in docs/coordinator.md."),
        _alert(c, "LinkPassCoordinatorShardBackedUp",
               f"linkpass_coordinator_shard_queue{{{c.coordinator}}} / "
               f"linkpass_coordinator_shard_queue_limit{{{c.coordinator}}} > {c.shard_queue_ratio} "
               f"or increase(linkpass_coordinator_shard_reports_total{{{c.coordinator},outcome=\"queue_full\"}}[{w}]) > 0",
               c.shard_queue_for, "warning", "Coordinator shard {{ $labels.shard }} holds reports the root does not take",
               "Its queue for the root is over half full, or agents got 503 because it was full: the root is away "
               "or slower than the changes arrive. Agents keep failing over locally and resend. See "
               "docs/coordinator.md, Sharding."),
        _alert(c, "LinkPassCoordinatorShardNotLocalizing",
               f"linkpass_coordinator_localization_stood_in{{{c.coordinator}}} > 0",
               c.shard_stood_in_for, "warning",
               "The coordinator's root localizes {{ $value }} shard part(s) itself",
               "A shard does not answer the root's localization rounds (away, restarting, or slower than "
               "their timeout): the root explains that part of the fabric from the evidence it keeps. The "
               "findings are the same, found slower, under the root's lock. See docs/coordinator.md, Sharding."),
        _alert(c, "LinkPassRouteChangeStorm",
               f"instance:linkpass_route_changes:rate{w}{{{a}}} * 60 > {c.route_changes_per_min} "
               f"or sum by (job, instance) (increase(linkpass_route_changes_deferred_total{{{a}}}[{w}])) > 0",
               c.route_storm_for, "warning",
               "{{ $labels.instance }}: route changes are storming",
               "The agent rewrites routes faster than failover needs, or its rate limit holds changes back: "
               "many paths changing state at once (a flapping plane, a host under CPU pressure)."),
        _alert(c, "LinkPassProbeOverload",
               f"instance:linkpass_agent_cpu:rate{w}{{{a}}} > {c.probe_cpu_cores} "
               f"or sum by (job, instance) (rate(linkpass_probe_dropped_packets_total{{{a},"
               f"reason=~\"send_buffer_full|reflector_table_full|ring_full|source_over_budget\"}}[{w}])) > 0",
               c.overload_for, "warning",
               "{{ $labels.instance }}: the agent is over its probe budget",
               "It uses more CPU than budgeted, or drops probes because a buffer or table is full. Detection "
               "slows when probes are dropped; lower the probe rate or the number of peers."),
        _alert(c, "LinkPassProbesForged",
               f"sum by (job, instance) (rate(linkpass_probe_dropped_packets_total{{{a},"
               f"reason=~\"bad_tag|replay|unknown_peer\"}}[{w}])) > 0",
               c.forged_for, "warning",
               "{{ $labels.instance }}: probe packets fail authentication",
               "Packets on the probe port carry a wrong tag, are replayed or come from an unknown agent id: a "
               "host with another fleet key, or someone sending to the probe port. They are dropped."),
    ]


def rules(c: RulesConfig = PRODUCTION) -> dict:
    return {"groups": [{"name": "linkpass-recording", "rules": recording(c)},
                       {"name": "linkpass-alerts", "rules": alerts(c)}]}


def render(c: RulesConfig = PRODUCTION) -> str:
    from ..formats import yaml_doc as yaml

    head = ("# Generated by `python -m linkpass.observe.rules`; edit linkpass/observe/rules.py, not this file.\n"
            "# Runbooks: docs/runbooks.md. Tested by tests/unit/test_rules.py (promtool test rules).\n")
    return head + yaml.safe_dump(rules(c), sort_keys=False, width=120, allow_unicode=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m linkpass.observe.rules", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write here (default: stdout)")
    p.add_argument("--lab", action="store_true", help="the lab's durations of seconds (demo, tests)")
    args = p.parse_args(argv)
    text = render(LAB if args.lab else PRODUCTION)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
