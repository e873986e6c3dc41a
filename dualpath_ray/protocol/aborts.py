"""What a caller asks the scheduler to abort (`Scheduler.abort`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AbortTarget:
    """One request (`request_id`), a whole trajectory (`prefix`: every request whose id starts
    with it, in flight now, and later ones until `clear_aborts([prefix])`), or, with neither,
    every request in flight now (later ones run as usual). Build it with `request`,
    `trajectory` or `everything`."""

    request_id: str | None = None
    prefix: str | None = None

    def __post_init__(self) -> None:
        if self.request_id is not None and self.prefix is not None:
            raise ValueError(
                "AbortTarget: request_id and prefix both set; give one (AbortTarget.request or "
                "AbortTarget.trajectory), or neither to abort everything in flight"
            )
        if self.prefix == "":
            raise ValueError(
                "AbortTarget.prefix is empty, which would refuse every later request; use "
                "AbortTarget.everything() to abort what is in flight"
            )

    @classmethod
    def request(cls, request_id: str) -> AbortTarget:
        return cls(request_id=request_id)

    @classmethod
    def trajectory(cls, prefix: str) -> AbortTarget:
        return cls(prefix=prefix)

    @classmethod
    def everything(cls) -> AbortTarget:
        return cls()
