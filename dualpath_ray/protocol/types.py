"""The names every part of dualpath_ray shares, defined once as enums.

They are `str` enums: a member equals its value ("pe" == ReadPath.PE), hashes like it, and is
written as it in JSON, YAML, Arrow tables and logs, so configs and stored results keep their
plain strings while code compares members.
"""

from __future__ import annotations

import enum


class NameEnum(str, enum.Enum):
    """A str enum that prints as its value (f-strings, str()), on every Python this supports."""

    def __str__(self) -> str:
        return str(self.value)


class Mode(NameEnum):
    """How a cluster reads hit KV (paper section 7's systems)."""

    DUALPATH = "dualpath"  # both read paths; the scheduler picks one per request
    BASIC = "basic"  # the prefill-side path only (the paper's baseline, with layerwise prefill)
    ORACLE = "oracle"  # no storage I/O or transfers at all: the upper bound


class ReadPath(NameEnum):
    """Where a request's hit KV is read from the store."""

    PE = "pe"  # into the prefill node's buffer, through its SNIC
    DE = "de"  # into the decode node's buffer, through its SNIC, then pulled layer by layer
    SPLIT = "split"  # its first hit blocks the PE way, the rest the DE way (scheduler.read_split)

    @property
    def side(self) -> ReadPath:
        """The side whose byte counters a request's moves count under: a split request's
        bytes count as DE, except the blocks its prefill-side reader reads (counted as PE)."""
        return ReadPath.DE if self is ReadPath.SPLIT else self


class Role(NameEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class StopReason(NameEnum):
    """Why a turn stopped generating."""

    LENGTH = "length"  # max_new_tokens generated
    STOP = "stop"  # a stop token was sampled
    CONTEXT = "context"  # the model's max_context is full
    ERROR = "error"  # it failed (TurnResult.error_kind says why)
    ABORTED = "aborted"  # its caller aborted it; it produced nothing


READ_SIDES = (ReadPath.PE, ReadPath.DE)  # the two ways a KV byte moves; byte counters keep one each
