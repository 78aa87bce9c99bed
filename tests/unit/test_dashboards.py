"""The Grafana dashboards (linkpass/observe/dashboards.py, checked in under deploy/grafana): the
files are what the code builds, they read back unchanged through grafana-foundation-sdk's types
(the schemas of Grafana 11.6), their structure is one Grafana takes (ids, a 24-column grid
without overlaps, a Prometheus query, a description and a unit on every panel, the `datasource`
variable), and every PromQL expression names only metrics LinkPass exports: the agent's golden
exposition, the coordinator's real /metrics, the recording rules, and Prometheus' own `up`,
`process_*` and `python_*`. promtool parses every expression.

The coordinator's families come from a coordinator started in-process, a service; so these
tests check every other name, and tests/service/test_dashboards_metrics.py checks them all."""
from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from linkpass.observe import dashboards as D
from linkpass.testbed.prometheus import promtool

from support.dashboards import (_VARIABLE, GOLDEN, GRAFANA, ROOT, all_panels, checked_in, exposition_names,
                                metric_names, not_exported, queries, query_of_variable, rule_names, sdk_errors,
                                unexported)

REGENERATE = "regenerate them: `.venv/bin/python -m linkpass.observe.dashboards --out deploy/grafana`"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRAFANA_GLOBALS = {"__rate_interval", "__interval", "__range", "__all"}


def overlaps(panels: list[dict]) -> list[tuple[int, int]]:
    boxes = [(p["id"], p["gridPos"]) for p in panels]
    return [(a, b) for i, (a, g) in enumerate(boxes) for b, k in boxes[i + 1:]
            if g["x"] < k["x"] + k["w"] and k["x"] < g["x"] + g["w"] and g["y"] < k["y"] + k["h"]
            and k["y"] < g["y"] + g["h"]]


BOARDS = sorted(D.build_all())


def test_the_checked_in_files_are_what_the_generator_builds():
    stale = [name for name, board in D.build_all().items()
             if not (GRAFANA / name).exists() or (GRAFANA / name).read_text() != D.render(board)]
    assert not stale, f"out of date against linkpass/observe/dashboards.py: {', '.join(stale)}; {REGENERATE}"
    extra = sorted(p.name for p in GRAFANA.glob("*.json")) != BOARDS
    assert not extra, f"deploy/grafana holds JSON files the generator does not make: {REGENERATE} and remove them"


