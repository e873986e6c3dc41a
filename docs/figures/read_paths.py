"""Draws docs/figures/read-paths.png, the README's picture of the two read paths and the scheduler.

    python docs/figures/read_paths.py        # needs matplotlib (the `bench` extra)

The picture is drawn from this source (not by hand) so that a change to the design is one edit
here and one rerun; the PNG is committed because GitHub renders it on the repository page.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).with_name("read-paths.png")
PE_PATH = "#1f77b4"  # the conventional read path, through the prefill node's storage NIC
DE_PATH = "#ff7f0e"  # DualPath's second path, through the decode node's storage NIC
OTHER = "#555555"


def box(ax, x: float, y: float, w: float, h: float, title: str, body: str, color: str = "#f4f4f4") -> None:
    """A rounded box centred at (x, y), a bold title over a smaller body."""
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.12",
                                facecolor=color, edgecolor="#333333", linewidth=1.2))
    ax.text(x, y + h * 0.18, title, ha="center", va="center", fontsize=10.5, weight="bold")
    ax.text(x, y - h * 0.2, body, ha="center", va="center", fontsize=8.5, color="#333333")


def arrow(ax, start: tuple[float, float], end: tuple[float, float], color: str, label: str,
          label_at: tuple[float, float], dashed: bool = False, rad: float = 0.0, width: float = 2.2) -> None:
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=16, color=color, linewidth=width,
                                 linestyle="--" if dashed else "-", connectionstyle=f"arc3,rad={rad}"))
    ax.text(*label_at, label, ha="center", va="center", fontsize=8.5, color=color,
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.5})


def draw(path: Path = OUT) -> Path:
    fig, ax = plt.subplots(figsize=(10, 7.0))
    ax.set_xlim(0, 10)
    ax.set_ylim(-0.45, 7.2)
    ax.axis("off")

    # Nodes: a prefill node on the left, a decode node on the right.
    for x, name in ((2.2, "prefill node (p0)"), (7.8, "decode node (d0)")):
        ax.add_patch(FancyBboxPatch((x - 2.0, 1.75), 4.0, 3.65, boxstyle="round,pad=0.02,rounding_size=0.15",
                                    facecolor="none", edgecolor="#999999", linestyle=":", linewidth=1.2))
        ax.text(x, 5.2, name, ha="center", va="center", fontsize=9, color="#666666", style="italic")

    box(ax, 5.0, 6.45, 6.4, 0.95, "scheduler (actor; the policy is pure and shared with the simulator)",
        "sees every reader's read queue and every engine's load;\n"
        "per request picks the read path and the engines, and pushes the task")
    box(ax, 2.2, 4.45, 3.4, 0.95, "prefill engine", "computes layer by layer (3-layer window),\n"
        "hit KV arriving while the previous layer computes")
    box(ax, 7.8, 4.45, 3.4, 0.95, "decode engine", "paged KV; decodes;\nfull blocks persisted as they fill")
    box(ax, 2.2, 2.45, 3.4, 0.95, "storage reader + PE buffer", "host staging buffer, storage NIC (SNIC)")
    box(ax, 7.8, 2.45, 3.4, 0.95, "storage reader + DE buffer", "host staging buffer, storage NIC (SNIC)")
    box(ax, 5.0, 0.55, 8.6, 0.8, "block store (SSD)", "checksummed Full Blocks, prefix index: "
        "a multi-turn agent's next prompt hits > 95% of its KV", color="#eef3e8")

    arrow(ax, (1.6, 0.95), (1.6, 1.97), PE_PATH, "PE path: hit KV\nvia the prefill SNIC", (1.6, 1.42))
    arrow(ax, (1.6, 2.93), (1.6, 3.97), PE_PATH, "layer by layer\n(H2D)", (1.6, 3.45))
    arrow(ax, (7.8, 0.95), (7.8, 1.97), DE_PATH, "DE path: hit KV\nvia the decode SNIC", (7.8, 1.42))
    arrow(ax, (6.6, 2.93), (3.4, 3.97), DE_PATH, "layer by layer over RDMA (compute NIC)", (5.0, 3.3), rad=0.08)
    arrow(ax, (3.9, 4.6), (6.1, 4.6), OTHER, "prompt KV\nover RDMA", (5.0, 4.85))
    arrow(ax, (9.1, 3.97), (9.1, 2.93), OTHER, "persist", (9.1, 3.45), dashed=True, width=1.4)
    arrow(ax, (9.1, 1.97), (9.1, 0.95), OTHER, "write", (9.1, 1.42), dashed=True, width=1.4)
    arrow(ax, (3.4, 5.97), (2.6, 4.93), OTHER, "tasks", (2.95, 5.45), dashed=True, width=1.2)
    arrow(ax, (7.4, 4.93), (6.6, 5.97), OTHER, "loads", (7.05, 5.45), dashed=True, width=1.2)
    arrow(ax, (0.5, 2.6), (1.8, 6.2), OTHER, "read\nqueue", (0.12, 4.4), dashed=True, rad=-0.5, width=1.2)
    arrow(ax, (9.5, 2.6), (8.2, 6.2), OTHER, "read\nqueue", (9.88, 4.4), dashed=True, rad=0.5, width=1.2)

    ax.plot([], [], color=PE_PATH, linewidth=2.2, label="PE read path (conventional)")
    ax.plot([], [], color=DE_PATH, linewidth=2.2, label="DE read path (DualPath's second path)")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, -0.02), ncol=2, fontsize=9, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    print(draw())
