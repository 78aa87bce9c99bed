"""LinkPass's Grafana dashboards, built as plain dicts by a few small helpers and written as JSON:

    fleet   the whole fleet: agents, paths by state, localized link faults, gray loss, reactions,
            the agents' own cost, the coordinator
    host    one agent host (variable `instance`): its paths, loss and delay per peer and plane,
            RTT, reactions, the process
    link    one peer-plane pair seen from one host (variables `instance`, `peer`, `plane`):
            forward vs reverse loss and one-way delay, paths by state, and the coordinator's
            localized link faults (variable `link`)

    python -m linkpass.observe.dashboards --out deploy/grafana            write the three files
    python -m linkpass.observe.dashboards --out deploy/grafana --check    exit 1 if they are stale

Every query goes through the `datasource` variable (a Prometheus data source picked on the
dashboard), so the files import as they are and provision unchanged. The output is deterministic
(sorted keys, ids and grid positions assigned in order), so the checked-in files under
deploy/grafana can be compared with what this module builds (tests/unit/test_dashboards.py does,
and also checks every expression names only metrics LinkPass exports).

Nothing here does I/O but `main()`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from ..core.states import COLOR, State

SCHEMA_VERSION = 39
GRID_WIDTH = 24
TAGS = ["linkpass"]
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
AGENT = 'job="linkpass-agent"'
COORDINATOR = 'job="linkpass-coordinator"'
RATE = "$__rate_interval"  # Grafana picks a range that holds at least four scrapes
USABLE = "|".join(s.value for s in State if s.usable)  # the states traffic may use (up, suspect)
STATE_COLORS = {s.value: c for s, c in COLOR.items()}  # core/states.py: one colour per state
UIDS = {"fleet": "linkpass-fleet", "host": "linkpass-host", "link": "linkpass-link"}

# where data links lead; ${datasource:queryparam} and ${__url_time_range} keep the data source and the time range
_KEEP = "${datasource:queryparam}&${__url_time_range}"


def dashboard_url(name: str, **variables: str) -> str:
    """The URL of one of the three dashboards with its variables set (values may be Grafana macros)."""
    query = "".join(f"var-{k}={v}&" for k, v in variables.items())
    return f"/d/{UIDS[name]}/{UIDS[name]}?{query}{_KEEP}"


def data_link(title: str, url: str) -> dict:
    return {"title": title, "url": url}


def to_host() -> dict:
    """A data link to the host dashboard of the series' instance."""
    return data_link("Host ${__field.labels.instance}", dashboard_url("host", instance="${__field.labels.instance}"))


def to_link(instance: str, peer: str, plane: str) -> dict:
    """A data link to the link dashboard of one host's peer-plane pair."""
    return data_link("This peer-plane", dashboard_url("link", instance=instance, peer=peer, plane=plane))


ROW_TO_LINK = to_link("${__data.fields.instance}", "${__data.fields.peer}", "${__data.fields.plane}")


# ---- the helpers -----------------------------------------------------------------------------

def target(expr: str, legend: str = "__auto", *, instant: bool = False, fmt: str = "time_series") -> dict:
    """One PromQL query of a panel (its refId is given by panel())."""
    return {"expr": expr, "legendFormat": legend, "instant": instant, "range": not instant, "format": fmt}


def panel(kind: str, title: str, description: str, targets: list[dict], *, unit: str, w: int, h: int,
          defaults: dict | None = None, options: dict | None = None, links: tuple[dict, ...] = (),
          overrides: list | None = None, **extra) -> dict:
    """A panel of any kind, not yet placed: layout() gives it its id and position."""
    if not 0 < w <= GRID_WIDTH:
        raise ValueError(f"{title}: width {w} does not fit the {GRID_WIDTH}-column grid")
    field = {"unit": unit, **(defaults or {})}
    if links:
        field["links"] = [dict(link) for link in links]
    return {"type": kind, "title": title, "description": description, "datasource": DATASOURCE,
            "targets": [{"datasource": DATASOURCE, "editorMode": "code", "refId": chr(ord("A") + i), **t}
                        for i, t in enumerate(targets)],
            "fieldConfig": {"defaults": field, "overrides": overrides or []},
            "options": options or {}, "gridPos": {"h": h, "w": w, "x": 0, "y": 0}, **extra}


def color_by_name(colors: dict[str, str]) -> list[dict]:
    """Overrides giving the series named like a key (its legend) that fixed colour."""
    return [{"matcher": {"id": "byName", "options": name},
             "properties": [{"id": "color", "value": {"fixedColor": color, "mode": "fixed"}}]}
            for name, color in colors.items()]


def timeseries(title: str, description: str, targets: list[dict], *, unit: str, w: int = 12, h: int = 8,
               stack: bool = False, legend: str = "list", links: tuple[dict, ...] = (),
               colors: dict[str, str] | None = None) -> dict:
    """A time series panel; `stack` stacks the series (parts of a whole, such as paths by state)."""
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 30 if stack else 10, "showPoints": "never",
              "spanNulls": False, "axisSoftMin": 0, "stacking": {"group": "A", "mode": "normal" if stack else "none"}}
    table = legend == "table"
    options = {"legend": {"calcs": ["max", "lastNotNull"] if table else [], "displayMode": legend,
                          "placement": "bottom", "showLegend": True},
               "tooltip": {"mode": "multi", "sort": "desc"}}
    return panel("timeseries", title, description, targets, unit=unit, w=w, h=h, options=options, links=links,
                 defaults={"custom": custom, "color": {"mode": "palette-classic"}},
                 overrides=color_by_name(colors or {}))