def test_the_command_writes_the_files_and_checks_them(tmp_path):
    out = tmp_path / "grafana"
    assert D.main(["--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == BOARDS
    assert all((out / n).read_text() == (GRAFANA / n).read_text() for n in BOARDS)
    assert D.build_all() == D.build_all() and D.render(D.fleet()) == D.render(D.fleet())  # deterministic
    (out / BOARDS[0]).write_text("{}\n")
    check = [sys.executable, "-m", "linkpass.observe.dashboards", "--check", "--out"]
    stale = subprocess.run([*check, str(out)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert stale.returncode == 1 and BOARDS[0] in stale.stderr and "--out" in stale.stderr
    fresh = subprocess.run([*check, str(GRAFANA)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert fresh.returncode == 0, fresh.stderr


@pytest.mark.parametrize("name", BOARDS)
def test_structure(name):
    board = checked_in()[name]
    for key in ("uid", "title", "schemaVersion", "panels", "templating", "tags"):
        assert key in board, f"{name}: no {key!r}"
    assert board["uid"] == name.removesuffix(".json") and board["title"] and board["schemaVersion"] == 41
    assert "linkpass" in board["tags"]
    variables = board["templating"]["list"]
    assert [v for v in variables if v["name"] == "datasource"] == [
        {**variables[0], "type": "datasource", "query": "prometheus"}], "the first variable picks the data source"
    names = {v["name"] for v in variables}
    assert len(names) == len(variables), "variable names repeat"
    for v in variables[1:]:
        assert v["type"] == "query" and v["datasource"] == DATASOURCE and v["query"]["query"], v["name"]

    panels = all_panels(board)
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) for i in ids) and len(set(ids)) == len(ids), f"panel ids repeat: {ids}"
    for p in panels:
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0 and g["x"] + g["w"] <= 24, (p["title"], g)
        assert p.get("datasource") == DATASOURCE, f"{p['title']}: datasource {p.get('datasource')}"
    assert not overlaps(board["panels"]), f"panels overlap: {overlaps(board['panels'])}"
    for r in board["panels"]:
        if r["type"] == "row":
            assert r["gridPos"]["w"] == 24 and r["gridPos"]["x"] == 0
            assert not r["panels"] or r["collapsed"], f"row {r['title']!r}: open rows hold no panels"
            assert not overlaps(r["panels"]), f"row {r['title']!r}: panels overlap: {overlaps(r['panels'])}"
            assert all(p["gridPos"]["y"] > r["gridPos"]["y"] for p in r["panels"]), r["title"]
            assert all(p["type"] != "row" for p in r["panels"]), "rows do not nest"

    for p in panels:
        if p["type"] == "row":
            continue
        where = f"{name} {p['title']!r}"
        targets = p.get("targets") or []
        assert targets, f"{where}: no query"
        assert all(t.get("expr", "").strip() and t.get("refId") for t in targets), f"{where}: a target lacks expr/refId"
        assert len({t["refId"] for t in targets}) == len(targets), f"{where}: refIds repeat"
        assert all(t.get("datasource", DATASOURCE) == DATASOURCE for t in targets), where
        text = p.get("description", "")
        assert text.endswith(".") and ". " not in text and len(text) < 240, f"{where}: description {text!r}"
        assert p["fieldConfig"]["defaults"].get("unit"), f"{where}: no unit"
        # every $variable a query or link uses is the dashboard's own, or one Grafana defines
        for t in targets:
            used = {m.strip("${}").split(":")[0] for m in re.findall(r"\$\{?\w+(?::\w+)?\}?", t["expr"])}
            assert used <= names | GRAFANA_GLOBALS, f"{where}: unknown variables {used - names - GRAFANA_GLOBALS}"


@pytest.mark.parametrize("name", BOARDS)
def test_the_files_read_back_through_the_sdks_types(name):
    """Decoded by grafana-foundation-sdk's models (each panel's options and field config by its
    plugin's, each query by the Prometheus one) and encoded again, a file is unchanged, and every
    value has the type its field declares."""
    errors = sdk_errors(checked_in()[name])
    assert not errors, f"{name} departs from the SDK's types:\n  " + "\n  ".join(errors)


def _first(board: dict, kind: str) -> dict:
    return next(p for p in all_panels(board) if p["type"] == kind)


@pytest.mark.parametrize("corrupt, where", [
    (lambda b: _first(b, "stat")["gridPos"].update(w="4"), "grid_pos.w: '4' is not int"),
    (lambda b: _first(b, "stat")["options"].update(sparkle=True), "options.sparkle: the SDK's types have no such"),
    (lambda b: _first(b, "timeseries")["options"]["legend"].update(displayMode="tabel"), "display_mode: 'tabel'"),
    (lambda b: _first(b, "timeseries")["fieldConfig"]["defaults"]["custom"].update(lineWidth="1"), "line_width"),
    (lambda b: _first(b, "table")["transformations"][0].update(optoins={}), "optoins: the SDK's types have no"),
    (lambda b: _first(b, "table")["targets"][0].update(exprr="up"), "targets[0].exprr: the SDK's types have no"),
    (lambda b: b["templating"]["list"][0].update(refresh="1"), "refresh: '1' is none of"),
    (lambda b: _first(b, "heatmap").update(type="heatmapp"), "no panel plugin 'heatmapp'"),
])
def test_the_sdk_check_reports_an_unknown_field_or_a_wrong_type(corrupt, where):
    board = copy.deepcopy(checked_in()["linkpass-host.json"])
    corrupt(board)
    assert any(where in e for e in sdk_errors(board)), sdk_errors(board)


def test_links_lead_to_the_dashboards_and_their_variables():
    boards = {b["uid"]: b for b in checked_in().values()}
    variables = {uid: {v["name"] for v in b["templating"]["list"]} for uid, b in boards.items()}
    urls = [(b["uid"], link["url"]) for b in boards.values() for p in all_panels(b)
            for link in p.get("fieldConfig", {}).get("defaults", {}).get("links", [])]
    urls += [(b["uid"], link["url"]) for b in boards.values() for link in b["links"] if link["type"] == "link"]
    assert urls, "no dashboard links to another"
    for source, url in urls:
        m = re.fullmatch(r"/d/([\w-]+)/[\w-]+(?:\?(.*))?", url)
        assert m and m.group(1) in boards, f"{source}: {url} leads to no LinkPass dashboard"
        set_vars = set(re.findall(r"(?:^|&)var-(\w+)=", m.group(2) or ""))
        assert set_vars <= variables[m.group(1)], f"{source}: {url} sets variables {m.group(1)} lacks"


@pytest.mark.parametrize("expr, names", [
    ('sum by (le) (rate(foo_bucket{a="x{y}", b=~"$v"}[$__rate_interval]))', {"foo_bucket"}),
    ("histogram_quantile(0.99, sum without (instance) (rate(a_b:c[5m])))", {"a_b:c"}),
    ("count(up{job='x'} == 0) or vector(0)", {"up"}),
    ("a / on (peer, plane) group_left (version) b offset 5m > bool 1e-3", {"a", "b"}),
    ("topk(10, m_p99_seconds > 0.5) unless ignoring(x) n2", {"m_p99_seconds", "n2"}),
    ("sum(rate(x[1h:1m])) by (job)", {"x"}),
    ("histogram_quantil(0.5, y)", {"histogram_quantil", "y"}),  # a misspelt function is reported
])
def test_the_tokenizer_finds_the_metric_names(expr, names):
    assert metric_names(expr) == names


def test_the_name_check_reports_an_unknown_metric():
    exported = exposition_names(GOLDEN.read_text())
    expr = 'sum(rate(linkpass_no_such_metric{job="linkpass-agent"}[5m])) / sum(rate(linkpass_probe_requests_total[5m]))'
    assert not_exported(metric_names(expr), exported) == {"linkpass_no_such_metric"}
    assert not_exported({"up", "process_cpu_seconds_total", "python_info", "linkpass_probe_rtt_seconds_bucket"},
                        exported) == set()
    assert query_of_variable('label_values(linkpass_no_such_metric{job="x"}, instance)') == \
        'linkpass_no_such_metric{job="x"}'


def test_expressions_name_only_metrics_the_agent_or_the_rules_export():
    """Every name but the coordinator's own families, which the service test below checks."""
    wrong = unexported(exposition_names(GOLDEN.read_text()) | rule_names(), skip_prefix="linkpass_coordinator_")
    assert not wrong, "not exported by LinkPass:\n  " + "\n  ".join(wrong)


def test_promtool_parses_every_expression(tmp_path):
    """Each expression as a recording rule, Grafana's variables replaced by what they stand for."""
    rules = []
    for board in checked_in().values():
        for where, expr in queries(board):
            promql = _VARIABLE.sub(lambda m: "5m" if "interval" in m.group() or "range" in m.group() else "x", expr)
            rules.append({"record": f"dashboard:check:{len(rules)}", "expr": promql, "labels": {"where": where}})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    out = promtool("check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(rules)} rules found" in out.stdout, out.stdout


def test_the_generator_does_no_io_and_imports_nothing_third_party_but_the_sdk():
    import ast

    tree = ast.parse(Path(D.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    allowed = set(sys.stdlib_module_names) | {"grafana_foundation_sdk"}
    assert imported <= allowed, imported - allowed
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    opens = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "open"]
    assert opens and all(main.lineno <= n.lineno <= main.end_lineno for n in opens), "files are opened only in main()"
