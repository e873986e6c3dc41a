"""Batch rollouts for RL pipelines: every trajectory turn by turn, results as an Arrow table.

A trajectory that fails is reported in `failures` while the others finish; `resume=` continues a
previous result from each trajectory's first missing turn. Turn k+1 is submitted only when turn
k has finished (plus its tool latency); its prompt is turn k's prompt + output + appended tokens.
A turn the scheduler refuses because its queue is full is submitted again after a pause
(`SchedulerClient.generate_admitted`), so a burst delays trajectories instead of failing them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dualpath_ray.api.client import SchedulerClient
from dualpath_ray.api.validation import make_spec, validate_prompt
from dualpath_ray.config import DualPathConfig
from dualpath_ray.metrics import TRAJECTORY_JCT_SECONDS, MetricSink, RayMetrics
from dualpath_ray.protocol.messages import SamplingParams, TurnResult
from dualpath_ray.protocol.types import ReadPath, StopReason
from dualpath_ray.runtime.telemetry.status_views import StatusQuery
from dualpath_ray.workload.trace import Trajectory

ROLLOUT_SCHEMA = pa.schema(
    [
        ("trajectory_id", pa.string()), ("turn", pa.int32()), ("request_id", pa.string()),
        ("prompt_tokens", pa.int32()), ("hit_tokens", pa.int32()), ("output_token_ids", pa.list_(pa.int32())),
        ("log_probs", pa.list_(pa.float32())), ("stop_reason", pa.string()), ("ttft_s", pa.float64()),
        ("tpot_s", pa.float64()), ("path", pa.string()), ("prefill_engine", pa.string()),
        ("decode_engine", pa.string()),
    ]
)


@dataclass
class RolloutResult:
    """Per-turn results as an Arrow table, plus the trajectories that failed and why."""

    table: pa.Table
    failures: dict[str, str]
    jct_s: float
    turn_results: dict[str, list[TurnResult]] = field(default_factory=dict)
    # Trajectories whose caller aborted them: their turns before the abort are in `table`, and
    # `resume=` continues them from the aborted turn.
    aborted: list[str] = field(default_factory=list)
    # The calls this rollout made to the scheduler ("submit", "collect"): its turns went batched.
    client_calls: dict[str, int] = field(default_factory=dict)

    def outputs(self) -> dict[str, list[tuple[int, ...]]]:
        grouped: dict[str, list[tuple[int, ...]]] = {}
        rows = self.table.sort_by([("trajectory_id", "ascending"), ("turn", "ascending")]).to_pylist()
        for row in rows:
            grouped.setdefault(row["trajectory_id"], []).append(tuple(row["output_token_ids"]))
        return grouped

    def summary(self) -> dict[str, Any]:
        prompt = pa.compute.sum(self.table["prompt_tokens"]).as_py() or 0
        hits = pa.compute.sum(self.table["hit_tokens"]).as_py() or 0
        return {
            "trajectories": len(set(self.table["trajectory_id"].to_pylist()) | set(self.failures)),
            "turns": self.table.num_rows,
            "failed_trajectories": sorted(self.failures),
            "failures": self.failures,
            "jct_s": self.jct_s,
            "hit_rate": hits / prompt if prompt else 0.0,
            "mean_ttft_s": float(np.mean(self.table["ttft_s"].to_numpy())) if self.table.num_rows else 0.0,
            "mean_tpot_s": float(np.mean(self.table["tpot_s"].to_numpy())) if self.table.num_rows else 0.0,
            "requests_by_path": _requests_by_path(self.table["path"].to_pylist()),
        }

    def write_parquet(self, path: str) -> None:
        pq.write_table(self.table, path)


def _requests_by_path(paths: list[str]) -> dict[str, int]:
    """Turns per read path; `split` only where some were split (scheduler.read_split)."""
    counts = {p.value: paths.count(p.value) for p in ReadPath}
    if not counts[ReadPath.SPLIT.value]:
        del counts[ReadPath.SPLIT.value]
    return counts


def _rows(trajectory_id: str, turn: int, result: TurnResult) -> dict[str, Any]:
    return {
        "trajectory_id": trajectory_id, "turn": turn, "request_id": result.request_id,
        "prompt_tokens": result.prompt_tokens, "hit_tokens": result.hit_tokens,
        "output_token_ids": list(result.output_tokens), "log_probs": list(result.log_probs),
        "stop_reason": result.stop_reason, "ttft_s": result.ttft_s, "tpot_s": result.tpot_s,
        "path": result.path, "prefill_engine": result.prefill_engine, "decode_engine": result.decode_engine,
    }


def _previous_outputs(resume: RolloutResult | None) -> dict[str, list[dict[str, Any]]]:
    if resume is None:
        return {}
    done: dict[str, list[dict[str, Any]]] = {}
    for row in resume.table.sort_by([("trajectory_id", "ascending"), ("turn", "ascending")]).to_pylist():
        done.setdefault(row["trajectory_id"], []).append(row)
    return done


class _Progress:
    def __init__(self, total: int, enabled: bool | None) -> None:
        self.bar = None
        if enabled if enabled is not None else sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="turn", desc="rollout")

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def next_turn_hint(trajectory: Trajectory, index: int) -> float | None:
    """The hint that turn `index` is followed by another after this many seconds of tool time (the
    scheduler stages that turn's KV meanwhile: scheduling/staging.py); None after the last turn or
    when the next one follows at once."""
    if index + 1 >= len(trajectory.turns):
        return None
    latency = trajectory.turns[index + 1].tool_latency_s
    return latency if latency > 0 else None


async def _run_trajectory(
    generate: Any, cfg: DualPathConfig, namespace: str, trajectory: Trajectory, done: list[dict[str, Any]],
    started: float, progress: _Progress, served: list[TurnResult], metrics: MetricSink,
    sampling: SamplingParams = SamplingParams(),
) -> tuple[list[dict[str, Any]], str | None, bool]:
    """The trajectory's rows, its error (None when it completed), and whether it was aborted."""
    rows = list(done)
    context: list[int] = []
    try:
        delay = trajectory.arrival_s - (time.monotonic() - started)
        if delay > 0 and not done:
            await asyncio.sleep(delay)
        for index, turn in enumerate(trajectory.turns):
            context = context + list(turn.appended)
            if index < len(done):
                context = context + list(done[index]["output_token_ids"])
                continue
            if turn.tool_latency_s > 0:
                await asyncio.sleep(turn.tool_latency_s)
            request_id = f"{trajectory_prefix(trajectory.trajectory_id)}t{index}"
            prompt = validate_prompt(request_id, context, turn.gen_len, cfg.model)
            spec = make_spec(request_id, prompt, dataclasses.replace(sampling, max_new_tokens=turn.gen_len), namespace,
                             expect_next_turn_s=next_turn_hint(trajectory, index))
            result: TurnResult = await generate(spec)
            if result.stop_reason is StopReason.ABORTED:
                _observe_jct(metrics, started + trajectory.arrival_s, "aborted")
                return rows, None, True
            if result.error:
                raise TurnFailedError(result)
            rows.append(_rows(trajectory.trajectory_id, index, result))
            served.append(result)
            progress.step()
            context = context + list(result.output_tokens)
    except Exception as exc:  # noqa: BLE001 - one trajectory's failure must not stop the others
        _observe_jct(metrics, started + trajectory.arrival_s, "failed")
        return rows, f"{type(exc).__name__}: {exc}", False
    _observe_jct(metrics, started + trajectory.arrival_s, "ok")
    return rows, None, False


def _observe_jct(metrics: MetricSink, arrived: float, outcome: str) -> None:
    """A trajectory's completion time, from its arrival (monotonic) to now."""
    metrics.observe(TRAJECTORY_JCT_SECONDS, time.monotonic() - arrived, {"outcome": outcome})


class TurnFailedError(RuntimeError):
    """A turn that ended in error after its retries; `kind` is its ErrorKind."""

    def __init__(self, result: TurnResult) -> None:
        self.kind = result.error_kind
        self.result = result
        kind = result.error_kind.value if result.error_kind is not None else "error"
        super().__init__(f"{kind} (attempt {result.attempt}): {result.error}")


async def rollout_async(
    scheduler: Any, cfg: DualPathConfig, trajectories: Sequence[Trajectory], resume: RolloutResult | None = None,
    progress: bool | None = None, weight_version: int | None = None,
    sampling: Mapping[str, SamplingParams] | None = None,
) -> RolloutResult:
    """`sampling`: trajectory id -> how its turns sample (each turn's max_new_tokens is its
    gen_len); greedy where absent. `weight_version` None: the version the engines hold now
    (the scheduler's published weights), however they were last updated."""
    if weight_version is None:
        published = (await scheduler.status.remote(StatusQuery.DEPLOYMENT)).weights
        weight_version = cfg.model.weight_version if published is None else published.weights.version
    version = weight_version
    namespace = cfg.kv_namespace(version)
    previous = _previous_outputs(resume)
    bar = _Progress(sum(len(t.turns) for t in trajectories), progress)

    client = SchedulerClient(scheduler)
    # A turn refused because the scheduler's queue was momentarily full (queue_full) does not
    # fail its trajectory: it is submitted again after a pause, for up to runtime.request_timeout_s.
    generate = functools.partial(client.generate_admitted, within_s=cfg.runtime.request_timeout_s)

    # A trajectory aborted in an earlier rollout runs again when it is rolled out again.
    await scheduler.clear_aborts.remote([trajectory_prefix(t.trajectory_id) for t in trajectories])
    served: dict[str, list[TurnResult]] = {t.trajectory_id: [] for t in trajectories}
    metrics = RayMetrics(cfg.runtime.metrics)
    started = time.monotonic()
    outcomes = await asyncio.gather(
        *(
            _run_trajectory(
                generate, cfg, namespace, t, previous.get(t.trajectory_id, []), started, bar, served[t.trajectory_id], metrics,
                (sampling or {}).get(t.trajectory_id, SamplingParams()),
            )
            for t in trajectories
        )
    )
    bar.close()
    rows = [row for rs, _, _ in outcomes for row in rs]
    failures = {t.trajectory_id: err for t, (_, err, _) in zip(trajectories, outcomes) if err}
    aborted = [t.trajectory_id for t, (_, _, stopped) in zip(trajectories, outcomes) if stopped]
    table = pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)
    calls = {"submit": client.submits, "collect": client.collects}
    return RolloutResult(table, failures, time.monotonic() - started, served, aborted, calls)


def trajectory_prefix(trajectory_id: str) -> str:
    """The request id prefix of a trajectory's turns (they are "<trajectory>/t<turn>")."""
    return f"{trajectory_id}/"
