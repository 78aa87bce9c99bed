"""Every PromQL expression of the Grafana dashboards names only metrics LinkPass exports, the
coordinator's families taken from a coordinator started in-process (the dashboards' files and
structure, and every other name: tests/unit/test_dashboards.py)."""
from __future__ import annotations

import json
import ssl
import urllib.request

from support.coordinator import lab_ca_file
from support.fleet import MODEL
from support.ports import free_port
from support.dashboards import GOLDEN, exposition_names, rule_names, unexported


def test_expressions_name_only_metrics_linkpass_exports(tmp_path):
    from linkpass.coordinator import startup
    from linkpass.coordinator.shard import LocalRoot

    # a sharded coordinator: the root exports the coordinator's families, a shard its own
    (tmp_path / "fabric.json").write_text(json.dumps(MODEL.to_dict()))
    settings = {"state_dir": str(tmp_path / "state"), "listen": f"127.0.0.1:{free_port()}",
                "fabric": str(tmp_path / "fabric.json"), "shards": 2,
                "shard_listen": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]}
    srv = startup.start(settings)
    shard = startup.start_shard(settings, 0, LocalRoot(srv))
    coordinator = set()
    try:
        ctx = ssl.create_default_context(cafile=lab_ca_file(tmp_path / "state"))
        reader = (tmp_path / "state" / "reader.token").read_text().strip()  # the series naming links need one
        for url in (srv.url, shard.url):
            ask = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {reader}"})
            with urllib.request.urlopen(ask, timeout=10, context=ctx) as answer:
                coordinator |= exposition_names(answer.read().decode())
    finally:
        shard.close()
        srv.close()
        srv.service.coordinator.store.close()
    assert {"linkpass_coordinator_link_fault", "linkpass_coordinator_request_duration_seconds_bucket",
            "linkpass_coordinator_shard_queue"} <= coordinator
    wrong = unexported(exposition_names(GOLDEN.read_text()) | coordinator | rule_names())
    assert not wrong, "not exported by LinkPass:\n  " + "\n  ".join(wrong)
