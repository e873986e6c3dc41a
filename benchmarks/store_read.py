"""Store read overhead: Full Blocks through LocalDirStore (checksums verified) vs plain reads.

Writes N Full Blocks into a LocalDirStore, then times, in the same process and page-cache state
(every file read once before timing, methods interleaved in rotating order each repetition):
- plain_readv: os.open + one os.readv of the whole file into one big buffer + os.close, per
  file, in order (the fastest plain sequential read Python offers; no parsing, no checksum);
- plain_readinto: the same with open(path, "rb", buffering=0).readinto (the everyday way);
- get_many_into: LocalDirStore.get_many_into of all N blocks into BufferPool slots: the caller
  and the store's helper thread each read and verify whole blocks, so one hashes block i while
  the other reads block i+1; every payload verified;
- get_many_serial: the same call on a store with read_threads=0 (every block read and verified
  on the calling thread), to show what the helper buys;
- get_into: LocalDirStore.get_into per block (single-block path, sequential; for reference);
- no_payload_hash (diagnostic, not a store API): reads and header checks without the payload
  checksum, to split the store's cost into its format/Python overhead and the checksum itself;
- plain_readv_x2 (reference): plain_readv split over two threads, what two unverified readers
  give on this machine.
Reports median GB/s of payload bytes per method and the median of the per-repetition ratios
to each plain baseline. Goal: get_many_into / plain >= 0.9. `--busy K` runs K busy-looping
processes while timing, to show what is left when the second core is taken.
Run: .venv/bin/python benchmarks/store_read.py
`--cold` (as root, fio installed) times cold reads against fio instead: benchmarks/store_cold.py.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from dualpath_ray.kv.index import block_keys, namespace_for
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.pool import BufferPool
from dualpath_ray.kv.store import LocalDirStore


@dataclass(frozen=True)
class MethodResult:
    name: str
    median_gbps: float
    min_gbps: float
    max_gbps: float
    ratio_to_readv: float
    ratio_to_readinto: float


@dataclass(frozen=True)
class BenchResult:
    blocks: int
    block_bytes: int
    total_mib: float
    repetitions: int
    busy_processes: int
    load_average: tuple[float, float]
    idle_cores_while_timing: float | None
    methods: list[MethodResult]
    checksum_only_gbps: float
    machine: str


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=128, help="Full Blocks to read (default 128)")
    parser.add_argument("--n-layer", type=int, default=16, help="layers per Full Block (default 16)")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per block (default 64)")
    parser.add_argument("--n-kv-head", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repetitions", type=int, default=15, help="timed rounds per method")
    parser.add_argument("--busy", type=int, default=0, help="busy-looping processes while timing (default 0)")
    parser.add_argument("--root", type=Path, default=None, help="store directory (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    cold = parser.add_argument_group("cold reads and persists against fio (benchmarks/store_cold.py)")
    cold.add_argument("--cold", action="store_true", help="drop the page cache before every run; compare with fio")
    cold.add_argument("--queue-depth", type=int, default=8, help="blocks read at once, store and fio (default 8)")
    cold.add_argument("--request-blocks", type=int, default=64, help="blocks per reader request (default 64)")
    cold.add_argument("--busy-nice", type=int, default=0, help="nice -n 15 spinners while timing (default 0)")
    cold.add_argument("--drop-level", type=int, default=3, choices=[1, 3],
                      help="what each drop empties: 3 (default) the page cache and the dentry and inode caches, "
                      "1 the page cache only")
    cold.add_argument("--persist", action="store_true", help="with --cold: time puts against fio's write")
    cold.add_argument("--page-cache-gib", type=float, default=0.0, help="with --cold: persist this much, "
                      "report the page cache's growth and the cold read rate before and after")
    cold.add_argument("--scratch", type=Path, default=Path("/var/tmp/dualpath-store-cold"),
                      help="directory on the disk under test (default /var/tmp/dualpath-store-cold)")
    return parser.parse_args(argv)


def fill_store(store: LocalDirStore, n_blocks: int) -> tuple[list[str], torch.Tensor]:
    layout = store.layout
    source = torch.randint(0, 256, (n_blocks, *layout.full_block_shape), dtype=torch.uint8)
    keys = block_keys(np.arange(n_blocks * layout.block_size), layout.block_size, namespace_for("bench", 0))
    for parent, key, block in zip([None, *keys], keys, source):
        store.put(key, block, parent=parent)
    return keys, source


def file_slices(n_files: int, file_bytes: int) -> list[memoryview]:
    """Consecutive slices of one zeroed buffer (touched once, so no page faults while timed)."""
    buffer = np.zeros(n_files * file_bytes, dtype=np.uint8)
    view = memoryview(buffer)
    return [view[i * file_bytes : (i + 1) * file_bytes] for i in range(n_files)]


def plain_readv(paths: list[str], file_bytes: int) -> Callable[[], None]:
    slices = file_slices(len(paths), file_bytes)

    def read_all() -> None:
        for path, target in zip(paths, slices):
            fd = os.open(path, os.O_RDONLY)
            try:
                if os.readv(fd, [target]) != file_bytes:
                    raise RuntimeError(f"short read of {path}")
            finally:
                os.close(fd)

    return read_all


def plain_readv_x2(paths: list[str], file_bytes: int) -> Callable[[], None]:
    """plain_readv over even files on a second thread while this thread reads the odd ones."""
    even = plain_readv(paths[0::2], file_bytes)
    odd = plain_readv(paths[1::2], file_bytes)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-plain")

    def read_all() -> None:
        other = pool.submit(even)
        odd()
        other.result()

    return read_all


def plain_readinto(paths: list[str], file_bytes: int) -> Callable[[], None]:
    slices = file_slices(len(paths), file_bytes)

    def read_all() -> None:
        for path, target in zip(paths, slices):
            with open(path, "rb", buffering=0) as file:
                if file.readinto(target) != file_bytes:
                    raise RuntimeError(f"short read of {path}")

    return read_all


def cpu_ticks() -> tuple[int, int] | None:
    """(idle, total) jiffies of all CPUs from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except OSError:
        return None
    return fields[3] + fields[4], sum(fields)


