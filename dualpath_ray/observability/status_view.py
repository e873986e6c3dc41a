"""The terminal view of a ClusterStatus: plain text tables, redrawn in place by `dualpath status`."""

from __future__ import annotations

import time
from typing import Sequence

from dualpath_ray.observability.status import ClusterStatus, LatencyView
from dualpath_ray.protocol.counters import PATHS

CLEAR_SCREEN = "\x1b[H\x1b[2J"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]


def by_path(values: dict[str, int]) -> str:
    return " / ".join(human_bytes(values.get(p, 0)) for p in PATHS)


def share(values: dict[str, int]) -> str:
    total = sum(values.get(p, 0) for p in PATHS)
    if not total:
        return "no bytes yet"
    return ", ".join(f"{p} {human_bytes(values.get(p, 0))} ({values.get(p, 0) / total:.0%})" for p in PATHS)


def render(status: ClusterStatus) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(status.collected_at))
    lines = [f"DualPath status  namespace={status.namespace}  {when}"]
    lines += ["", "Ray nodes"] + table(
        ("NODE", "ROLE", "ADDRESS", "ALIVE", "GPUS", "CPUS", "DUALPATH NODES"),
        [(n.node_id[:8], n.role, n.address, "yes" if n.alive else "NO", f"{n.gpus:g}", f"{n.cpus:g}",
          ", ".join(n.hosts) or "-") for n in status.ray_nodes],
    )
    if not status.deployed:
        lines += ["", (f"No dualpath deployment answers in namespace {status.namespace!r} "
                       "(nothing deployed, or another runtime.namespace: pass --namespace).")]
        return "\n".join(lines) + "\n"
    lines += ["", f"Deployment: mode {status.mode}, emulation {status.emulation}, "
                  f"{status.in_flight} requests in flight"]
    lines += ["", "Storage readers (SNIC bytes by path: pe / de)"] + table(
        ("NODE", "READ_Q (tokens)", "SNIC READ pe / de", "SNIC WRITE", "BUFFER BLOCKS used/size", "PINNED"),
        [(r.node, r.read_q_tokens, by_path(r.snic_read), human_bytes(r.snic_write),
          f"{r.buffer_used_blocks}/{r.buffer_capacity_blocks}", _yes_no(r.buffer_pinned))
         if r.answered else (r.node, "not answering", "", "", "", "") for r in status.readers],
    )
    lines += [f"  {r.node}: {r.pinning}" for r in status.readers if r.answered and r.buffer_pinned is False]
    lines += ["", "Engines (CNIC bytes by path: pe / de)"] + table(
        ("ENGINE", "REQUESTS", "TOKENS", "FREE HBM (tokens)", "CNIC IN pe / de", "CNIC OUT pe / de"),
        [(e.name, e.requests, e.tokens, e.free_hbm_tokens if e.role == "decode" else "-", by_path(e.cnic_in),
          by_path(e.cnic_out)) if e.answered else (e.name, "not answering", "", "", "", "") for e in status.engines],
    )
    lines += ["", f"SNIC read by path: {share(status.snic_read_by_path)}",
              f"CNIC by path:      {share(status.cnic_by_path)}"]
    lines += ["", _latency_line(status.latency)]
    if status.scheduler_calls:
        lines.append("Scheduler: " + ", ".join(f"{k} {v}" for k, v in status.scheduler_calls.items()))
    return "\n".join(lines) + "\n"


def _yes_no(value: bool | None) -> str:
    return "?" if value is None else ("yes" if value else "no")


def _latency_line(view: LatencyView | None) -> str:
    if view is None:
        return "Recent turns: the scheduler does not report them"
    head = f"Recent turns (last {view.window_s:g} s): {view.turns}"
    if not view.turns:
        return head
    paths = ", ".join(f"{p} {view.turns_by_path.get(p, 0)}" for p in PATHS)
    ttft = " ".join(f"{k} {v:.3f} s" for k, v in view.ttft_s.items())
    tpot = " ".join(f"{k} {v * 1000:.1f} ms" for k, v in view.tpot_s.items()) or "-"
    return f"{head} ({paths})\n  TTFT {ttft}\n  TPOT {tpot}"
