"""LinkPass's Grafana dashboards, built with Grafana Labs' grafana-foundation-sdk and written as JSON:

    fleet   the whole fleet: agents, paths by state, localized link faults, gray loss, reactions,
            the agents' own cost, the coordinator
    host    one agent host (variable `instance`): its paths, loss and delay per peer and plane,
            RTT, reactions, the process
    link    one peer-plane pair seen from one host (variables `instance`, `peer`, `plane`):
            forward vs reverse loss and one-way delay, paths by state, and the coordinator's
            localized link faults (variable `link`)

    python -m linkpass.observe.dashboards --out deploy/grafana            write the three files
    python -m linkpass.observe.dashboards --out deploy/grafana --check    exit 1 if they are stale

The SDK (grafana-foundation-sdk 1769699379!11.6.0, its build for Grafana 11.6: dashboard schema 41)
is Grafana Labs' own, generated from Grafana's schemas, with a typed builder per panel plugin: an
option a panel does not have is no method of its builder, a value of the wrong kind a type error.
(grafanalib, the older choice, is hand-written, last released in January 2024 and defaults to
schema 12.) It is a test dependency: nothing but this generator imports it, and nothing the agent
or the CLI runs imports this.

Every query goes through the `datasource` variable (a Prometheus data source picked on the
dashboard), so the files import as they are and provision unchanged. The output is deterministic
(sorted keys, ids and grid positions assigned in order), so the checked-in files under
deploy/grafana can be compared with what this module builds (tests/unit/test_dashboards.py does,
loads them back through the SDK's types, and checks every expression names only metrics LinkPass
exports).

Nothing here does I/O but `main()`.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

from ..core.states import COLOR, State

try:
    from grafana_foundation_sdk.builders import common as bcommon, dashboard as bdash, heatmap as bheatmap
    from grafana_foundation_sdk.builders import prometheus as bprom, stat as bstat, table as btable
    from grafana_foundation_sdk.builders import timeseries as btimeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common, dashboard as mdash, heatmap as mheatmap, prometheus as mprom
except ImportError as e:  # a test dependency, absent from an agent's install
    raise ImportError("the dashboards generator needs grafana-foundation-sdk: "
                      "pip install 'grafana-foundation-sdk==1769699379!11.6.0' (or the `test` extra)") from e

GRID_WIDTH = 24
TAGS = ["linkpass"]
DATASOURCE = mdash.DataSourceRef(type_val="prometheus", uid="${datasource}")
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


def data_link(title: str, url: str) -> bdash.DashboardLink:
    return bdash.DashboardLink(title).url(url)


def to_host() -> bdash.DashboardLink:
    """A data link to the host dashboard of the series' instance."""
    return data_link("Host ${__field.labels.instance}", dashboard_url("host", instance="${__field.labels.instance}"))


def to_link(instance: str, peer: str, plane: str) -> bdash.DashboardLink:
    """A data link to the link dashboard of one host's peer-plane pair."""
    return data_link("This peer-plane", dashboard_url("link", instance=instance, peer=peer, plane=plane))


ROW_TO_LINK = to_link("${__data.fields.instance}", "${__data.fields.peer}", "${__data.fields.plane}")


def to_dashboard(name: str, title: str, tooltip: str) -> bdash.DashboardLink:
    """A link in the dashboard's header to another one, keeping the variables and the time range."""
    return (bdash.DashboardLink(title).type(mdash.DashboardLinkType.LINK).url(f"/d/{UIDS[name]}/{UIDS[name]}")
            .include_vars(True).keep_time(True).icon("dashboard").tooltip(tooltip))


# ---- the helpers: the SDK's builders with LinkPass's choices ---------------------------------------

def target(expr: str, legend: str = "__auto") -> bprom.Dataquery:
    """One PromQL range query of a panel (its refId is given by panel(); table() and heatmap()
    change the kind)."""
    return (bprom.Dataquery().expr(expr).legend_format(legend).range().format(mprom.PromQueryFormat.TIME_SERIES)
            .editor_mode(mprom.QueryEditorMode.CODE).datasource(DATASOURCE))


def panel(builder, title: str, description: str, targets: list[bprom.Dataquery], *, unit: str, w: int, h: int,
          links: tuple[bdash.DashboardLink, ...] = ()):
    """What every panel has, on a panel builder of any kind; layout() gives it its id and position."""
    builder.title(title).description(description).datasource(DATASOURCE).unit(unit).height(h).span(w)
    builder.targets([t.ref_id(chr(ord("A") + i)) for i, t in enumerate(targets)])
    if links:
        builder.data_links(list(links))
    return builder


