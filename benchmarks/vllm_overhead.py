"""The vllm engine backend's overhead (oracle mode): dualpath_ray's cores driving a vLLM engine
(engine.backend: vllm) against the same vLLM engine driven directly, side by side.

    .venv/bin/python benchmarks/vllm_overhead.py [--json] [--repeats 3] [--batch 8] [--context 512] [--steps 32]
        [--phase decode|prefill|prefill-engine] [--baseline DIR] [--store memory|local_dir] [--threads N]

Two processes, each holding one vLLM engine of the same config (cluster_configs/vllm-cpu-1p1d.yaml's
model, its seeded random weights), alternate their measurements round by round (`--phase decode`,
decode-heavy):
- backend: the real prefill and decode cores in one process (tests/engine_harness.py, oracle
  mode: no storage or transport), their compute a VllmCompute; `--batch` requests of `--context`
  prompt tokens are prefilled and take their first decode step untimed, then the decode core's
  own step loop is timed for the rest of their `--steps` tokens (its page copies, persistence
  and reports included);
- direct: vllm's LLMEngine with the same arguments and no connector, the same prompts, each
  token's log-prob returned as the backend returns it (RL callers need them), timed from the step
  after the first token to the last.
`--phase prefill-engine` (prefill-heavy, the prefill engine's figure): in a deployment the
prefill and the decode engine are different engines, so this compares the PREFILL ENGINE alone:
prompt tokens/s of the real prefill core over a VllmCompute(PREFILL) (its own vLLM engine, sized
as a prefill engine: cluster.prefill_hbm_tokens), from the tasks' arrival (the scheduler's
lookup that builds them is untimed: another process's work in a deployment) to every handoff
sent, against the same vLLM engine (engine_kwargs of Role.PREFILL) driven directly prefilling
the same prompts (max_tokens=1, each first token's log-prob returned). The handoffs go to the
in-process decode port of tests/engine_harness.py (its real decode core, on the native compute
of the same config, not a second vLLM engine: vLLM 0.32 runs one engine per process on the CPU)
and that core decodes them after the timed window, outside the timed engine, so each round's
turns still end and are checked. Not the decode side in another process: that would add a
third engine process on this 2-core VM, and its decode would run inside the timed window.
`--phase prefill` (prefill-heavy, **a P/D turn on one engine**): each round's requests ask for 2
tokens (the prefill's and one decode step), and the figure is prompt tokens/s from adding them
to every result: the backend's whole oracle path with ONE vLLM engine serving both roles (the
prefill core, the handoff, the decode engine computing the prompt into its vLLM pages, which its
prefix cache serves from the prefill's step, the prompt blocks read back from them and stored
(`--store`), the first decode step, the result), the direct engine's prefill and one decode
step: two vLLM requests per turn against the direct engine's one, which no deployment runs.
`--store`: the backend's block store. `memory` (the default) is the paper's Oracle, all I/O
removed: the oracle path still reads every block it persists back from vLLM's pages, keys it and
stores it before its turn's result names it (the persistence contract), but into memory, not a
block file; `local_dir` writes block files as a deployment's store does (the direct engine writes
nothing either way).
`--threads N`: every process's vLLM computes on N OpenMP threads (OMP_NUM_THREADS; default:
vLLM's own choice, all cores). On a machine other work shares, one thread per process is the
figure to compare: an OpenMP team whose other thread waits for a core stalls every kernel.
`--baseline DIR`: a third process runs the backend from another checkout of the repository at
DIR (its dualpath_ray and tests/engine_harness.py), in the same rounds: before / after a change,
side by side.
Reported: tokens/s of each (median over the rounds) and backend / direct per round (their
median). The machine's load moves all; the ratio of interleaved rounds is the figure
(benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIG = Path(__file__).resolve().parents[1] / "cluster_configs" / "vllm-cpu-1p1d.yaml"
_STATE: dict[str, object] = {}  # per worker process: its engine, built by its first call
# Pages for every sequence of the largest batch at once (the decode core admits only what its
# pages hold; vLLM gets the same number of pages either way).
HBM_TOKENS = 65536
STORE_ENV = "DUALPATH_BENCH_STORE"  # --store, handed to the spawned processes


def bench_config():  # type: ignore[no-untyped-def]
    """The benchmark's config: the backend's store is `--store`'s (the environment's
    DUALPATH_BENCH_STORE, set by main before the processes start)."""
    from dualpath_ray.config import load_config

    return load_config(CONFIG).with_overrides(
        emulation={"enabled": False}, cluster={"hbm_tokens_per_engine": HBM_TOKENS},
        store={"backend": os.environ.get(STORE_ENV, "memory")},
    )


def prompts(batch: int, context: int, round_: int) -> list[list[int]]:
    import numpy as np

    return [[int(t) for t in np.random.default_rng(1000 * round_ + i).integers(0, 512, context)] for i in range(batch)]


def backend_round(batch: int, context: int, steps: int, round_: int) -> float:
    """Decode tokens/s of the decode core over a VllmCompute (oracle mode, in-process ports)."""
    from tests.engine_harness import Request

    # One engine per process: prefill batches and decode steps take turns on it (all prefills
    # of a round end before its decode starts, so no step mixes the two).
    h = _harness()
    requests = [Request(f"r{round_}-{i}", p, "pe", steps + 1) for i, p in enumerate(prompts(batch, context, round_))]
    before, arrived = h.decode.stats.tokens, len(h.collector.results)  # type: ignore[attr-defined]
    h.prefill.accept([h.task(r, oracle=True) for r in requests])  # type: ignore[attr-defined]
    while h.prefill.jobs:  # type: ignore[attr-defined]
        h.prefill.step()  # type: ignore[attr-defined]
    while h.decode.stats.tokens - before < batch:  # type: ignore[attr-defined]  # handoffs taken, every sequence decoding
        # A request that failed (in its prefill, say) never decodes: say so rather than wait for ever.
        _check(h.collector.results[arrived:])  # type: ignore[attr-defined]
        h.decode.step()  # type: ignore[attr-defined]
    first = h.decode.stats.tokens  # type: ignore[attr-defined]
    done_before = len(h.collector.results)  # type: ignore[attr-defined]
    in_vllm, cpu = _in_vllm_s(h), time.process_time()
    start = time.perf_counter()
    while len(h.collector.results) - done_before < batch:  # type: ignore[attr-defined]
        h.decode.step()  # type: ignore[attr-defined]
    elapsed = time.perf_counter() - start
    _check(h.collector.results[done_before:])  # type: ignore[attr-defined]
    tokens = h.decode.stats.tokens - first  # type: ignore[attr-defined]
    return _figures(tokens, elapsed, _in_vllm_s(h) - in_vllm, time.process_time() - cpu)


def _in_vllm_s(h) -> float:  # type: ignore[no-untyped-def]
    """Seconds the harness's vLLM engine spent in its steps so far (NaN for a baseline
    checkout that does not count them)."""
    return float(getattr(h.compute.host, "step_s", float("nan")))


def _figures(tokens: float, elapsed_s: float, in_vllm_s: float, cpu_s: float) -> dict[str, float]:
    """A round's figures: tokens/s; tokens per CPU second of the process (its threads' CPU
    time: what another process's load on the shared cores moves far less than wall time); and
    the share of its time outside vLLM's engine.step() (the backend's own work: cores, compute,
    connector bookkeeping outside the step)."""
    return {"tokens_s": tokens / elapsed_s, "cpu_tokens_s": tokens / cpu_s, "outside_vllm": 1.0 - in_vllm_s / elapsed_s}


def backend_prefill_round(batch: int, context: int, steps: int, round_: int) -> float:
    """Prompt tokens/s of the oracle path over a VllmCompute, from the requests' arrival to
    every result (2 tokens each)."""
    from tests.engine_harness import Request

    h = _harness()
    requests = [Request(f"p{round_}-{i}", p, "pe", 2) for i, p in enumerate(prompts(batch, context, round_))]
    done_before = len(h.collector.results)  # type: ignore[attr-defined]
    in_vllm, cpu = _in_vllm_s(h), time.process_time()
    start = time.perf_counter()
    h.prefill.accept([h.task(r, oracle=True) for r in requests])  # type: ignore[attr-defined]
    # Every prefill batch before the decode core takes the handoffs: the harness's one vLLM
    # engine serves both cores, and a decode request added while a prefill batch waits would
    # join its step (two engines in a deployment never mix them).
    while h.prefill.jobs:  # type: ignore[attr-defined]
        h.prefill.step()  # type: ignore[attr-defined]
    while len(h.collector.results) - done_before < batch:  # type: ignore[attr-defined]
        h.decode.step()  # type: ignore[attr-defined]
    elapsed = time.perf_counter() - start
    _check(h.collector.results[done_before:])  # type: ignore[attr-defined]
    return _figures(batch * context, elapsed, _in_vllm_s(h) - in_vllm, time.process_time() - cpu)


def backend_prefill_engine_round(batch: int, context: int, steps: int, round_: int) -> dict[str, float]:
    """Prompt tokens/s of the prefill engine alone (`--phase prefill-engine`): the prefill core
    over a VllmCompute(PREFILL), from the requests' arrival to every handoff sent; the decode
    side finishes the turns afterwards, untimed."""
    from tests.engine_harness import Request

    h = _prefill_engine_harness()
    requests = [Request(f"e{round_}-{i}", p, "pe", 2) for i, p in enumerate(prompts(batch, context, round_))]
    done_before = len(h.collector.results)  # type: ignore[attr-defined]
    # The scheduler's part (its prefix lookup, the tasks) is another process's in a deployment.
    tasks = [h.task(r, oracle=True) for r in requests]  # type: ignore[attr-defined]
    in_vllm, cpu = _in_vllm_s(h), time.process_time()
    start = time.perf_counter()
    h.prefill.accept(tasks)  # type: ignore[attr-defined]
    while h.prefill.jobs:  # type: ignore[attr-defined]
        h.prefill.step()  # type: ignore[attr-defined]
    elapsed = time.perf_counter() - start
    figures = _figures(batch * context, elapsed, _in_vllm_s(h) - in_vllm, time.process_time() - cpu)
    # The decode engine's part, outside the timed window: every turn ends, and none failed.
    while len(h.collector.results) - done_before < batch:  # type: ignore[attr-defined]
        _check(h.collector.results[done_before:])  # type: ignore[attr-defined]
        h.decode.step()  # type: ignore[attr-defined]
    _check(h.collector.results[done_before:])  # type: ignore[attr-defined]
    return figures


def _check(results) -> None:  # type: ignore[no-untyped-def]
    """A round whose requests failed measures nothing: say why."""
    failed = [result for result in results if result.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} requests failed: {failed[0].error}")


def _harness():  # type: ignore[no-untyped-def]
    """This process's 1P1D harness over one VllmCompute (built by its first call)."""
    import torch

    from dualpath_ray.kv.layout import KVLayout
    from dualpath_ray.protocol.types import Role
    from dualpath_ray.runtime.vllm_engine.compute import VllmCompute
    from tests.engine_harness import EngineHarness

    if "harness" not in _STATE:
        cfg = bench_config()
        layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
        compute = VllmCompute(cfg, layout, torch.device("cpu"), Role.DECODE)
        # One engine serves both cores, so it keeps both cores' KV in its pages: the prefill
        # core's batches too (PrefillKV: a vLLM prefill batch names where its KV lies and goes).
        compute.prefill_kv = compute
        _STATE["harness"] = EngineHarness(cfg, Path(tempfile.mkdtemp(prefix="dualpath-vllm-bench-")), compute=compute)
    return _STATE["harness"]


