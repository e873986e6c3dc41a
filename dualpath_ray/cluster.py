"""DualPathCluster: the driver. Brings up (or connects to) Ray, deploys the actor graph on the
P/D topology, runs multi-turn trajectories, and exposes byte counters and integrity checks.

Turn k+1 of a trajectory is submitted only when turn k has finished (plus its tool latency);
its prompt is turn k's prompt + turn k's output + the turn's appended tokens.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from typing import Any, Sequence

import ray

from dualpath_ray.config import DualPathConfig
from dualpath_ray.faults.injector import FaultCount, merge_counts
from dualpath_ray.protocol.aborts import AbortTarget
from dualpath_ray.observability.job_metadata import driver_job_config
from dualpath_ray.protocol.counters import NodeCounters
from dualpath_ray.protocol.messages import TurnResult
from dualpath_ray.protocol.weights import WeightSource
from dualpath_ray.runtime.deploy.deployment import Deployment, create_deployment, tear_down
from dualpath_ray.runtime.placement.topology import (
    HEAD_RESOURCE, ROLE_LABEL, NodeSpec, front_end_options, plan_nodes, slot_resource,
)
from dualpath_ray.runtime.weights.sync import WeightSender, manifest_of
from dualpath_ray.runtime.telemetry.engine_stats import EngineStats
from dualpath_ray.runtime.telemetry.status_views import StatusQuery
from dualpath_ray.runtime.emulation.choice import EmulationChoice, resolve_emulation
from dualpath_ray.workload.trace import Trajectory

LOG = logging.getLogger("dualpath_ray.cluster")


def _embedded_env() -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_rdt_fetch_fail_timeout_milliseconds", "30000")


def _say_emulation(choice: EmulationChoice, embedded: bool) -> None:
    """The driver's first log line: whether NIC rates are emulated. Emulating on a cluster it
    connects to (presumably real hardware) is worth a warning; elsewhere it is information."""
    LOG.log(logging.WARNING if choice.enabled and not embedded else logging.INFO, choice.line())


def _check_version(version: object) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"update_weights: version must be an int >= 0 (got {version!r})")


class DualPathCluster:
    def __init__(self, cfg: DualPathConfig, local_cluster: Any | None) -> None:
        # Every deployment of this driver gets an explicit emulation.enabled (choice.py).
        self.cfg, self.emulation = resolve_emulation(cfg, embedded=local_cluster is not None)
        self.local_cluster = local_cluster
        self.nodes: list[NodeSpec] = plan_nodes(cfg)
        self.deployment: Deployment | None = None
        self._temp_roots: list[str] = []

    # --- bring-up ----------------------------------------------------------------------

    @classmethod
    def start(cls, cfg: DualPathConfig) -> DualPathCluster:
        """An embedded local cluster: one Ray node per configured node, plus a head. Emulation
        is on unless the config says `emulation.enabled: false`."""
        from ray.cluster_utils import Cluster

        _say_emulation(resolve_emulation(cfg, embedded=True)[1], embedded=True)
        _embedded_env()
        local = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "resources": {HEAD_RESOURCE: 1}, "include_dashboard": False,
                            "object_store_memory": 80 << 20},
        )
        for spec in plan_nodes(cfg):
            local.add_node(
                num_cpus=cfg.cluster.cpus_per_node,
                num_gpus=spec.gpus,
                resources={slot_resource(spec.role): 1},
                labels={ROLE_LABEL: spec.role},
                object_store_memory=80 << 20,
            )
        local.wait_for_nodes()
        ray.init(address=local.address, namespace=cfg.runtime.namespace, log_to_driver=True,
                 job_config=driver_job_config(cfg))
        return cls(cfg, local)

    @classmethod
    def connect(cls, cfg: DualPathConfig, address: str = "auto") -> DualPathCluster:
        """Use a running cluster whose nodes carry the role labels and slot resources. Emulation
        is off unless the config says `emulation.enabled: true`."""
        _say_emulation(resolve_emulation(cfg, embedded=False)[1], embedded=False)
        _embedded_env()
        if not ray.is_initialized():
            ray.init(address=address, namespace=cfg.runtime.namespace, job_config=driver_job_config(cfg))
        return cls(cfg, None)

    def deploy(
        self, mode: str | None = None, store_root: str | None = None, cfg: DualPathConfig | None = None,
        *, replace_existing: bool = False,
    ) -> Deployment:
        """Start the scheduler, one reader per node and one engine per GPU; verify placement.
        `cfg` may replace the configuration for this deployment if its topology is unchanged.

        Actors of another deployment still alive in the namespace (a crashed driver's detached
        scheduler, say) are an error naming them, since reusing them would serve this run with
        their config, mode and store; `replace_existing=True` kills them first."""
        if self.deployment is not None:
            self.teardown()
        if cfg is not None:
            if cfg.cluster != self.cfg.cluster:
                raise ValueError("deploy(cfg=...) cannot change the cluster section; start a new cluster")
            self.cfg, self.emulation = resolve_emulation(cfg, embedded=self.local_cluster is not None)
        cfg = self.cfg
        mode = mode or cfg.runtime.mode
        root = store_root or (str(cfg.store.root) if cfg.store.root else self._fresh_root())
        self.deployment = create_deployment(
            cfg, self.nodes, mode, root, replace_existing=replace_existing,
            scheduler_on_head=self.local_cluster is not None,
        )
        return self.deployment

    def _fresh_root(self) -> str:
        root = tempfile.mkdtemp(prefix="dualpath-store-")
        self._temp_roots.append(root)
        return root

    # --- running trajectories ----------------------------------------------------------

    def run_trajectories(self, trajectories: Sequence[Trajectory]) -> dict[str, list[TurnResult]]:
        """Run every trajectory turn by turn; trajectory id -> its turns' results. Any failed
        trajectory is an error here; `rollout` reports failures per trajectory instead."""
        result = self.rollout(trajectories, progress=False)
        if result.failures:
            raise RuntimeError(f"trajectories failed: {result.failures}")
        return result.turn_results

    def rollout(self, trajectories: Sequence[Trajectory], resume: Any = None, progress: bool | None = None) -> Any:
        """The batch API for RL pipelines (see dualpath_ray.api.rollout_async): a RolloutResult."""
        from dualpath_ray.api import rollout_async

        if self.deployment is None:
            self.deploy()
        assert self.deployment is not None
        return asyncio.run(rollout_async(self.deployment.scheduler, self.cfg, trajectories, resume, progress))

    def abort(self, request_id: str) -> bool:
        """Abort one request in flight (its caller gets stop reason `aborted`; its extents and
        pages are freed); False when none of that id is in flight."""
        return bool(ray.get(self._scheduler().abort.remote(AbortTarget.request(request_id))))

    def abort_trajectory(self, trajectory_id: str) -> int:
        """Abort a trajectory of a running rollout: its turn in flight now and every later one
        (the rollout lists it in `aborted`; rolling it out again resumes it). Returns the turns
        that were in flight."""
        from dualpath_ray.api.rollout import trajectory_prefix

        return int(ray.get(self._scheduler().abort.remote(AbortTarget.trajectory(trajectory_prefix(trajectory_id)))))

    def abort_all(self) -> int:
        """Abort every request in flight; returns how many."""
        return int(ray.get(self._scheduler().abort.remote(AbortTarget.everything())))

    def _scheduler(self) -> Any:
        if self.deployment is None:
            raise RuntimeError("no deployment: call deploy() (or rollout()) first")
        return self.deployment.scheduler

    def server(self) -> Any:
        """The named `rollout-server` actor: verl-style `generate`, weight version, cache reset.
        Restarted by Ray when its process dies (runtime.front_end_max_restarts), the calls in
        flight sent again to the new incarnation (api/server.py)."""
        from dualpath_ray.api import SERVER_NAME, RolloutServer

        if self.deployment is None:
            self.deploy()
        assert self.deployment is not None
        if self.deployment.server is None:
            self.deployment.server = RolloutServer.options(
                **front_end_options(self.cfg, SERVER_NAME), get_if_exists=True
            ).remote(self.cfg)
        return self.deployment.server

    # --- observation -------------------------------------------------------------------

    def counters(self) -> dict[str, NodeCounters]:
        """Exact bytes per logical node: its reader's SNIC and buffer-side CNIC plus its engines."""
        assert self.deployment is not None
        totals: dict[str, NodeCounters] = {}
        for spec in self.nodes:
            node = NodeCounters()
            node.merge(ray.get(self.deployment.readers[spec.reader_name].counters.remote()))
            for name in spec.engine_names():
                node.merge(ray.get(self.deployment.engines[name].stats.remote()))
            totals[spec.node_id] = node
        return totals

    def pool_integrity(self) -> dict[str, tuple[int, int, int, int]]:
        """node -> (free, leased, in_flight, capacity), each checked by the pool itself."""
        assert self.deployment is not None
        return {name: ray.get(r.pool_integrity.remote()) for name, r in self.deployment.readers.items()}

    def pool_holders(self) -> dict[str, dict[str, int]]:
        """node -> owner -> buffer blocks it holds: who holds a pool that is not free."""
        assert self.deployment is not None
        return {name: ray.get(r.pool_holders.remote()) for name, r in self.deployment.readers.items()}

    def page_integrity(self) -> dict[str, tuple[int, int, int, int]]:
        """decode engine -> (free, allocated, reserved, capacity) of its HBM pages, checked by the pool."""
        assert self.deployment is not None
        decode = {n: e for n, e in self.deployment.engines.items() if n.startswith("decode/")}
        return dict(zip(decode, ray.get([e.page_integrity.remote() for e in decode.values()])))

    def engine_stats(self) -> dict[str, EngineStats[Any]]:
        """Each live engine's core and transport figures (batches, transfers, bytes in flight,
        ...); a dead engine is left out."""
        assert self.deployment is not None
        refs = {name: e.engine_stats.remote() for name, e in self.deployment.engines.items()}
        stats = {}
        for name, ref in refs.items():
            try:
                stats[name] = ray.get(ref, timeout=self.cfg.runtime.heartbeat_timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue
        return stats

    def fault_counts(self) -> dict[str, FaultCount]:
        """The fault plan's counters ("site:mode[:phase]" -> events, injected), summed over every
        live engine and reader (an actor killed by its plan takes its counts with it)."""
        assert self.deployment is not None
        actors = [*self.deployment.engines.values(), *self.deployment.readers.values()]
        parts = []
        for actor in actors:
            try:
                parts.append(ray.get(actor.fault_counts.remote(), timeout=self.cfg.runtime.heartbeat_timeout_s))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue
        return merge_counts(parts)

    def integrity_report(self) -> dict[str, int | set[str]]:
        """What the KV checks caught: digest mismatches (tokens) and second reads at the prefill
        and decode sides, attempts runtime.verify_kv failed at the decode side (KV that got past
        the digests), and the stored blocks the readers damaged (plan) and found corrupt."""
        assert self.deployment is not None
        report: dict[str, Any] = {"prefill_mismatches": 0, "prefill_rereads": 0, "decode_mismatches": 0,
                                  "decode_reloads": 0, "verify_mismatches": 0, "damaged_keys": set(),
                                  "corrupt_keys": set()}
        for name, stats in self.engine_stats().items():
            core = stats.core  # PrefillStats or DecodeStats (runtime/telemetry/engine_stats.py)
            if name.startswith("prefill/"):
                report["prefill_mismatches"] += core.pipeline.digest_mismatches
                report["prefill_rereads"] += core.pipeline.digest_rereads
            else:
                report["decode_mismatches"] += core.digest_mismatches
                report["decode_reloads"] += core.digest_reloads
                report["verify_mismatches"] += core.verify_mismatches
        for reader in self.deployment.readers.values():
            damaged, corrupt = ray.get(reader.integrity_keys.remote())
            report["damaged_keys"].update(damaged)
            report["corrupt_keys"].update(corrupt)
        return report

    def update_weights(self, version: int, source: Any) -> int:
        """Swap every engine's weights between rollouts and move later requests to the key
        namespace of `version`, so KV of the old weights is never hit. `source`: a safetensors
        checkpoint directory, or a state dict (put once in the object store for all engines)."""
        assert self.deployment is not None
        _check_version(version)
        if isinstance(source, (str, os.PathLike)):
            weights = WeightSource(checkpoint=os.fspath(source))
        else:
            weights = WeightSource(state=ray.put(dict(source)))
        ray.get(self._scheduler().update_weights.remote(version, weights))
        self._use_weight_version(version)
        return version

    def _use_weight_version(self, version: int) -> None:
        self.cfg = self.cfg.with_overrides(model={"weight_version": version})
        if self.deployment is not None and self.deployment.server is not None:
            ray.get(self.deployment.server.update_weight_version.remote(version))

    def sleep(self) -> int:
        """Between rollouts: every engine frees its KV memory and moves its weights off the
        accelerator (the store and the index are kept); returns the bytes freed."""
        return int(ray.get(self._scheduler().sleep.remote()))

    def wake_up(self) -> None:
        ray.get(self._scheduler().wake_up.remote())

    def attach_weight_sender(self, group_name: str = "policy", timeout_s: float = 300.0) -> WeightSender:
        """This process becomes rank 0 of a weight broadcast group every engine joins (the way
        a trainer syncs its policy); use it with `update_weights_from_group`. Its device is this
        process's GPU where it has one; the backend is the one the trainer and the engines agree
        on from their devices (runtime/weights/sync.py: NCCL when each has a GPU of its
        own, else gloo), `sender.backend` once this returns."""
        engines = len(ray.get(self._scheduler().status.remote(StatusQuery.DEPLOYMENT)).engines)
        sender = WeightSender.listen(engines + 1, host=ray.util.get_node_ip_address(), group_name=group_name,
                                     timeout_s=timeout_s)
        joined = self._scheduler().join_weight_group.remote(sender.host, sender.port, group_name, timeout_s)
        sender.connect()
        ray.get(joined)
        return sender

    def update_weights_from_group(self, sender: WeightSender, version: int, state_dict: Any) -> int:
        """Broadcast `state_dict` to every engine through the group and make it weight version
        `version`: later requests use that version's key namespace, so KV of the old weights is
        never hit."""
        _check_version(version)
        manifest = manifest_of(state_dict)
        received = self._scheduler().update_weights_from_group.remote(version, manifest)
        sender.send(state_dict, manifest)
        ray.get(received)
        self._use_weight_version(version)
        return version

    def health(self) -> dict[str, str]:
        """Engines whose worker thread failed, with the error."""
        assert self.deployment is not None
        reports = ray.get([e.health.remote() for e in self.deployment.engines.values()])
        return {name: err for name, err in zip(self.deployment.engines, reports) if err}

    # --- teardown ------------------------------------------------------------------------

    def teardown(self, stop_timeout_s: float | None = None) -> None:
        """Stop and remove every actor and placement group of the current deployment. Each
        engine gets `stop_timeout_s` (default runtime.heartbeat_timeout_s) to stop before it is
        killed."""
        from dualpath_ray.api import SERVER_NAME

        if self.deployment is None:
            return
        timeout_s = self.cfg.runtime.heartbeat_timeout_s if stop_timeout_s is None else stop_timeout_s
        tear_down(self.deployment, self.cfg.runtime.namespace, timeout_s, SERVER_NAME)
        self.deployment = None

    def embedded_alive(self) -> bool:
        """Whether every process the embedded cluster started (GCS, raylets, ...) still runs;
        True for a cluster this driver connected to. A Ray call waits up to a minute for a GCS
        that died, so a caller that must stop in time asks this first."""
        if self.local_cluster is None:
            return True
        nodes = [self.local_cluster.head_node, *self.local_cluster.worker_nodes]
        return all(info.process.poll() is None for node in nodes if node is not None
                   for infos in node.all_processes.values() for info in infos)

    def shutdown(self, teardown: bool = True) -> None:
        """Tear the deployment down, disconnect, and stop the embedded cluster. `teardown=False`
        skips the actor-by-actor teardown: for an embedded cluster whose processes are stopped
        anyway (`dualpath serve` stops them all at once, which is faster)."""
        if teardown:
            self.teardown()
        self.deployment = None
        ray.shutdown()
        if self.local_cluster is not None:
            self.local_cluster.shutdown()
            self.local_cluster = None
        for root in self._temp_roots:
            shutil.rmtree(root, ignore_errors=True)
        self._temp_roots.clear()

    def __enter__(self) -> DualPathCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
