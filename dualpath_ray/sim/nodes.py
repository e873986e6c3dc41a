"""A simulated node: its storage NIC (one link per direction), DRAM, staging buffer, read queue.

Names follow the runtime's topology (runtime/placement/topology.py): nodes p0..p{P-1} and d0..d{D-1},
engines `<role>/<node>/g<i>`, groups `<role>/<node>`, so decisions read the same in both.

Traffic per request (paper-digest.md, "The two read paths"), each byte charged to every
resource it crosses:
- hit KV read from the store: the reading node's SNIC receive side and its DRAM;
- a layer's past KV into the prefill engine: the PE's CNIC receive side, plus the source
  node's DRAM, plus (from the decode node's buffer) the decode engine's CNIC transmit side;
- a layer's KV sent to the decode buffer: the PE's CNIC transmit side, the decode engine's CNIC
  receive side and the decode node's DRAM;
- the prompt's KV buffer -> decode HBM (H2D): the decode engine's CNIC receive side and DRAM;
- persisting: prompt blocks from the buffer (DRAM, SNIC transmit), blocks filled while decoding
  D2H first (the decode engine's CNIC transmit side, DRAM) then the SNIC.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dualpath_ray.protocol.names import engine_name
from dualpath_ray.protocol.types import ReadPath, Role
from dualpath_ray.sim.buffers import SimBufferPool
from dualpath_ray.sim.links import SimLink, ReadQueue
from dualpath_ray.sim.settings import SimSettings


@dataclass
class SnicWindows:
    """Bytes a node's SNIC read per window of `window_s` (for the SNIC balance metric)."""

    window_s: float
    bytes_by_window: dict[int, int] = field(default_factory=dict)

    def add(self, when: float, nbytes: int) -> None:
        index = int(when / self.window_s)
        self.bytes_by_window[index] = self.bytes_by_window.get(index, 0) + nbytes


class SimNode:
    def __init__(self, node_id: str, role: Role, settings: SimSettings) -> None:
        burst = settings.burst_s
        self.node_id = node_id
        self.role = role
        self.snic_read = SimLink(f"snic-read/{node_id}", settings.snic_bytes_s, settings.snic_bytes_s * burst)
        self.snic_write = SimLink(f"snic-write/{node_id}", settings.snic_bytes_s, settings.snic_bytes_s * burst)
        self.dram = SimLink(f"dram/{node_id}", settings.dram_bytes_s)
        self.buffer = SimBufferPool(node_id, settings.buffer_blocks)
        self.read_queue = ReadQueue()
        self.snic_windows = SnicWindows(settings.options.snic_window_s)
        self.read_bytes_by_path = {ReadPath.PE: 0, ReadPath.DE: 0}

    def read(self, now: float, tokens: int, nbytes: int, path: ReadPath) -> float:
        """Read hit KV from the store into this node's buffer; returns when it is there."""
        start = max(now, self.snic_read.busy_until)
        snic_done = self.snic_read.take(now, nbytes)
        done = max(snic_done, self.dram.take(now, nbytes))
        self.read_queue.add_read(start, snic_done, tokens)
        self.snic_windows.add(snic_done, nbytes)
        self.read_bytes_by_path[path] += nbytes
        return done

    def write(self, now: float, nbytes: int) -> float:
        """Persist Full Blocks from this node's buffer to the store; returns when they are written."""
        return max(self.snic_write.take(now, nbytes), self.dram.take(now, nbytes))


class EngineLinks:
    """One GPU's CNIC: a link per direction."""

    def __init__(self, engine_id: str, settings: SimSettings) -> None:
        burst = settings.cnic_bytes_s * settings.burst_s
        self.cnic_in = SimLink(f"cnic-in/{engine_id}", settings.cnic_bytes_s, burst)
        self.cnic_out = SimLink(f"cnic-out/{engine_id}", settings.cnic_bytes_s, burst)


def node_ids(role: Role, count: int) -> list[str]:
    prefix = "p" if role is Role.PREFILL else "d"
    return [f"{prefix}{i}" for i in range(count)]


def engine_ids(role: Role, node_id: str, gpus: int) -> list[str]:
    return [engine_name(role, node_id, gpu) for gpu in range(gpus)]
