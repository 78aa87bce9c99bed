"""The Kubernetes manifests and the Containerfile, checked structurally (no cluster and no image
builder on this machine): the namespace admits the agent, the DaemonSet's one templated config
parses for any node, its probes, ports, mounts and command exist in the code, the PodMonitor
finds the metrics port, the coordinator's StatefulSet runs a command the CLI has. The RayCluster
runs Ray with its token on every container, starts the coordinator on the head over a connection
the image's Ray has, and its NetworkPolicy lets only agents reach the coordinator and only the
head reach Ray."""
from __future__ import annotations

import ipaddress
import re
from pathlib import Path

import yaml

from linkpass.agent.config import HostFacts, parse


K8S = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
CONTAINERFILE = Path(__file__).resolve().parents[2] / "deploy" / "container" / "Containerfile"


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


RAYCLUSTER = "linkpass-raycluster.yaml"


def ray_containers(rc: dict) -> list[dict]:
    """Every container of the RayCluster's pods: the head's and any worker group's."""
    workers = rc["spec"].get("workerGroupSpecs") or []
    templates = [rc["spec"]["headGroupSpec"]["template"]] + [g["template"] for g in workers]
    return [c for t in templates for c in t["spec"]["containers"]]


def head_start(rc: dict) -> tuple[dict, str, list[str]]:
    """The head's Ray container, the shell script its command runs, and the coordinator's command
    (the container's args: the script's "$@")."""
    c = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert c["command"][:2] == ["/bin/bash", "-c"] and len(c["command"]) == 4, c["command"]  # script, $0
    return c, c["command"][2], c["args"]


def test_the_ray_cluster_starts_a_sharded_coordinator_the_service_reaches():
    from linkpass.cli.main import build_parser
    from linkpass.coordinator.startup import shard_addresses

    rc, svc = kind(RAYCLUSTER, "RayCluster"), kind(RAYCLUSTER, "Service")
    assert rc["apiVersion"] == "ray.io/v1" and rc["spec"]["workerGroupSpecs"] == []  # every actor on the head pod
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    _, _, command = head_start(rc)
    args = build_parser().parse_args(command[1:])
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


def test_the_coordinator_is_started_over_a_connection_the_images_ray_has():
    """The image's Ray is the coordinator extra's, without the Ray Client (ray://, ray[client]):
    a driver must run on a Ray node. The head's own command starts KubeRay's `ray start`, then
    `linkpass coordinator --address auto` (a driver on this node), tried until Ray answers; no
    other pod (no Job) connects to Ray."""
    from linkpass.cli.main import build_parser

    rc = kind(RAYCLUSTER, "RayCluster")
    assert rc["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"  # else KubeRay ignores the command
    c, script, command = head_start(rc)
    assert command[:2] == ["linkpass", "coordinator"]
    assert build_parser().parse_args(command[1:]).address == "auto"
    lines = [ln.strip() for ln in script.splitlines() if ln.strip()]
    ray_start = next(i for i, ln in enumerate(lines) if "$KUBERAY_GEN_RAY_START_CMD" in ln and ln.endswith("&"))
    retry = next(i for i, ln in enumerate(lines) if ln == 'until "$@"; do')
    assert ray_start < retry and lines[-1] == 'wait "$ray"'  # Ray in the background, the start retried, Ray waited for
    stage = CONTAINERFILE.read_text().split("AS coordinator")[1]
    assert "ray[client]" not in stage and "ray[default]" not in stage
    # nothing in the manifests asks for what this Ray cannot do: no ray:// address, no start Job
    assert not [d for d in docs(RAYCLUSTER) if d["kind"] in ("Job", "CronJob", "RayJob")]
    for f in sorted(K8S.glob("*.yaml")):
        for d in docs(f.name):
            assert "ray://" not in yaml.safe_dump(d), (f.name, d["kind"])
    ports = {p["containerPort"] for p in c["ports"]}
    assert 10001 not in ports and 8265 not in ports  # no Ray Client, no dashboard runs
    assert rc["spec"]["headGroupSpec"]["rayStartParams"]["include-dashboard"] == "false"
    # KubeRay's default probes ask the dashboard: its own probes ask Ray's GCS and the root
    assert c["livenessProbe"]["tcpSocket"]["port"] == 6379
    assert (c["readinessProbe"]["httpGet"]["port"], c["readinessProbe"]["httpGet"]["scheme"]) == (9470, "HTTPS")


def test_every_ray_container_runs_with_rays_token_from_a_secret():
    """`ray start` (what KubeRay runs) has no authentication unless every node is given it:
    RAY_AUTH_MODE=token and the token from a Secret (never written in the manifest); Ray 2.52
    or later reads them (an older one ignores them), which the image installs."""
    rc = kind(RAYCLUSTER, "RayCluster")
    assert ray_containers(rc)
    for c in ray_containers(rc):
        env = {e["name"]: e for e in c.get("env") or []}
        assert env["RAY_AUTH_MODE"].get("value") == "token", c["name"]
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "linkpass-ray-auth", "key": "auth_token"}, c["name"]  # not optional: no token, no pod
        assert "value" not in env["RAY_AUTH_TOKEN"]
        assert "RAY_AUTH_TOKEN_PATH" not in env  # one source of the token
    stage = CONTAINERFILE.read_text().split("AS coordinator")[1]
    floor = re.search(r'"ray>=2\.(\d+)', stage)
    assert floor and int(floor.group(1)) >= 52, "the coordinator image must install Ray 2.52 or later (token auth)"
    header = (K8S / RAYCLUSTER).read_text().split("apiVersion:")[0]
    assert "create secret generic linkpass-ray-auth --from-literal=auth_token=" in header  # how to make it


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # matchExpressions: not used here
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _admits(policy: dict, port: int, namespace: str, labels: dict, address: str) -> bool:
    """Whether `policy` lets a connection to `port` in, from a pod (its namespace, labels and the
    address its connections carry: a host-network pod's are its node's)."""
    for rule in policy["spec"].get("ingress") or []:
        ports = rule.get("ports")
        if ports and not any(p.get("protocol", "TCP") == "TCP" and p["port"] <= port <= p.get("endPort", p["port"])
                             for p in ports):
            continue
        assert rule.get("from"), rule  # a rule without `from` would admit every source
        for peer in rule["from"]:
            if "ipBlock" in peer:
                block = peer["ipBlock"]
                ip = ipaddress.ip_address(address)
                if ip in ipaddress.ip_network(block["cidr"]) and \
                        not any(ip in ipaddress.ip_network(x) for x in block.get("except") or []):
                    return True
            elif "namespaceSelector" not in peer:  # a podSelector alone: the policy's own namespace
                if namespace == policy["metadata"]["namespace"] and _selects(peer["podSelector"], labels):
                    return True
            else:
                raise AssertionError(f"a peer of other namespaces: {peer}")
    return False


