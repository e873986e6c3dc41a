"""Cold store reads and persists against fio on the same disk (`store_read.py --cold`).

What a reader meets in production: blocks another node wrote minutes ago, not in this node's page
cache. Every timed run starts with the page cache dropped (`sync; echo 3 >
/proc/sys/vm/drop_caches`, so run as root), and the methods run interleaved, in rotating order,
`--repetitions` times; medians of GB/s of payload bytes and of the per-repetition ratios to fio.
- fio: O_DIRECT, libaio, 1 job x --queue-depth, one I/O per block file over the store's own files
  (`--opendir`); its rate is io bytes / its own runtime, scaled to payload bytes. The command is
  printed, to rerun it by hand.
- direct: LocalDirStore.get_many_into with O_DIRECT, --queue-depth blocks at once (every payload
  verified before it is reported), into aligned BufferPool slots.
- buffered: the same through the page cache, with the store's default threads for buffered I/O
  (what the store did before direct I/O).
- reader: ReaderCore.read_blocks of requests of --request-blocks blocks each over the direct
  store (lease an extent, read, verify, count each verified block on the SNIC read counter, free),
  the SNIC unpaced, one request after another: the reader end to end without Ray (the actor's
  core, `ReaderCore`, which the actor only wraps); reader_2_requests: two such requests at once,
  as the actor serves them, with two store helpers fewer (blocks in flight still --queue-depth).
`--busy-nice` adds a `nice -n 15` spinner per given count while timing.

`--persist` times puts instead: N blocks from aligned pool slots into an empty directory,
direct and buffered, against fio's sequential O_DIRECT write of files of the same size (psync,
one job, depth 1: a put is one file written by one thread), with the growth of the page cache
(/proc/meminfo Cached) each left behind. `--page-cache-gib G` persists G GiB through the direct
store and reports the page cache's growth (/proc/meminfo Cached, all processes; and the
persisted files' own resident bytes, fincore) and the cold direct read rate before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import xxhash

from dualpath_ray.faults.injector import FaultInjector
from dualpath_ray.faults.plan import FaultPlan
from dualpath_ray.kv.block_format import HEADER_SIZE
from dualpath_ray.kv.index import block_keys, namespace_for
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.pool import BufferPool
from dualpath_ray.kv.store import LocalDirStore
from dualpath_ray.runtime.emulation.links import Link
from dualpath_ray.runtime.reader.core import ReaderCore
from dualpath_ray.runtime.reader.settings import ReaderSettings
from dualpath_ray.protocol.types import ReadPath


def drop_caches(level: int = 3) -> None:
    """Drop the page cache (1), or it and the dentry and inode caches too (3): with 3 every
    open of a block file reads its directory entries and inode from the disk, as a reader's first
    open of a block another node wrote does on a shared file system; fio opens its files before
    its timed phase, so it pays none of that (compare --drop-level 1)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as knob:
        knob.write(f"{level}\n")


def cached_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Cached line in /proc/meminfo")


def resident_bytes(paths: list[str]) -> int:
    """Bytes of these files in the page cache now (util-linux fincore), whoever else reads or
    writes files meanwhile: /proc/meminfo's Cached counts every process's files."""
    total = 0
    for first in range(0, len(paths), 512):
        report = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *paths[first : first + 512]],
            check=True, capture_output=True, text=True,
        ).stdout
        total += sum(int(line) for line in report.split())
    return total


def fio_read_command(root: Path, file_bytes: int, depth: int) -> list[str]:
    return [
        "fio", "--name=cold-read", f"--opendir={root}", "--rw=read", f"--bs={file_bytes}", "--ioengine=libaio",
        "--direct=1", f"--iodepth={depth}", "--numjobs=1", "--output-format=json",
    ]


def fio_write_command(target: Path, file_bytes: int, n_files: int) -> list[str]:
    return [
        "fio", "--name=seq-write", f"--directory={target}", "--rw=write", f"--bs={file_bytes}",
        f"--filesize={file_bytes}", f"--nrfiles={n_files}", "--ioengine=psync", "--direct=1", "--numjobs=1",
        "--file_service_type=sequential", "--create_on_open=1", "--output-format=json",
    ]


def fio_rate(command: list[str], kind: str) -> float:
    """Bytes per second fio reports for `kind` (read or write): its io bytes over its runtime."""
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    report = json.loads(out[out.index("{"):])  # fio may print notes ("opendir added N files") first
    job = report["jobs"][0][kind]
    return job["io_bytes"] / (job["runtime"] / 1000)


def fill(store: LocalDirStore, n_blocks: int, pool: BufferPool) -> list[str]:
    layout = store.layout
    keys = block_keys(np.arange(n_blocks * layout.block_size), layout.block_size, namespace_for("cold", 0))
    source = pool.full_block(0)
    for i, (parent, key) in enumerate(zip([None, *keys], keys)):
        source.copy_(torch.randint(0, 256, layout.full_block_shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(i)))
        store.put(key, source, parent=parent)
    return keys


