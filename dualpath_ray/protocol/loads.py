"""An engine's load report: what every engine sends the scheduler, and the policy reads
(scheduling/loads.py takes it with the policy's other types). Defined with the messages, below the
scheduling package, so the messages that carry it need nothing from above.
"""

from __future__ import annotations

from dataclasses import dataclass


def require_non_negative(owner: str, field: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{owner}.{field} must be >= 0 (got {value}); counters never go negative")


@dataclass(frozen=True)
class EngineLoad:
    """One engine's load report (paper section 6).

    seq: unfinished requests on the engine; tok: their summed tokens, as `QueuedRequest.tokens`
    counts them (a prefill engine: tokens to compute, `prefill_tokens`; a decode engine: whole
    lengths, the KV it holds); free_hbm_tokens: KV capacity still free in its HBM, in tokens (used
    by decode engines only).
    """

    engine_id: str
    node_id: str
    seq: int
    tok: int
    free_hbm_tokens: int = 0

    def __post_init__(self) -> None:
        require_non_negative("EngineLoad", "seq", self.seq)
        require_non_negative("EngineLoad", "tok", self.tok)
        require_non_negative("EngineLoad", "free_hbm_tokens", self.free_hbm_tokens)