def _prefill_engine_harness():  # type: ignore[no-untyped-def]
    """This process's 1P1D harness whose prefill engine is a VllmCompute(PREFILL) of its own and
    whose decode engine computes natively (built by its first call; see the module doc)."""
    import torch

    from dualpath_ray.kv.layout import KVLayout
    from dualpath_ray.protocol.types import Role
    from dualpath_ray.runtime.engine.compute_choice import make_compute
    from dualpath_ray.runtime.vllm_engine.compute import VllmCompute
    from tests.engine_harness import EngineHarness

    if "prefill_harness" not in _STATE:
        cfg = bench_config()
        layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
        compute = VllmCompute(cfg, layout, torch.device("cpu"), Role.PREFILL)
        native = cfg.with_overrides(engine={"backend": "native"}, emulation={"compute": "model"})
        decode = make_compute(native, layout, torch.device("cpu"))
        root = Path(tempfile.mkdtemp(prefix="dualpath-vllm-bench-"))
        _STATE["prefill_harness"] = EngineHarness(cfg, root, compute=compute, decode_compute=decode)
    return _STATE["prefill_harness"]


def _engine(role_name: str = "decode"):  # type: ignore[no-untyped-def]
    """This process's plain vLLM engine of a role (`decode`: the backend's decode engine;
    `prefill`: its prefill engine), built from the same arguments, without the connector."""
    from dualpath_ray.protocol.types import Role
    from dualpath_ray.runtime.vllm_engine.host import configure_vllm_env, engine_kwargs

    name = f"engine:{role_name}"
    if name not in _STATE:
        configure_vllm_env()
        from vllm import EngineArgs, LLMEngine

        role = Role.PREFILL if role_name == "prefill" else Role.DECODE
        _STATE[name] = LLMEngine.from_engine_args(EngineArgs(**engine_kwargs(bench_config(), role)))
    return _STATE[name]


