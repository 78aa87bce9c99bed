"""A private Prometheus server and promtool, from Debian's `prometheus` package unpacked by
deploy/install-prometheus.sh (no system service is installed or touched).

`Prometheus` runs one server for a lab (the demo, the tests): its own config and data directory
in a temporary folder, listening on 127.0.0.1 only, the project's rules loaded; `close()` stops it
and removes the folder. It reads its API for alerts and queries.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

from .ports import free_port

VERSION = "2.42.0"
DEFAULT_DIR = f"/var/cache/linkpass/prometheus/{VERSION}/bin"
INSTALLER = "deploy/install-prometheus.sh"


class PrometheusMissing(RuntimeError):
    pass


def binary(name: str) -> str:
    """The path of `prometheus` or `promtool` ($LINKPASS_PROMETHEUS_BIN overrides the folder)."""
    folder = os.environ.get("LINKPASS_PROMETHEUS_BIN", DEFAULT_DIR)
    path = os.path.join(folder, name)
    if not os.access(path, os.X_OK):
        raise PrometheusMissing(f"{name} is not in {folder}: run `bash {INSTALLER}` as root (it unpacks Debian's "
                                f"prometheus {VERSION} there; `make test` and `make demo` do it)")
    return path


def promtool(*args: str, stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([binary("promtool"), *args], input=stdin, capture_output=True, text=True, timeout=timeout)


class Prometheus:
    """A private Prometheus: scrapes `targets` ({job: [host:port, ...]}) every `scrape_s`,
    evaluates `rules_text` every `eval_s`, keeps its data in a temporary folder removed by
    `close()`. `tls` ({job: {"ca_file", "cert_file", "key_file"}}) scrapes that job over HTTPS."""

    def __init__(self, targets: dict[str, list[str]], rules_text: str, scrape_s: float = 1.0, eval_s: float = 1.0,
                 tls: dict[str, dict] | None = None, start_timeout_s: float = 30.0,
                 token_files: dict[str, str] | None = None):
        from ..formats import yaml_doc as yaml

        self.dir = tempfile.mkdtemp(prefix="linkpass-prometheus-")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = None  # Prometheus' own output, in the folder
        try:
            with open(os.path.join(self.dir, "rules.yml"), "w") as f:
                f.write(rules_text)
            jobs = []
            for job, hosts in targets.items():
                j = {"job_name": job, "static_configs": [{"targets": list(hosts)}]}
                if tls and job in tls:
                    j.update(scheme="https", tls_config=dict(tls[job]))
                if token_files and job in token_files:  # a bearer token read from the file at each scrape
                    j["authorization"] = {"type": "Bearer", "credentials_file": token_files[job]}
                jobs.append(j)
            ms = lambda s: f"{round(s * 1000)}ms"  # noqa: E731 - Prometheus durations take no fractions
            config = {"global": {"scrape_interval": ms(scrape_s), "evaluation_interval": ms(eval_s),
                                 "scrape_timeout": ms(min(scrape_s, 10))},
                      "rule_files": ["rules.yml"], "scrape_configs": jobs}
            with open(os.path.join(self.dir, "prometheus.yml"), "w") as f:
                yaml.safe_dump(config, f, sort_keys=False)
            self.log = open(os.path.join(self.dir, "prometheus.log"), "w")
            self._launch(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _launch(self, timeout_s: float) -> None:
        self.proc = subprocess.Popen(
            [binary("prometheus"), f"--config.file={self.dir}/prometheus.yml",
             f"--storage.tsdb.path={self.dir}/data", f"--web.listen-address=127.0.0.1:{self.port}",
             "--storage.tsdb.retention.time=1d", "--web.console.templates=/nonexistent",
             "--web.console.libraries=/nonexistent"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Prometheus did not start: {self.log_tail()}")
            time.sleep(0.2)

    def restart(self, timeout_s: float = 60.0) -> None:
        """SIGKILL the server, as a crash would, and start it again on the same port and data
        (its write-ahead log replayed: the series and the alerts' state from before are kept)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._launch(timeout_s)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def log_tail(self, n: int = 3000) -> str:
        try:
            with open(os.path.join(self.dir, "prometheus.log")) as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def api(self, path: str, **params) -> object:
        q = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}{'?' + q if q else ''}", timeout=10) as r:
                doc = json.load(r)
        except urllib.error.HTTPError as exc:  # Prometheus says why in the body
            raise RuntimeError(f"Prometheus API {path}: {exc.code} {exc.read()[:500]!r}") from None
        if doc.get("status") != "success":
            raise RuntimeError(f"Prometheus API {path}: {doc}")
        return doc["data"]

    def alerts(self) -> list[dict]:
        """Alerts pending or firing now: [{labels, annotations, state, activeAt, value}]."""
        return self.api("alerts")["alerts"]

    def firing(self) -> set[str]:
        return {a["labels"]["alertname"] for a in self.alerts() if a["state"] == "firing"}

    def targets_up(self) -> dict[str, bool]:
        """scrape URL -> whether its last scrape worked."""
        return {t["scrapeUrl"]: t["health"] == "up" for t in self.api("targets")["activeTargets"]}

    def firing_spans(self, start: float, end: float, step_s: float = 1.0,
                     merge: bool = True) -> dict[str, list[tuple[float, float]]]:
        """alertname -> [(first, last) evaluation time it was seen firing] between start and end
        (epoch s), from the ALERTS series Prometheus writes for its own alerts. With `merge`, the
        spans of an alert's instances (one per peer, plane, ...) are joined where they overlap or
        touch (how long the alert was on at all); without, each instance's spans are kept (when a
        new instance started, also while another one was firing)."""
        data = self.api("query_range", query='ALERTS{alertstate="firing"}', start=f"{start:.3f}", end=f"{end:.3f}",
                        step=f"{step_s:g}")
        out: dict[str, list[tuple[float, float]]] = {}
        for series in data["result"]:
            spans = out.setdefault(series["metric"]["alertname"], [])
            first = last = None
            for t in (float(t) for t, _ in series["values"]):
                if last is not None and t - last > 1.5 * step_s:  # a gap: it cleared in between
                    spans.append((first, last))
                    first = None
                first = t if first is None else first
                last = t
            if first is not None:
                spans.append((first, last))
        return {k: _union(v, 1.5 * step_s) if merge else sorted(v) for k, v in out.items() if v}

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.log is not None:
            self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _union(spans: list[tuple[float, float]], gap: float) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a - out[-1][1] <= gap:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


AGENT_JOB, COORDINATOR_JOB = "linkpass-agent", "linkpass-coordinator"  # the rules' default selectors


def for_lab(agents: list[str], coordinator: str | None = None, tls_dir: str | None = None,
            token_file: str | None = None) -> Prometheus:
    """Prometheus for a lab (the demo, the tests): scraping the agents' metrics endpoints
    (host:port) and the coordinator's (host:port, over HTTPS with the lab CA's client
    certificate when `tls_dir` is given, with the reader token in `token_file` for the series that
    name hosts and links) every second, with the project's rules at LAB durations."""
    from ..control.tls import LOCAL_CLIENT, lab_paths
    from ..observe.rules import LAB, render

    targets = {AGENT_JOB: agents, **({COORDINATOR_JOB: [coordinator]} if coordinator else {})}
    tls = None
    if coordinator and tls_dir:
        cert, key = lab_paths(tls_dir, LOCAL_CLIENT)
        tls = {COORDINATOR_JOB: {"ca_file": lab_paths(tls_dir, "ca")[0], "cert_file": cert, "key_file": key}}
    tokens = {COORDINATOR_JOB: token_file} if coordinator and token_file else None
    return Prometheus(targets, render(LAB), tls=tls, token_files=tokens)