def reader_core(store: LocalDirStore, blocks: int) -> ReaderCore:
    settings = ReaderSettings(node_id="bench", buffer_blocks=blocks, lease_timeout_s=60.0, kv_digests=False)
    links = (Link("snic-read/bench"), Link("snic-write/bench"))
    return ReaderCore(settings, store.layout, store, links, FaultInjector(FaultPlan(), "reader/bench"))


def spinners(count: int) -> list[subprocess.Popen[bytes]]:
    return [
        subprocess.Popen(["nice", "-n", "15", sys.executable, "-c", "while True: pass"]) for _ in range(count)
    ]


def time_cold(
    methods: dict[str, Callable[[], float | None]], repetitions: int, drop_level: int = 3
) -> dict[str, list[float]]:
    """Seconds per run of each method (or the rate it reports itself, as 1 / seconds), each run
    after a page-cache drop, the methods in rotating order every repetition."""
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for rep in range(repetitions):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            drop_caches(drop_level)
            start = time.perf_counter()
            reported = methods[name]()
            seconds[name].append(time.perf_counter() - start if reported is None else reported)
    return seconds


def cold_reads(args: argparse.Namespace) -> dict[str, object]:
    layout = KVLayout(args.n_layer, args.block_size, args.n_kv_head, args.head_dim, args.dtype)
    root = args.root / f"cold-{layout.full_block_bytes}"
    shutil.rmtree(root, ignore_errors=True)
    direct = LocalDirStore(root, layout, io="direct", read_threads=args.queue_depth - 1)
    buffered = LocalDirStore(root, layout, io="buffered")
    pool = BufferPool(args.blocks, layout, pin=False)
    keys = fill(direct, args.blocks, pool)
    extent = pool.lease("bench", args.blocks)
    assert extent is not None
    outs = pool.full_blocks(extent)
    core = reader_core(direct, args.request_blocks * 2)
    file_bytes = HEADER_SIZE + layout.full_block_bytes
    payload = args.blocks * layout.full_block_bytes
    fio = fio_read_command(root, file_bytes, args.queue_depth)
    cpu: list[float] = []

    def run_fio() -> float:
        return payload / (fio_rate(fio, "read") * payload / (args.blocks * file_bytes))

    def run_direct() -> None:
        before = time.process_time()
        direct.get_many_into(keys, outs)
        cpu.append(time.process_time() - before)

    def run_reader() -> None:
        for first in range(0, len(keys), args.request_blocks):
            chunk = keys[first : first + args.request_blocks]
            read = core.read_blocks("bench", chunk, len(chunk), ReadPath.PE)
            core.free(read.extent_id)

    # Two requests at once, as the reader actor serves them (its "io" concurrency group): the
    # store has two helpers fewer, so the blocks in flight stay at the queue depth.
    pair_store = LocalDirStore(root, layout, io="direct", read_threads=args.queue_depth - 2)
    pair_core = reader_core(pair_store, args.request_blocks * 2)
    requests = [keys[first : first + args.request_blocks] for first in range(0, len(keys), args.request_blocks)]

    def run_reader_pair() -> None:
        def stream(mine: list[list[str]]) -> None:
            for chunk in mine:
                read = pair_core.read_blocks("bench", chunk, len(chunk), ReadPath.PE)
                pair_core.free(read.extent_id)

        other = threading.Thread(target=stream, args=(requests[1::2],))
        other.start()
        stream(requests[0::2])
        other.join()

    methods: dict[str, Callable[[], float | None]] = {
        "fio": run_fio,
        "direct": run_direct,
        "buffered": lambda: buffered.get_many_into(keys, outs),
        "reader": run_reader,
        "reader_2_requests": run_reader_pair,
    }
    busy = spinners(args.busy_nice)
    try:
        seconds = time_cold(methods, args.repetitions, args.drop_level)
    finally:
        for spinner in busy:
            spinner.kill()
            spinner.wait()
    check = torch.empty(layout.full_block_shape, dtype=torch.uint8)
    direct.get_into(keys[-1], check)
    if not torch.equal(check, pool.full_block(extent.slots[-1])):
        raise RuntimeError("the direct read did not deliver the stored bytes")
    hash_start = time.process_time()
    for out in outs:  # the store's verification: xxh3_64 of each payload, here alone
        xxhash.xxh3_64_intdigest(memoryview(out.numpy()).cast("B"))
    hash_s = time.process_time() - hash_start
    direct.close()
    buffered.close()
    pair_store.close()
    shutil.rmtree(root, ignore_errors=True)
    rates = {name: [payload / s / 1e9 for s in times] for name, times in seconds.items()}
    return {
        "block_bytes": layout.full_block_bytes,
        "blocks": args.blocks,
        "queue_depth": args.queue_depth,
        "busy_nice_spinners": args.busy_nice,
        "repetitions": args.repetitions,
        "drop_caches": args.drop_level,
        "fio_command": " ".join(fio),
        "median_gbps": {name: statistics.median(r) for name, r in rates.items()},
        "range_gbps": {name: (min(r), max(r)) for name, r in rates.items()},
        "median_ratio_to_fio": {
            name: statistics.median(f / t for f, t in zip(seconds["fio"], times)) for name, times in seconds.items()
        },
        "direct_cpu_s_per_gb": statistics.median(cpu) / (payload / 1e9),
        "xxh3_cpu_s_per_gb": hash_s / (payload / 1e9),
    }


