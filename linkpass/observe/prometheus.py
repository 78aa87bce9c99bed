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
import urllib.parse
import urllib.request

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