def stat(title: str, description: str, targets: list[dict], *, unit: str = "short", w: int = 4, h: int = 4,
         steps: tuple[tuple[str, float | None], ...] = (("green", None),), mappings: dict | None = None,
         text: str = "auto", links: tuple[dict, ...] = ()) -> dict:
    """A single figure, coloured by `steps` (colour, from this value on); `mappings` names values."""
    defaults = {"color": {"mode": "thresholds"},
                "thresholds": {"mode": "absolute", "steps": [{"color": c, "value": v} for c, v in steps]}}
    if mappings:
        defaults["mappings"] = [{"type": "value", "options": {
            str(value): {"index": i, "text": name} for i, (value, name) in enumerate(sorted(mappings.items()))}}]
    options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
               "colorMode": "background", "graphMode": "none", "justifyMode": "auto", "orientation": "auto",
               "textMode": text, "wideLayout": True, "showPercentChange": False}
    return panel("stat", title, description, targets, unit=unit, w=w, h=h, defaults=defaults, options=options,
                 links=links)


def table(title: str, description: str, targets: list[dict], *, unit: str, w: int = 12, h: int = 8,
          hide: tuple[str, ...] = ("Time", "__name__", "job"), rename: dict[str, str] | None = None,
          links: tuple[dict, ...] = ()) -> dict:
    """The series of an instant query as rows, one column per label (`hide` drops some)."""
    instant = [{**t, "instant": True, "range": False, "format": "table"} for t in targets]
    organize = {"id": "organize", "options": {"excludeByName": {name: True for name in hide},
                                              "renameByName": dict(rename or {}), "indexByName": {}}}
    options = {"showHeader": True, "cellHeight": "sm",
               "footer": {"show": False, "reducer": ["sum"], "countRows": False, "fields": ""}}
    return panel("table", title, description, instant, unit=unit, w=w, h=h, options=options, links=links,
                 defaults={"custom": {"align": "auto", "filterable": True}}, transformations=[organize])


def heatmap(title: str, description: str, targets: list[dict], *, unit: str, y_unit: str, w: int = 12,
            h: int = 8) -> dict:
    """A histogram's buckets over time (targets in `heatmap` format, legend {{le}})."""
    options = {"calculate": False, "cellGap": 1, "yAxis": {"axisPlacement": "left", "unit": y_unit},
               "rowsFrame": {"layout": "auto"}, "cellValues": {"unit": unit},
               "color": {"mode": "scheme", "scheme": "Oranges", "scale": "exponential", "exponent": 0.5,
                         "steps": 64, "fill": "dark-orange", "reverse": False},
               "filterValues": {"le": 1e-9}, "legend": {"show": True},
               "tooltip": {"mode": "single", "yHistogram": False}, "exemplars": {"color": "rgba(255,0,255,0.7)"}}
    return panel("heatmap", title, description, [{**t, "format": "heatmap"} for t in targets], unit=unit,
                 w=w, h=h, options=options)


def row(title: str, panels: list[dict], *, collapsed: bool = False) -> dict:
    """A row and the panels under it; a collapsed row keeps them inside itself until opened."""
    return {"type": "row", "title": title, "collapsed": collapsed, "datasource": DATASOURCE, "panels": panels,
            "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": 0}}


def var(name: str, label: str, query: str, *, include_all: bool = False, multi: bool = False) -> dict:
    """A template variable filled by a Prometheus query such as label_values(metric{...}, label)."""
    out = {"name": name, "label": label, "type": "query", "datasource": DATASOURCE, "definition": query,
           "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
           "refresh": 2, "sort": 1, "regex": "", "hide": 0, "includeAll": include_all, "multi": multi,
           "options": [], "current": {}}
    if include_all:
        # every value, also when there is none yet (the coordinator's fault series come and go)
        out["allValue"] = ".*"
        out["current"] = {"selected": True, "text": ["All"], "value": ["$__all"]}
    return out


def datasource_var() -> dict:
    """The `datasource` variable every panel queries through: any Prometheus data source."""
    return {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "refresh": 1, "regex": "", "hide": 0, "includeAll": False, "multi": False, "options": [],
            "current": {}}


def layout(sections: list[dict]) -> list[dict]:
    """Place the rows and their panels on the 24-column grid, left to right and wrapping, and
    number every panel. A collapsed row's panels are placed below it, as Grafana shows them when
    the row is opened; the row itself takes one line."""
    next_id = iter(range(1, 10_000))
    out: list[dict] = []
    y = 0

    def flow(panels: list[dict], top: int) -> int:
        x, line = 0, 0
        for p in panels:
            w, h = p["gridPos"]["w"], p["gridPos"]["h"]
            if x + w > GRID_WIDTH:
                top, x, line = top + line, 0, 0
            p["id"] = next(next_id)
            p["gridPos"] = {"h": h, "w": w, "x": x, "y": top}
            x, line = x + w, max(line, h)
        return top + line

    for section in sections:
        r = dict(section)
        children = [dict(p) for p in r.pop("panels")]
        r["id"] = next(next_id)
        r["gridPos"] = {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}
        end = flow(children, y + 1)
        if r["collapsed"]:
            r["panels"] = children
            out.append(r)
            y += 1
        else:
            r["panels"] = []
            out += [r, *children]
            y = end
    return out


def dashboard(name: str, title: str, description: str, sections: list[dict], variables: list[dict],
              links: list[dict]) -> dict:
    return {
        "uid": UIDS[name], "title": title, "description": description, "tags": list(TAGS),
        "schemaVersion": SCHEMA_VERSION, "version": 1, "id": None, "editable": True, "graphTooltip": 1,
        "time": {"from": "now-6h", "to": "now"}, "timepicker": {}, "timezone": "browser", "refresh": "30s",
        "fiscalYearStartMonth": 0, "weekStart": "", "liveNow": False,
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "links": [{"title": "LinkPass", "type": "dashboards", "tags": list(TAGS), "asDropdown": True,
                   "includeVars": False, "keepTime": True, "targetBlank": False, "icon": "external link",
                   "tooltip": "", "url": ""}, *links],
        "templating": {"list": [datasource_var(), *variables]},
        "panels": layout(sections),
    }


