"""The coordinator's HTTP API as an OpenAPI 3.1 document, made from the endpoint's own route table
(`http._ROUTES`: method, path, the action that decides who may call it, the query parameters its
handler reads, the request dataclass its parser makes) and the request dataclasses' fields
(control/bodies.py, with REQUIRED). Served at GET /v1/openapi.json without a token and printed by
`linkpass coordinator openapi`; deploy/schema/coordinator-openapi.json is the checked-in copy.
"""
from __future__ import annotations

import dataclasses
import types
import typing

from .. import __version__
from .auth import NEEDS
from ..control.bodies import REQUIRED
from ..control.errors import KINDS

_SCALAR = {str: {"type": "string"}, int: {"type": "integer"}, float: {"type": "number"}, bool: {"type": "boolean"}}


def _schema_of(t, components: dict) -> dict:
    """A JSON Schema for a request field's type annotation; dataclasses become components."""
    origin = typing.get_origin(t)
    args = typing.get_args(t)
    if t in _SCALAR:
        return dict(_SCALAR[t])
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        one = _schema_of(inner[0], components) if len(inner) == 1 else {"anyOf": [_schema_of(a, components)
                                                                                for a in inner]}
        return {"anyOf": [one, {"type": "null"}]} if type(None) in args else one
    if origin is tuple:
        return {"type": "array", "items": _schema_of(args[0], components)}
    if origin is dict:  # plane number (as a JSON key) -> address
        return {"type": "object", "additionalProperties": _schema_of(args[1], components)}
    if dataclasses.is_dataclass(t):
        return {"$ref": f"#/components/schemas/{_component(t, components)}"}
    raise TypeError(f"no JSON Schema for {t!r}")


def _component(cls, components: dict) -> str:
    name = cls.__name__
    if name not in components:
        components[name] = {}  # placeholder: a dataclass that refers to itself stops here
        hints = typing.get_type_hints(cls)
        components[name] = {"type": "object",
                            "properties": {f.name: _schema_of(hints[f.name], components) for f in dataclasses.fields(cls)},
                            "required": list(REQUIRED.get(cls, ()))}
    return name


def spec(routes: dict) -> dict:
    """The document for `routes` (http._ROUTES: the endpoint hands in its own table)."""
    components: dict = {}
    paths: dict = {}
    for (method, path), route in sorted(routes.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        op: dict = {"summary": route.summary, "operationId": f"{method.lower()}_{path.strip('/').replace('/', '_')}",
                    "responses": {"200": {"description": "done", "content": {"application/json": {}}},
                                  "4XX": {"description": "refused: the message names the field and the fix, the kind what it is",
                                          "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}}}
        if route.action is None:
            op["security"] = []
        elif route.token_optional:
            op["security"] = [{}, {"bearer": []}]
            op["x-linkpass-role"] = NEEDS[route.action]
            op["description"] = (f"answers without a token; a token of role {NEEDS[route.action]} (or any other) "
                                 "gets more")
        else:
            op["x-linkpass-role"] = NEEDS[route.action]
            op["description"] = f"needs a token of role {NEEDS[route.action]}" + (
                " (or operator)" if NEEDS[route.action] == "reader" else "") + (
                "; an agent token only as its own host" if route.action == "report" else "")
        if route.query:
            op["parameters"] = [{"name": name, "in": "query", "required": required, "schema": {"type": kind}}
                                for name, kind, required in route.query]
        if route.body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{_component(route.body, components)}"}}}}
        if path == "/metrics":
            op["responses"]["200"]["content"] = {"text/plain": {}}
        if path in ("/v1/register", "/v1/report"):
            op["responses"]["307"] = {
                "description": "a sharded coordinator: this agent registers and reports at its shard (Location, and "
                               "`url` and `shard` in the body)",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        paths.setdefault(path, {})[method.lower()] = op
    components["Error"] = {
        "type": "object", "required": ["error", "kind"],
        "properties": {"error": {"type": "string", "description": "for a person: what was refused and what would work"},
                       "kind": {"type": "string", "enum": list(KINDS),
                                "description": "for a program to match (the message's words may change)"},
                       "needs_role": {"type": "string", "description": "kind forbidden: the role that may do this"},
                       "url": {"type": "string", "description": "kind moved: where this agent registers and reports"},
                       "shard": {"type": "integer", "description": "kind moved: that coordinator shard"}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "LinkPass coordinator", "version": __version__,
                 "description": "Agents report here; the CLI and dashboards read and drain (docs/coordinator.md, "
                                "docs/security.md)."},
        "servers": [{"url": "https://127.0.0.1:9470"}],
        "security": [{"bearer": []}],
        "paths": paths,
        "components": {"schemas": dict(sorted(components.items())),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "a reader, operator or agent token"}}},
    }
