"""What the simulator benchmarks share: paper-scale configs, workloads, running, JSON and PNG.

Workload: the paper's coding trace is not public, so every experiment generates agents with
dualpath_ray/workload/synth.py at its defaults (the digest's statistics: log-normal turns around
157 per trajectory, 429 appended tokens per turn with a heavy tail, generation around 256 tokens
per turn), each trajectory cut at the experiment's MaxLen; the seed is fixed (0) so every run of a
script simulates the same agents.

Compute quota: prefill batches are packed with the quota bounding the whole forward's predicted
time (the config's sim.quota_scope, "forward" by default, as in `dualpath sim`): with the runtime's per-layer reading, a 61-layer model's
batches could run 61 x 300 ms, which no TTFT SLO of seconds survives (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from dualpath_ray.config import DualPathConfig
from dualpath_ray.sim.profiles import sim_config
from dualpath_ray.sim.results import SimResult
from dualpath_ray.sim.settings import SimOptions
from dualpath_ray.sim.simulator import simulate
from dualpath_ray.sim.workload import Workload, from_synth
from dualpath_ray.workload.synth import SynthParams

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "cluster_configs" / "profiles"
HARDWARE = PROFILES / "hardware" / "h100-sxm-8gpu.yaml"
LARGE_MLA = PROFILES / "models" / "deepseek-v3.2-660b.yaml"
SMALL_MLA = PROFILES / "models" / "deepseek-v2-lite-mla.yaml"
OUT = ROOT / "benchmarks" / "sim" / "results"
OPTIONS = SimOptions()  # quota_scope from the config: sim.quota_scope, forward
MODES = ("basic", "dualpath", "oracle")


def cluster(prefill: int, decode: int, model: Path = LARGE_MLA, max_context: int = 140000, **scheduler: Any) -> DualPathConfig:
    """P prefill and D decode nodes of the H100-class node, `model`'s profile."""
    return sim_config({
        "model": {"max_context": max_context},
        "cluster": {"prefill_nodes": prefill, "decode_nodes": decode, "prefill_hbm_tokens": 262144},
        "scheduler": dict(scheduler),
        "sim": {"hardware_profile": str(HARDWARE), "model_profile": str(model)},
    })


def agents(count: int, max_len: int, **params: Any) -> Workload:
    return from_synth(SynthParams(agents=count, max_len=max_len, seed=0, **params))


def run(cfg: DualPathConfig, workload: Workload, mode: str, options: SimOptions = OPTIONS) -> SimResult:
    result = simulate(cfg, workload, mode, options)
    print(f"  {result.headline()} [{result.wall_s:.0f} s wall]", flush=True)
    return result


def brief(result: SimResult) -> dict[str, Any]:
    """The figures an experiment keeps of one run."""
    return {
        "jct_s": result.jct_s, "turns": result.turns, "ttft_s": result.ttft_s, "tpot_s": result.tpot_s,
        "hit_rate": result.hit_rate, "requests_by_path": result.requests_by_path, "snic_balance": result.snic_balance,
        "attention_balance": result.attention_balance, "snic_read_bytes": result.snic_read_bytes,
        "scheduler_cpu_per_sim_s": result.scheduler_cpu_per_sim_s, "wall_s": result.wall_s,
        "alpha_tokens": result.alpha_tokens, "beta_tokens": result.beta_tokens,
    }


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smaller grid that runs in a few minutes")
    p.add_argument("--out", type=Path, default=OUT, help="folder for the JSON and PNG")
    return p


def save(out: Path, name: str, data: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    data = {"generated": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            **data}
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def figure(out: Path, name: str):  # noqa: ANN201 - a matplotlib figure
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    return plt, out / f"{name}.png"


def with_options(**changes: Any) -> SimOptions:
    return replace(OPTIONS, **changes)


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def wait_for_quiet(max_wait_s: float = 1800.0, poll_s: float = 30.0) -> dict[str, Any]:
    """Before a wall-time measurement on a shared machine: wait (polling every 30 s, at most 30
    min) until no Ray cluster runs here and the 1-minute load average is below 1.0. Returns what
    was seen, so the result records the conditions it was measured under."""
    import subprocess

    started = time.monotonic()
    while True:
        ray_running = subprocess.run(["pgrep", "-f", "raylet"], capture_output=True).returncode == 0
        load = load_average()
        waited = time.monotonic() - started
        if (not ray_running and load < 1.0) or waited >= max_wait_s:
            return {"load_1min": load, "ray_running": ray_running, "waited_s": round(waited), "quiet": not ray_running and load < 1.0}
        print(f"waiting for a quiet machine (load {load:.2f}, raylet running: {ray_running})", flush=True)
        time.sleep(poll_s)


def bisect_rate(serve_at: Callable[[float], dict[str, Any]], low: float, high: float, steps: int,
                trials: list[dict[str, Any]]) -> float:
    """`steps` bisections between a rate meeting the SLO (`low`) and one over it (`high`): the
    highest rate found to meet it. Each trial (`serve_at(rate)`, a dict with "ok") is appended."""
    for _ in range(steps):
        middle = (low + high) / 2
        trial = serve_at(middle)
        trials.append(trial)
        low, high = (middle, high) if trial["ok"] else (low, middle)
    return low
