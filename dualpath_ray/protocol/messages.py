"""Typed messages between the actors. Each carries the request id and the attempt number, so a
retried request can never be confused with a stale message of an earlier attempt.

A leaf module: plain frozen dataclasses and numpy arrays, no torch and no other project module at
run time, so every process (and the simulator) can import it cheaply.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, NamedTuple

import numpy as np

from dualpath_ray.protocol.types import ReadPath, StopReason

from dualpath_ray.protocol.errors import ErrorKind  # carried by TurnResult; callers import it from here too

if TYPE_CHECKING:
    from dualpath_ray.protocol.loads import EngineLoad


class PeerState(str, enum.Enum):
    """What the last call to an engine or reader said about it."""

    ALIVE = "alive"
    SILENT = "silent"  # did not answer in time: slow or hung, may answer again
    RESTARTING = "restarting"  # Ray is restarting it: its incarnation's state is gone
    DEAD = "dead"  # gone for good (no restarts left), or it refuses work (its worker loop died)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; temperature 0 is greedy. Sampling is seeded by (seed, position).
    The defaults of top_k, min_p and repetition_penalty are "off". What each does, and in which
    order, is dualpath_ray/model/sampling.py's docstring; both engine backends follow it."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = -1  # keep the k most likely tokens; -1 or 0: all
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one; 0: none
    repetition_penalty: float = 1.0  # logits of tokens already in the context scaled by it; 1.0: off


def attempt_owner(request_id: str, attempt: int, epoch: int = 0) -> str:
    """The name of one attempt of a request: what owns its extents, pages and decode job. The
    epoch names the serving it belongs to (see RequestSpec.epoch): a request id served again (a
    restarted scheduler's new incarnation, or a caller that reuses the id once its turn ended)
    numbers its attempts from 0 again, and an engine's memory of the old attempt (a cancel it
    remembers, say) must never apply to the new one."""
    return f"{request_id}#{attempt}" if not epoch else f"{request_id}#{attempt}@{epoch}"


class Holding(NamedTuple):
    """One attempt an engine holds, as it answers the scheduler's heartbeat."""

    attempt: int
    handed_off: bool  # its handoff reached the decode engine (or its result is on its way)
    epoch: int = 0  # the serving that dispatched it (RequestSpec.epoch)

    @classmethod
    def of(cls, attempt: RequestSpec | TurnResult, handed_off: bool) -> Holding:
        """The holding of the attempt a request spec or a turn result is of."""
        return cls(attempt.attempt, handed_off, attempt.epoch)

    def owner(self, request_id: str) -> str:
        return attempt_owner(request_id, self.attempt, self.epoch)

    def newer_than(self, other: Holding) -> bool:
        return (self.epoch, self.attempt) > (other.epoch, other.attempt)


def newest_holdings(entries: Iterable[tuple[str, Holding]]) -> dict[str, Holding]:
    """Request id -> its newest attempt among `entries`; one attempt seen twice is handed off
    if either sighting says so."""
    held: dict[str, Holding] = {}
    for rid, holding in entries:
        known = held.get(rid)
        if known is None or holding.newer_than(known):
            held[rid] = holding
        elif not known.newer_than(holding) and holding.handed_off:
            held[rid] = holding
    return held


@dataclass(frozen=True)
class RequestSpec:
    """One turn to serve: the whole prompt (cached + new tokens) and how to sample."""

    request_id: str
    attempt: int
    prompt: np.ndarray
    sampling: SamplingParams
    namespace: str
    submitted_at: float
    # Set by the scheduler for each serving of a request id: its incarnation's start (time_ns)
    # plus the number of servings it began before, so unique per serving, and every epoch of an
    # incarnation is above every epoch of the one before (it started later than the old one
    # served requests, one per nanosecond at the very most).
    epoch: int = 0
    stream: bool = False  # the decode engine sends its tokens as they are sampled (TokenChunk)
    # The caller's hint that its session's next turn comes about this many seconds after this one
    # ends (a tool call): its KV is staged meanwhile (scheduling/staging.py). None: no hint.
    expect_next_turn_s: float | None = None
    # A node whose reader this attempt must not read its hits through: the attempt before it
    # failed reading there (SchedulerCore.next_attempt). "" = none.
    avoid_reader: str = ""

    @property
    def owner(self) -> str:
        """The lease owner of this attempt's buffer extents."""
        return attempt_owner(self.request_id, self.attempt, self.epoch)


