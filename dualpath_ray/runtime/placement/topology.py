"""P/D topology by placement groups: one bundle per node, one group per role.

A node offers `dualpath_<role>_slot: 1` and the label `dualpath/role=<role>`; the role's
placement group asks for one bundle {GPU: g, <slot>: 1} per configured node under
STRICT_SPREAD with a label selector, so bundle i is exactly one node of that role. Engines
(`num_gpus=1`) and the node's reader (a sliver of the slot) are scheduled into bundle i.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dualpath_ray.analysis.report import classify_ratio, pd_bounds
from dualpath_ray.config import DualPathConfig
from dualpath_ray.protocol.names import SCHEDULER, engine_name, reader_name
from dualpath_ray.protocol.types import Role

ROLE_LABEL = "dualpath/role"
HEAD_RESOURCE = "dualpath_head"
LOG = logging.getLogger("dualpath_ray.topology")


class TopologyError(RuntimeError):
    """The cluster cannot host, or does not host, the configured P/D topology."""


def slot_resource(role: Role) -> str:
    return f"dualpath_{role}_slot"


@dataclass(frozen=True)
class NodeSpec:
    node_id: str
    role: Role
    bundle_index: int
    gpus: int

    @property
    def reader_name(self) -> str:
        return reader_name(self.node_id)

    def engine_names(self) -> list[str]:
        return [engine_name(self.role, self.node_id, gpu) for gpu in range(self.gpus)]


def plan_nodes(cfg: DualPathConfig) -> list[NodeSpec]:
    """Logical nodes: p0..p{P-1} for prefill, d0..d{D-1} for decode."""
    g = cfg.cluster.gpus_per_node
    prefill = [NodeSpec(f"p{i}", Role.PREFILL, i, g) for i in range(cfg.cluster.prefill_nodes)]
    decode = [NodeSpec(f"d{i}", Role.DECODE, i, g) for i in range(cfg.cluster.decode_nodes)]
    return prefill + decode


def warn_if_outside_bounds(cfg: DualPathConfig) -> str | None:
    """Check P/D against the bottleneck-free range; log and return a warning if outside."""
    c = cfg.cluster
    bounds = pd_bounds(c.gpus_per_node, c.snic_gbps, c.cnic_gbps, c.dram_gbs)
    verdict = classify_ratio(bounds, c.prefill_nodes, c.decode_nodes)
    if verdict.inside:
        return None
    if bounds.is_empty:
        message = f"no P/D ratio is bottleneck-free on this hardware: {bounds.empty_reason}"
    else:
        message = (
            f"P/D = {c.prefill_nodes}/{c.decode_nodes} is outside the bottleneck-free range "
            f"[{bounds.lower:.3g}, {bounds.upper:.3g}]: {', '.join(verdict.saturates)} saturates"
        )
    LOG.warning(message)
    return message


def create_role_groups(cfg: DualPathConfig, timeout_s: float = 60.0) -> dict[Role, PlacementGroup]:
    """Reserve one bundle per node of each role; a topology that cannot be met is an error."""
    groups: dict[Role, PlacementGroup] = {}
    counts: dict[Role, int] = {Role.PREFILL: cfg.cluster.prefill_nodes, Role.DECODE: cfg.cluster.decode_nodes}
    for role, count in counts.items():
        bundle = {"GPU": float(cfg.cluster.gpus_per_node), slot_resource(role): 1.0}
        groups[role] = placement_group(
            [dict(bundle) for _ in range(count)],
            strategy="STRICT_SPREAD",
            name=f"{cfg.runtime.namespace}-{role}",
            bundle_label_selector=[{ROLE_LABEL: role} for _ in range(count)],
        )
    for role, group in groups.items():
        if not group.wait(timeout_s):
            available = _nodes_by_role().get(role, 0)
            for pending in groups.values():
                remove_placement_group(pending)
            raise TopologyError(
                f"cannot place {counts[role]} {role} node(s) with {cfg.cluster.gpus_per_node} GPUs each: "
                f"the cluster has {available} alive node(s) labelled {ROLE_LABEL}={role} with "
                f"resource {slot_resource(role)}; add nodes or lower cluster.{role}_nodes"
            )
    return groups


def _nodes_by_role() -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in ray.nodes():
        role = node.get("Labels", {}).get(ROLE_LABEL)
        if node.get("Alive") and role:
            counts[role] = counts.get(role, 0) + 1
    return counts


def in_bundle(group: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)


def verify_placement(
    groups: dict[Role, PlacementGroup], nodes: list[NodeSpec], actor_nodes: dict[str, str]
) -> dict[str, str]:
    """Check, from Ray's placement group table, that every node's engines and reader sit on the
    Ray node of its bundle, that bundles of a role are on distinct nodes labelled with that
    role, and return logical node id -> Ray node id. `actor_nodes` maps actor name -> Ray node
    id as each actor reported it."""
    labels = {n["NodeID"]: n.get("Labels", {}) for n in ray.nodes()}
    placed: dict[str, str] = {}
    for role, group in groups.items():
        table = placement_group_table(group)
        if table.get("state") != "CREATED":
            raise TopologyError(f"{role} placement group is {table.get('state')}, not CREATED")
        bundle_nodes = table["bundles_to_node_id"]
        if len(set(bundle_nodes.values())) != len(bundle_nodes):
            raise TopologyError(f"{role} bundles share a Ray node: {bundle_nodes}")
        for spec in (n for n in nodes if n.role == role):
            ray_node = bundle_nodes[spec.bundle_index]
            if labels.get(ray_node, {}).get(ROLE_LABEL) != role:
                raise TopologyError(f"node {spec.node_id} landed on a Ray node not labelled {ROLE_LABEL}={role}")
            members = [*spec.engine_names(), spec.reader_name]
            wrong = [name for name in members if actor_nodes.get(name) != ray_node]
            if wrong:
                raise TopologyError(f"actors {wrong} of node {spec.node_id} are not on its bundle's Ray node")
            placed[spec.node_id] = ray_node
    return placed


def restart_options(max_restarts: int) -> dict[str, Any]:
    """Ray restarts a dead engine or reader this often. Calls are not retried by Ray
    (max_task_retries=0): a call in flight at the death fails, and the scheduler retries the
    attempt it belonged to with attempt + 1, so nothing runs twice on the new incarnation."""
    return {"max_restarts": max_restarts, "max_task_retries": 0}


def scheduler_options(cfg: DualPathConfig, on_head: bool) -> dict[str, Any]:
    """The named, detached Scheduler's Ray options. Ray restarts it at most
    runtime.scheduler_max_restarts times and sends a call in flight at its death to the new
    incarnation at most runtime.max_call_resends times: both bounded, because a call that kills
    the process would otherwise be sent again for ever (a crash loop that no caller ever hears
    of). `on_head`: an embedded cluster, whose head node carries HEAD_RESOURCE for it."""
    return {
        "name": SCHEDULER,
        "namespace": cfg.runtime.namespace,
        "lifetime": "detached",
        "max_restarts": cfg.runtime.scheduler_max_restarts,
        "max_task_retries": cfg.runtime.max_call_resends,
        "resources": {HEAD_RESOURCE: 0.01} if on_head else None,
    }


def front_end_options(cfg: DualPathConfig, name: str) -> dict[str, Any]:
    """A front-end actor's Ray options (the rollout-server, the openai-server): named in the
    deployment's namespace, restarted at most runtime.front_end_max_restarts times, and a call in
    flight at its death sent again at most runtime.max_call_resends times, so a caller's
    `generate` reaches the new incarnation instead of failing."""
    return {
        "name": name,
        "namespace": cfg.runtime.namespace,
        "max_restarts": cfg.runtime.front_end_max_restarts,
        "max_task_retries": cfg.runtime.max_call_resends,
    }


def environment_options(env_vars: Mapping[str, str] | None) -> dict[str, Any]:
    """The actor's process environment (runtime/placement/qos.py's per-role traffic classes) as a Ray
    runtime_env: set before the process starts, so UCX and NCCL read it when they initialise.
    Ray merges it with the job's runtime_env, these variables winning."""
    return {"runtime_env": {"env_vars": dict(env_vars)}} if env_vars else {}