def count_or_zero(expr: str) -> str:
    """How many series `expr` returns, 0 when it returns none (a stat then shows 0, not 'No data')."""
    return f"count({expr}) or vector(0)"


# ---- the dashboards ----------------------------------------------------------------------------

def fleet() -> dict:
    """The whole fleet at a glance, and where to look next."""
    no_usable = f'sum by (instance, peer, plane) (linkpass_peer_paths{{{AGENT}, state=~"{USABLE}"}}) == 0'
    glance = [
        stat("Agents scraped", "How many agents Prometheus scrapes now; fewer than the fleet has means agents "
             "died or their metrics port is unreachable.", [target(f"sum(up{{{AGENT}}})", "agents")]),
        stat("Agents not scraped", "Agents Prometheus knows but cannot scrape: each is a host whose paths nobody "
             "watches.", [target(count_or_zero(f"up{{{AGENT}}} == 0"), "agents")], steps=(("green", None), ("red", 1))),
        stat("Agents lost (coordinator)", "Registered agents the coordinator has not heard from within its timeout, "
             "so their reports are missing from localization.",
             [target(f'sum(linkpass_coordinator_agents{{{COORDINATOR}, status="lost"}})', "lost")],
             steps=(("green", None), ("red", 1))),
        stat("Agents cut off from the coordinator", "Agents whose last call to the coordinator failed: they keep "
             "failing over on their own but report nothing.",
             [target(count_or_zero(f"linkpass_agent_coordinator_up{{{AGENT}}} == 0"), "agents")],
             steps=(("green", None), ("orange", 1))),
        stat("Stalled probe threads", "Agents whose probe thread stopped making progress, so their path states "
             "are stale and /healthz fails.",
             [target(count_or_zero(f"linkpass_agent_probe_thread_up{{{AGENT}}} == 0"), "agents")],
             steps=(("green", None), ("red", 1))),
        stat("Coordinator", "Whether Prometheus scrapes the coordinator; while it is down nothing localizes "
             "faults, though agents keep failing over.", [target(f"max(up{{{COORDINATOR}}})", "coordinator")],
             steps=(("red", None), ("green", 1)), mappings={0: "down", 1: "up"}),
        stat("Peer-planes without a usable path", "Peer-plane pairs where no path is up or suspect: traffic "
             "there has nowhere to go on that plane.", [target(count_or_zero(no_usable), "peer-planes")],
             steps=(("green", None), ("red", 1))),
        stat("Fail-static peers", "Peers left with no usable path on any plane, whose routes are frozen as they "
             "were; each is a host pair cut off.", [target(f"sum(linkpass_fail_static_peers{{{AGENT}}})", "peers")],
             steps=(("green", None), ("red", 1))),
        stat("Localized link faults", "Directed fabric links the coordinator currently blames for failed paths; "
             "the table below names them.",
             [target(f"max(linkpass_coordinator_localized_faults{{{COORDINATOR}}})", "links")],
             steps=(("green", None), ("orange", 1))),
        stat("Drained links", "Fabric links operators have drained, which stay out of use until undrained.",
             [target(f"max(linkpass_coordinator_drained_links{{{COORDINATOR}}})", "links")],
             steps=(("green", None), ("blue", 1))),
        stat("Route changes, last hour", "Route rewrites the agents made in the last hour; a burst means many "
             "paths changed state at once.",
             [target(f"sum(increase(linkpass_route_changes_total{{{AGENT}}}[1h]))", "changes")]),
        stat("LinkPass versions running", "Distinct LinkPass versions among agents and coordinator; more than one "
             "means a rollout is under way or stuck.",
             [target("count(count by (version) (linkpass_build_info))", "versions")],
             steps=(("green", None), ("orange", 2))),
    ]
    paths = [
        timeseries("Agents' paths by state", "Every path the agents probe, stacked by state; growth outside "
                   "'up' is the fabric degrading.",
                   [target(f"sum by (state) (linkpass_peer_paths{{{AGENT}}})", "{{state}}")],
                   unit="short", stack=True, colors=STATE_COLORS),
        timeseries("Coordinator's paths by state", "The paths the agents reported to the coordinator, by state, "
                   "which is what its localization works from.",
                   [target(f"max by (state) (linkpass_coordinator_paths{{{COORDINATOR}}})", "{{state}}")],
                   unit="short", stack=True, colors=STATE_COLORS),
        table("Peer-planes without a usable path", "Which host lost every usable path to which peer on which "
              "plane; click a row for that pair's link dashboard.", [target(no_usable)], unit="short",
              rename={"Value": "usable paths"}, links=(ROW_TO_LINK,)),
        table("Localized link faults", "Each directed link the coordinator localized as faulty, with its "
              "endpoints and confidence; click a row for the link dashboard.",
              [target(f"linkpass_coordinator_link_fault{{{COORDINATOR}}}")], unit="percentunit",
              hide=("Time", "__name__", "job", "instance"), rename={"Value": "confidence"},
              links=(data_link("This link", dashboard_url("link", link="${__data.fields.link}")),)),
        timeseries("Fail-static peers per host", "Hosts with peers frozen on their old route for want of a "
                   "usable path (hosts with none are left out); click a series for that host.",
                   [target(f"sum by (instance) (linkpass_fail_static_peers{{{AGENT}}}) > 0", "{{instance}}")],
                   unit="short", links=(to_host(),)),
        timeseries("Localized faults and drained links", "How many links are blamed and drained over time, to "
                   "tell a new fault from a standing one.",
                   [target(f"max(linkpass_coordinator_localized_faults{{{COORDINATOR}}})", "localized faults"),
                    target(f"max(linkpass_coordinator_drained_links{{{COORDINATOR}}})", "drained links")],
                   unit="short"),
    ]
    gray = [
        timeseries("Worst loss per direction", "The highest window loss any agent sees on any peer-plane, "
                   "forward (towards the peer), reverse (the replies) and any (unanswered).",
                   [target(f"max by (direction) (linkpass_peer_loss_ratio{{{AGENT}}})", "{{direction}}")],
                   unit="percentunit"),
        table("Lossiest peer-planes", "The ten host, peer and plane triples with the most window loss in one "
              "direction; click a row for that pair's link dashboard.",
              [target(f'topk(10, linkpass_peer_loss_ratio{{{AGENT}, direction!="any"}} > 0)')],
              unit="percentunit", rename={"Value": "loss"}, links=(ROW_TO_LINK,)),
        timeseries("Worst one-way delay p99 per direction", "The highest 99th percentile one-way delay any agent "
                   "sees, per direction, which shows queueing on one side of a path (needs clock sync).",
                   [target(f"max by (direction) (linkpass_peer_one_way_delay_p99_seconds{{{AGENT}}})",
                           "{{direction}}")], unit="s"),
        timeseries("Probe RTT p99 per plane", "The 99th percentile probe round trip over every agent per plane, "
                   "so a plane with congestion stands out from the others.",
                   [target("histogram_quantile(0.99, sum by (plane, le) "
                           f"(rate(linkpass_probe_rtt_seconds_bucket{{{AGENT}}}[{RATE}])))", "plane {{plane}}")],
                   unit="s"),
    ]
    reactions = [
        timeseries("Route changes per second", "Route rewrites applied, and those held back by the rate limit, "
                   "which should stay rare.",
                   [target(f"sum(rate(linkpass_route_changes_total{{{AGENT}}}[{RATE}]))", "applied"),
                    target(f"sum(rate(linkpass_route_changes_deferred_total{{{AGENT}}}[{RATE}]))", "deferred")],
                   unit="ops", w=8),
        timeseries("Path transitions per second by new state", "How fast paths change state across the fleet, "
                   "by the state they enter; a steady flow into 'damped' means flapping.",
                   [target(f"sum by (to) (rate(linkpass_path_transitions_total{{{AGENT}}}[{RATE}]))", "{{to}}")],
                   unit="ops", w=8, colors=STATE_COLORS),
        timeseries("Held, absorbed and fail-static events", "DOWNs held back by a busy host's lateness "
                   "allowance, those its late replies undid, and peers left without a usable path.",
                   [target(f"sum(rate(linkpass_downs_held_for_lateness_total{{{AGENT}}}[{RATE}]))", "held"),
                    target(f"sum(rate(linkpass_downs_absorbed_total{{{AGENT}}}[{RATE}]))", "absorbed"),
                    target(f"sum(rate(linkpass_fail_static_events_total{{{AGENT}}}[{RATE}]))", "fail-static")],
                   unit="ops", w=8),
    ]
    agents = [
        timeseries("Agent CPU per host", "Cores each agent uses, probing included; a host far above the others "
                   "probes too much or spins.",
                   [target(f"rate(process_cpu_seconds_total{{{AGENT}}}[{RATE}])", "{{instance}}")],
                   unit="percentunit", w=8, links=(to_host(),)),
        timeseries("Agent resident memory per host", "Memory each agent holds; steady growth on one host is "
                   "a leak to report.", [target(f"process_resident_memory_bytes{{{AGENT}}}", "{{instance}}")],
                   unit="bytes", w=8, links=(to_host(),)),
        timeseries("Probe packets dropped per second by reason", "Packets the probe threads threw away, by "
                   "reason; bad tags or replays mean a wrong key or someone replaying probes.",
                   [target(f"sum by (reason) (rate(linkpass_probe_dropped_packets_total{{{AGENT}}}[{RATE}]))",
                           "{{reason}}")], unit="pps", w=8),
        timeseries("Agent loop errors per second", "Exceptions in the agents' main loop by host and step "
                   "(hosts without any are left out); each is logged on that host.",
                   [target(f"sum by (instance, step) (rate(linkpass_agent_loop_errors_total{{{AGENT}}}[{RATE}])) "
                           "> 0", "{{instance}} {{step}}")], unit="ops", w=8, links=(to_host(),)),
        timeseries("Coordinator answers rejected per second", "Coordinator answers agents refused whole as "
                   "malformed (hosts without any are left out), a sign of a version mismatch or a bad coordinator.",
                   [target("sum by (instance) "
                           f"(rate(linkpass_agent_coordinator_answers_rejected_total{{{AGENT}}}[{RATE}])) > 0",
                           "{{instance}}")], unit="ops", w=8, links=(to_host(),)),
        table("Versions running", "How many agents and coordinators run each LinkPass version.",
              [target("count by (job, version) (linkpass_build_info)")], unit="short",
              hide=("Time",), rename={"Value": "processes"}, w=8),
    ]
    latency = (f"histogram_quantile(0.99, sum by (path, le) "
               f"(rate(linkpass_coordinator_request_duration_seconds_bucket{{{COORDINATOR}}}[{RATE}])))")
    coordinator = [
        timeseries("Coordinator request latency p99 by endpoint", "The 99th percentile time from a request's "
                   "head to its answer per endpoint, waiting for a worker included.",
                   [target(latency, "{{path}}")], unit="s", w=8),
        timeseries("Coordinator requests pending vs limit", "Requests holding a body against max_pending; at the "
                   "limit the coordinator answers 503 and agents retry.",
                   [target(f"max(linkpass_coordinator_requests_pending{{{COORDINATOR}}})", "pending"),
                    target(f"max(linkpass_coordinator_requests_pending_limit{{{COORDINATOR}}})", "limit")],
                   unit="short", w=8, colors={"limit": "red"}),
        timeseries("Coordinator requests and refusals per second", "Requests read, and those refused or failed "
                   "by kind, where unauthenticated or forbidden point at bad tokens.",
                   [target(f"sum(rate(linkpass_coordinator_requests_total{{{COORDINATOR}}}[{RATE}]))", "requests"),
                    target("sum by (kind) "
                           f"(rate(linkpass_coordinator_request_errors_total{{{COORDINATOR}}}[{RATE}])) > 0",
                           "{{kind}}")], unit="reqps", w=8),
        timeseries("Agents reporting vs lost", "Registered agents the coordinator hears from and those it "
                   "lost, over time.",
                   [target(f"max by (status) (linkpass_coordinator_agents{{{COORDINATOR}}})", "{{status}}")],
                   unit="short", w=8, stack=True, colors={"reporting": "green", "lost": "red"}),
        table("Lost agents", "The agents the coordinator lost, by the name they registered with.",
              [target(f"linkpass_coordinator_agent_up{{{COORDINATOR}}} == 0")], unit="short",
              hide=("Time", "__name__", "job", "instance", "Value"), w=8),
        timeseries("Path reports per second", "Path verdicts the agents send the coordinator; a drop to zero "
                   "with agents up means reports do not arrive.",
                   [target(f"sum(rate(linkpass_coordinator_path_reports_total{{{COORDINATOR}}}[{RATE}]))",
                           "reports")], unit="ops", w=8),
        timeseries("Digests, tables asked and unknown changes per second", "Agents' digests of their verdicts, "
                   "whole tables asked for after a digest differed, and changes naming unknown paths: a steady "
                   "rate of the last two means reports get lost.",
                   [target(f"sum(rate(linkpass_coordinator_digests_total{{{COORDINATOR}}}[{RATE}]))", "digests"),
                    target(f"sum(rate(linkpass_coordinator_tables_asked_total{{{COORDINATOR}}}[{RATE}]))",
                           "tables asked"),
                    target(f"sum(rate(linkpass_coordinator_changes_unknown_path_total{{{COORDINATOR}}}[{RATE}]))",
                           "unknown changes")], unit="ops", w=8),
        timeseries("Paths the fleet model cannot map", "Reported paths whose hops fit no path of the "
                   "coordinator's fleet model (a stale model, a recabled or miscabled link): localization "
                   "cannot use them (zero on a fleet whose model is right).",
                   [target(f"max(linkpass_coordinator_paths_unmapped{{{COORDINATOR}}})", "paths")],
                   unit="short", w=8),
        timeseries("Coordinator open connections", "Client connections the coordinator holds open, about one "
                   "per agent plus readers.",
                   [target(f"sum(linkpass_coordinator_connections{{{COORDINATOR}}})", "connections")],
                   unit="short", w=8),
        timeseries("Coordinator CPU", "Cores the coordinator process uses; near one core it falls behind.",
                   [target(f"rate(process_cpu_seconds_total{{{COORDINATOR}}}[{RATE}])", "{{instance}}")],
                   unit="percentunit", w=8),
        timeseries("Coordinator resident memory", "Memory the coordinator process holds.",
                   [target(f"process_resident_memory_bytes{{{COORDINATOR}}}", "{{instance}}")], unit="bytes", w=8),
        timeseries("Shards: reports per second by outcome", "A sharded coordinator's shards: reports answered "
                   "there, queued for the root, forwarded at once, refused with 503 (queue full); empty with one "
                   "shard.",
                   [target(f"sum by (outcome) (rate(linkpass_coordinator_shard_reports_total{{{COORDINATOR}}}"
                           f"[{RATE}]))", "{{outcome}}")], unit="ops", w=8),
        timeseries("Shards: reports held for the root", "Each shard's queue for the root against its limit; "
                   "a queue that stays up means the root is away or slower than the changes arrive.",
                   [target(f"max by (shard) (linkpass_coordinator_shard_queue{{{COORDINATOR}}})", "shard {{shard}}"),
                    target(f"max(linkpass_coordinator_shard_queue_limit{{{COORDINATOR}}})", "limit")],
                   unit="short", w=8),
    ]
    return dashboard(
        "fleet", "LinkPass / Fleet",
        "The LinkPass fleet: agents, paths by state, localized link faults, gray loss and delay, reactions, cost "
        "and the coordinator.",
        [row("At a glance", glance), row("Paths and localized faults", paths),
         row("Gray failures: loss and delay", gray), row("Reactions", reactions), row("Agents", agents),
         row("Coordinator", coordinator)],
        [], [])


