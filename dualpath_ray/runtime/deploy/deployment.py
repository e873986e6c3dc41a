"""One deployment's actors: brought up on the P/D topology, and torn down again.

The driver (dualpath_ray/cluster.py, `DualPathCluster.deploy` and `teardown`) decides the
configuration, mode and store; this places the actors of it. A deployment owns its namespace:
named actors of another one found alive there are refused (or, asked to, killed) before anything
starts, and a teardown waits until its own names are gone, so the next deployment does not mistake
them for another's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray

from dualpath_ray.config import DualPathConfig
from dualpath_ray.protocol.names import OPENAI_SERVER, ROLLOUT_SERVER, SCHEDULER
from dualpath_ray.runtime.control.scheduler import Scheduler
from dualpath_ray.runtime.decode.actor import DecodeEngine
from dualpath_ray.runtime.restarts.kept_state import KeptState
from dualpath_ray.runtime.placement.qos import ActorKind, actor_environment, engine_kind
from dualpath_ray.runtime.placement.topology import (
    NodeSpec,
    create_role_groups,
    engine_options,
    reader_options,
    scheduler_options,
    verify_placement,
    warn_if_outside_bounds,
)
from dualpath_ray.runtime.engine.base import EngineIdentity
from dualpath_ray.runtime.prefill.actor import PrefillEngine
from dualpath_ray.runtime.reader.actor import StorageReader
from dualpath_ray.runtime.transport.gloo_world import setup_gloo_world
from dualpath_ray.runtime.telemetry.status_views import StatusQuery


@dataclass
class Deployment:
    """The actors of one mode's run, and where they are."""

    mode: str
    store_root: str
    scheduler: Any
    readers: dict[str, Any]
    engines: dict[str, Any]
    groups: dict[str, Any]
    placement: dict[str, str]
    warnings: list[str] = field(default_factory=list)
    server: Any = None


class DeploymentConflictError(RuntimeError):
    """Actors of another deployment are alive in this deployment's namespace."""


# --- bring-up ---------------------------------------------------------------------------


def create_deployment(
    cfg: DualPathConfig, nodes: list[NodeSpec], mode: str, store_root: str, *, replace_existing: bool,
    scheduler_on_head: bool,
) -> Deployment:
    """Start the scheduler, one reader per node and one engine per GPU; verify placement.
    `scheduler_on_head`: an embedded cluster, whose head node carries HEAD_RESOURCE for it."""
    warnings = [w for w in [warn_if_outside_bounds(cfg)] if w]
    clear_leftover_actors(cfg.runtime.namespace, replace_existing)
    groups = create_role_groups(cfg, cfg.runtime.placement_timeout_s)
    scheduler = _start_scheduler(cfg, mode, store_root, scheduler_on_head)
    readers, engines = _start_node_actors(cfg, nodes, groups, store_root)
    actors = {**readers, **engines}
    where = dict(zip(actors, ray.get([a.node_labels.remote() for a in actors.values()])))
    placement = verify_placement(groups, nodes, {n: labels["ray.io/node-id"] for n, labels in where.items()})
    if cfg.runtime.transport == "gloo":
        setup_gloo_world(list(actors.values()))
    ray.get([engine.start.remote() for engine in engines.values()])
    _wait_until_known(scheduler, frozenset(actors), cfg.runtime.placement_timeout_s)
    return Deployment(mode, store_root, scheduler, readers, engines, groups, placement, warnings)


class DeploymentStartError(RuntimeError):
    """The scheduler did not hear from every engine and reader it was deployed with."""


def _wait_until_known(scheduler: Any, names: frozenset[str], timeout_s: float) -> None:
    """Until the scheduler knows the incarnation of every engine and reader in `names` (their
    first reports, sent as they start). A restart is told apart from a first sighting only by an
    incarnation the scheduler already knew: an actor killed before its first report arrived (CI
    killed one 0.7 s into a rollout, on a loaded host) came back as a first sighting, so its dead
    incarnation's work was never failed or reclaimed on its account, and one the heartbeat had
    written off as dead stayed out of service."""
    deadline = time.monotonic() + timeout_s
    while True:
        known = set(ray.get(scheduler.status.remote(StatusQuery.SERVICE)).incarnations)
        missing = sorted(names - known)
        if not missing:
            return
        if time.monotonic() > deadline:
            raise DeploymentStartError(
                f"the scheduler heard nothing from {missing} within runtime.placement_timeout_s={timeout_s} s "
                "of their start: they cannot reach its report channel (scheduler.report_port), or the host is "
                "too loaded; raise runtime.placement_timeout_s for the latter"
            )
        time.sleep(0.05)


