"""The wait-or-compute rule of in-flight sharing: pure, a comparison of estimated ends.

A request about to be placed whose next blocks (past its stored hit) are promised by a
producer in flight (kv/promised.py) can

- compute them itself, now:  end = engine_wait + prefill_s(hit, promised + miss)
- wait for the producer and read them from a source:
                              end = max(ready_in + read_s(source), engine_wait)
                                    + prefill_s(hit + promised, miss)

  the store:                  read_s = (read_queue + promised) / read_rate
  the producer's decode-node buffer (only where the request decodes on that node too, so its
  DE-path read finds them in its own node's memory and the prefill engine pulls them over
  its CNIC, as it pulls any DE-path hit):
                              read_s = promised / buffer_rate

where engine_wait is the time the prefill engines need for the tokens they hold before it
(engine_queue_tokens at the compute rate), ready_in the time until the producer publishes the
blocks (its estimate, scheduling/sharing.py), read_queue_tokens what the SNIC reader already
holds (a buffer read never crosses the SNIC, so it waits behind nothing there), read_rate one
SNIC's and buffer_rate one CNIC's KV tokens per second (ComputePathModel), and prefill_s the
latency model's time of one request's prefill given (cached, new) tokens (scheduling/
compute_path.py: the same estimates as the compute path). The hit is read in every case and
left out of all of them.

A partial-block hit (scheduler.partial_block_hits): when the promised run reaches the block that
holds the prompt's last token, miss is 0 and the waiter reads that block whole and computes only
the last token. Every prefill_s above then takes cached = min(hit + promised, prompt - 1) and
new = prompt - cached (prompt = hit + promised + miss), and the reads still count every promised
token (whole blocks).

It waits, through the source that ends it sooner (of equal ends the buffer: it leaves the SNIC
to others), only if waiting ends strictly sooner than computing: of equal ends computing wins
(no dependency on another request, nothing to release if that one fails).
`tests/unit/scheduling/test_share_rule.py` checks it against the rule written out literally.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dualpath_ray.scheduling.compute_path import ComputePathModel


class ShareSource(str, enum.Enum):
    """Where a waiter reads the producer's blocks from."""

    STORE = "store"  # through a storage reader's SNIC, once the producer's turn has stored them
    BUFFER = "buffer"  # from the producer's decode node's memory, over the prefill engine's CNIC


@dataclass(frozen=True)
class ShareInputs:
    """One request's figures when it is considered for a prefill engine."""

    hit_tokens: int  # stored already (its late hit)
    promised_tokens: int  # the producer's run right after the hit
    # The rest of its prompt past the promised blocks: at least one token, or 0 where the last
    # promised block holds the prompt's last token (a partial-block hit, module doc).
    miss_tokens: int
    ready_in_s: float  # until the producer publishes the promised blocks (0 if it is late)
    read_queue_tokens: int  # queued on the reader the promised blocks would be read through
    engine_queue_tokens: int  # prefill tokens the engines it may land on hold before it
    # The producer's decode node keeps its prompt in memory and is this request's decode node.
    same_decode_node: bool = False

    def __post_init__(self) -> None:
        if min(self.hit_tokens, self.promised_tokens, self.read_queue_tokens, self.engine_queue_tokens) < 0 or (
            self.miss_tokens < 0 or self.ready_in_s < 0 or self.prompt_tokens < 1
        ):
            raise ValueError(f"share inputs must be >= 0 (and hit + promised + miss >= 1): {self}")

    @property
    def prompt_tokens(self) -> int:
        return self.hit_tokens + self.promised_tokens + self.miss_tokens


def _prefill_s(inputs: ShareInputs, model: ComputePathModel, cached: int) -> float:
    """The latency model's prefill of the request with `cached` tokens read: its last token is
    computed whatever is read (it yields the logits)."""
    cached = min(cached, inputs.prompt_tokens - 1)
    return model.prefill_s(cached, inputs.prompt_tokens - cached)


def end_if_computed(inputs: ShareInputs, model: ComputePathModel) -> float:
    """Seconds from now to the end of its prefill when it computes the promised blocks itself."""
    engine_wait = inputs.engine_queue_tokens / model.compute_tokens_per_s
    return engine_wait + _prefill_s(inputs, model, inputs.hit_tokens)


def sources(inputs: ShareInputs, model: ComputePathModel) -> tuple[ShareSource, ...]:
    """The sources it could read the promised blocks from, the buffer first (it wins ties)."""
    if inputs.same_decode_node and model.buffer_read_tokens_per_s > 0:
        return ShareSource.BUFFER, ShareSource.STORE
    return (ShareSource.STORE,)


def end_if_waiting(inputs: ShareInputs, model: ComputePathModel, source: ShareSource = ShareSource.STORE) -> float:
    """Seconds from now to the end of its prefill when it waits for the producer and reads the
    promised blocks from `source`."""
    engine_wait = inputs.engine_queue_tokens / model.compute_tokens_per_s
    if source is ShareSource.BUFFER:
        read_s = inputs.promised_tokens / model.buffer_read_tokens_per_s
    else:
        read_s = (inputs.read_queue_tokens + inputs.promised_tokens) / model.read_tokens_per_s
    read_done = inputs.ready_in_s + read_s
    return max(read_done, engine_wait) + _prefill_s(inputs, model, inputs.hit_tokens + inputs.promised_tokens)


def wait_source(inputs: ShareInputs, model: ComputePathModel) -> ShareSource | None:
    """The source to wait for and read the promised blocks from, or None: compute them (module doc)."""
    if inputs.promised_tokens == 0:
        return None
    ends = {source: end_if_waiting(inputs, model, source) for source in sources(inputs, model)}
    best = min(ends, key=ends.__getitem__)  # the first of equal minima: the buffer
    return best if ends[best] < end_if_computed(inputs, model) else None


def should_wait(inputs: ShareInputs, model: ComputePathModel) -> bool:
    """Whether waiting for the producer ends the request strictly sooner (module doc)."""
    return wait_source(inputs, model) is not None