@dataclass(frozen=True)
class StagedRead:
    """A task's first `blocks` hit blocks, staged on its decode node while the session's tool ran
    (scheduling/staging.py): that reader hands over the extent of `stage_id` instead of reading them."""

    stage_id: str
    node_id: str
    blocks: int


@dataclass(frozen=True)
class PrefillTask:
    """The scheduler's decision for one request, handed to the chosen prefill engine."""

    request: RequestSpec
    hit_keys: tuple[str, ...]
    hit_tokens: int
    path: ReadPath
    oracle: bool
    prefill_engine: str
    prefill_node: str
    decode_engine: str
    decode_node: str
    # Hit blocks the prefill-side reader reads: the first ones (all of them on the PE path, none
    # on the DE path, some on a split read); the decode-side reader reads the rest.
    pe_hit_blocks: int = 0
    staged: StagedRead | None = None  # its first hit blocks wait staged on its decode node
    # Stored blocks after hit_keys whose tokens are computed instead of read (the compute path,
    # scheduling/compute_path.py), and those tokens: stored already, so none is persisted again.
    recomputed_keys: tuple[str, ...] = ()
    recomputed_tokens: int = 0
    # The last stored block (read or recomputed) holds the prompt's last token, which is computed
    # anyway (its logits) and counted in neither hit_tokens nor recomputed_tokens: a partial-block
    # hit (scheduling/binding.py). Read whole, that block's stored KV is what goes on to the
    # decode engine (runtime/prefill/pipeline.py), and it is not persisted again.
    partial_hit: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def stored_tokens(self) -> int:
        """The prompt's tokens whose blocks the store holds: read (hit_tokens), recomputed, and
        with a partial hit the last token (then the whole prompt)."""
        return self.hit_tokens + self.recomputed_tokens + self.partial_hit

    @property
    def read_end(self) -> int:
        """The tokens the read blocks hold, [0, read_end): hit_tokens, and one more when the last
        read block is a partial hit's (read whole, its last token computed all the same)."""
        return self.hit_tokens + (self.partial_hit and not self.recomputed_keys)

    @property
    def stored_keys(self) -> tuple[str, ...]:
        """The keys of the prompt's stored blocks, in chain order (read, then recomputed)."""
        return self.hit_keys + self.recomputed_keys

    @property
    def pe_blocks(self) -> int:
        """Hit blocks the prefill-side reader reads (the first ones)."""
        if self.path == ReadPath.SPLIT:
            return self.pe_hit_blocks
        return len(self.hit_keys) if self.path == ReadPath.PE else 0

    @property
    def pe_tokens(self) -> int:
        """Tokens of past KV in the prefill node's extent at the first chunk: [0, pe_tokens)."""
        return self.read_end * self.pe_blocks // len(self.hit_keys) if self.hit_keys else 0


@dataclass(frozen=True)
class DecodeReservation:
    """A decode engine's HBM for a request, set aside when the scheduler places it there. The
    runtime sends it nowhere: the decode engine reserves the same pages when the handoff arrives
    (scheduling/loads.py `decode_tokens`), which the scheduler's books keep free for it."""

    request_id: str
    attempt: int
    tokens: int
    decode_engine: str
    epoch: int = 0