def direct_prefill_engine_round(batch: int, context: int, steps: int, round_: int) -> dict[str, float]:
    """Prompt tokens/s of a plain vLLM prefill engine prefilling the same prompts (1 token each)."""
    return _direct_prompts_round(_engine("prefill"), f"e{round_}", 1, batch, context, round_)


def direct_prefill_round(batch: int, context: int, steps: int, round_: int) -> float:
    """Prompt tokens/s of a plain vLLM engine on the same prompts, 2 tokens each."""
    return _direct_prompts_round(_engine(), f"p{round_}", 2, batch, context, round_)


def _direct_prompts_round(engine, prefix: str, max_tokens: int, batch: int, context: int, round_: int):  # type: ignore[no-untyped-def]
    """Prompt tokens/s of `engine` driven directly: the round's prompts, `max_tokens` greedy tokens each."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    cpu, start = time.process_time(), time.perf_counter()
    for i, p in enumerate(prompts(batch, context, round_)):
        engine.add_request(f"{prefix}-{i}", TokensPrompt(prompt_token_ids=p),
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=0))
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - start
    return _figures(batch * context, elapsed, elapsed, time.process_time() - cpu)


def direct_round(batch: int, context: int, steps: int, round_: int) -> float:
    """Decode tokens/s of a plain vLLM engine on the same prompts."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = _engine()
    for i, p in enumerate(prompts(batch, context, round_)):
        engine.add_request(f"r{round_}-{i}", TokensPrompt(prompt_token_ids=p),  # type: ignore[attr-defined]
                           SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True, detokenize=False,
                                          logprobs=0))
    produced = 0
    while produced < batch:  # every request's first token (prefill), untimed
        produced += sum(1 for out in engine.step() if len(out.outputs[0].token_ids) == 1)  # type: ignore[attr-defined]
    cpu, start = time.process_time(), time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():  # type: ignore[attr-defined]
        tokens += len(engine.step())  # type: ignore[attr-defined]
    elapsed = time.perf_counter() - start
    return _figures(tokens, elapsed, elapsed, time.process_time() - cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--phase", choices=("decode", "prefill", "prefill-engine"), default="decode",
                        help="decode-heavy; prefill-heavy as a P/D turn on one engine; the prefill engine alone")
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout's backend, measured alongside")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--store", choices=("memory", "local_dir"), default="memory",
                        help="the backend's block store: memory (the paper's Oracle: no I/O) or local_dir (block files)")
    parser.add_argument("--threads", type=int, default=None,
                        help="OpenMP threads of every process's vLLM (OMP_NUM_THREADS); default: vLLM's own choice")
    args = parser.parse_args()
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads {args.threads}: give 1 or more OpenMP threads per process")
        # Inherited by the spawned processes before they import torch, which reads it once.
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if args.phase == "prefill-engine" and args.baseline is not None:
        parser.error("--phase prefill-engine --baseline: a checkout before the phase existed has no harness with a "
                     "decode engine of its own (tests/engine_harness.py decode_compute); leave --baseline out")
    os.environ[STORE_ENV] = args.store
    spawn = multiprocessing.get_context("spawn")
    rounds = {"decode": (backend_round, direct_round), "prefill": (backend_prefill_round, direct_prefill_round),
              "prefill-engine": (backend_prefill_engine_round, direct_prefill_engine_round)}
    backend_fn, direct_fn = rounds[args.phase]
    pools = {"backend": ProcessPoolExecutor(1, mp_context=spawn), "direct": ProcessPoolExecutor(1, mp_context=spawn)}
    if args.baseline is not None:
        pools["baseline"] = ProcessPoolExecutor(1, mp_context=spawn, initializer=_use_checkout, initargs=(str(args.baseline),))
    load_before = _loadavg()
    figures: dict[str, list[float]] = {name: [] for name in pools}
    cpu: dict[str, list[float]] = {name: [] for name in pools}
    outside: dict[str, list[float]] = {name: [] for name in pools if name != "direct"}
    try:
        for round_ in range(args.repeats + 1):  # round 0 builds the engines and warms them, untimed
            for name, pool in pools.items():
                fn = direct_fn if name == "direct" else backend_fn
                got = pool.submit(fn, args.batch, args.context, args.steps, round_).result()
                if round_:
                    figures[name].append(got["tokens_s"])
                    cpu[name].append(got["cpu_tokens_s"])
                    if name in outside and not math.isnan(got["outside_vllm"]):
                        outside[name].append(got["outside_vllm"])
    finally:
        for pool in pools.values():
            pool.shutdown()
    result: dict[str, object] = {
        "phase": args.phase, "store": args.store, "threads": args.threads, "batch": args.batch, "context": args.context, "steps": args.steps, "rounds": figures,
        "cpu_rounds": cpu,
        # The machine's 1/5/15-minute load averages as the run began and ended (other work on it).
        "loadavg": {"before": load_before, "after": _loadavg()},
        **{f"{name}_tokens_s": statistics.median(values) for name, values in figures.items()},
        # The share of a backend round's time outside vLLM's steps: its own overhead, measured
        # inside one process and so far less moved by the machine's load than the ratio.
        **{f"{name}_outside_vllm": statistics.median(values) for name, values in outside.items() if values},
    }
    for name in [n for n in figures if n != "direct"]:
        ratios = [b / d for b, d in zip(figures[name], figures["direct"])]
        result[f"{name}_ratio_per_round"] = ratios
        result[f"{name}_over_direct"] = statistics.median(ratios)
        cpu_ratios = [b / d for b, d in zip(cpu[name], cpu["direct"])]
        result[f"{name}_cpu_ratio_per_round"] = cpu_ratios
        result[f"{name}_over_direct_cpu"] = statistics.median(cpu_ratios)
    if args.baseline is not None:
        result["baseline"] = str(args.baseline)
    if args.json:
        print(json.dumps(result))
        return
    unit = {"decode": "decode tokens/s", "prefill": "prompt tokens/s of a P/D turn on one engine",
            "prefill-engine": "prompt tokens/s of the prefill engine"}[args.phase]
    print(f"{unit}, batch {args.batch}, context {args.context}, {args.steps} steps, median of {args.repeats}:")
    for name in figures:
        print(f"  {name}: {result[f'{name}_tokens_s']:.1f}")
    for name in [n for n in figures if n != "direct"]:
        ratios = result[f"{name}_ratio_per_round"]
        print(f"  {name} / direct: {result[f'{name}_over_direct']:.3f} (per round: {', '.join(f'{r:.3f}' for r in ratios)})")  # type: ignore[union-attr]
        cpu_ratios = result[f"{name}_cpu_ratio_per_round"]
        print(f"  {name} / direct per CPU second: {result[f'{name}_over_direct_cpu']:.3f} "
              f"(per round: {', '.join(f'{r:.3f}' for r in cpu_ratios)})")  # type: ignore[union-attr]
        if f"{name}_outside_vllm" in result:
            print(f"  {name}: {result[f'{name}_outside_vllm']:.3f} of its time outside vLLM's steps")


def _loadavg() -> list[float]:
    """The 1, 5 and 15-minute load averages (/proc/loadavg; empty where there is none)."""
    try:
        return [float(field) for field in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def _use_checkout(root: str) -> None:
    """A baseline process imports dualpath_ray and tests from another checkout."""
    sys.path.insert(0, root)


if __name__ == "__main__":
    main()