def engine_options(
    group: PlacementGroup, spec: NodeSpec, name: str, namespace: str, max_restarts: int = 0,
    env_vars: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "num_gpus": 1,
        "num_cpus": 0,
        "scheduling_strategy": in_bundle(group, spec.bundle_index),
        **restart_options(max_restarts),
        **environment_options(env_vars),
    }


# A reader asks Ray for no GPU, yet pins its node's staging buffer with CUDA (kv/host_memory.py).
# With RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1 where Ray started (older Rays' default) Ray
# hides every GPU from such an actor and the buffer would silently stay unpinned; this keeps the
# node's GPUs visible to the reader whatever the cluster's setting.
READER_GPU_VISIBILITY = {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}


def reader_options(
    group: PlacementGroup, spec: NodeSpec, namespace: str, max_restarts: int = 0,
    env_vars: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The reader's actor options: in its node's bundle, the node's GPUs visible (to pin)."""
    return {
        "name": spec.reader_name,
        "namespace": namespace,
        "num_cpus": 0,
        "resources": {slot_resource(spec.role): 0.01},
        "scheduling_strategy": in_bundle(group, spec.bundle_index),
        **restart_options(max_restarts),
        **environment_options({**READER_GPU_VISIBILITY, **(env_vars or {})}),
    }
