"""The Kubernetes manifests and the Containerfile, checked structurally (no cluster and no image
builder on this machine): the namespace admits the agent, the DaemonSet's one templated config
parses for any node, its probes, ports, mounts and command exist in the code, the PodMonitor
finds the metrics port, the coordinator's StatefulSet runs a command the CLI has."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from linkpass.agent.config import HostFacts, parse

pytestmark = pytest.mark.unit

K8S = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
CONTAINERFILE = Path(__file__).resolve().parent.parent / "deploy" / "container" / "Containerfile"


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def kind(name: str, k: str) -> dict:
    return next(d for d in docs(name) if d["kind"] == k)


def test_every_object_lives_in_the_linkpass_namespace_which_admits_the_agent():
    ns = kind("namespace.yaml", "Namespace")
    assert ns["metadata"]["name"] == "linkpass"
    labels = ns["metadata"]["labels"]
    # hostNetwork and NET_ADMIN are admitted by `privileged` only; baseline is audited and warned about
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
    assert labels["pod-security.kubernetes.io/warn"] == "baseline"
    for f in sorted(K8S.glob("*.yaml")):
        for d in docs(f.name):
            if d["kind"] != "Namespace":
                assert d["metadata"]["namespace"] == "linkpass", (f.name, d["kind"])


def agent_pod() -> tuple[dict, dict]:
    pod = kind("linkpass-agent.yaml", "DaemonSet")["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def test_one_templated_config_serves_every_node():
    cm = kind("linkpass-agent.yaml", "ConfigMap")
    assert list(cm["data"]) == ["agent.yaml"]  # one entry, not one per node (ConfigMaps stop at 1 MiB)
    raw = yaml.safe_load(cm["data"]["agent.yaml"])
    for i in (1, 2, 100):
        node = HostFacts(f"gpu-node-{i}", (
            ("lo", f"198.18.0.{i}/32"), ("bond0", f"198.19.0.{i}/24"),
            ("ens1f0", f"198.18.64.{2 * i + 1}/31"), ("ens2f0", f"198.18.128.{2 * i + 1}/31")))
        cfg = parse(raw, node)
        assert (cfg.name, cfg.service, cfg.metrics_address) == (f"gpu-node-{i}", f"198.18.0.{i}", f"198.19.0.{i}")
        assert [(n.ifname, n.gateway) for n in cfg.nics] == [("ens1f0", f"198.18.64.{2 * i}"),
                                                            ("ens2f0", f"198.18.128.{2 * i}")]
        assert cfg.routes_enabled and cfg.entropy_enabled and cfg.coordinator.follow_plan
    # the name comes from the node, the files from mounted volumes
    _, agent = agent_pod()
    env = {e["name"]: e for e in agent["env"]}
    assert env["LINKPASS_HOST_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    mounts = [m["mountPath"] for m in agent["volumeMounts"]]
    for path in (raw["fleet_key_file"], raw["coordinator"]["token_file"], raw["coordinator"]["ca_file"]):
        assert any(path.startswith(m + "/") for m in mounts), path


def test_the_agent_pod_has_only_what_it_needs():
    pod, agent = agent_pod()
    assert pod["hostNetwork"] is True and pod["automountServiceAccountToken"] is False
    sc = agent["securityContext"]
    assert sc["capabilities"] == {"add": ["NET_RAW", "NET_ADMIN", "SYS_NICE"], "drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not agent["image"].endswith(":latest")
    assert agent["command"] == ["linkpass", "agent", "--config", "/etc/linkpass/agent.yaml"]


def test_probes_ask_the_agents_real_endpoints():
    from linkpass.agent.api import PROBE_PATHS
    from linkpass.core.constants import AGENT_API_PORT, AGENT_METRICS_PORT

    _, agent = agent_pod()
    probes = {k: agent[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["readinessProbe"]["path"] == probes["startupProbe"]["path"] == "/readyz"
    assert probes["livenessProbe"]["path"] == "/healthz"
    for p in probes.values():
        assert (p["host"], p["port"]) == ("127.0.0.1", AGENT_API_PORT)
        assert p["path"] in PROBE_PATHS, p["path"]
    ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
    assert ports == {"metrics": AGENT_METRICS_PORT}
    pm = kind("podmonitor.yaml", "PodMonitor")
    assert pm["spec"]["selector"]["matchLabels"] == kind("linkpass-agent.yaml", "DaemonSet")["spec"]["selector"][
        "matchLabels"]
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics"]


def test_the_coordinator_statefulset_runs_a_command_the_cli_has():
    from linkpass.cli.main import build_parser

    sts = kind("linkpass-coordinator.yaml", "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert sts["spec"]["replicas"] == 1  # one writer of the store
    args = build_parser().parse_args(c["command"][1:])
    assert args.fabric == "/etc/linkpass/fabric.json" and args.state_dir == "/var/lib/linkpass/coordinator"
    assert "linkpass-coordinator.linkpass.svc" in args.tls_san
    assert pod["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    for probe in ("readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert (get["path"], get["scheme"]) == ("/v1/healthz", "HTTPS")
    svc = kind("linkpass-coordinator.yaml", "Service")
    agent_cfg = yaml.safe_load(kind("linkpass-agent.yaml", "ConfigMap")["data"]["agent.yaml"])
    host = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc"
    assert agent_cfg["coordinator"]["url"] == f"https://{host}:{svc['spec']['ports'][0]['port']}"


def test_the_ray_cluster_starts_a_sharded_coordinator_the_service_reaches():
    from linkpass.cli.main import build_parser
    from linkpass.coordinator.runner import shard_addresses

    name = "linkpass-raycluster.yaml"
    rc, svc, job = kind(name, "RayCluster"), kind(name, "Service"), kind(name, "Job")
    assert rc["apiVersion"] == "ray.io/v1" and rc["spec"]["workerGroupSpecs"] == []  # every actor on the head pod
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    c = job["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(c["command"][1:])
    assert args.address == f"ray://{rc['metadata']['name']}-head-svc:10001"  # KubeRay's name for the head's Service
    assert args.shards == 16 and args.store.startswith("postgresql://")
    # the shards listen on the ports after the root's; the Service carries all of them to the head pod
    from linkpass.cli.coordinator import _tls_settings

    settings = {"listen": args.listen, "shards": args.shards, **_tls_settings(args)}
    assert [p["port"] for p in svc["spec"]["ports"]] == [9470] + [p for _, p in shard_addresses(settings)]
    assert svc["spec"]["selector"]["ray.io/node-type"] == "head"
    assert settings["tls_san"][0] == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc"  # agents go there
    # the paths the actors read are mounted on the head pod, where they run
    mounts = {m["mountPath"] for m in head["containers"][0]["volumeMounts"]}
    assert {args.state_dir, "/etc/linkpass", "/etc/linkpass-store"} <= mounts
    assert args.fabric.startswith("/etc/linkpass/") and args.store_password_file.startswith("/etc/linkpass-store/")
    assert head["securityContext"]["runAsNonRoot"] is True


def test_containerfile_builds_the_images_the_manifests_name():
    text = CONTAINERFILE.read_text()
    stages = re.findall(r"^FROM \S+ AS (\w+)$", text, re.M)
    assert stages == ["build", "runtime", "agent", "coordinator"]
    _, agent = agent_pod()
    coord = kind("linkpass-coordinator.yaml", "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    for image, target in ((agent["image"], "agent"), (coord["image"], "coordinator")):
        assert f"--target {target} -t {image} ." in text, (image, target)
    agent_stage = text.split("AS agent")[1].split("FROM ")[0]
    assert "[coordinator]" not in agent_stage  # no Ray on every node
    assert "FROM runtime AS agent" in text and "iproute2" in text.split("AS runtime")[1].split("FROM ")[0]
    assert "[coordinator]" in text.split("AS coordinator")[1]
    assert "USER 10001" in text.split("AS coordinator")[1]
