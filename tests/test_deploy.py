"""The install artifacts: the systemd unit passes systemd's own checker, and the DaemonSet asks for
what the agent needs (host network, the three capabilities, SIGTERM grace, journal and entropy
table on the host) and runs the command the CLI really has."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = os.path.join(os.path.dirname(__file__), "..")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("name,command", [("linkpass-agent", "agent --config"),
                                          ("linkpass-coordinator", "coordinator --fabric")])
def test_systemd_unit_verifies(tmp_path, name, command):
    unit = open(os.path.join(ROOT, f"deploy/systemd/{name}.service")).read()
    linkpass = os.path.join(os.path.dirname(sys.executable), "linkpass")
    assert f"/opt/linkpass/.venv/bin/linkpass {command}" in unit
    path = tmp_path / f"{name}.service"
    path.write_text(unit.replace("/opt/linkpass/.venv/bin/linkpass", linkpass))
    out = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (out.stdout + out.stderr).splitlines() if f"{name}.service" in line]
    assert out.returncode == 0 and not problems, out.stdout + out.stderr
    # every flag the unit passes exists in the CLI
    args = unit.split("/opt/linkpass/.venv/bin/linkpass ")[1].splitlines()[0].split()
    flags = [a for a in args if a.startswith("--")]
    help_text = subprocess.run([linkpass, args[0], "--help"], capture_output=True, text=True, timeout=60).stdout
    assert all(f in help_text for f in flags), (flags, help_text)


def test_daemonset_asks_for_what_the_agent_needs():
    docs = list(yaml.safe_load_all(open(os.path.join(ROOT, "deploy/kubernetes/linkpass-agent.yaml"))))
    ds = next(d for d in docs if d and d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["terminationGracePeriodSeconds"] >= 10
    agent = pod["containers"][0]
    assert agent["command"][:3] == ["linkpass", "agent", "--config"]
    assert set(agent["securityContext"]["capabilities"]["add"]) == {"NET_RAW", "NET_ADMIN", "SYS_NICE"}
    assert "cpu" not in agent["resources"].get("limits", {})  # CPU throttling would fake failures
    mounts = {m["mountPath"] for m in agent["volumeMounts"]}
    assert {"/run/linkpass", "/etc/linkpass"} <= mounts  # the journal and the entropy table live in /run/linkpass
    assert "/dev/shm" not in mounts  # world-writable: anyone could plant a table there
    # the command's flags exist in the CLI
    from linkpass.cli.main import build_parser

    args = build_parser().parse_args(agent["command"][1:3] + ["x.yaml"])
    assert args.config == "x.yaml"