def test_a_network_policy_lets_only_agents_reach_the_coordinator_and_only_the_head_reach_ray():
    rc, svc, policy = kind(RAYCLUSTER, "RayCluster"), kind(RAYCLUSTER, "Service"), kind(RAYCLUSTER, "NetworkPolicy")
    name = rc["metadata"]["name"]
    # the head pod as KubeRay labels it: its template's labels and KubeRay's own
    head = {**rc["spec"]["headGroupSpec"]["template"]["metadata"]["labels"], "ray.io/cluster": name,
            "ray.io/node-type": "head", "ray.io/is-ray-node": "yes"}
    assert _selects(policy["spec"]["podSelector"], head) and "Ingress" in policy["spec"]["policyTypes"]
    assert _selects({"matchLabels": svc["spec"]["selector"]}, head)  # the pod the Service sends agents to
    assert set(policy["spec"]["podSelector"]["matchLabels"]) == {"ray.io/cluster", "ray.io/node-type"}
    # the agents: host-network pods, whose connections carry their node's management address
    ds = kind("linkpass-agent.yaml", "DaemonSet")
    agent_cfg = yaml.safe_load(kind("linkpass-agent.yaml", "ConfigMap")["data"]["agent.yaml"])
    assert ds["spec"]["template"]["spec"]["hostNetwork"] is True
    node = str(next(iter(ipaddress.ip_network(agent_cfg["host"]["management_subnet"]).hosts())))
    agent = ("linkpass", ds["spec"]["template"]["metadata"]["labels"], node)
    job = ("training", {"app": "train", "ray.io/cluster": name, "ray.io/node-type": "head"}, "10.244.7.9")
    neighbour = ("linkpass", {"app": "other"}, "10.244.7.10")  # another pod of the namespace
    endpoints = [p["targetPort"] for p in svc["spec"]["ports"]]
    assert endpoints == list(range(9470, 9487))
    for port in endpoints:
        assert _admits(policy, port, *agent), port
        assert not _admits(policy, port, *job) and not _admits(policy, port, *neighbour), port
    ray_ports = [6379, 10001, 8265, 52365, 8080, 8076, 10002, 19999]  # GCS, client, dashboard (+agent), metrics,
    for port in ray_ports:                                              # object manager, workers
        assert _admits(policy, port, "linkpass", head, "10.244.7.2"), port  # the head itself (its own start)
        for source in (agent, job, neighbour):
            assert not _admits(policy, port, *source), (port, source)
    assert not _admits(policy, 9487, *agent) and not _admits(policy, 22, *agent)
    # the coordinator's endpoints stay on the rule's ports, Ray's off them
    assert not set(ray_ports) & set(range(9470, 9487))


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