def _instance_var() -> dict:
    return var("instance", "Host", f"label_values(linkpass_build_info{{{AGENT}}}, instance)")


def _per_path(sel: str, *, by_peer: bool) -> list[dict]:
    """The collapsed row's panels on each path's own series (only there with metrics.per_path)."""
    who = "{{peer}} plane {{plane}} path {{path}}" if by_peer else "path {{path}}"
    keys = "peer, plane, path" if by_peer else "path"
    return [
        table("Paths out of use", "Each path not up now, with its state (an empty table means every path is up).",
              [target(f'linkpass_path_state{{{sel}, state!="up"}} == 1')], unit="short",
              hide=("Time", "__name__", "job", "instance", "Value"), w=12),
        timeseries("Loss per path", "The window loss on each path that loses anything, per direction, to "
                   "tell one bad path from a whole plane.",
                   [target(f'linkpass_path_loss_ratio{{{sel}, direction!="any"}} > 0', f"{who} {{{{direction}}}}")],
                   unit="percentunit", w=12, legend="table"),
        timeseries("One-way delay p99 per path", "The 99th percentile one-way delay on each path and direction "
                   "(needs clock sync).",
                   [target(f"linkpass_path_one_way_delay_p99_seconds{{{sel}}}", f"{who} {{{{direction}}}}")],
                   unit="s", w=12, legend="table"),
        timeseries("RTT p99 per path", "The 99th percentile round trip on each path, which singles out the "
                   "path crossing a congested link.",
                   [target(f"histogram_quantile(0.99, sum by ({keys}, le) "
                           f"(rate(linkpass_path_rtt_seconds_bucket{{{sel}}}[{RATE}])))", who)],
                   unit="s", w=12, legend="table"),
    ]


