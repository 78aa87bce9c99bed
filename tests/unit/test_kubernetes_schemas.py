"""The Kubernetes manifests against the schemas of the APIs that read them (no cluster here: nothing
is applied to an API server, so admission, RBAC and the operators' webhooks are not exercised).

- Kubernetes' own kinds (Namespace, ConfigMap, DaemonSet, Service, StatefulSet, PVC,
  NetworkPolicy): kubernetes-validate's strict schemas (an unknown field is an error), once for
  every Kubernetes version in KUBERNETES_VERSIONS.
- The PodMonitor: the pydantic models that cloudcoil generates from prometheus-operator's CRDs.
  The models ignore an unknown field, so the validated model is dumped again and must give back
  exactly what the manifest says: a field the model dropped or a value it converted fails.
  Its metadata and selector are also checked against Kubernetes' ObjectMeta and LabelSelector.
- The RayCluster is NOT checked against KubeRay's CRD: that CRD is published only from KubeRay's
  GitHub repository and Helm chart, neither reachable from CI nor committable here, and no
  package registry carries it. What is checked instead: its pod templates (the head group's, each
  worker group's) and its metadata against Kubernetes' own strict PodTemplateSpec and ObjectMeta,
  per version, and everything around them against RAYCLUSTER_V1, a hand-written subset of
  KubeRay's documented ray.io/v1 API (the fields the manifest uses, the ones KubeRay requires,
  nothing else: an unknown field fails). A field KubeRay has but the subset lacks fails too;
  add it to the subset, from KubeRay's API reference, when a manifest starts using it.

A kind none of these knows fails: a missing schema is never a pass. The broken copies at the end
show that every check can fail, and that its message names the field.
"""
from __future__ import annotations

import copy
import functools
from pathlib import Path

import jsonschema
import kubernetes_validate
import pydantic
import pytest
import yaml
from cloudcoil.models.prometheus_operator import v1 as prometheus_operator
from kubernetes_validate import utils as kv_utils
from referencing import Registry, Resource

K8S = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
MANIFESTS = sorted(p.name for p in K8S.glob("*.yaml"))

# The Kubernetes versions the manifests support, and are checked against: 1.25 through 1.37.
# 1.25 is the floor because the manifests rely on two APIs that became stable there: Pod Security
# Admission (namespace.yaml's pod-security.kubernetes.io labels are the namespace's whole admission
# policy; 1.25 also removed PodSecurityPolicy) and NetworkPolicy's endPort (the coordinator's ports
# 9470..9486 as one range; a server that drops it admits 9470 only). It is also the oldest schema
# kubernetes-validate bundles, so nothing older could be checked. 1.37 is the newest it bundles
# (kubernetes-validate 1.37.0); raise it when the validator brings a newer one.
KUBERNETES_VERSIONS = tuple(f"1.{minor}" for minor in range(25, 38))

DEFS = "https://kubernetes.io/api/_definitions.json#/$defs/"  # the $id of kubernetes-validate's definitions


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def dotted(path) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


def title(doc: dict) -> str:
    return f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"


# ---- the Kubernetes schemas of one version, loaded once

@functools.lru_cache(maxsize=None)
def registry(version: str) -> Registry:
    """kubernetes-validate's strict definitions of `version` (every io.k8s.* type), by their $id."""
    defs = kv_utils.schema_contents(f"kubernetes-json-schema/v{version}.0-local-strict/_definitions.json", version)
    return Resource.from_contents(defs) @ Registry()


@functools.lru_cache(maxsize=None)
def validator(version: str, schema_name: str) -> jsonschema.Draft202012Validator:
    schema = RAYCLUSTER_V1 if schema_name == "RayCluster" else {"$ref": DEFS + schema_name}
    return jsonschema.Draft202012Validator(schema, registry=registry(version))


def schema_errors(instance, version: str, schema_name: str, at: tuple = ()) -> list[str]:
    errors = sorted(validator(version, schema_name).iter_errors(instance), key=lambda e: [str(p) for p in e.path])
    return [f"{dotted(at + tuple(e.absolute_path))}: {e.message}" for e in errors]


# ---- the RayCluster: a subset of KubeRay's ray.io/v1 API around Kubernetes' own pod templates