def persists(args: argparse.Namespace) -> dict[str, object]:
    layout = KVLayout(args.n_layer, args.block_size, args.n_kv_head, args.head_dim, args.dtype)
    pool = BufferPool(args.blocks, layout, pin=False)
    keys = block_keys(np.arange(args.blocks * layout.block_size), layout.block_size, namespace_for("persist", 0))
    pool.buffer.random_(0, 256)
    blocks = [pool.full_block(i) for i in range(args.blocks)]
    file_bytes = HEADER_SIZE + layout.full_block_bytes
    target = args.root / "persist"
    fio = fio_write_command(target, file_bytes, args.blocks)
    growth: dict[str, list[int]] = {"fio": [], "direct": [], "buffered": []}

    def put_all(io: str) -> Callable[[], float | None]:
        def run() -> None:
            store = LocalDirStore(target, layout, io=io)  # type: ignore[arg-type]
            for key, block in zip(keys, blocks):
                store.put(key, block)
        return run

    def fio_write() -> float:
        target.mkdir(parents=True, exist_ok=True)
        return args.blocks * file_bytes / fio_rate(fio, "write")

    methods: dict[str, Callable[[], float | None]] = {"fio": fio_write, "direct": put_all("direct"), "buffered": put_all("buffered")}
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for rep in range(args.repetitions):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            shutil.rmtree(target, ignore_errors=True)
            drop_caches()
            before = cached_bytes()
            start = time.perf_counter()
            reported = methods[name]()
            seconds[name].append(time.perf_counter() - start if reported is None else reported)
            growth[name].append(cached_bytes() - before)
    shutil.rmtree(target, ignore_errors=True)
    payload = args.blocks * layout.full_block_bytes
    return {
        "block_bytes": layout.full_block_bytes,
        "blocks": args.blocks,
        "repetitions": args.repetitions,
        "fio_command": " ".join(fio),
        "median_gbps": {name: payload / statistics.median(s) / 1e9 for name, s in seconds.items()},
        "median_ratio_to_fio": {
            name: statistics.median(f / t for f, t in zip(seconds["fio"], s)) for name, s in seconds.items()
        },
        "median_page_cache_growth_mib": {name: statistics.median(g) / 2**20 for name, g in growth.items()},
    }


def page_cache(args: argparse.Namespace) -> dict[str, object]:
    layout = KVLayout(args.n_layer, args.block_size, args.n_kv_head, args.head_dim, args.dtype)
    n_blocks = int(args.page_cache_gib * 2**30) // layout.full_block_bytes
    target = args.root / "page-cache"
    shutil.rmtree(target, ignore_errors=True)
    store = LocalDirStore(target, layout, io="direct")
    pool = BufferPool(64, layout, pin=False)
    pool.buffer.random_(0, 256)
    keys = block_keys(np.arange(n_blocks * layout.block_size), layout.block_size, namespace_for("fill", 0))

    def read_rate() -> float:
        before = cold_reads(args)
        return before["median_gbps"]["direct"]  # type: ignore[index]

    rate_before = read_rate()
    drop_caches()
    cached_before = cached_bytes()
    start = time.perf_counter()
    for i, key in enumerate(keys):
        store.put(key, pool.full_block(i % 64))
    put_s = time.perf_counter() - start
    growth = cached_bytes() - cached_before
    resident = resident_bytes([str(store.path_of(key)) for key in keys])
    rate_after = read_rate()
    shutil.rmtree(target, ignore_errors=True)
    return {
        "persisted_gib": n_blocks * layout.full_block_bytes / 2**30,
        "persist_gbps": n_blocks * layout.full_block_bytes / put_s / 1e9,
        "page_cache_growth_mib": growth / 2**20,
        "persisted_files_resident_mib": resident / 2**20,
        "cold_direct_read_gbps_before": rate_before,
        "cold_direct_read_gbps_after": rate_after,
    }


def cold_run_refusal(what: str) -> str | None:
    """Why `what` cannot run here (it drops the page cache, so needs root, and compares with
    fio); None when it can."""
    if os.geteuid() != 0:
        return f"{what} drops the page cache: run as root"
    if shutil.which("fio") is None:
        return f"{what} compares with fio: install it (apt-get install fio)"
    return None


def main(args: argparse.Namespace) -> int:
    refusal = cold_run_refusal("--cold")
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    args.root.mkdir(parents=True, exist_ok=True)
    if args.page_cache_gib:
        result = page_cache(args)
    elif args.persist:
        result = persists(args)
    else:
        result = cold_reads(args)
    print(json.dumps(result, indent=2))
    return 0