def host() -> dict:
    """One agent host: its paths, loss and delay per peer and plane, reactions and the process."""
    sel = f'{AGENT}, instance="$instance"'
    by_peer = "{{peer}} plane {{plane}}"
    series_to_link = to_link("$instance", "${__field.labels.peer}", "${__field.labels.plane}")
    row_to_link = to_link("$instance", "${__data.fields.peer}", "${__data.fields.plane}")
    glance = [
        stat("Probe thread", "Whether this agent's probe thread makes progress; stalled, its path states are "
             "stale and /healthz fails.", [target(f"linkpass_agent_probe_thread_up{{{sel}}}", "probe thread")],
             steps=(("red", None), ("green", 1)), mappings={0: "stalled", 1: "progressing"}),
        stat("Coordinator link", "Whether the coordinator answered this agent's last call; away, the agent "
             "fails over alone and reports nothing.",
             [target(f"linkpass_agent_coordinator_up{{{sel}}}", "coordinator")],
             steps=(("orange", None), ("green", 1)), mappings={0: "away", 1: "answering"}),
        stat("Peer-planes without a usable path", "Peer-plane pairs where this host has no path up or suspect, "
             "so that plane carries nothing to that peer.",
             [target(count_or_zero(f'sum by (peer, plane) (linkpass_peer_paths{{{sel}, state=~"{USABLE}"}}) '
                                   "== 0"), "peer-planes")], steps=(("green", None), ("red", 1))),
        stat("Fail-static peers", "Peers this host has no usable path to on any plane, their routes frozen as "
             "they were.", [target(f"linkpass_fail_static_peers{{{sel}}}", "peers")],
             steps=(("green", None), ("red", 1))),
        stat("Loop errors, last hour", "Exceptions in this agent's main loop in the last hour; the log names "
             "each.", [target(f"sum(increase(linkpass_agent_loop_errors_total{{{sel}}}[1h]))", "errors")],
             steps=(("green", None), ("orange", 1))),
        stat("Version", "The LinkPass version and probe engine this agent runs.",
             [target(f"linkpass_build_info{{{sel}}}", "{{version}} ({{engine}})")], text="name",
             steps=(("blue", None),)),
    ]
    paths = [
        timeseries("Paths by state", "This host's paths to every peer, stacked by state; anything but green "
                   "is a path out of use or about to be.",
                   [target(f"sum by (state) (linkpass_peer_paths{{{sel}}})", "{{state}}")],
                   unit="short", stack=True, colors=STATE_COLORS),
        table("Peer-planes with paths not up", "Per peer, plane and state, how many paths are not up; click a "
              "row for that pair's link dashboard.",
              [target(f'linkpass_peer_paths{{{sel}, state!="up"}} > 0')], unit="short",
              hide=("Time", "__name__", "job", "instance"), rename={"Value": "paths"}, links=(row_to_link,)),
        timeseries("Usable paths per peer and plane", "How many paths to each peer on each plane traffic may "
                   "use; a line at zero is a plane lost to that peer.",
                   [target(f'sum by (peer, plane) (linkpass_peer_paths{{{sel}, state=~"{USABLE}"}})', by_peer)],
                   unit="short", legend="table", links=(series_to_link,)),
        timeseries("Planes the route to each peer uses", "How many planes the route to each peer spreads over "
                   "now; fewer than the host has means LinkPass moved traffic off a plane.",
                   [target(f"linkpass_route_planes{{{sel}}}", "{{peer}}")], unit="short", legend="table"),
    ]
    loss = [
        timeseries(f"Loss {name}", f"The window loss {what} on each peer-plane's worst path; click a series "
                   "for that pair.",
                   [target(f'linkpass_peer_loss_ratio{{{sel}, direction="{direction}"}}', by_peer)],
                   unit="percentunit", w=8, legend="table", links=(series_to_link,))
        for name, what, direction in (("forward", "of probes towards the peer", "forward"),
                                      ("reverse", "of replies coming back", "reverse"),
                                      ("any direction", "of probes that got no answer at all", "any"))
    ] + [
        timeseries(f"One-way delay p99 {direction}", f"The 99th percentile one-way delay {what} on each "
                   "peer-plane's worst path (needs clock sync).",
                   [target(f'linkpass_peer_one_way_delay_p99_seconds{{{sel}, direction="{direction}"}}', by_peer)],
                   unit="s", legend="table", links=(series_to_link,))
        for direction, what in (("forward", "towards the peer"), ("reverse", "of the replies"))
    ] + [
        timeseries("RTT p50 and p99 per plane", "The median and 99th percentile round trip from this host per "
                   "plane, over every peer.",
                   [target(f"histogram_quantile({q}, sum by (plane, le) "
                           f"(rate(linkpass_probe_rtt_seconds_bucket{{{sel}}}[{RATE}])))",
                           f"p{name} plane {{{{plane}}}}")
                    for q, name in (("0.5", "50"), ("0.99", "99"))], unit="s"),
        heatmap("RTT distribution", "How this host's probe round trips spread over the histogram's buckets, all "
                "planes together, so a second mode shows up.",
                [target(f"sum by (le) (rate(linkpass_probe_rtt_seconds_bucket{{{sel}}}[{RATE}]))", "{{le}}")],
                unit="ops", y_unit="s"),
    ]
    reactions = [
        timeseries("Path transitions per second by new state", "How fast this host's paths change state, by "
                   "the state they enter.",
                   [target(f"sum by (to) (rate(linkpass_path_transitions_total{{{sel}}}[{RATE}]))", "{{to}}")],
                   unit="ops", w=8, colors=STATE_COLORS),
        timeseries("Route changes per second", "Route rewrites applied on this host, and those the rate limit "
                   "held back.",
                   [target(f"rate(linkpass_route_changes_total{{{sel}}}[{RATE}])", "applied"),
                    target(f"rate(linkpass_route_changes_deferred_total{{{sel}}}[{RATE}])", "deferred")],
                   unit="ops", w=8),
        timeseries("Lateness allowance per peer", "How long a DOWN to each peer must stand before it is acted "
                   "on, earned when this host answers late on every path (0 on a calm host).",
                   [target(f"linkpass_host_lateness_allowance_seconds{{{sel}}}", "{{peer}}")], unit="s", w=8),
        timeseries("Held, absorbed and fail-static events", "DOWNs held back by the lateness allowance, those "
                   "late replies undid, and peers left without a usable path.",
                   [target(f"rate(linkpass_downs_held_for_lateness_total{{{sel}}}[{RATE}])", "held"),
                    target(f"rate(linkpass_downs_absorbed_total{{{sel}}}[{RATE}])", "absorbed"),
                    target(f"rate(linkpass_fail_static_events_total{{{sel}}}[{RATE}])", "fail-static")],
                   unit="ops", w=8),
        timeseries("Probe packets per second", "Probe requests sent, answers reflected for peers and packets "
                   "received by this host's probe thread.",
                   [target(f"sum by (kind) (rate(linkpass_probe_packets_total{{{sel}}}[{RATE}]))", "{{kind}}")],
                   unit="pps", w=8),
        timeseries("Packets dropped per second by reason", "Packets this host's probe thread threw away, by "
                   "reason; bad tags or replays mean a wrong key or replayed probes.",
                   [target(f"sum by (reason) (rate(linkpass_probe_dropped_packets_total{{{sel}}}[{RATE}]))",
                           "{{reason}}")], unit="pps", w=8),
    ]
    process = [
        timeseries("CPU", "Cores this agent uses, probing included.",
                   [target(f"rate(process_cpu_seconds_total{{{sel}}}[{RATE}])", "cpu")], unit="percentunit", w=6),
        timeseries("Resident memory", "Memory this agent holds; steady growth is a leak to report.",
                   [target(f"process_resident_memory_bytes{{{sel}}}", "rss")], unit="bytes", w=6),
        timeseries("Loop errors per second by step", "Exceptions in this agent's main loop by step; the log "
                   "names each.",
                   [target(f"sum by (step) (rate(linkpass_agent_loop_errors_total{{{sel}}}[{RATE}]))", "{{step}}")],
                   unit="ops", w=6),
        timeseries("Coordinator answers rejected per second", "Coordinator answers this agent refused whole as "
                   "malformed, a sign of a version mismatch.",
                   [target(f"rate(linkpass_agent_coordinator_answers_rejected_total{{{sel}}}[{RATE}])", "rejected")],
                   unit="ops", w=6),
    ]
    return dashboard(
        "host", "LinkPass / Host",
        "One LinkPass agent host: its paths, loss and delay per peer and plane, RTT, reactions and the process.",
        [row("At a glance", glance), row("Paths", paths), row("Loss and delay", loss), row("Reactions", reactions),
         row("Process", process), row("Per path (needs metrics.per_path: true)", _per_path(sel, by_peer=True),
                                      collapsed=True)],
        [_instance_var()],
        [{"title": "Link dashboard", "type": "link", "url": f"/d/{UIDS['link']}/{UIDS['link']}",
          "includeVars": True, "keepTime": True, "asDropdown": False, "targetBlank": False, "icon": "dashboard",
          "tags": [], "tooltip": "This host's peer-plane pairs"}])


