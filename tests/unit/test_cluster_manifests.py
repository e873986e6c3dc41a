"""Cluster manifests: the launcher YAML passes Ray's own validation; KubeRay ones are consistent."""

from __future__ import annotations

import copy
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from dualpath_ray.config import DualPathConfig, parse_config
from dualpath_ray.runtime.placement.topology import HEAD_RESOURCE, ROLE_LABEL, slot_resource

CONFIGS = Path(__file__).resolve().parents[2] / "cluster_configs"
ROLES = ("prefill", "decode")


def validate_launcher_config(config: dict[str, Any]) -> dict[str, Any]:
    """Ray's own `ray up` validation (a private API, so it is pinned behind this helper)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def _documents(name: str) -> dict[str, dict[str, Any]]:
    docs = list(yaml.safe_load_all((CONFIGS / name).read_text()))
    return {doc["kind"]: doc for doc in docs}


@pytest.fixture(scope="module")
def launcher() -> dict[str, Any]:
    return yaml.safe_load((CONFIGS / "ray-cluster-launcher.yaml").read_text())


@pytest.fixture(scope="module")
def raycluster() -> dict[str, dict[str, Any]]:
    return _documents("kuberay-raycluster.yaml")


@pytest.fixture(scope="module")
def rayjob() -> dict[str, dict[str, Any]]:
    return _documents("kuberay-rayjob.yaml")


def _dualpath_config(configmap: dict[str, Any]) -> DualPathConfig:
    return parse_config(yaml.safe_load(configmap["data"]["dualpath.yaml"]), source="ConfigMap")


def test_launcher_passes_rays_validation(launcher: dict[str, Any]) -> None:
    prepared = validate_launcher_config(launcher)
    assert prepared["head_node_type"] == "head", "the head node type is the one named head"
    broken = copy.deepcopy(launcher)
    broken["available_node_types"]["prefill"]["resources"]["GPU"] = 0.5
    with pytest.raises(Exception, match="integer"):
        validate_launcher_config(broken)


def test_launcher_node_types_match_the_topology(launcher: dict[str, Any]) -> None:
    types = launcher["available_node_types"]
    assert set(types) == {"head", *ROLES}, "exactly head, prefill and decode node types"
    assert types["head"]["labels"] == {ROLE_LABEL: "head"}, "the head is labelled as head"
    assert types["head"]["resources"].get(HEAD_RESOURCE) == 1, "the head offers dualpath_head: 1"
    for role in ROLES:
        node = types[role]
        assert node["labels"] == {ROLE_LABEL: role}, f"{role} nodes carry dualpath/role={role}"
        custom = {k: v for k, v in node["resources"].items() if k.startswith("dualpath_")}
        assert custom == {slot_resource(role): 1}, f"{role} nodes offer only their own slot"
        assert node["resources"]["GPU"] == 8, f"{role} nodes have 8 GPUs"
        assert node["min_workers"] == node["max_workers"] >= 1, "the P/D topology is fixed"
    assert launcher["max_workers"] == sum(types[r]["max_workers"] for r in ROLES), (
        "the cluster's max_workers is the sum of the worker types"
    )


def test_launcher_start_commands(launcher: dict[str, Any]) -> None:
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        start = next(c for c in launcher[key] if "ray start" in c)
        assert "--metrics-export-port=" in start, f"{key} exports metrics on a fixed port"
        assert "RAY_AUTH_MODE=token" in start, f"{key} keeps token authentication on"
    assert "~/.ray/auth_token" in launcher["file_mounts"], "the token file reaches every node"


def _groups(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {group["groupName"]: group for group in spec["workerGroupSpecs"]}


def _container(group: dict[str, Any]) -> dict[str, Any]:
    [container] = group["template"]["spec"]["containers"]
    return container


def _check_cluster_spec(spec: dict[str, Any], config: DualPathConfig) -> None:
    assert spec["authOptions"]["mode"] == "token", "KubeRay token authentication is on"
    head = spec["headGroupSpec"]
    assert head["labels"] == {ROLE_LABEL: "head"}, "the head group is labelled as head"
    assert head["resources"] == {HEAD_RESOURCE: "1"}, "the head group offers dualpath_head"
    assert "metrics-export-port" in head["rayStartParams"], "the head exports metrics"
    groups = _groups(spec)
    assert set(groups) == set(ROLES), "exactly a prefill and a decode worker group"
    counts = {"prefill": config.cluster.prefill_nodes, "decode": config.cluster.decode_nodes}
    for role, group in groups.items():
        assert group["labels"] == {ROLE_LABEL: role}, f"group {role} carries dualpath/role={role}"
        resources = group["resources"]
        assert all(isinstance(v, str) for v in resources.values()), (
            "KubeRay group resources are strings"
        )
        assert resources[slot_resource(role)] == "1", f"group {role} offers its slot resource"
        assert not {k for k in resources if k.startswith("dualpath_")} - {slot_resource(role)}, (
            f"group {role} offers no other role's slot"
        )
        limits = _container(group)["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) == int(resources["GPU"]) == config.cluster.gpus_per_node, (
            f"group {role}: GPU limit, Ray GPU resource and gpus_per_node agree"
        )
        assert any(k.startswith("rdma/") for k in limits), f"group {role} requests an RDMA device"
        assert "IPC_LOCK" in _container(group)["securityContext"]["capabilities"]["add"], (
            f"group {role} may pin memory for RDMA (IPC_LOCK)"
        )
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == counts[role], (
            f"group {role} runs exactly the config's {role}_nodes Pods"
        )
        mounts = {m["mountPath"] for m in _container(group)["volumeMounts"]}
        assert str(config.store.root) in mounts, f"group {role} mounts the shared KV store root"


def test_raycluster_groups_match_the_config(raycluster: dict[str, dict[str, Any]]) -> None:
    cluster = raycluster["RayCluster"]
    assert cluster["apiVersion"] == "ray.io/v1", "a ray.io/v1 RayCluster"
    assert set(raycluster) == {"ConfigMap", "RayCluster"}, "the cluster ships its config"
    config = _dualpath_config(raycluster["ConfigMap"])
    assert config.emulation.enabled is False, "real hardware: no emulated NICs"
    _check_cluster_spec(cluster["spec"], config)


def test_rayjob_runs_rollout_on_the_same_cluster(
    rayjob: dict[str, dict[str, Any]], raycluster: dict[str, dict[str, Any]]
) -> None:
    job = rayjob["RayJob"]
    assert job["apiVersion"] == "ray.io/v1", "a ray.io/v1 RayJob"
    assert job["spec"]["rayClusterSpec"] == raycluster["RayCluster"]["spec"], (
        "the RayJob's inline cluster is exactly the RayCluster manifest's spec"
    )
    assert rayjob["ConfigMap"] == raycluster["ConfigMap"], "both manifests ship the same config"
    _check_cluster_spec(job["spec"]["rayClusterSpec"], _dualpath_config(rayjob["ConfigMap"]))
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["python", "jobs/rollout.py"], "the entrypoint runs jobs/rollout.py"
    flags = dict(zip(argv[2::2], argv[3::2]))
    assert set(flags) == {"--config", "--trace", "--out"}, "config, trace and output are given"
    assert flags["--config"] == "/etc/dualpath/dualpath.yaml", "the job reads the mounted config"
    run_id = job["spec"]["metadata"]["trainer_run_id"]
    assert run_id and job["metadata"]["labels"]["dualpath/trainer-run-id"] == run_id, (
        "the trainer run id is in the job metadata and the resource labels"
    )
    assert all(isinstance(v, str) for v in job["spec"]["metadata"].values()), (
        "Ray job metadata values are strings"
    )
