"""The coordinator's OpenAPI document is made from its own route table and request dataclasses,
and says what the endpoint does: the checked-in copy is current, every route is in it with the
role that may call it, and each body's required fields are exactly the ones its parser refuses to
go without (the running coordinator serving it: tests/service/test_openapi_served.py)."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from linkpass.control import bodies as R
from linkpass.control.errors import CoordinatorError
from linkpass.coordinator.auth import NEEDS
from linkpass.coordinator.http import _ROUTES
from linkpass.coordinator.openapi import spec as spec_of

REPO = Path(__file__).resolve().parents[2]
CHECKED_IN = REPO / "deploy" / "schema" / "coordinator-openapi.json"

PATH = {"id": 1, "peer": "h1", "plane": 0, "sport": 49152, "hops": ["198.18.64.0"], "peer_addr": "198.18.64.3",
        "state": "up", "reason": None}
# a valid body per request dataclass, and the parser that takes it
BODIES = {
    R.RegisterIn: (R.parse_register, {"name": "h0", "agent_id": 1, "service": "198.18.0.1", "nics": {"0": "198.18.64.1"},
                                      "version": "0.1.0", "api_port": 9471, "paths": [PATH], "drain_version": None,
                                      "plan_version": None, "plan_deltas": True,
                                      "probe_budget": {"pps": 20000, "idle_interval_ms": 100}, "digests": True}),
    R.ReportIn: (R.parse_report, {"name": "h0", "paths": [PATH], "changes": [{"id": 1, "state": "down", "reason": None}],
                                  "drain_version": 3, "plan_version": 2, "plan_deltas": False,
                                  "probe_budget": {"pps": 0, "idle_interval_ms": 250}, "digests": True,
                                  "digest": "0123456789abcdef" * 2}),
    R.DrainIn: (R.parse_drain, {"link": "p0l0-p0s1", "reason": "optic", "dry_run": True, "force": False, "for_s": 600}),
    R.DecommissionIn: (R.parse_decommission, {"host": "h3", "reason": "retired", "dry_run": False}),
}


def test_the_checked_in_document_is_what_the_code_makes():
    out = subprocess.run([sys.executable, "-m", "linkpass.cli", "coordinator", "openapi"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and json.loads(out.stdout) == spec_of(_ROUTES)
    assert json.loads(CHECKED_IN.read_text()) == spec_of(_ROUTES), "regenerate: linkpass coordinator openapi > " + str(CHECKED_IN)


def test_every_route_is_published_with_who_may_call_it():
    doc = spec_of(_ROUTES)
    assert doc["openapi"] == "3.1.0"
    published = {(m.upper(), p): op for p, ops in doc["paths"].items() for m, op in ops.items()}
    assert set(published) == set(_ROUTES)
    for key, route in _ROUTES.items():
        op = published[key]
        if route.action is None:
            assert op["security"] == []
        else:
            assert op["x-linkpass-role"] == NEEDS[route.action]
        if route.body is not None:
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/" + route.body.__name__)
    # every $ref resolves
    text = json.dumps(doc)
    for name in set(part.split('"')[0] for part in text.split("#/components/schemas/")[1:]):
        assert name in doc["components"]["schemas"], name


@pytest.mark.parametrize("cls", list(BODIES), ids=lambda c: c.__name__)
def test_required_fields_are_exactly_what_the_parser_cannot_do_without(cls):
    parser, body = BODIES[cls]
    parser(copy.deepcopy(body))  # the whole body is accepted
    schema = spec_of(_ROUTES)["components"]["schemas"][cls.__name__]
    assert set(schema["properties"]) == set(body), "the example names every field"
    for field in body:
        partial = {k: v for k, v in copy.deepcopy(body).items() if k != field}
        try:
            parser(partial)
            refused = False
        except CoordinatorError as exc:
            refused = field in str(exc)
        assert refused == (field in schema["required"]), (cls.__name__, field)


def test_a_refusal_s_kinds_are_published():
    """Programs match a refusal's kind: the document lists every one (control/errors.py)."""
    from linkpass.control.errors import KINDS

    error = spec_of(_ROUTES)["components"]["schemas"]["Error"]
    assert error["required"] == ["error", "kind"] and error["properties"]["kind"]["enum"] == list(KINDS)


def test_every_refusal_the_endpoint_answers_itself_has_a_kind():
    """Each way the endpoint refuses before a handler runs (what its metric counts it as) maps to
    a refusal kind; a new one without a kind would fail here, not at a caller's request."""
    import inspect
    import re

    from linkpass.control.errors import KINDS
    from linkpass.coordinator import http

    counted = set(re.findall(r'_refuse\(writer, \w+, [\w.]+, "(\w+)"', inspect.getsource(http)))
    assert counted and counted | {"rate_limited", "busy"} <= set(http._KIND_OF_COUNTED)
    assert set(http._KIND_OF_COUNTED.values()) <= set(KINDS)
