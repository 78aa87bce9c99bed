"""`linkpass doctor`, one real run inside a testbed host's namespace (the pure checks and the
rendering: tests/unit/test_doctor.py)."""
from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from linkpass.cli import doctor as DC


def test_doctor_in_a_testbed_namespace(fabric, tmp_path, capsys):
    from linkpass.kernel import netns as ns_io
    from linkpass.testbed.agents import write_agent_configs

    ns = fabric.netns("h0")
    rows = [{"path": 1, "peer": "h1", "plane": 0, "state": "up"}, {"path": 2, "peer": "h1", "plane": 1, "state": "down"}]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = json.dumps(rows).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    # a stand-in agent API inside h0's namespace, on a port of its own
    server = ns_io.run_in_netns(ns, lambda: ThreadingHTTPServer(("127.0.0.1", 0), Handler))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        configs = write_agent_configs(fabric, str(tmp_path), bytes(range(32)), api_port=server.server_address[1])
        ap = argparse.ArgumentParser()
        DC.register(ap.add_subparsers(dest="command"))
        args = ap.parse_args(["doctor", "--netns", ns, "--config", configs[0], "-o", "json"])
        code = args.func(args)
    finally:
        server.shutdown()
        server.server_close()
    doc = json.loads(capsys.readouterr().out)
    c = {x["name"]: x for x in doc["checks"]}
    for name in ("sysctl.multipath_hash", "sysctl.rp_filter", "config", "nic.p0", "nic.p1",
                 "route.h1", "route.h2", "route.h3"):
        assert c[name]["status"] == "ok", c[name]
    assert "plane(s) 0,1" in c["route.h3"]["detail"]
    assert c["agent"]["status"] == "warn" and "2 paths, 1 down (h1/p1)" in c["agent"]["detail"]
    assert code == (2 if any(x["status"] == "fail" for x in doc["checks"]) else 1)