POD_TEMPLATE = {"$ref": DEFS + "io.k8s.api.core.v1.PodTemplateSpec"}
RAY_START_PARAMS = {"type": "object", "additionalProperties": {"type": "string"}}  # map[string]string
INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
RAYCLUSTER_V1 = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayCluster"},
        "metadata": {"$ref": DEFS + "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["headGroupSpec"],
            "properties": {
                "rayVersion": {"type": "string"},  # optional in ray.io/v1
                "headGroupSpec": {
                    "type": "object",
                    "additionalProperties": False,
                    # rayStartParams: required by KubeRay 1.1, the oldest the manifest supports
                    "required": ["rayStartParams", "template"],
                    "properties": {
                        "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                        "rayStartParams": RAY_START_PARAMS,
                        "template": POD_TEMPLATE,
                    },
                },
                "workerGroupSpecs": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["groupName", "rayStartParams", "template"],  # the replica counts default
                        "properties": {
                            "groupName": {"type": "string", "minLength": 1},
                            "replicas": INT32,
                            "minReplicas": INT32,
                            "maxReplicas": INT32,
                            "rayStartParams": RAY_START_PARAMS,
                            "template": POD_TEMPLATE,
                        },
                    },
                },
            },
        },
    },
}


# ---- the PodMonitor: prometheus-operator's models, held to what they keep

def not_kept(given, kept, at: tuple = ()) -> list[str]:
    """Where the model's dump differs from the manifest: a field it has not (dropped), or a value it
    converted (another type); the models ignore unknown fields rather than reject them."""
    if isinstance(given, dict) and isinstance(kept, dict):
        out = []
        for key, value in given.items():
            if key in kept:
                out += not_kept(value, kept[key], at + (key,))
            else:
                out.append(f"{dotted(at)}: unknown field {key!r} (not in the model)")
        return out
    if isinstance(given, list) and isinstance(kept, list) and len(given) == len(kept):
        return [p for i, (g, k) in enumerate(zip(given, kept)) for p in not_kept(g, k, at + (i,))]
    if type(given) is not type(kept) or given != kept:
        return [f"{dotted(at)}: {given!r} was read as {kept!r} (not of the field's type)"]
    return []


def podmonitor_problems(doc: dict, version: str) -> list[str]:
    try:
        model = prometheus_operator.PodMonitor.model_validate(doc)
    except pydantic.ValidationError as e:
        return [f"{dotted(err['loc'])}: {err['msg']}" for err in e.errors()]
    out = not_kept(doc, model.model_dump(mode="json", by_alias=True, exclude_unset=True))
    out += schema_errors(doc.get("metadata"), version, "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",
                         ("metadata",))
    out += schema_errors((doc.get("spec") or {}).get("selector"), version,
                         "io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector", ("spec", "selector"))
    return out


# ---- one document, one version

CUSTOM = {
    ("ray.io/v1", "RayCluster"): lambda doc, version: schema_errors(doc, version, "RayCluster"),
    ("monitoring.coreos.com/v1", "PodMonitor"): podmonitor_problems,
}


def problems(doc: dict, version: str) -> list[str]:
    """What is wrong with `doc` for Kubernetes `version`, each as 'path: message'; [] if nothing."""
    custom = CUSTOM.get((doc.get("apiVersion"), doc.get("kind")))
    if custom:
        return custom(doc, version)
    try:
        checked = kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{dotted(e.absolute_path)}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"(kind): {e.message}; no check knows it, and a missing schema is no pass"]
    assert checked == version, f"asked for Kubernetes {version}, validated against {checked}"
    return []


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("manifest", MANIFESTS)
def test_every_document_validates_strictly(manifest, version):
    found = {title(d): problems(d, version) for d in documents(manifest)}
    wrong = [f"{doc}: {p}" for doc, ps in found.items() for p in ps]
    assert found and not wrong, f"{manifest} against Kubernetes {version}:\n  " + "\n  ".join(wrong)


def test_every_manifest_and_kind_is_checked():
    kinds = {(d["apiVersion"], d["kind"]) for m in MANIFESTS for d in documents(m)}
    assert set(CUSTOM) <= kinds  # both custom checks are used
    assert {"namespace.yaml", "linkpass-agent.yaml", "linkpass-coordinator.yaml", "linkpass-raycluster.yaml",
            "podmonitor.yaml"} <= set(MANIFESTS)
    assert set(KUBERNETES_VERSIONS) <= {kv_utils.major_minor(v) for v in kv_utils.all_versions()}


# ---- broken copies: each must fail, naming the field

def doc_of(manifest: str, kind: str) -> dict:
    return copy.deepcopy(next(d for d in documents(manifest) if d["kind"] == kind))


def ray_head(rc: dict) -> dict:
    return rc["spec"]["headGroupSpec"]


