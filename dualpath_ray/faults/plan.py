"""The fault plan: which faults a run injects, where, how often (the `faults` config section).

A plan is part of the config, so every actor of a deployment gets the same plan with its config
(no environment variables); each process injects only at the sites of its own role, decided by
its own seeded random stream, and counts what it injected (faults/injector.py).
"""

from __future__ import annotations

import enum
import fnmatch

from pydantic import BaseModel, ConfigDict, Field, model_validator


class FaultSite(str, enum.Enum):
    STORE_READ = "store_read"  # a reader reading one hit Full Block
    STORE_PUBLISH = "store_publish"  # a reader writing (publishing) one Full Block
    LAYER_TRANSFER = "layer_transfer"  # a prefill engine's layer read or write of KV
    BUFFER_TO_HBM = "buffer_to_hbm"  # a decode engine copying a handoff's KV into its pages
    # an engine's call to a reader, the scheduler or a decode engine, or the scheduler's task push
    ACTOR_CALL = "actor_call"
    HEARTBEAT = "heartbeat"  # an engine answering the scheduler's heartbeat


class FaultMode(str, enum.Enum):
    # the operation raises (actor calls: the request or the reply is lost; the store sites: the
    # store's own OSError(EIO), so an injected disk fault takes the path of a real one)
    FAIL = "fail"
    CORRUPT = "corrupt"  # one byte of the data is flipped (stored, in transit or copied)
    DROP = "drop"  # the operation silently does nothing (a publish lost; a heartbeat unanswered)
    DELAY = "delay"  # the operation waits delay_s first
    KILL = "kill"  # the process dies at this point (os._exit)


class CallPhase(str, enum.Enum):
    REQUEST = "request"  # the call never reaches the callee
    RESPONSE = "response"  # the callee ran it, the caller sees an error instead of the reply


MODES_BY_SITE: dict[FaultSite, frozenset[FaultMode]] = {
    FaultSite.STORE_READ: frozenset({FaultMode.FAIL, FaultMode.CORRUPT, FaultMode.DELAY, FaultMode.KILL}),
    # corrupt: one byte of the block's buffer flipped just before the store writes it (after its
    # engine computed it), which only the persist digest (runtime.kv_digests) can catch
    FaultSite.STORE_PUBLISH: frozenset({FaultMode.FAIL, FaultMode.CORRUPT, FaultMode.DROP, FaultMode.DELAY, FaultMode.KILL}),
    FaultSite.LAYER_TRANSFER: frozenset({FaultMode.FAIL, FaultMode.CORRUPT, FaultMode.DELAY, FaultMode.KILL}),
    FaultSite.BUFFER_TO_HBM: frozenset({FaultMode.FAIL, FaultMode.CORRUPT, FaultMode.DELAY, FaultMode.KILL}),
    FaultSite.ACTOR_CALL: frozenset({FaultMode.FAIL, FaultMode.DELAY, FaultMode.KILL}),
    FaultSite.HEARTBEAT: frozenset({FaultMode.DROP, FaultMode.DELAY}),
}

# The calls an engine waits on or whose loss the runtime must survive. Frees, reclaims and
# cancels are cleanup: losing one is a leak by construction, so they are not fault sites.
CALL_METHODS = ("read_hits", "lease", "persist_extent", "persist_pages", "report", "hand_off", "accept")


class FaultSpec(BaseModel):
    """One kind of fault at one site. Trigger: `nth` (exactly the nth eligible event of each
    process) or `probability` per event, with `min_count` forced at the first events after
    `after` and at most `max_count` per process."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    site: FaultSite = Field(description="Where: " + ", ".join(s.value for s in FaultSite) + ".")
    mode: FaultMode = Field(description="What: " + ", ".join(m.value for m in FaultMode) + " (allowed modes depend on the site).")
    actors: str = Field("*", min_length=1, description="Glob of the injecting actors' names, e.g. 'prefill/*', 'reader/d0'.")
    methods: tuple[str, ...] = Field(CALL_METHODS, description="actor_call only: which calls (" + ", ".join(CALL_METHODS) + ").")
    phase: CallPhase = Field(CallPhase.REQUEST, description="actor_call fail only: request or response lost.")
    nth: int | None = Field(None, ge=1, description="Inject at exactly this eligible event of each process.")
    probability: float = Field(0.0, ge=0.0, le=1.0, description="Chance per eligible event.")
    after: int = Field(0, ge=0, description="Eligible events of each process to let pass before any injection.")
    min_count: int = Field(0, ge=0, description="Injections forced (at the first eligible events after `after`).")
    max_count: int | None = Field(None, ge=0, description="At most this many injections per process.")
    delay_s: float = Field(0.0, ge=0.0, description="delay mode: seconds to wait.")

    @model_validator(mode="after")
    def _coherent(self) -> FaultSpec:
        allowed = MODES_BY_SITE[self.site]
        if self.mode not in allowed:
            raise ValueError(
                f"mode {self.mode.value!r} is not possible at site {self.site.value!r}; "
                f"use one of {sorted(m.value for m in allowed)}"
            )
        if self.nth is None and self.probability == 0.0 and self.min_count == 0:
            raise ValueError("a fault needs a trigger: set nth, probability > 0 or min_count > 0")
        if self.nth is not None and (self.probability or self.min_count):
            raise ValueError("nth and probability/min_count exclude each other; set one trigger")
        unknown = sorted(set(self.methods) - set(CALL_METHODS))
        if unknown:
            raise ValueError(f"methods {unknown} are not fault sites; use some of {list(CALL_METHODS)}")
        if self.phase is CallPhase.RESPONSE and (self.site is not FaultSite.ACTOR_CALL or self.mode is not FaultMode.FAIL):
            raise ValueError("phase: response is only for site actor_call with mode fail")
        if self.mode is FaultMode.DELAY and self.delay_s <= 0:
            raise ValueError("delay mode needs delay_s > 0")
        if self.max_count is not None and self.max_count < self.min_count:
            raise ValueError(f"max_count ({self.max_count}) is below min_count ({self.min_count})")
        return self

    def applies_to(self, actor: str) -> bool:
        return fnmatch.fnmatchcase(actor, self.actors)


class FaultPlan(BaseModel):
    """The `faults` section: empty (the default) injects nothing and costs nothing."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = Field(0, description="Seed of every process's fault stream (with its actor name).")
    faults: tuple[FaultSpec, ...] = Field((), description="The faults to inject; see FaultSpec.")

    @property
    def enabled(self) -> bool:
        return bool(self.faults)