@dataclass(frozen=True)
class ExtentGrant:
    """A leased extent of one node's host buffer: where a request's KV sits on that node.

    `slots` are the buffer's Full Block slots in block order; peers address bytes of them
    through the transport (the reader's pool "buffer"), so the grant is all they need.
    """

    node_id: str
    reader: str
    extent_id: int
    slots: tuple[int, ...]
    # Digests [n_layer, hit tokens] of the hit KV the reader verified into the extent
    # (runtime.kv_digests; kv/digest.py), which the prefill engine checks what it loads against.
    digests: np.ndarray | None = None
    # Extent ids are per reader process: a restarted reader ignores frees and writes that name
    # an extent of its dead incarnation (they could otherwise name a new lease with the same id).
    incarnation: str = ""


@dataclass(frozen=True)
class DecodeHandoff:
    """Prefill is done: the prompt's KV is in the decode node's buffer extent (or, in oracle
    mode, to be materialised in place) and the first token is sampled."""

    task: PrefillTask
    extent: ExtentGrant | None
    first_token: int
    first_log_prob: float
    first_token_at: float
    # Digests [n_layer, prompt tokens] of the prompt's KV as the prefill engine computed (or
    # checked) it; the decode engine checks its pages against them before decoding.
    digests: np.ndarray | None = None


@dataclass(frozen=True)
class TokenChunk:
    """Tokens of a streamed request as its decode engine sampled them: output positions
    [start, start + len(tokens)) of one attempt. A retry streams from position 0 again; sampling
    is seeded by (seed, position), so its tokens equal the ones already streamed."""

    request_id: str
    attempt: int
    epoch: int
    start: int
    tokens: tuple[int, ...]
    log_probs: tuple[float, ...]


@dataclass(frozen=True)
class StreamDelta:
    """What a streaming caller receives: output positions [start, start + len(tokens))."""

    start: int
    tokens: tuple[int, ...]
    log_probs: tuple[float, ...]

    @classmethod
    def after(cls, chunk: TokenChunk, sent: int) -> StreamDelta | None:
        """The part of `chunk` past the first `sent` output tokens (None if nothing new, or if
        it starts past them: a gap the final result fills)."""
        if chunk.start > sent or chunk.start + len(chunk.tokens) <= sent:
            return None
        skip = sent - chunk.start
        return cls(sent, chunk.tokens[skip:], chunk.log_probs[skip:])


@dataclass(frozen=True)
class PersistedBlock:
    key: str
    parent: str | None
    digest: int | None = None  # persist_digest of the KV its engine computed (kv/digest.py; None: not checked)


@dataclass(frozen=True)
class TurnResult:
    """What one served turn produced, with where and how it was served."""

    request_id: str
    attempt: int
    output_tokens: tuple[int, ...]
    log_probs: tuple[float, ...]
    stop_reason: StopReason
    prompt_tokens: int
    hit_tokens: int
    path: ReadPath
    prefill_engine: str
    decode_engine: str
    ttft_s: float
    tpot_s: float
    kv_bytes_verified: int = 0
    kv_mismatches: int = 0
    persisted: tuple[PersistedBlock, ...] = ()
    error: str | None = None
    error_kind: ErrorKind | None = None
    bad_keys: tuple[str, ...] = ()  # the stored blocks a KV_MISSING / KV_CORRUPT / KV_UNREADABLE failure names
    epoch: int = 0  # of the serving that dispatched the attempt (RequestSpec.epoch)
    failed_reader: str = ""  # the node whose reader's read of its hits failed it, if one did
    recomputed_tokens: int = 0  # stored tokens its prefill computed instead of reading (the compute path)

    @property
    def owner(self) -> str:
        return attempt_owner(self.request_id, self.attempt, self.epoch)


@dataclass(frozen=True)
class GroupReport:
    """A group's load report as the scheduler core is asked with it (scheduling/rounds.py): its
    engines' loads and its node's storage read queue in tokens (None: nothing new is known since
    the group's last report, so the core keeps its own count)."""

    group_id: str
    node_id: str
    engines: tuple[EngineLoad, ...]
    read_q_tokens: int | None
    reader_state: PeerState = PeerState.ALIVE
    # (engine or reader name, its incarnation) of every member that answered: a new one means
    # that actor restarted and its old incarnation's attempts are gone.
    incarnations: tuple[tuple[str, str], ...] = ()

    @property
    def reader_alive(self) -> bool:
        return self.reader_state is PeerState.ALIVE


