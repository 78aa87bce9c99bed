#!/usr/bin/env python3
"""Coordinator under a connection flood: does on-call still get an answer?

    python sim/bench/reliability_flood.py [--quick] [--json FILE]

The real endpoint (`runner.start`, its own process, HTTPS on 127.0.0.1, max_connections 256,
read_timeout_s 2) with 4 registered agents. Flood: HALF_SENT connections that each send part of
a request head after the TLS handshake and stop (re-opened as the server closes them), plus one client posting
unauthenticated drains as fast as it can. Measured: the latency of an authenticated
`GET /v1/status` on a fresh connection, during the flood and, in the same run, without it.

Row: coordinator-flood (status latency ms during the flood; peer: the same calls without the
flood; extras: how many of the flood's connections the server closed, by eviction or timeout,
and how many unauthenticated requests it refused, or rate-limited, per second).

`coordinator_flood(args)` returns the rows, for a registry of reliability benchmarks.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from linkpass_sim import report  # noqa: E402
from linkpass_sim.report import progress, row  # noqa: E402
from linkpass.coordinator.auth import agent_token, read_agent_secret  # noqa: E402
from linkpass.coordinator.client import Client, Refusal, Unreachable  # noqa: E402
from linkpass.coordinator.tls import build_client_context, lab_dir, lab_paths  # noqa: E402
from linkpass.core.names import host_name  # noqa: E402

HALF_SENT = 1000
MAX_CONNECTIONS = 256
READ_TIMEOUT_S = 2.0


def free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def start_server(work: str, port: int) -> subprocess.Popen:
    settings = {"state_dir": os.path.join(work, "state"), "listen": f"127.0.0.1:{port}",
                "max_connections": MAX_CONNECTIONS, "read_timeout_s": READ_TIMEOUT_S, "idle_timeout_s": 5.0}
    code = ("import time; from linkpass.coordinator import runner; "
            f"runner.start({settings!r}); print('up', flush=True); time.sleep(3600)")
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "sim")])}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    if proc.stdout.readline().strip() != "up":
        raise RuntimeError("the coordinator did not start")
    return proc


class Flood:
    """Half-sent requests kept open, and unauthenticated drains, until stop()."""

    def __init__(self, port: int, tls: ssl.SSLContext):
        self.port = port
        self.tls = tls
        self.stop_ = threading.Event()
        self.refused = 0
        self.reopened = 0
        self.threads = [threading.Thread(target=self._half_sent, daemon=True),
                        threading.Thread(target=self._unauthenticated, daemon=True)]

    def start(self) -> "Flood":
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stop_.set()
        for t in self.threads:
            t.join(timeout=30)

    def _open(self) -> socket.socket | None:
        try:
            # past the TLS handshake: what a flood holds is the request it never finishes
            sk = self.tls.wrap_socket(socket.create_connection(("127.0.0.1", self.port), timeout=5),
                                      server_hostname="127.0.0.1")
            sk.sendall(b"POST /v1/report HTTP/1.1\r\nHost: x\r\nContent-Le")
            sk.setblocking(False)
            return sk
        except OSError:
            return None

    def _half_sent(self) -> None:
        socks = [s for s in (self._open() for _ in range(HALF_SENT)) if s is not None]
        while not self.stop_.wait(0.2):
            for i, sk in enumerate(socks):
                try:
                    closed = sk.recv(1) == b""
                except (BlockingIOError, ssl.SSLWantReadError):
                    continue
                except OSError:
                    closed = True
                if closed:  # the server let it go: open another in its place
                    sk.close()
                    socks[i] = self._open() or sk
                    self.reopened += 1
        for sk in socks:
            sk.close()

    def _unauthenticated(self) -> None:
        c = Client(f"https://127.0.0.1:{self.port}", "not-a-token", timeout_s=5, tls=self.tls)
        while not self.stop_.is_set():
            try:
                c.post("/v1/drain", {"link": "p0l0-p0s0", "reason": "flood"})
            except Refusal:
                self.refused += 1
            except Unreachable:
                time.sleep(0.01)
        c.close()


def status_latencies(url: str, token: str, n: int, tls: ssl.SSLContext) -> tuple[list[float], int]:
    """ms per authenticated status call on a fresh connection; and how many got no answer."""
    out, failed = [], 0
    for _ in range(n):
        t = time.perf_counter()
        try:
            with Client(url, token, timeout_s=30, tls=tls) as c:
                c.get("/v1/status")
            out.append(round((time.perf_counter() - t) * 1000, 3))
        except (Refusal, Unreachable):
            failed += 1
        time.sleep(0.05)
    return out, failed


def errors(url: str, tls: ssl.SSLContext) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=30, context=tls).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("linkpass_coordinator_request_errors_total{"):
            kind = line.split('kind="')[1].split('"')[0]
            out[kind] = float(line.rsplit(" ", 1)[1])
    return out


def coordinator_flood(args) -> list[dict]:
    n = 20 if args.quick else 100
    work = tempfile.mkdtemp(prefix="linkpass-bench-flood-")
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    proc = start_server(work, port)
    try:
        state = os.path.join(work, "state")
        reader = open(os.path.join(state, "reader.token")).read().strip()
        secret = read_agent_secret(os.path.join(state, "agent.secret"))
        tls = build_client_context(lab_paths(lab_dir(state), "ca")[0])  # HTTPS with the lab CA, as agents
        for i in range(4):
            with Client(url, agent_token(secret, host_name(i)), tls=tls) as c:
                c.post("/v1/register", {"name": host_name(i), "agent_id": i + 1, "service": f"198.18.0.{i + 1}",
                                        "nics": {}, "paths": []})
        progress(f"no flood: {n} status calls")
        calm, calm_failed = status_latencies(url, reader, n, tls)
        before = errors(url, tls)
        flood = Flood(port, tls).start()
        time.sleep(3.0)  # the flood has filled the server's connections
        progress(f"flood: {HALF_SENT} half-sent connections, unauthenticated drains; {n} status calls")
        t = time.perf_counter()
        busy, busy_failed = status_latencies(url, reader, n, tls)
        flood.stop()
        window = time.perf_counter() - t + 3.0
        after = errors(url, tls)
    finally:
        proc.kill()
        proc.wait()
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return [row("coordinator-flood", "status_latency", "ms", busy, "same calls, no flood", calm,
                half_sent=HALF_SENT, max_connections=MAX_CONNECTIONS, read_timeout_s=READ_TIMEOUT_S,
                unanswered=busy_failed + calm_failed, closed_by_server=int(d.get("evicted", 0) + d.get("timeout", 0)),
                reopened=flood.reopened, refused_per_s=round(d.get("unauthenticated", 0) / window, 1),
                rate_limited_per_s=round(d.get("rate_limited", 0) / window, 1))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few trials (smoke test)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    rows = coordinator_flood(args)
    print(f"\n{'case':18} {'metric':15} {'unit':4} {'n':>4} {'median':>8} {'p99':>8} {'calm':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['case']:18} {r['metric']:15} {r['unit']:4} {r['n']:>4} {str(r['median']):>8} {str(r['p99']):>8} "
              f"{str(r.get('peer_median')):>8} {str(r.get('ratio')):>6}")
        print("  " + json.dumps({k: v for k, v in r.items() if k not in ("case", "metric", "unit", "n", "median", "p99",
                                                                         "peer", "peer_n", "peer_median", "peer_p99",
                                                                         "ratio")}))
    report.write(report.document("reliability-flood", rows), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
