"""The dashboards' expressions and the metric names LinkPass exports: the PromQL tokens an
expression's metric names are read from, the agent's golden exposition, the recording rules and
the checked-in dashboards; and the check of a dashboard against grafana-foundation-sdk's types."""
from __future__ import annotations

import enum
import json
import re
import types
import typing
from pathlib import Path

import yaml
from grafana_foundation_sdk.cog import plugins, runtime as cogruntime
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.runtime import UnknownDataquery
from grafana_foundation_sdk.cog.variants import Dataquery
from grafana_foundation_sdk.models.dashboard import Dashboard

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


def sdk_errors(board: dict) -> list[str]:
    """Where `board` departs from grafana-foundation-sdk's types (the schemas of the Grafana line
    the SDK is built for): a panel type without a plugin in the SDK's registry, a key the SDK's
    models drop when the file is decoded and encoded again (a field Grafana does not have), a
    value whose kind is not the one its field declares (a string for a number, an unknown enum
    value), a query of a data source the SDK does not know."""
    plugins.register_default_plugins()
    errors = [f"panel {p['title']!r}: no panel plugin {p['type']!r} in the SDK"
              for p in all_panels(board) if p["type"] != "row" and cogruntime.panelcfg_config(p["type"]) is None]
    model = Dashboard.from_json(board)
    errors += _differences(board, _encoded(model), "dashboard")
    return errors + _type_errors(model, Dashboard, "dashboard")


def _encoded(model) -> object:
    return json.loads(json.dumps(model, cls=JSONEncoder))


def _differences(doc, again, where: str) -> list[str]:
    if isinstance(doc, dict) and isinstance(again, dict):
        out = [f"{where}.{k}: the SDK's types have no such field" for k in doc if k not in again]
        out += [f"{where}.{k}: missing (the SDK writes {json.dumps(again[k])})" for k in again if k not in doc]
        return out + [e for k in doc if k in again for e in _differences(doc[k], again[k], f"{where}.{k}")]
    if isinstance(doc, list) and isinstance(again, list) and len(doc) == len(again):
        return [e for i, (a, b) in enumerate(zip(doc, again)) for e in _differences(a, b, _item(where, i, a))]
    return [] if doc == again and type(doc) is type(again) else [f"{where}: {doc!r} comes back as {again!r}"]


def _item(where: str, i: int, item) -> str:
    title = item.get("title") if isinstance(item, dict) else getattr(item, "title", None)
    return f"{where}[{i}{f' {title!r}' if isinstance(title, str) else ''}]"


def _name(hint) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _is_model(value) -> bool:
    return hasattr(type(value), "from_json") and hasattr(value, "to_json")


def _shaped(value, hint) -> bool:
    """Whether `value` has the shape of `hint` (an object for a model, a list for a list...), its
    contents unchecked."""
    origin = typing.get_origin(hint) or hint
    if hint in (typing.Any, object) or origin in (typing.Union, types.UnionType):
        return True
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hasattr(origin, "from_json") and isinstance(value, dict):
        return True
    if isinstance(origin, type) and issubclass(origin, enum.Enum):
        return isinstance(value, (int, str))
    return isinstance(value, (int, float) if origin is float else origin)


def _type_errors(value, hint, where: str) -> list[str]:
    """`value` (a decoded model, or what its from_json kept as it was) checked against `hint`,
    the type its field declares."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    wrong = [f"{where}: {value!r} is not {_name(hint)}"]
    if hint in (typing.Any, object):  # untyped in the schema; a model the SDK decoded there still is
        return _type_errors(value, type(value), where) if _is_model(value) else []
    if origin in (typing.Union, types.UnionType):  # the arms of the value's shape; the closest of them
        tries = [_type_errors(value, arm, where) for arm in args if _shaped(value, arm)]
        return min(tries, key=len) if tries else wrong
    if origin is typing.Literal:
        return [] if value in args else [f"{where}: {value!r} is not one of {args}"]
    if origin is list:
        if not isinstance(value, list):
            return wrong
        return [e for i, v in enumerate(value) for e in _type_errors(v, args[0], _item(where, i, v))]
    if origin is dict:
        if not isinstance(value, dict):
            return wrong
        return [e for k, v in value.items()
                for e in _type_errors(k, args[0], where) + _type_errors(v, args[1], f"{where}.{k}")]
    if hint is type(None):
        return [] if value is None else wrong
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = [m.value for m in hint]
        ok = isinstance(value, hint) or any(value == v and type(value) is type(v) for v in values)
        return [] if ok else [f"{where}: {value!r} is none of {values}"]
    if hint is bool:
        return [] if isinstance(value, bool) else wrong
    if hint in (int, float):  # JSON has one kind of number: an int is a float too
        kinds = (int, float) if hint is float else int
        return [] if isinstance(value, kinds) and not isinstance(value, bool) else wrong
    if hint is str:
        return [] if isinstance(value, str) else wrong
    if isinstance(hint, type) and issubclass(hint, Dataquery):
        if isinstance(value, UnknownDataquery) or not isinstance(value, hint):
            return [f"{where}: a query of no data source the SDK knows: {value!r}"]
        hint = type(value)
    if isinstance(hint, type) and hasattr(hint, "from_json"):
        out = []
        if isinstance(value, dict):  # kept as it was by its parent's from_json (a panel's transformations)
            decoded = hint.from_json(value)
            out, value = _differences(value, _encoded(decoded), where), decoded
        if not isinstance(value, hint):
            return wrong
        fields = typing.get_type_hints(hint)
        return out + [e for name, h in fields.items() for e in _type_errors(getattr(value, name), h, f"{where}.{name}")]
    return [f"{where}: no check for {hint!r}"]