def _start_scheduler(cfg: DualPathConfig, mode: str, store_root: str, on_head: bool) -> Any:
    """The named scheduler, once it is ready."""
    # Restarted by Ray when its process dies, with the calls in flight resent to the new
    # incarnation, which takes over from the engines (runtime/control/adoption.py); both bounded
    # by the config (scheduler_options).
    scheduler = Scheduler.options(**scheduler_options(cfg, on_head)).remote(cfg, store_root, mode)
    ray.get(scheduler.ready.remote())
    return scheduler


def _start_node_actors(
    cfg: DualPathConfig, nodes: list[NodeSpec], groups: dict[str, Any], store_root: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each node's reader and its engines (one per GPU) in its role's placement group:
    (reader name -> reader, engine name -> engine), started but not yet serving."""
    ns = cfg.runtime.namespace
    restarts = cfg.runtime.max_actor_restarts
    readers: dict[str, Any] = {}
    engines: dict[str, Any] = {}
    for spec in nodes:
        group = groups[spec.role]
        reader_env = actor_environment(cfg.qos, ActorKind.READER)
        readers[spec.reader_name] = StorageReader.options(**reader_options(group, spec, ns, restarts, reader_env)).remote(
            cfg, spec.node_id, store_root, spec.reader_name
        )
        actor_cls = PrefillEngine if spec.role == "prefill" else DecodeEngine
        for gpu, name in enumerate(spec.engine_names()):
            identity = EngineIdentity(name, spec.node_id, gpu, spec.reader_name)
            engine_env = actor_environment(cfg.qos, engine_kind(spec.role))
            engines[name] = actor_cls.options(**engine_options(group, spec, name, ns, restarts, engine_env)).remote(
                cfg, identity, store_root
            )
    return readers, engines


# --- what another deployment left ---------------------------------------------------------


def _remove_leftover_groups(namespace: str) -> None:
    """Placement groups of a deployment its driver forgot (one that crashed takes its own along)."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    for info in ray.util.placement_group_table().values():
        if info.get("name", "").startswith(f"{namespace}-") and info.get("state") != "REMOVED":
            try:
                remove_placement_group(get_placement_group(info["name"]))
            except ValueError:
                continue  # removed meanwhile


def clear_leftover_actors(namespace: str, replace: bool) -> None:
    """Refuse (or, asked to, kill) named actors already alive in `namespace`."""
    alive = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]
    if replace:
        _remove_leftover_groups(namespace)
    if not alive:
        return
    if not replace:
        shown = ", ".join(sorted(alive)[:6]) + (" ..." if len(alive) > 6 else "")
        raise DeploymentConflictError(
            f"namespace {namespace!r} already has {len(alive)} actors of another deployment ({shown}), "
            "e.g. a detached scheduler left by a driver that crashed; reusing them would serve this run "
            "with their config, mode and store. Pass replace_existing=True (CLI: --replace) to kill "
            "them, or set runtime.namespace to another name"
        )
    for name in alive:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:
            continue  # it died between the listing and the kill
    if not _named_actors_gone(namespace, timeout_s=30.0):
        raise DeploymentConflictError(f"namespace {namespace!r}: leftover actors did not exit within 30 s")


def _named_actors_gone(namespace: str, timeout_s: float, names: frozenset[str] | None = None) -> bool:
    """Wait until no named actor (of `names`, when given) is listed in `namespace`; False if
    some still are after timeout_s. `ray.kill` returns before the GCS drops the actor's name."""
    deadline = time.monotonic() + timeout_s
    while True:
        listed = ray.util.list_named_actors(all_namespaces=True)
        if not any(a["namespace"] == namespace and (names is None or a["name"] in names) for a in listed):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


# --- teardown ------------------------------------------------------------------------------


def tear_down(d: Deployment, namespace: str, stop_timeout_s: float, server_name: str) -> None:
    """Stop and remove every actor and placement group of `d`. Each engine is asked to stop
    (within stop_timeout_s) before it is killed; `server_name`: the name of `d.server`."""
    from ray.util.placement_group import remove_placement_group

    for engine in d.engines.values():
        try:
            ray.get(engine.stop.remote(), timeout=stop_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            continue  # a dead (or hung) engine is killed below all the same
    extra = [d.server] if d.server is not None else []
    for actor in [*d.engines.values(), *d.readers.values(), d.scheduler, *extra]:
        ray.kill(actor, no_restart=True)
    for group in d.groups.values():
        remove_placement_group(group)
    # The next deploy refuses named actors it finds alive in the namespace; without this wait
    # it could find this deployment's own, killed but not yet gone (a demo's second mode
    # failed so on a fresh clone). One that outlives the wait is reported by that check.
    names = frozenset([*d.engines, *d.readers, SCHEDULER] + ([server_name] if d.server is not None else []))
    _named_actors_gone(namespace, timeout_s=30.0, names=names)
    for front_end in (ROLLOUT_SERVER, OPENAI_SERVER):
        KeptState(namespace, front_end).forget()
