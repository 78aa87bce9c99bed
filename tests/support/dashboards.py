"""The dashboards' expressions and the metric names LinkPass exports: the PromQL tokens an
expression's metric names are read from, the agent's golden exposition, the recording rules and
the checked-in dashboards."""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from linkpass.observe import dashboards as D

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
GOLDEN = ROOT / "tests" / "golden" / "agent_metrics.txt"
RULES = ROOT / "deploy" / "prometheus" / "linkpass-rules.yml"
PROMETHEUS_OWN = {"up"}
PROMETHEUS_OWN_PREFIXES = ("process_", "python_")


FUNCTIONS = {
    "abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh", "avg_over_time",
    "ceil", "changes", "clamp", "clamp_max", "clamp_min", "cos", "cosh", "count_over_time", "day_of_month",
    "day_of_week", "day_of_year", "days_in_month", "deg", "delta", "deriv", "exp", "floor", "histogram_avg",
    "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev", "histogram_stdvar",
    "histogram_sum", "holt_winters", "hour", "idelta", "increase", "irate", "label_join", "label_replace",
    "last_over_time", "ln", "log10", "log2", "mad_over_time", "max_over_time", "min_over_time", "minute", "month",
    "pi", "predict_linear", "present_over_time", "quantile_over_time", "rad", "rate", "resets", "round", "scalar",
    "sgn", "sin", "sinh", "sort", "sort_by_label", "sort_by_label_desc", "sort_desc", "sqrt", "stddev_over_time",
    "stdvar_over_time", "sum_over_time", "tan", "tanh", "time", "timestamp", "vector", "year",
}
AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
                "quantile", "limitk", "limit_ratio"}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right",
            "inf", "nan", "start", "end"}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")  # label names inside are not metrics
_RANGE = re.compile(r"\[[^\[\]]*\]")  # [5m], [$__rate_interval], subqueries' [1h:1m]
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_OFFSET = re.compile(r"\boffset\s+-?[\w$]+")
_VARIABLE = re.compile(r"\$(?:\{\w+(?::\w+)?\}|\w+)")
_NUMBER = re.compile(r"(?<![\w:.])(?:0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(?![\w:])")
_IDENTIFIER = re.compile(r"[a-zA-Z_:][\w:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects: identifiers, once string literals, label matchers and
    label lists, ranges and durations, Grafana variables and numbers are gone, that are not a
    keyword or a known function or aggregation (a misspelt function stays, and is reported)."""
    s = _STRING.sub('""', expr)
    s = _MATCHERS.sub("{}", s)
    s = _RANGE.sub("[]", s)
    s = _LABEL_LIST.sub(" ", s)
    s = _OFFSET.sub(" ", s)
    s = _VARIABLE.sub(" ", s)
    s = _NUMBER.sub(" ", s)
    names = set()
    for m in _IDENTIFIER.finditer(s):
        word, called = m.group(), s[m.end():].lstrip().startswith("(")
        if word in KEYWORDS or (called and word in FUNCTIONS | AGGREGATIONS):
            continue
        names.add(word)
    return names


def query_of_variable(query: str) -> str:
    """The PromQL in a variable's query: label_values(SELECTOR, LABEL) selects SELECTOR."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", query, re.S)
    return m.group(1) if m else query


def exposition_names(text: str) -> set[str]:
    """Every name a Prometheus text exposition lets a query select: each `# TYPE` family, and a
    histogram's or summary's series."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        names.add(name)
        if kind in ("histogram", "summary"):
            names |= {f"{name}_sum", f"{name}_count"} | ({f"{name}_bucket"} if kind == "histogram" else set())
        if kind == "counter" and not name.endswith("_total"):
            names.add(f"{name}_total")
    return names


def rule_names() -> set[str]:
    """The recording rules' names, when the rules file is there (another part of deploy/ owns it)."""
    if not RULES.exists():
        return set()
    doc = yaml.safe_load(RULES.read_text()) or {}
    return {r["record"] for g in doc.get("groups") or [] for r in g.get("rules") or [] if "record" in r}


def not_exported(names: set[str], exported: set[str]) -> set[str]:
    return {n for n in names if n not in exported and n not in PROMETHEUS_OWN
            and not n.startswith(PROMETHEUS_OWN_PREFIXES)}


def checked_in() -> dict[str, dict]:
    return {name: json.loads((GRAFANA / name).read_text()) for name in D.build_all()}


def all_panels(board: dict) -> list[dict]:
    """Every panel, those inside collapsed rows too."""
    return [q for p in board["panels"] for q in (p, *p.get("panels", []))]


def queries(board: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    out = [(f"{board['uid']} panel {p['id']} {p['title']!r} {t.get('refId')}", t.get("expr", ""))
           for p in all_panels(board) for t in p.get("targets", [])]
    out += [(f"{board['uid']} variable {v['name']}", query_of_variable(v["query"]["query"]))
            for v in board["templating"]["list"] if v["type"] == "query"]
    return out


def unexported(exported: set[str], *, skip_prefix: str | None = None) -> list[str]:
    wrong = []
    for board in checked_in().values():
        for where, expr in queries(board):
            bad = not_exported(metric_names(expr), exported)
            bad = {n for n in bad if not (skip_prefix and n.startswith(skip_prefix))}
            if bad:
                wrong.append(f"{where}: {sorted(bad)} in {expr}")
    return wrong
