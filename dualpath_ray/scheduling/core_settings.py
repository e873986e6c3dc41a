"""The scheduler core's settings (`CoreSettings`), built from the deployment's configuration:
the mode, the policy's constants, retry and staging rules, and the compute path's estimates
(scheduling/compute_path.py). No Ray; the runtime and the simulator both build one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dualpath_ray.scheduling.admission import Admission
from dualpath_ray.scheduling.compute_path import ComputePathModel
from dualpath_ray.scheduling.dispatcher import Constants
from dualpath_ray.scheduling.staging import StagingSettings
from dualpath_ray.protocol.types import Mode

if TYPE_CHECKING:
    from dualpath_ray.config import DualPathConfig


@dataclass(frozen=True)
class CoreSettings:
    mode: Mode
    block_size: int
    constants: Constants
    max_attempts: int = 3
    kv_failure_policy: str = "recompute"  # or "fail" (runtime.kv_failure_policy)
    epoch: int = 0  # the scheduler incarnation; every attempt it dispatches carries it
    read_split: str = "whole"  # or "proportional" (scheduler.read_split)
    decode_groups: int = 0  # decode groups the cluster has (one per decode node); 0 = unknown
    admission: Admission = Admission()  # no limit unless configured (scheduler.max_queued_turns)
    staging: StagingSettings = StagingSettings()  # tool-time staging (scheduler.stage_tool_time)
    compute_path: ComputePathModel | None = None  # recompute hit tails (scheduler.compute_path); None = off
    bind_hits: str = "late"  # or "early": hits looked up at submit only (scheduler.bind_hits)
    # In-flight sharing's estimates (scheduler.share_in_flight, scheduling/sharing.py); None = off.
    share_in_flight: ComputePathModel | None = None
    # The driver reports a prompt's blocks stored before its turn ends (prompt_persisted): the
    # simulator does, and the runtime in dualpath mode with scheduler.share_buffer_blocks > 0 (its
    # decode nodes' readers report them held in memory); otherwise they publish with the turn's result.
    early_prompt_publish: bool = False
    # A hit may end with the block that holds the prompt's last token (scheduler.partial_block_hits,
    # resolved for the deployment's engines: DualPathConfig.partial_block_hits).
    partial_block_hits: bool = False

    @classmethod
    def of(
        cls, cfg: DualPathConfig, mode: Mode | str, constants: Constants, epoch: int = 0,
        prefill_s: Callable[[int, int], float] | None = None,
    ) -> CoreSettings:
        """`prefill_s`: one request's prefill seconds given (cached, new) tokens, the latency
        model the compute path estimates with (needed when scheduler.compute_path is on)."""
        return cls(Mode(mode), cfg.store.block_size, constants, cfg.runtime.max_attempts,
                   cfg.runtime.kv_failure_policy, epoch, cfg.scheduler.read_split, cfg.cluster.decode_nodes,
                   Admission(cfg.scheduler.max_queued_turns), StagingSettings(
                       cfg.scheduler.stage_tool_time and Mode(mode) is Mode.DUALPATH,
                       cfg.scheduler.stage_slack, cfg.scheduler.stage_margin_s,
                       read_tokens_per_s=constants.alpha_tokens / cfg.scheduler.alpha_seconds),
                   compute_path_model(cfg, constants, prefill_s), cfg.scheduler.bind_hits,
                   sharing_model(cfg, constants, prefill_s, buffer_source=Mode(mode) is Mode.DUALPATH),
                   early_prompt_publish=Mode(mode) is Mode.DUALPATH and cfg.scheduler.share_buffer_blocks > 0,
                   partial_block_hits=cfg.partial_block_hits)


def compute_path_model(
    cfg: DualPathConfig, constants: Constants, prefill_s: Callable[[int, int], float] | None,
) -> ComputePathModel | None:
    """The compute path's estimates, when scheduler.compute_path is on: one SNIC reads alpha
    tokens in alpha_seconds, one engine computes beta in beta_seconds, `prefill_s` times one
    request."""
    if cfg.scheduler.compute_path == "off":
        return None
    if prefill_s is None:
        raise ValueError("scheduler.compute_path needs a latency model (prefill_s) to estimate compute with")
    return ComputePathModel(
        constants.alpha_tokens / cfg.scheduler.alpha_seconds, constants.beta_tokens / cfg.scheduler.beta_seconds, prefill_s,
        read_nothing=cfg.scheduler.compute_path == "all",
    )


def sharing_model(
    cfg: DualPathConfig, constants: Constants, prefill_s: Callable[[int, int], float] | None,
    buffer_source: bool = False,
) -> ComputePathModel | None:
    """In-flight sharing's estimates, when scheduler.share_in_flight is on: the compute path's
    rates and latency model (scheduling/share_rule.py). With `buffer_source` (the runtime in
    dualpath mode) and scheduler.share_buffer_blocks > 0, the decode-node buffer's read rate
    too: one CNIC's KV tokens per second, alpha's SNIC rate scaled by cnic_gbps / snic_gbps (both
    are the NIC's bytes per second over the KV bytes per token)."""
    if not cfg.scheduler.share_in_flight:
        return None
    if prefill_s is None:
        raise ValueError("scheduler.share_in_flight needs a latency model (prefill_s) to estimate compute with")
    read_rate = constants.alpha_tokens / cfg.scheduler.alpha_seconds
    buffer_rate = 0.0
    if buffer_source and cfg.scheduler.share_buffer_blocks > 0:
        buffer_rate = read_rate * cfg.cluster.cnic_gbps / cfg.cluster.snic_gbps
    return ComputePathModel(
        read_rate, constants.beta_tokens / cfg.scheduler.beta_seconds, prefill_s, buffer_read_tokens_per_s=buffer_rate,
    )