class EngineHoldings(NamedTuple):
    """An engine's answer to the scheduler's heartbeat; `ready`: it holds the published weights
    (False: restarted, still catching up: runtime/engine/held_weights.py) and takes work."""

    incarnation: str
    held: dict[str, Holding]
    ready: bool = True


@dataclass(frozen=True)
class EngineReport:
    """What an engine tells the scheduler after one step of its worker, in one call (sent only
    when there is something to say): the attempts whose handoff it took (a decode engine: from
    now on they no longer depend on their prefill engine), the turns that ended (served or
    failed; persisted blocks included) and the tokens streamed requests sampled. `incarnation`
    names the process, so a report of a restarted engine's new process is recognised (`ready`: see EngineHoldings)."""

    engine: str
    incarnation: str
    handed_off: dict[str, Holding] = field(default_factory=dict)
    results: tuple[TurnResult, ...] = ()
    chunks: tuple[TokenChunk, ...] = ()
    ready: bool = True


@dataclass(frozen=True)
class ReaderReport:
    """A storage reader's read queue (hit tokens waiting for or in its SNIC), sent when it
    changed (at most every scheduler.report_interval_ms), and once when the reader starts; and
    the attempts (owners) whose computed prompt blocks it now holds in memory, sent as soon as it
    holds them (in-flight sharing's decode-buffer source, runtime/reader/hot_blocks.py)."""

    node_id: str
    reader: str
    incarnation: str
    read_q_tokens: int
    prompts_on_node: tuple[str, ...] = ()


class Refusal(str, enum.Enum):
    """Why the scheduler refused a submitted turn (`Scheduler.submit`); the client raises it."""

    DUPLICATE = "duplicate"  # a request of that id is already in flight (from another caller)
    ASLEEP = "asleep"  # the cluster sleeps: wake_up() first

    def error(self, request_id: str) -> Exception:
        if self is Refusal.DUPLICATE:
            return ValueError(f"request id {request_id!r} is already in flight; ids must be unique")
        return RuntimeError("the cluster is asleep: call wake_up() before generating")


@dataclass(frozen=True)
class Collected:
    """A client's finished turns (`Scheduler.collect`) and the scheduler incarnation that
    answered: a new epoch means the scheduler restarted and forgot what was submitted to it."""

    epoch: int
    results: tuple[TurnResult, ...] = ()


def aborted_result(spec: RequestSpec) -> TurnResult:
    """What the caller of an aborted request gets: no output, stop reason ABORTED, no error."""
    return TurnResult(
        request_id=spec.request_id, attempt=spec.attempt, output_tokens=(), log_probs=(),
        stop_reason=StopReason.ABORTED, prompt_tokens=len(spec.prompt), hit_tokens=0, path=ReadPath.PE,
        prefill_engine="", decode_engine="", ttft_s=0.0, tpot_s=0.0, epoch=spec.epoch,
    )


def failed_result(
    spec: RequestSpec, engine: str, error: BaseException | str, kind: ErrorKind = ErrorKind.INTERNAL,
    bad_keys: tuple[str, ...] = (), failed_reader: str = "",
) -> TurnResult:
    """The result of a request an engine could not serve: the caller gets the error, not a hang."""
    return TurnResult(
        request_id=spec.request_id, attempt=spec.attempt, output_tokens=(), log_probs=(),
        stop_reason=StopReason.ERROR, prompt_tokens=len(spec.prompt), hit_tokens=0, path=ReadPath.PE,
        prefill_engine=engine, decode_engine="", ttft_s=0.0, tpot_s=0.0, error=f"{engine}: {error!r}",
        error_kind=kind, bad_keys=bad_keys, epoch=spec.epoch, failed_reader=failed_reader,
    )
