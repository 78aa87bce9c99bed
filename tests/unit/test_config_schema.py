"""The agent config's JSON Schema is made from the parser's own tables, and the two agree: the
checked-in file is what `linkpass agent --schema` prints, the shipped examples and the testbed's
configs validate, every number's bounds are accepted by both and one step beyond is refused by
both, and unknown fields are refused by both."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from linkpass.agent.config import DETECT, SCALARS, ConfigError, HostFacts, parse, schema


REPO = Path(__file__).resolve().parents[2]
CHECKED_IN = REPO / "deploy" / "schema" / "agent-config.schema.json"
BASE = {"agent_id": 7, "name": "h7", "fleet_key_file": "/etc/linkpass/fleet.key", "service": "198.18.0.7",
        "nics": [{"plane": 0, "ifname": "p0", "addr": "198.18.64.15", "gateway": "198.18.64.14"}],
        "coordinator": {"url": "https://198.19.0.1:9470", "token_file": "/etc/linkpass/agent.token"}}
VALIDATOR = jsonschema.Draft202012Validator(schema())


def as_json(doc: dict) -> dict:
    """The file as JSON sees it: mapping keys are strings (a peer's nics {0: ...} becomes {"0": ...})."""
    return json.loads(json.dumps(doc))


def both(doc: dict) -> tuple[bool, bool]:
    """(the parser accepts it, the schema accepts it)."""
    try:
        parse(doc)
        parsed = True
    except ConfigError:
        parsed = False
    return parsed, VALIDATOR.is_valid(as_json(doc))


def test_the_checked_in_schema_is_what_the_code_makes():
    jsonschema.Draft202012Validator.check_schema(schema())
    out = subprocess.run([sys.executable, "-m", "linkpass.cli", "agent", "--schema"], capture_output=True, text=True)
    assert out.returncode == 0 and json.loads(out.stdout) == schema()
    assert json.loads(CHECKED_IN.read_text()) == schema(), "regenerate: linkpass agent --schema > " + str(CHECKED_IN)


def test_the_examples_validate():
    fleet = yaml.safe_load((REPO / "deploy" / "examples" / "agent-fleet.yaml").read_text())
    one = yaml.safe_load((REPO / "deploy" / "examples" / "agent-one-host.yaml").read_text())
    cm = next(d for d in yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "linkpass-agent.yaml").read_text())
              if d["kind"] == "ConfigMap")
    for doc in (fleet, one, yaml.safe_load(cm["data"]["agent.yaml"]), BASE):
        errors = [e.message for e in VALIDATOR.iter_errors(as_json(doc))]
        assert not errors, errors


@pytest.mark.parametrize("where", [w for w, spec in SCALARS.items() if spec[0] in ("number", "integer")])
def test_schema_and_parser_agree_on_every_numbers_bounds(where):
    section, key = where.split(".")
    lo, hi = SCALARS[where][1:]
    step = 1 if SCALARS[where][0] == "integer" else 0.01
    # interval_ms <= standby, progress <= idle (standby) are rules between fields, the parser's alone: keep them true
    extra = {"idle_interval_ms": {"interval_ms": 0.1, "standby_interval_ms": 0.1},
             "interval_ms": {"idle_interval_ms": 60_000, "standby_interval_ms": 60_000, "progress_interval_ms": 60_000},
             "standby_interval_ms": {"interval_ms": 0.1, "idle_interval_ms": 60_000},
             "progress_interval_ms": {"interval_ms": 0.1}}.get(key, {})
    for value, ok in ((lo, True), (hi, True), (lo - step, False), (hi + step, False)):
        doc = {**BASE, section: {**BASE.get(section, {}), **extra, key: value}}
        assert both(doc) == (ok, ok), (where, value)


@pytest.mark.parametrize("key", list(DETECT))
def test_schema_and_parser_agree_on_detect(key):
    _f, _factor, lo, hi, _d = DETECT[key]
    assert both({**BASE, "detect": {key: hi}})[1] and both({**BASE, "detect": {key: lo}})[1]
    assert both({**BASE, "detect": {key: hi + 1}}) == (False, False)


@pytest.mark.parametrize("change", [
    {"probe": {"intervall_ms": 1}}, {"colour": "blue"}, {"probe": {"engine": "dpdk"}},
    {"metrics": {"address": "not-an-address-at-all"}}, {"nics": []}, {"agent_id": 0}, {"agent_id": "seven"},
    {"coordinator": {"url": "https://x:9470"}}, {"routes": {"enabled": "yes"}},
])
def test_what_the_parser_refuses_the_schema_refuses_too(change):
    parsed, valid = both({**BASE, **change})
    assert not parsed
    # an address is a string to JSON Schema: only the parser can tell a bad one
    assert not valid or change == {"metrics": {"address": "not-an-address-at-all"}}


def test_auto_values_are_valid_and_resolve():
    doc = {**BASE, "agent_id": "auto", "name": "auto", "service": "auto", "nics": "auto",
           "metrics": {"address": "auto"},
           "host": {"service_subnet": "198.18.0.0/24", "management_subnet": "198.19.0.0/24",
                    "planes": [{"plane": 0, "subnet": "198.18.64.0/18"}]}}
    assert VALIDATOR.is_valid(as_json(doc))
    cfg = parse(doc, HostFacts("h7", (("lo", "198.18.0.7/32"), ("m", "198.19.0.7/24"), ("p0", "198.18.64.15/31"))))
    assert (cfg.agent_id, cfg.metrics_address, cfg.nics[0].gateway) == (3323068423, "198.19.0.7", "198.18.64.14")


PATH_FIELDS = ["fleet_key_file", "fleet_key_accept_file"] + \
    [w for w, spec in SCALARS.items() if spec[0] in ("path", "optional_path")]


def test_every_file_field_is_a_path_field():
    # a file or folder the agent opens must be checked as an absolute path, not as a plain string
    named = {w for w in SCALARS if w.endswith(("_file", "_dir", ".journal", ".path"))}
    assert named <= set(PATH_FIELDS) and len(PATH_FIELDS) >= 9


@pytest.mark.parametrize("where", PATH_FIELDS)
def test_a_relative_path_is_refused_by_name_and_by_the_schema(where):
    def with_value(value):
        if "." not in where:
            return {**BASE, where: value}
        section, key = where.split(".")
        sec = {**BASE.get(section, {}), key: value}
        if key in ("cert_file", "key_file"):  # they go together: the other one is valid
            sec.setdefault("key_file" if key == "cert_file" else "cert_file", "/etc/linkpass/tls/h7.pem")
        return {**BASE, section: sec}

    assert both(with_value("/var/lib/linkpass/x")) == (True, True)
    for relative in ("x", "./x", "../etc/x", "lanes"):
        with pytest.raises(ConfigError, match=rf"^{where}: '{re.escape(relative)}' is not an absolute path; e\.g\. /"):
            parse(with_value(relative))
        assert not VALIDATOR.is_valid(as_json(with_value(relative)))
