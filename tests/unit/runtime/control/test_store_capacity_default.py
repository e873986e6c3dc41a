"""A deployment's scheduler bounds a directory store by default (store.capacity_bytes unset):
a store grown without bound fills its file system, and then every persist is refused."""

from __future__ import annotations

from pathlib import Path

from dualpath_ray.config import DualPathConfig, parse_config
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.runtime.control.scheduler_core import build_core


def test_the_default_config_bounds_a_directory_store_by_its_free_space(tmp_path: Path) -> None:
    cfg = DualPathConfig()
    assert cfg.store.capacity_bytes is None, "no capacity is configured by default"
    core = build_core(cfg, str(tmp_path), "dualpath")
    assert core.eviction is not None and core.eviction.capacity_blocks is not None, (
        "yet the scheduler's eviction has a capacity: derived from the file system"
    )
    assert core.eviction.capacity_blocks >= 1, "at least one block fits"


def test_a_memory_store_and_a_configured_capacity_are_left_as_they_are(tmp_path: Path) -> None:
    memory = build_core(parse_config({"store": {"backend": "memory"}}), None, "dualpath")
    assert memory.eviction is not None and memory.eviction.capacity_blocks is None, "a memory store has no limit"
    layout = KVLayout.from_model(DualPathConfig().model, DualPathConfig().store.block_size)
    cfg = parse_config({"store": {"capacity_bytes": 5 * layout.full_block_bytes}})
    assert build_core(cfg, str(tmp_path), "dualpath").eviction.capacity_blocks == 5, "a configured capacity wins"