def idle_cores(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """CPUs left idle between two cpu_ticks samples (this process's own work included)."""
    if before is None or after is None or after[1] == before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * (os.cpu_count() or 1)


def busy_loop() -> None:
    while True:
        pass


def start_busy(count: int) -> list[multiprocessing.Process]:
    """`count` processes spinning on a core each: the competition a shared machine brings."""
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=busy_loop, daemon=True) for _ in range(count)]
    for worker in workers:
        worker.start()
    return workers


def stop_busy(workers: list[multiprocessing.Process]) -> None:
    for worker in workers:
        worker.terminate()
    for worker in workers:
        worker.join()


def time_interleaved(methods: dict[str, Callable[[], None]], repetitions: int) -> dict[str, list[float]]:
    """Seconds per call of each method, the methods run in a rotating order every repetition."""
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for rep in range(repetitions):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            start = time.perf_counter()
            methods[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def store_methods(store: LocalDirStore, serial: LocalDirStore, keys: list[str], outs: list[torch.Tensor]) -> dict[str, Callable[[], None]]:
    def get_many_into() -> None:
        store.get_many_into(keys, outs)

    def get_many_serial() -> None:
        serial.get_many_into(keys, outs)

    def get_into() -> None:
        for key, out in zip(keys, outs):
            store.get_into(key, out)

    def no_payload_hash() -> None:
        for key, out in zip(keys, outs):
            store._read_unverified(key, out)

    return {
        "get_many_into": get_many_into,
        "get_many_serial": get_many_serial,
        "get_into": get_into,
        "no_payload_hash": no_payload_hash,
    }


def summarise(seconds: dict[str, list[float]], payload: int) -> list[MethodResult]:
    return [
        MethodResult(
            name=name,
            median_gbps=payload / statistics.median(times) / 1e9,
            min_gbps=payload / max(times) / 1e9,
            max_gbps=payload / min(times) / 1e9,
            ratio_to_readv=statistics.median(p / t for p, t in zip(seconds["plain_readv"], times)),
            ratio_to_readinto=statistics.median(p / t for p, t in zip(seconds["plain_readinto"], times)),
        )
        for name, times in seconds.items()
    ]


def run(args: argparse.Namespace) -> BenchResult:
    layout = KVLayout(args.n_layer, args.block_size, args.n_kv_head, args.head_dim, args.dtype)
    with tempfile.TemporaryDirectory(prefix="dualpath-store-bench-") as scratch:
        root = args.root or Path(scratch)
        store = LocalDirStore(root, layout, io="buffered")  # warm: reads from the page cache
        serial = LocalDirStore(root, layout, read_threads=0, io="buffered")
        keys, source = fill_store(store, args.blocks)
        paths = [str(store.path_of(key)) for key in keys]
        file_bytes = os.path.getsize(paths[0])
        pool = BufferPool(args.blocks, layout, pin=False)
        pool.buffer.fill_(0)
        extent = pool.lease("bench", args.blocks)
        assert extent is not None
        outs = pool.full_blocks(extent)
        methods: dict[str, Callable[[], None]] = {
            "plain_readv": plain_readv(paths, file_bytes),
            "plain_readinto": plain_readinto(paths, file_bytes),
            **store_methods(store, serial, keys, outs),
            "plain_readv_x2": plain_readv_x2(paths, file_bytes),
        }
        for method in methods.values():
            method()
        busy = start_busy(args.busy)
        load_before = os.getloadavg()[0]
        ticks_before = cpu_ticks()
        try:
            seconds = time_interleaved(methods, args.repetitions)
        finally:
            ticks_after = cpu_ticks()
            stop_busy(busy)
            store.close()
        load_after = os.getloadavg()[0]
        pool.buffer.fill_(0)
        store.get_many_into(keys, outs)
        if not torch.equal(pool.buffer[list(extent.slots)], source):
            raise RuntimeError("store reads did not deliver the bytes that were written")
        checksum_gbps = checksum_only(outs)
    payload = args.blocks * layout.full_block_bytes
    return BenchResult(
        blocks=args.blocks,
        block_bytes=layout.full_block_bytes,
        total_mib=payload / 2**20,
        repetitions=args.repetitions,
        busy_processes=args.busy,
        load_average=(load_before, load_after),
        idle_cores_while_timing=idle_cores(ticks_before, ticks_after),
        methods=summarise(seconds, payload),
        checksum_only_gbps=checksum_gbps,
        machine=f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"xxhash {xxhash.VERSION}",
    )


def checksum_only(outs: list[torch.Tensor]) -> float:
    """xxh3_64 throughput over the pool's payloads: the verification cost by itself."""
    views = [memoryview(o.numpy()).cast("B") for o in outs]
    start = time.perf_counter()
    for view in views:
        xxhash.xxh3_64_intdigest(view)
    return sum(len(v) for v in views) / (time.perf_counter() - start) / 1e9


def print_table(result: BenchResult) -> None:
    print(
        f"{result.blocks} Full Blocks x {result.block_bytes / 2**20:.2f} MiB = {result.total_mib:.0f} MiB, "
        f"{result.repetitions} interleaved repetitions, page cache warm ({result.machine})"
    )
    idle = "n/a" if result.idle_cores_while_timing is None else f"{result.idle_cores_while_timing:.2f}"
    print(
        f"busy-looping processes while timing: {result.busy_processes}; 1-minute load average "
        f"{result.load_average[0]:.1f} before, {result.load_average[1]:.1f} after; "
        f"idle cores while timing: {idle} of {os.cpu_count()}"
    )
    print(f"{'method':<17}{'median GB/s':>12}{'min':>8}{'max':>8}{'/ readv':>10}{'/ readinto':>12}")
    for m in result.methods:
        print(
            f"{m.name:<17}{m.median_gbps:>12.2f}{m.min_gbps:>8.2f}{m.max_gbps:>8.2f}"
            f"{m.ratio_to_readv:>10.3f}{m.ratio_to_readinto:>12.3f}"
        )
    print(f"checksum only (xxh3_64 over the payloads): {result.checksum_only_gbps:.1f} GB/s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cold:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import store_cold

        args.root = args.root or args.scratch
        return store_cold.main(args)
    if args.blocks < 2 or args.repetitions < 1 or args.busy < 0:
        print("--blocks must be >= 2, --repetitions >= 1 and --busy >= 0", file=sys.stderr)
        return 2
    result = run(args)
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
