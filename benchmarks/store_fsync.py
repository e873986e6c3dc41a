"""What `store.fsync` costs: puts of Full Blocks into a LocalDirStore with fsync off and on.

Each repetition puts the same `--blocks` Full Blocks (random bytes, new keys every time, so
every put writes and publishes a file) once into a store with fsync=False and once into one with
fsync=True, in alternating order, into fresh directories of the same file system (`--root`,
default a temporary directory: say which file system it is when you quote a figure; fsync on
tmpfs costs nothing). A put with fsync flushes the block file before its publishing rename and
its directory after it (kv/local_store.py). Reports, per mode, the median over repetitions of
the median put latency and of the put throughput (MB/s of payload), and the median of the
per-repetition latency ratio on/off; the file system and the machine are printed with them.
Run: .venv/bin/python benchmarks/store_fsync.py [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from dualpath_ray.kv.index import block_keys, namespace_for
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.store import LocalDirStore

MODES = (("fsync_off", False), ("fsync_on", True))


@dataclass(frozen=True)
class ModeResult:
    name: str
    median_put_ms: float
    p90_put_ms: float
    median_mb_per_s: float


@dataclass(frozen=True)
class FsyncBenchResult:
    blocks: int
    block_bytes: int
    repetitions: int
    file_system: str
    machine: str
    modes: list[ModeResult]
    latency_ratio_on_off: float


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=64, help="Full Blocks put per mode and repetition (default 64)")
    parser.add_argument("--n-layer", type=int, default=16, help="layers per Full Block (default 16)")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per block (default 64)")
    parser.add_argument("--n-kv-head", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repetitions", type=int, default=7, help="timed rounds per mode (default 7)")
    parser.add_argument("--root", type=Path, default=None, help="parent of the store directories (default: temp)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.repetitions < 1:
        parser.error("--blocks and --repetitions must be >= 1")
    return args


def file_system_of(path: Path) -> str:
    """`df -T`'s type of the file system holding `path` (ext4, xfs, tmpfs, nfs4, ...)."""
    try:
        out = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True, check=True).stdout
        return out.splitlines()[1].split()[1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def time_puts(root: Path, layout: KVLayout, fsync: bool, blocks: torch.Tensor, keys: list[str]) -> list[float]:
    """Seconds of each put of `blocks` under `keys` into a fresh store at `root` (then removed)."""
    store = LocalDirStore(root, layout, fsync=fsync)
    seconds = []
    try:
        for parent, key, block in zip([None, *keys], keys, blocks):
            started = time.perf_counter()
            if not store.put(key, block, parent=parent):
                raise RuntimeError(f"put of fresh key {key} did not write: the timing would be of nothing")
            seconds.append(time.perf_counter() - started)
    finally:
        store.close()
        shutil.rmtree(root)
    return seconds


def run(args: argparse.Namespace) -> FsyncBenchResult:
    layout = KVLayout(args.n_layer, args.block_size, args.n_kv_head, args.head_dim, args.dtype)
    blocks = torch.randint(0, 256, (args.blocks, *layout.full_block_shape), dtype=torch.uint8)
    parent_dir = Path(tempfile.mkdtemp(prefix="dualpath-fsync-bench-", dir=args.root))
    latencies: dict[str, list[float]] = {name: [] for name, _ in MODES}
    throughputs: dict[str, list[float]] = {name: [] for name, _ in MODES}
    p90s: dict[str, list[float]] = {name: [] for name, _ in MODES}
    ratios = []
    try:
        for rep in range(args.repetitions):
            order = MODES if rep % 2 == 0 else MODES[::-1]
            medians = {}
            for name, fsync in order:
                tokens = np.arange(args.blocks * layout.block_size) + rep * 1_000_000
                keys = block_keys(tokens, layout.block_size, namespace_for(f"bench-{name}", rep, layout=layout))
                seconds = time_puts(parent_dir / f"{name}-{rep}", layout, fsync, blocks, keys)
                medians[name] = statistics.median(seconds)
                latencies[name].append(medians[name])
                p90s[name].append(sorted(seconds)[int(0.9 * (len(seconds) - 1))])
                throughputs[name].append(args.blocks * layout.full_block_bytes / sum(seconds) / 1e6)
            ratios.append(medians["fsync_on"] / medians["fsync_off"])
        file_system = file_system_of(parent_dir)
    finally:
        shutil.rmtree(parent_dir, ignore_errors=True)
    modes = [
        ModeResult(
            name,
            statistics.median(latencies[name]) * 1e3,
            statistics.median(p90s[name]) * 1e3,
            statistics.median(throughputs[name]),
        )
        for name, _ in MODES
    ]
    machine = f"{cpu_model()}, {os.cpu_count()} cores, {platform.platform()}"
    return FsyncBenchResult(
        args.blocks, layout.full_block_bytes, args.repetitions, file_system, machine, modes, statistics.median(ratios)
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(asdict(result), indent=2))
        return
    print(f"{result.blocks} Full Blocks of {result.block_bytes / 2**20:.2f} MiB per mode, "
          f"{result.repetitions} repetitions, file system {result.file_system}; {result.machine}")
    print(f"{'mode':<10} {'median put ms':>14} {'p90 put ms':>11} {'MB/s':>8}")
    for mode in result.modes:
        print(f"{mode.name:<10} {mode.median_put_ms:>14.2f} {mode.p90_put_ms:>11.2f} {mode.median_mb_per_s:>8.0f}")
    print(f"median per-repetition latency ratio fsync on / off: {result.latency_ratio_on_off:.2f}x")


if __name__ == "__main__":
    main()