def timeseries(title: str, description: str, targets: list[bprom.Dataquery], *, unit: str, w: int = 12,
               h: int = 8, stack: bool = False, legend: str = "list", links: tuple[bdash.DashboardLink, ...] = (),
               colors: dict[str, str] | None = None) -> btimeseries.Panel:
    """A time series panel; `stack` stacks the series (parts of a whole, such as paths by state),
    `colors` gives the series named like a key (its legend) that fixed colour."""
    stacking = bcommon.StackingConfig().group("A").mode(common.StackingMode("normal" if stack else "none"))
    legend_options = (bcommon.VizLegendOptions().calcs(["max", "lastNotNull"] if legend == "table" else [])
                      .display_mode(common.LegendDisplayMode(legend)).placement(common.LegendPlacement.BOTTOM)
                      .show_legend(True))
    p = (btimeseries.Panel().draw_style(common.GraphDrawStyle.LINE).line_width(1).fill_opacity(30 if stack else 10)
         .show_points(common.VisibilityMode.NEVER).span_nulls(False).axis_soft_min(0).stacking(stacking)
         .color_scheme(bdash.FieldColor().mode(mdash.FieldColorModeId.PALETTE_CLASSIC)).legend(legend_options)
         .tooltip(bcommon.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING)))
    for name, color in (colors or {}).items():
        fixed = mdash.FieldColor(mode=mdash.FieldColorModeId.FIXED, fixed_color=color)
        p.override_by_name(name, [mdash.DynamicConfigValue(id_val="color", value=fixed)])
    return panel(p, title, description, targets, unit=unit, w=w, h=h, links=links)


def stat(title: str, description: str, targets: list[bprom.Dataquery], *, unit: str = "short", w: int = 4,
         h: int = 4, steps: tuple[tuple[str, float | None], ...] = (("green", None),), mappings: dict | None = None,
         text: str = "auto", links: tuple[bdash.DashboardLink, ...] = ()) -> bstat.Panel:
    """A single figure, coloured by `steps` (colour, from this value on); `mappings` names values."""
    p = (bstat.Panel().color_scheme(bdash.FieldColor().mode(mdash.FieldColorModeId.THRESHOLDS))
         .thresholds(bdash.ThresholdsConfig().mode(mdash.ThresholdsMode.ABSOLUTE)
                     .steps([mdash.Threshold(value=v, color=c) for c, v in steps]))
         .reduce_options(bcommon.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False))
         .color_mode(common.BigValueColorMode.BACKGROUND).graph_mode(common.BigValueGraphMode.NONE)
         .justify_mode(common.BigValueJustifyMode.AUTO).orientation(common.VizOrientation.AUTO)
         .text_mode(common.BigValueTextMode(text)).wide_layout(True).show_percent_change(False))
    if mappings:
        p.mappings([mdash.ValueMap(options={str(value): mdash.ValueMappingResult(text=name, index=i)
                                            for i, (value, name) in enumerate(sorted(mappings.items()))})])
    return panel(p, title, description, targets, unit=unit, w=w, h=h, links=links)


def table(title: str, description: str, targets: list[bprom.Dataquery], *, unit: str, w: int = 12, h: int = 8,
          hide: tuple[str, ...] = ("Time", "__name__", "job"), rename: dict[str, str] | None = None,
          links: tuple[bdash.DashboardLink, ...] = ()) -> btable.Panel:
    """The series of an instant query as rows, one column per label (`hide` drops some)."""
    organize = mdash.DataTransformerConfig(id_val="organize", options={
        "excludeByName": {name: True for name in hide}, "renameByName": dict(rename or {}), "indexByName": {}})
    p = (btable.Panel().align(common.FieldTextAlignment.AUTO).filterable(True).show_header(True)
         .cell_height(common.TableCellHeight.SM).with_transformation(organize)
         .footer(bcommon.TableFooterOptions().show(False).reducer(["sum"]).count_rows(False)))
    instant = [t.instant().format(mprom.PromQueryFormat.TABLE) for t in targets]
    return panel(p, title, description, instant, unit=unit, w=w, h=h, links=links)


def heatmap(title: str, description: str, targets: list[bprom.Dataquery], *, unit: str, y_unit: str, w: int = 12,
            h: int = 8) -> bheatmap.Panel:
    """A histogram's buckets over time (targets in `heatmap` format, legend {{le}})."""
    color = (bheatmap.HeatmapColorOptions().mode(mheatmap.HeatmapColorMode.SCHEME).scheme("Oranges")
             .scale(mheatmap.HeatmapColorScale.EXPONENTIAL).exponent(0.5).steps(64).fill("dark-orange").reverse(False))
    p = (bheatmap.Panel().calculate(False).cell_gap(1).color(color)
         .y_axis(bheatmap.YAxisConfig().axis_placement(common.AxisPlacement.LEFT).unit(y_unit))
         .rows_frame(bheatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.AUTO))
         .cell_values(bheatmap.CellValues().unit(unit)).filter_values(bheatmap.FilterValueRange().le(1e-9))
         .show_legend().mode(common.TooltipDisplayMode.SINGLE).hide_y_histogram()
         .exemplars_color("rgba(255,0,255,0.7)"))
    p = panel(p, title, description, [t.format(mprom.PromQueryFormat.HEATMAP) for t in targets], unit=unit, w=w, h=h)
    # the plugin's own field config, empty (its defaults): the SDK reads a heatmap back with one
    p.build().field_config.defaults.custom = mheatmap.FieldConfig()
    return p


