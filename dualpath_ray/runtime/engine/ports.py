"""What the engine cores need from the rest of the system: a few small ports.

The cores (runtime/prefill/core.py, runtime/decode/core.py) hold every decision and state
change of an engine and never import Ray; the actor shells implement these ports with Ray calls
and the transport, the unit tests with in-process fakes (tests/fakes.py), and a
simulator may implement them with simulated time. Calls that take time return a `Pending`,
which the core polls or waits on, so transfers and reads overlap compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, Sequence, TypeVar

from dualpath_ray.kv.paged_block_layers import PagedBlockLayers
from dualpath_ray.protocol.types import ReadPath
from dualpath_ray.protocol.messages import (
    DecodeHandoff, ExtentGrant, Holding, PersistedBlock, RequestSpec, StagedRead, TokenChunk, TurnResult,
)
from dualpath_ray.runtime.transport.moves import Move

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Pending(Protocol[T_co]):
    """Work in progress: `done` polls without blocking, `wait` blocks for the result (or raises)."""

    def done(self) -> bool: ...

    def wait(self, timeout_s: float | None = None) -> T_co: ...


@dataclass
class Ready(Generic[T]):
    """A Pending that is already complete (an in-process port, or nothing to wait for)."""

    value: T

    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float | None = None) -> T:
        return self.value


@dataclass
class Failed:
    """A Pending that failed at once: `done` and `wait` raise the error."""

    error: BaseException

    def done(self) -> bool:
        raise self.error

    def wait(self, timeout_s: float | None = None) -> object:
        raise self.error


class ReaderPort(Protocol):
    """The storage readers of every node, addressed by node id."""

    def read_hits(
        self, node_id: str, owner: str, keys: Sequence[str], total_blocks: int, path: ReadPath, first_block: int = 0,
        staged: StagedRead | None = None,
    ) -> Pending[ExtentGrant]:
        """Lease an extent of total_blocks on the node and read the hit blocks `keys` into its
        slots from block `first_block` on (a split read's decode-side part starts past the
        blocks the prefill side reads). With `staged` (PrefillTask.staged, DE path), the node's
        reader hands over the extent it staged for the first `staged.blocks` keys and reads
        only the rest; one it no longer holds is read as usual. The grant is the same."""

    def lease(self, node_id: str, owner: str, n_blocks: int) -> Pending[ExtentGrant]:
        """Lease an empty extent (the decode side of a PE-path request)."""

    def free(self, grant: ExtentGrant) -> None:
        """Give an extent back (no reply awaited)."""

    def reclaim(self, node_id: str, owner: str) -> None:
        """Free every extent of `owner` (a failed attempt) on the node that no write is using,
        including one whose lease reply was lost (no reply awaited)."""

    def persist_extent(self, grant: ExtentGrant, blocks: Sequence[tuple[int, PersistedBlock]]) -> Pending[int]:
        """Write blocks (index in the extent, key) to the store from the extent, then free it."""

    def persist_pages(
        self, node_id: str, owner: str, blocks: Sequence[tuple[int, PersistedBlock]], paged: PagedBlockLayers | None = None,
    ) -> Pending[int]:
        """D2H + write: the node's reader pulls pages of this engine's HBM and stores them.
        `paged`: the pages are a compute's own (vLLM's), laid out as it says
        (kv/paged_block_layers.py); None: Full Block pages of the engine's Pool.HBM."""


class TransportPort(Protocol):
    """One-sided moves between this engine's registered memory and a peer's."""

    def read(self, peer: str, moves: Sequence[Move]) -> Pending[int]: ...

    def write(self, peer: str, moves: Sequence[Move]) -> Pending[int]: ...


class SchedulerPort(Protocol):
    def report(
        self, handed_off: dict[str, Holding], results: Sequence[TurnResult], chunks: Sequence[TokenChunk]
    ) -> Pending[None]:
        """One step's news in one call (protocol/messages.py EngineReport): the attempts whose
        handoff a decode engine took (from then on they no longer depend on their prefill
        engines; a lost note costs only the wait for the next heartbeat, which says the same),
        the turns that ended (done once the scheduler has them: until then the engine's
        heartbeat names them, runtime/engine/outbox.py) and the tokens streamed requests sampled (a
        lost chunk is made up by the final result)."""


class DecodePort(Protocol):
    def hand_off(self, engine: str, handoffs: Sequence[DecodeHandoff]) -> Pending[None]:
        """Give prefilled requests to their decode engine (one call for all of a batch's that
        go there); done once the engine has them."""


class WeightsPort(Protocol):
    """The weights the engine holds (runtime/engine/held_weights.py HeldWeights)."""

    def check(self, spec: RequestSpec) -> None:
        """Raise StaleWeightsError unless the engine is ready and holds the weights `spec`
        names (its key namespace): called before anything of the request is computed, so no
        token is sampled and no KV stored under another version's namespace."""


class Clock(Protocol):
    def now(self) -> float:
        """Wall-clock seconds (time.time), comparable with RequestSpec.submitted_at."""
