"""The running coordinator serves its OpenAPI document without a token, and reads every typed
query parameter it declares (a bad value is refused naming it)."""
from __future__ import annotations

import json

import pytest

from linkpass.coordinator.http import _ROUTES
from linkpass.coordinator.openapi import spec as spec_of


def test_the_coordinator_serves_it_and_reads_every_typed_query_parameter(tmp_path):
    from linkpass.coordinator import startup

    from support.coordinator import coordinator_client
    from support.fleet import MODEL

    fabric = tmp_path / "fabric.json"
    fabric.write_text(json.dumps(MODEL.to_dict()))
    srv = startup.start({"state_dir": str(tmp_path / "state"), "listen": "127.0.0.1:0", "fabric": str(fabric)})
    try:
        with coordinator_client(srv.url, None, tmp_path / "state") as anonymous:  # no token needed
            assert anonymous.get("/v1/openapi.json") == spec_of(_ROUTES)
        reader = (tmp_path / "state" / "reader.token").read_text().strip()
        with coordinator_client(srv.url, reader, tmp_path / "state") as c:
            for (method, path), route in _ROUTES.items():
                for name, kind, required in route.query:
                    if kind == "string" and name not in ("host", "kind"):
                        continue  # free text (a link name, a flag): nothing to refuse
                    bad = "../x" if name == "host" else "nope" if kind == "string" else "-1x"
                    with pytest.raises(Exception, match=name):
                        c.get(path, **{name: bad})
    finally:
        srv.close()
        srv.service.coordinator.store.close()
