"""The DaemonSet asks for what the agent needs (host network, the three capabilities, SIGTERM
grace, journal and entropy table on the host) and runs the command the CLI really has. The
systemd units are checked by systemd's own tools in tests/unit/test_systemd.py."""
from __future__ import annotations

import os

import yaml


ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


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

    args = build_parser().parse_args(agent["command"][1:])
    assert args.config == agent["command"][3] and args.config.startswith("/etc/linkpass/")
