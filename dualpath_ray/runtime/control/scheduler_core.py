"""The scheduler core of a deployment, built from its configuration and its store.

The pure core (scheduling/scheduler.py) takes its parts ready-made; this builds them the way a
deployment needs them: the Scheduler actor (runtime/control/scheduler.py) builds one per
incarnation, and tests build the same one without Ray.
"""

from __future__ import annotations

from collections.abc import Callable

from dualpath_ray.config import ConfigError, DualPathConfig
from dualpath_ray.kv.eviction import LRUEviction, store_capacity_bytes
from dualpath_ray.kv.index import PrefixIndex
from dualpath_ray.kv.janitor import StoreJanitor
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.store import open_store
from dualpath_ray.model.profile import derive_alpha_beta, load_profile_for
from dualpath_ray.scheduling.dispatcher import Constants
from dualpath_ray.scheduling.core_settings import CoreSettings
from dualpath_ray.scheduling.scheduler import SchedulerCore


def prefill_s_of(cfg: DualPathConfig) -> Callable[[int, int], float] | None:
    """One request's prefill seconds given (cached, new) tokens, from the configured hardware
    profile (what beta is derived from), for the compute path and in-flight sharing; None when
    both are off."""
    if cfg.scheduler.compute_path == "off" and not cfg.scheduler.share_in_flight:
        return None
    if cfg.scheduler.compute_path == "auto" and cfg.emulation.profile_path is None:
        # The built-in profile is a nominal accelerator's: its prefill times can be off by 50x
        # on real engines, and auto would then recompute every hit (benchmarks/README.md).
        raise ConfigError(
            "scheduler.compute_path: auto estimates compute from the latency profile, and emulation.profile_path "
            "is unset (the built-in nominal profile is not this hardware): measure one with `dualpath profile "
            "--config YOUR.yaml --out profile.json` and set emulation.profile_path to it, or set "
            "scheduler.compute_path: off"
        )
    profile = load_profile_for(cfg)
    return lambda cached, new: profile.forward_ms([(cached, new)]) / 1000.0 if new else 0.0


def build_core(cfg: DualPathConfig, store_root: str | None, mode: str, epoch: int = 0) -> SchedulerCore:
    """The scheduler core of a deployment: its index rebuilt from the store, the store's
    capacity (configured, or derived from its file system's free space now and at each of the
    janitor's walks), the store's janitor thread (started: it deletes what leaves the index),
    and alpha/beta of the configured cluster and model."""
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    store = open_store(cfg.store, layout, root=store_root)
    index = PrefixIndex.rebuild(store, cfg.store.block_size)
    capacity = store_capacity_bytes(cfg.store.capacity_bytes, cfg.store.capacity_free_fraction, store, len(index))
    derived = cfg.store.capacity_bytes is None and store.root is not None
    janitor = StoreJanitor(store, cfg.store.sweep_interval_s, grace_s=cfg.runtime.request_timeout_s)
    eviction = LRUEviction(
        index, janitor, capacity, layout.full_block_bytes, cfg.store.capacity_free_fraction if derived else None
    )
    janitor.start(eviction)
    alpha, beta = derive_alpha_beta(cfg, layout)
    settings = CoreSettings.of(cfg, mode, Constants(alpha, beta, cfg.scheduler.z_margin), epoch, prefill_s_of(cfg))
    return SchedulerCore(settings, index, eviction, store)