def _set(obj: dict, key: str, value) -> None:
    obj[key] = value


BROKEN = {
    # (manifest, kind, how it is broken, what the message names)
    "container-unknown-field": ("linkpass-agent.yaml", "DaemonSet",
                                lambda d: _set(d["spec"]["template"]["spec"]["containers"][0], "imagePullPolicyy",
                                               "Always"),
                                ["spec.template.spec.containers.0", "'imagePullPolicyy' was unexpected"]),
    "replicas-a-string": ("linkpass-coordinator.yaml", "StatefulSet", lambda d: _set(d["spec"], "replicas", "2"),
                          ["spec.replicas", "'2' is not of type 'integer'"]),
    "container-without-name": ("linkpass-coordinator.yaml", "StatefulSet",
                               lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("name"),
                               ["spec.template.spec.containers.0", "'name' is a required property"]),
    "networkpolicy-port-range-misspelt": ("linkpass-raycluster.yaml", "NetworkPolicy",
                                          lambda d: _set(d["spec"]["ingress"][0]["ports"][0], "endport", 9486),
                                          ["spec.ingress.0.ports.0", "'endport' was unexpected"]),
    "podmonitor-endpoint-unknown-field": ("podmonitor.yaml", "PodMonitor",
                                          lambda d: _set(d["spec"]["podMetricsEndpoints"][0], "scrapeIntervall",
                                                         "30s"),
                                          ["spec.podMetricsEndpoints.0", "'scrapeIntervall'"]),
    "podmonitor-port-a-number": ("podmonitor.yaml", "PodMonitor",
                                 lambda d: _set(d["spec"]["podMetricsEndpoints"][0], "port", 9472),
                                 ["spec.podMetricsEndpoints.0.port", "string"]),
    "podmonitor-flag-a-string": ("podmonitor.yaml", "PodMonitor",  # the model converts it: still rejected
                                 lambda d: _set(d["spec"]["podMetricsEndpoints"][0], "honorLabels", "true"),
                                 ["spec.podMetricsEndpoints.0.honorLabels", "'true' was read as True"]),
    "podmonitor-selector-unknown-field": ("podmonitor.yaml", "PodMonitor",
                                          lambda d: _set(d["spec"]["selector"], "matchLabel", {"a": "b"}),
                                          ["spec.selector", "'matchLabel'"]),
    "raycluster-unknown-field": ("linkpass-raycluster.yaml", "RayCluster",
                                 lambda d: _set(ray_head(d), "enableIngres", True),
                                 ["spec.headGroupSpec", "'enableIngres' was unexpected"]),
    "raycluster-start-param-a-number": ("linkpass-raycluster.yaml", "RayCluster",
                                        lambda d: _set(ray_head(d)["rayStartParams"], "num-cpus", 0),
                                        ["spec.headGroupSpec.rayStartParams.num-cpus", "not of type 'string'"]),
    "raycluster-head-container-unknown-field": ("linkpass-raycluster.yaml", "RayCluster",
                                                lambda d: _set(ray_head(d)["template"]["spec"]["containers"][0],
                                                               "securityContex", {}),
                                                ["spec.headGroupSpec.template.spec.containers.0",
                                                 "'securityContex' was unexpected"]),
    "raycluster-worker-without-group-name": ("linkpass-raycluster.yaml", "RayCluster",
                                             lambda d: _set(d["spec"], "workerGroupSpecs", [{
                                                 "rayStartParams": {}, "template": ray_head(d)["template"]}]),
                                             ["spec.workerGroupSpecs.0", "'groupName' is a required property"]),
    "raycluster-without-head": ("linkpass-raycluster.yaml", "RayCluster", lambda d: d["spec"].pop("headGroupSpec"),
                                ["spec", "'headGroupSpec' is a required property"]),
    "unknown-kind-is-no-pass": ("linkpass-raycluster.yaml", "RayCluster", lambda d: _set(d, "kind", "RayJob"),
                                ["Couldn't find schema for kind RayJob", "no pass"]),
}


@pytest.mark.parametrize("version", [KUBERNETES_VERSIONS[0], KUBERNETES_VERSIONS[-1]])
@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_copy_is_rejected_naming_the_field(case, version):
    manifest, kind, breaks, named = BROKEN[case]
    doc = doc_of(manifest, kind)
    assert problems(doc, version) == []  # the manifest as it is passes
    breaks(doc)
    found = "\n".join(problems(doc, version))
    assert found, f"{case}: the broken copy passed"
    for words in named:
        assert words in found, f"{case}: {words!r} not in:\n{found}"