def row(title: str, panels: list, *, collapsed: bool = False) -> dict:
    """A row and the panels under it; a collapsed row keeps them inside itself until opened."""
    return {"title": title, "panels": panels, "collapsed": collapsed}


def var(name: str, label: str, query: str, *, include_all: bool = False, multi: bool = False) -> bdash.QueryVariable:
    """A template variable filled by a Prometheus query such as label_values(metric{...}, label)."""
    v = (bdash.QueryVariable(name).label(label).datasource(DATASOURCE)
         .query({"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"})
         .refresh(mdash.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(mdash.VariableSort.ALPHABETICAL_ASC).regex("")
         .hide(mdash.VariableHide.DONT_HIDE).include_all(include_all).multi(multi).options([]))
    if include_all:
        # every value, also when there is none yet (the coordinator's fault series come and go)
        v.all_value(".*").current(mdash.VariableOption(selected=True, text=["All"], value=["$__all"]))
    return v


def datasource_var() -> bdash.DatasourceVariable:
    """The `datasource` variable every panel queries through: any Prometheus data source."""
    return (bdash.DatasourceVariable("datasource").label("Data source").type("prometheus").regex("")
            .hide(mdash.VariableHide.DONT_HIDE).include_all(False).multi(False))


def layout(board: bdash.Dashboard, sections: list[dict]) -> None:
    """Place the rows and their panels on the 24-column grid, left to right and wrapping, number
    every panel, and add them to `board`. A collapsed row holds its panels, placed below it as
    Grafana shows them when the row is opened, and takes one line itself; an open row's panels
    follow it at the top level, where Grafana expects them (the SDK's with_row would nest them)."""
    ids = itertools.count(1)
    y = 0
    for section in sections:
        r = (bdash.Row(section["title"]).id(next(ids)).collapsed(section["collapsed"]).datasource(DATASOURCE)
             .grid_pos(mdash.GridPos(h=1, w=GRID_WIDTH, x=0, y=y)))
        top, x, line = y + 1, 0, 0
        for p in section["panels"]:
            size = p.build().grid_pos
            if x + size.w > GRID_WIDTH:
                top, x, line = top + line, 0, 0
            p.id(next(ids)).grid_pos(mdash.GridPos(h=size.h, w=size.w, x=x, y=top))
            x, line = x + size.w, max(line, size.h)
        if section["collapsed"]:
            for p in section["panels"]:
                r.with_panel(p)
            board.with_row(r)
            y += 1
        else:
            board.with_row(r)
            for p in section["panels"]:
                board.with_panel(p)
            y = top + line


def dashboard(name: str, title: str, description: str, sections: list[dict], variables: list,
              links: list[bdash.DashboardLink]) -> dict:
    """A dashboard as the JSON document Grafana imports."""
    builtin = (bdash.AnnotationQuery().name("Annotations & Alerts").type("dashboard").built_in(1).enable(True)
               .hide(True).datasource(mdash.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
               .icon_color("rgba(0, 211, 255, 1)"))
    to_all = (bdash.DashboardLink("LinkPass").type(mdash.DashboardLinkType.DASHBOARDS).tags(list(TAGS))
              .as_dropdown(True).keep_time(True).icon("external link").tooltip("").url(""))
    board = (bdash.Dashboard(title).uid(UIDS[name]).description(description).tags(list(TAGS)).version(1).editable()
             .tooltip(mdash.DashboardCursorSync.CROSSHAIR).time("now-6h", "now").timezone("browser").refresh("30s")
             .fiscal_year_start_month(0).week_start("").live_now(False).annotation(builtin)
             .links([to_all, *links]).variables([datasource_var(), *variables]))
    layout(board, sections)
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


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


def _instance_var() -> bdash.QueryVariable:
    return var("instance", "Host", f"label_values(linkpass_build_info{{{AGENT}}}, instance)")


def _per_path(sel: str, *, by_peer: bool) -> list:
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
        [to_dashboard("link", "Link dashboard", "This host's peer-plane pairs")])


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
        [to_dashboard("host", "Host dashboard", "The host this pair is seen from")])


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
