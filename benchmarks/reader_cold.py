"""The readers end to end through `dualpath bench`, against fio on the same disk, interleaved.

`benchmarks/store_read.py --cold` measures the store and the reader's core without Ray; this runs
the whole system as a user would (`dualpath bench` on a fresh embedded cluster, a store on disk,
cluster_configs/bench-cold-reader.yaml: 2 MiB Full Blocks, NICs not emulated, engine time from the
latency model), so a turn's load is limited by the reader actor: lease, O_DIRECT reads
`store.read_queue_depth` deep, xxh3 verification, staging into buffer slots, SNIC counters.

Each round: drop the page cache and time fio (O_DIRECT, libaio, 1 job x the store's read depth,
one I/O per block file) over a scratch store of the same block files; then one `dualpath bench`
round of basic and dualpath. A reader's rate is `store_read_gbps` in the bench's report: the hit
bytes it read over the seconds it had a read in flight (NodeCounters.store_read_s). Basic mode's
prefill-node reader (p0) is the one-reader-one-disk figure the acceptance compares with fio at
the same depth; in dualpath mode both nodes' readers share this one disk (on a cluster each node
has its own), so their rates are reported, not compared. Medians over rounds of GB/s and of each
round's ratio. Run as root (the page-cache drop):

    sudo .venv/bin/python benchmarks/reader_cold.py --rounds 3 --out benchmarks/results/reader_cold_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from store_cold import cold_run_refusal, drop_caches, fill, fio_rate, fio_read_command

from dualpath_ray.config import load_config
from dualpath_ray.kv.block_format import HEADER_SIZE
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.local_store import default_read_threads
from dualpath_ray.kv.pool import BufferPool
from dualpath_ray.kv.store import LocalDirStore

ROOT = Path(__file__).resolve().parent.parent


def bench_round(args: argparse.Namespace, out: Path) -> dict[str, dict[str, float | None]]:
    """One `dualpath bench` round of basic and dualpath; each mode's per-node reader rates."""
    command = [
        sys.executable, "-m", "dualpath_ray.cli", "bench", "--config", str(args.config), "--modes", "basic,dualpath",
        "--agents", str(args.agents), "--turns", str(args.turns), "--first", str(args.first), "--out", str(out),
    ]
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    subprocess.run(command, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    return {mode: dict(summary["store_read_gbps"]) for mode, summary in report["modes"].items()}


def main(args: argparse.Namespace) -> int:
    refusal = cold_run_refusal("reader_cold.py")
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    cfg = load_config(args.config)
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    # The depth the bench's store reads at (direct I/O here): the caller plus its helper threads.
    depth = cfg.store.read_queue_depth or default_read_threads(True, layout.full_block_bytes) + 1
    scratch = args.scratch / f"reader-cold-{layout.full_block_bytes}"
    shutil.rmtree(scratch, ignore_errors=True)
    store = LocalDirStore(scratch, layout, io="direct")
    fill(store, args.fio_blocks, BufferPool(1, layout, pin=False))
    store.close()
    file_bytes = HEADER_SIZE + layout.full_block_bytes
    fio = fio_read_command(scratch, file_bytes, depth)
    rounds: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="reader-cold-") as tmp:
        for index in range(args.rounds):
            drop_caches()
            fio_gbps = fio_rate(fio, "read") * layout.full_block_bytes / file_bytes / 1e9
            readers = bench_round(args, Path(tmp) / f"bench-{index}.json")
            p0 = readers["basic"]["p0"]
            rounds.append({
                "round": index + 1, "fio_gbps": fio_gbps, "readers_gbps": readers,
                "basic_p0_over_fio": p0 / fio_gbps if p0 is not None else None,
            })
            print(f"round {index + 1}: fio {fio_gbps:.2f} GB/s, readers {readers}", file=sys.stderr)
    ratios = [r["basic_p0_over_fio"] for r in rounds if r["basic_p0_over_fio"] is not None]
    result = {
        "config": str(args.config), "block_bytes": layout.full_block_bytes, "queue_depth": depth,
        "workload": f"dualpath bench --agents {args.agents} --turns {args.turns} --first {args.first} --modes basic,dualpath",
        "fio_command": " ".join(fio[:2] + [f"--opendir={scratch}"] + fio[3:]),
        "median_fio_gbps": statistics.median(float(r["fio_gbps"]) for r in rounds),  # type: ignore[arg-type]
        "median_basic_p0_gbps": statistics.median(
            r["readers_gbps"]["basic"]["p0"] for r in rounds if r["readers_gbps"]["basic"]["p0"] is not None  # type: ignore[index]
        ),
        "median_basic_p0_over_fio": statistics.median(ratios) if ratios else None,
        "rounds": rounds, "cpus": os.cpu_count(), "loadavg_after": os.getloadavg(),
    }
    shutil.rmtree(scratch, ignore_errors=True)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "cluster_configs/bench-cold-reader.yaml")
    parser.add_argument("--rounds", type=int, default=3, help="fio + bench rounds, interleaved (default 3)")
    parser.add_argument("--agents", type=int, default=8, help="bench trajectories (default 8)")
    parser.add_argument("--turns", type=int, default=3, help="bench turns each, the first untimed (default 3)")
    parser.add_argument("--first", type=int, default=2048, help="bench first prompt tokens (default 2048)")
    parser.add_argument("--fio-blocks", type=int, default=512, help="block files fio reads (default 512)")
    parser.add_argument("--scratch", type=Path, default=Path("/var/tmp/dualpath-store-cold"),
                        help="directory on the disk under test (default /var/tmp/dualpath-store-cold)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main(parse_args()))