def link() -> dict:
    """One peer-plane pair seen from one host, and the coordinator's localized link faults."""
    pair = f'{AGENT}, instance="$instance", peer="$peer", plane="$plane"'
    peer = f'{AGENT}, instance="$instance", peer="$peer"'
    plane = f'{AGENT}, instance="$instance", plane="$plane"'
    faults = f'{COORDINATOR}, link=~"$link"'
    loss_steps = (("green", None), ("orange", 0.001), ("red", 0.01))
    glance = [
        stat("Usable paths", "Paths to the peer on this plane traffic may use (up or suspect); zero means the "
             "plane is lost to this peer.",
             [target(f'sum(linkpass_peer_paths{{{pair}, state=~"{USABLE}"}})', "paths")],
             steps=(("red", None), ("green", 1))),
        stat("Paths out of use", "Paths to the peer on this plane that traffic may not use now (degraded, "
             "recovering, down or damped).",
             [target(f'sum(linkpass_peer_paths{{{pair}, state!~"{USABLE}"}})', "paths")],
             steps=(("green", None), ("orange", 1))),
        stat("Loss forward", "The window loss of probes towards the peer on the plane's worst path.",
             [target(f'linkpass_peer_loss_ratio{{{pair}, direction="forward"}}', "forward")],
             unit="percentunit", steps=loss_steps),
        stat("Loss reverse", "The window loss of replies coming back on the plane's worst path.",
             [target(f'linkpass_peer_loss_ratio{{{pair}, direction="reverse"}}', "reverse")],
             unit="percentunit", steps=loss_steps),
        stat("Planes the route uses", "How many planes the route to this peer spreads over now; fewer than "
             "the host has means LinkPass moved traffic off a plane.",
             [target(f"linkpass_route_planes{{{peer}}}", "planes")]),
        stat("Lateness allowance", "How long a DOWN to this peer must stand before it is acted on (0 unless "
             "this host answers late on every path).",
             [target(f"linkpass_host_lateness_allowance_seconds{{{peer}}}", "allowance")], unit="s",
             steps=(("green", None), ("orange", 0.001))),
    ]
    both = [
        timeseries("Loss, forward vs reverse", "The window loss on the plane's worst path towards the peer "
                   "(forward), back (reverse) and unanswered (any): the direction tells which way the bad link "
                   "carries traffic.",
                   [target(f"linkpass_peer_loss_ratio{{{pair}}}", "{{direction}}")], unit="percentunit",
                   colors={"forward": "blue", "reverse": "orange", "any": "red"}),
        timeseries("Lost probes per second by direction", "Probes lost per second over all the plane's paths "
                   "to the peer, by the direction of the loss.",
                   [target(f"sum by (direction) (rate(linkpass_probe_lost_total{{{pair}}}[{RATE}]))",
                           "{{direction}}")], unit="pps", colors={"forward": "blue", "reverse": "orange"}),
        timeseries("One-way delay p50 and p99, forward vs reverse", "Median and 99th percentile one-way delay "
                   "each way on the plane's worst path, where a gap between directions is queueing on one side "
                   "(needs clock sync).",
                   [target(f"linkpass_peer_one_way_delay_p50_seconds{{{pair}}}", "p50 {{direction}}"),
                    target(f"linkpass_peer_one_way_delay_p99_seconds{{{pair}}}", "p99 {{direction}}")], unit="s"),
        timeseries("Probe requests and replies per second", "Probes sent to the peer on this plane and the "
                   "authenticated replies received; the gap is the loss.",
                   [target(f"rate(linkpass_probe_requests_total{{{pair}}}[{RATE}])", "requests"),
                    target(f"rate(linkpass_probe_replies_total{{{pair}}}[{RATE}])", "replies")], unit="pps"),
        timeseries("Paths by state", "The plane's paths to the peer stacked by state, showing when paths left "
                   "use and came back.",
                   [target(f"sum by (state) (linkpass_peer_paths{{{pair}}})", "{{state}}")], unit="short",
                   stack=True, colors=STATE_COLORS),
        timeseries("RTT p50 and p99 on the plane (every peer)", "The median and 99th percentile round trip from "
                   "this host on the plane, over all its peers, the baseline this peer's delay compares with.",
                   [target(f"histogram_quantile({q}, sum by (le) "
                           f"(rate(linkpass_probe_rtt_seconds_bucket{{{plane}}}[{RATE}])))", f"p{name}")
                    for q, name in (("0.5", "50"), ("0.99", "99"))], unit="s"),
    ]
    localization = [
        table("Localized link faults", "The directed links (of the `link` variable) the coordinator localized "
              "as faulty, with their endpoints and confidence.",
              [target(f"linkpass_coordinator_link_fault{{{faults}}}")], unit="percentunit",
              hide=("Time", "__name__", "job", "instance"), rename={"Value": "confidence"}),
        timeseries("Fault confidence over time", "When the coordinator started and stopped blaming each link, "
                   "and how sure it was.",
                   [target(f"linkpass_coordinator_link_fault{{{faults}}}", "{{link}} {{direction}}")],
                   unit="percentunit"),
    ]
    return dashboard(
        "link", "LinkPass / Link",
        "One peer-plane pair seen from one host (loss, one-way delay and paths forward vs reverse), and the "
        "coordinator's localized link faults.",
        [row("Peer $peer, plane $plane, from $instance", glance), row("Forward vs reverse", both),
         row("Coordinator's localization", localization),
         row("Per path (needs metrics.per_path: true)", _per_path(pair, by_peer=False), collapsed=True)],
        [_instance_var(),
         var("peer", "Peer", f'label_values(linkpass_peer_paths{{{AGENT}, instance="$instance"}}, peer)'),
         var("plane", "Plane", f'label_values(linkpass_peer_paths{{{peer}}}, plane)'),
         var("link", "Fabric link", f"label_values(linkpass_coordinator_link_fault{{{COORDINATOR}}}, link)",
             include_all=True, multi=True)],
        [{"title": "Host dashboard", "type": "link", "url": f"/d/{UIDS['host']}/{UIDS['host']}",
          "includeVars": True, "keepTime": True, "asDropdown": False, "targetBlank": False, "icon": "dashboard",
          "tags": [], "tooltip": "The host this pair is seen from"}])


BUILDERS = {"fleet": fleet, "link": link, "host": host}


def build_all() -> dict[str, dict]:
    """Every dashboard by the name of its file."""
    return {f"linkpass-{name}.json": build() for name, build in BUILDERS.items()}


def render(board: dict) -> str:
    """A dashboard as the checked-in file holds it."""
    return json.dumps(board, sort_keys=True, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m linkpass.observe.dashboards", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="deploy/grafana", help="folder to write the JSON files to (default: %(default)s)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs from the code")
    args = p.parse_args(argv)
    stale = []
    for name, board in build_all().items():
        path, text = os.path.join(args.out, name), render(board)
        if args.check:
            try:
                with open(path) as f:
                    same = f.read() == text
            except FileNotFoundError:
                same = False
            if not same:
                stale.append(path)
            continue
        os.makedirs(args.out, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        print(path)
    if stale:
        print(f"stale: {', '.join(stale)}; run `python -m linkpass.observe.dashboards --out {args.out}`",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
