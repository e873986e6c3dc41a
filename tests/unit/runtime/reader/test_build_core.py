"""The reader actor's wiring (`build_core`): a ReaderCore with the settings and collaborators the
config describes, so the core's tests (built by hand) and the deployed reader run the same thing."""

from __future__ import annotations

from pathlib import Path

from dualpath_ray.config import DualPathConfig
from dualpath_ray.faults.injector import FaultInjector
from dualpath_ray.kv.local_store import LocalDirStore
from dualpath_ray.runtime.reader.actor import build_core


def test_build_core_takes_settings_store_links_and_faults_from_the_config(tmp_path: Path) -> None:
    cfg = DualPathConfig().with_overrides(
        store={"root": str(tmp_path / "unused"), "stale_temporary_s": 42.0},
        cluster={"buffer_blocks_per_node": 5, "snic_gbps": 10.0},
        runtime={"transfer_timeout_s": 7.0, "kv_digests": False},
        emulation={"enabled": True},
        faults={"faults": [{"site": "store_read", "mode": "fail", "actors": "reader/n3", "nth": 1}]},
    )
    core = build_core(cfg, "n3", str(tmp_path), incarnation="inc-1")
    settings = core.settings
    assert (settings.node_id, settings.incarnation, core.node_id) == ("n3", "inc-1", "n3"), "names the node and process"
    assert settings.buffer_blocks == 5 and core.pool.capacity == 5, "the buffer is cluster.buffer_blocks_per_node"
    assert settings.lease_timeout_s == 14.0, "a lease waits twice runtime.transfer_timeout_s"
    assert settings.kv_digests is False and settings.stale_temporary_s == 42.0, "the runtime and store settings"
    assert isinstance(core.store, LocalDirStore) and core.store.root == tmp_path, "the store is at store_root"
    assert core.snic_read is not core.snic_write, "the NIC is full duplex: one link per direction"
    assert core.snic_read.turns is not None and core.snic_write.turns is not None, "emulated links queue whole reads"
    assert isinstance(core.faults, FaultInjector) and core.faults.actor == "reader/n3", "faults of reader/<node>"
    assert core.faults.active, "the plan's fault for this reader applies"
    core.store.close()


def test_a_restarted_reader_has_no_kill_left_to_fire(tmp_path: Path) -> None:
    cfg = DualPathConfig().with_overrides(
        store={"root": str(tmp_path)},
        cluster={"buffer_blocks_per_node": 2},
        faults={"faults": [{"site": "store_read", "mode": "kill", "actors": "reader/*", "nth": 1}]},
    )
    assert build_core(cfg, "n0", str(tmp_path)).faults.active, "the first process may be killed"
    assert not build_core(cfg, "n0", str(tmp_path), restarted=True).faults.active, "its restart may not"
