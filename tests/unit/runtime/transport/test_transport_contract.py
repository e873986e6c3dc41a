"""The Ray-free contract of the KV transport: regions, coalescing, lifecycle, self-moves, knobs, tags."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from dualpath_ray.config.verbs import VerbsConfig
from dualpath_ray.runtime.transport.base import TRANSPORT_GROUP, Transport
from dualpath_ray.runtime.transport.moves import (
    PoolInfo,
    Region,
    RegionError,
    Transfer,
    TransportError,
    TransportState,
    TransportStats,
    check_moves,
    check_region,
    coalesce_moves,
    next_state,
)
from dualpath_ray.runtime.transport.endpoint import endpoint_actor_options
from dualpath_ray.runtime.transport.factory import make_transport
from dualpath_ray.runtime.transport.gloo import _MAX_TAG, _TAG_RANGES, _TagCounter
from dualpath_ray.runtime.transport.verbs import VerbsTransport
from dualpath_ray.runtime.transport.nixl import (
    apply_ucx_environment,
    descriptor_groups,
    nixl_pool,
    ucx_environment,
)

from tests.fake_verbs import FakeFabric, FakeVerbs

POOLS = {"hbm": PoolInfo("hbm", 1024, "cpu"), "window": PoolInfo("window", 256, "cpu")}


def _sealed_gloo(name: str = "decode/n1/g0") -> tuple[Transport, torch.Tensor, torch.Tensor]:
    """A gloo transport (no world, no Ray) with a float32 pool "hbm" [4, 2, 8] and a uint8 "window"."""
    transport = make_transport("gloo", name, namespace="dualpath")
    hbm = torch.arange(64, dtype=torch.float32).reshape(4, 2, 8)
    window = torch.zeros(3, 16, dtype=torch.uint8)
    transport.register("hbm", hbm)
    transport.register("window", window)
    transport.seal()
    return transport, hbm, window


def _sealed_verbs(name: str = "decode/n1/g0") -> tuple[Transport, torch.Tensor, torch.Tensor]:
    """The same pools on a verbs transport over the fake verbs layer (tests/fake_verbs.py)."""
    transport = VerbsTransport(name, "dualpath", 60.0, layer=FakeVerbs(FakeFabric()), settings=VerbsConfig())
    hbm = torch.arange(64, dtype=torch.float32).reshape(4, 2, 8)
    window = torch.zeros(3, 16, dtype=torch.uint8)
    transport.register("hbm", hbm)
    transport.register("window", window)
    transport.seal()
    return transport, hbm, window


SEALED = [pytest.param(_sealed_gloo, id="gloo"), pytest.param(_sealed_verbs, id="verbs-fake")]


def test_region_checks_name_the_field_and_the_fix() -> None:
    assert check_region(Region("hbm", 1000, 24), POOLS, "decode/n1/g0", "r") == Region("hbm", 1000, 24), (
        "a region ending exactly at the pool's end is valid"
    )
    cases = {
        "not a Region": ("hbm", 0, 8),
        "r.pool 'kv' is not a pool of decode/n1/g0": Region("kv", 0, 8),
        r"r.offset is -8; it must be an int >= 0": Region("hbm", -8, 8),
        r"r.nbytes is 0; it must be an int > 0": Region("hbm", 0, 0),
        r"ends at byte 1032, past the end of decode/n1/g0's pool 'hbm' \(1024 bytes\)": Region("hbm", 1000, 32),
    }
    for needle, region in cases.items():
        with pytest.raises(RegionError, match=needle):
            check_region(region, POOLS, "decode/n1/g0", "r")


def test_moves_must_be_non_empty_pairs_of_equal_size() -> None:
    good = [(Region("hbm", 0, 8), Region("buffer", 64, 8))]
    assert check_moves(good, "read") == good, "well-formed moves pass unchanged"
    for needle, moves in {
        "non-empty list": [],
        r"moves\[0\] must be a \(local Region, remote Region\) tuple": [Region("hbm", 0, 8)],
        r"moves\[1\] local nbytes 8 != remote nbytes 16": good + [(Region("hbm", 8, 8), Region("buffer", 0, 16))],
    }.items():
        with pytest.raises(RegionError, match=needle):
            check_moves(moves, "read")


def test_coalescing_merges_runs_contiguous_on_both_sides_only() -> None:
    moves = [
        (Region("hbm", 0, 8), Region("buffer", 100, 8)),
        (Region("hbm", 8, 8), Region("buffer", 108, 8)),  # continues both sides: merged
        (Region("hbm", 16, 8), Region("buffer", 200, 8)),  # remote jumps: new descriptor
        (Region("hbm", 24, 8), Region("buffer", 208, 8)),  # continues the previous one: merged
        (Region("window", 32, 8), Region("buffer", 216, 8)),  # other local pool: new descriptor
        (Region("hbm", 0, 4), Region("buffer", 0, 4)),  # behind the previous run: kept in order
    ]
    assert coalesce_moves(moves) == [
        (Region("hbm", 0, 16), Region("buffer", 100, 16)),
        (Region("hbm", 16, 16), Region("buffer", 200, 16)),
        (Region("window", 32, 8), Region("buffer", 216, 8)),
        (Region("hbm", 0, 4), Region("buffer", 0, 4)),
    ], "adjacent moves merge only when local and remote both continue the previous move"


@pytest.mark.parametrize("sealed", SEALED)
def test_region_of_and_view_are_byte_arithmetic_on_the_pool(sealed: Callable[..., Any]) -> None:
    transport, hbm, window = sealed()
    region = transport.region_of("hbm", hbm[2, 1])
    assert region == Region("hbm", (2 * 2 + 1) * 8 * 4, 8 * 4), "offset and size count bytes, whatever the dtype"
    assert torch.equal(transport.view(region), hbm[2, 1].view(torch.uint8)), "view() returns the same bytes"
    assert transport.view(region).dtype == torch.uint8 and transport.view(region).dim() == 1, "views are uint8 1-D"
    assert transport.region_of("window", window[1]) == Region("window", 16, 16), "every pool has its own offsets"
    for needle, pool, view in [
        ("not contiguous", "hbm", hbm[:, 0]),
        ("not inside pool 'hbm'", "hbm", torch.zeros(8)),
        ("'kv' is not a pool", "kv", hbm[0]),
    ]:
        with pytest.raises(RegionError, match=needle):
            transport.region_of(pool, view)
    with pytest.raises(RegionError, match="past the end"):
        transport.view(Region("window", 40, 16))


def test_registration_rules() -> None:
    transport = make_transport("gloo", "reader/n1", namespace="dualpath")
    transport.register("buffer", torch.zeros(4, 8, dtype=torch.uint8))
    for needle, name, pool in [
        ("already registered", "buffer", torch.zeros(4, dtype=torch.uint8)),
        ("contiguous", "other", torch.zeros(4, 8).t()),
        ("non-empty str", "", torch.zeros(4)),
        ("gloo moves host memory; use nixl on GPU nodes", "hbm", torch.empty(8, device="meta")),
    ]:
        with pytest.raises(RegionError, match=needle):
            transport.register(name, pool)
    transport.seal()
    with pytest.raises(TransportError, match="register before seal"):
        transport.register("late", torch.zeros(4))
    with pytest.raises(TransportError, match="seal\\(\\) runs once"):
        transport.seal()


def test_lifecycle_transitions() -> None:
    for path in (
        [TransportState.READY, TransportState.CLOSED],  # nixl: seal -> ready
        [TransportState.AWAITING_WORLD, TransportState.READY, TransportState.BROKEN, TransportState.READY],
    ):
        state = TransportState.REGISTERING
        for target in path:
            state = next_state(state, target)
        assert state is path[-1], f"the lifecycle allows {path}"
    assert next_state(TransportState.READY, TransportState.READY) is TransportState.READY, "a world may be re-formed"
    for current, target in [
        (TransportState.CLOSED, TransportState.READY),
        (TransportState.AWAITING_WORLD, TransportState.BROKEN),
        (TransportState.REGISTERING, TransportState.BROKEN),
    ]:
        with pytest.raises(TransportError, match=f"from {current.value} to {target.value}"):
            next_state(current, target)


def test_state_gates_moves_and_info() -> None:
    transport = make_transport("gloo", "reader/n1", namespace="dualpath")
    transport.register("buffer", torch.zeros(64, dtype=torch.uint8))
    move = [(Region("buffer", 0, 8), Region("buffer", 8, 8))]
    assert transport.state is TransportState.REGISTERING, "a transport starts registering"
    with pytest.raises(TransportError, match="info\\(\\) needs seal"):
        transport.info()
    with pytest.raises(TransportError, match="call seal\\(\\) after registering"):
        transport.read("reader/n1", move)
    transport.seal()
    assert transport.state is TransportState.AWAITING_WORLD, "a sealed gloo endpoint waits for its world"
    with pytest.raises(TransportError, match="setup_gloo_world"):
        transport.read("decode/n2/g0", move)
    info = transport.info()
    assert (info.endpoint, info.kind, info.pools) == ("reader/n1", "gloo", (PoolInfo("buffer", 64, "cpu"),)), (
        "info() publishes the endpoint name, kind and every pool's size and device"
    )
    transport.close()
    assert transport.state is TransportState.CLOSED, "close() ends the lifecycle"
    transport.close()  # idempotent
    with pytest.raises(TransportError, match="it was closed"):
        transport.write("reader/n1", move)


@pytest.mark.parametrize("sealed", SEALED)
def test_self_moves_copy_bytes_and_count(sealed: Callable[..., Any]) -> None:
    transport, hbm, window = sealed("prefill/n0/g0")
    me = transport.endpoint_name
    window[0] = torch.arange(16, dtype=torch.uint8)
    source = transport.region_of("window", window[0])
    first, second = transport.region_of("hbm", hbm[1, 0]), transport.region_of("hbm", hbm[1, 1])
    halves = [Region("window", 0, 8), Region("window", 8, 8)]
    pairs = [(Region("hbm", first.offset, 8), halves[0]), (Region("hbm", first.offset + 8, 8), halves[1])]
    read = transport.read(me, pairs)
    assert read.done() and read.wait() == 16, "a self-read completes at once and reports its bytes"
    assert torch.equal(transport.view(Region("hbm", first.offset, 16)), window[0]), "a self-read copies remote -> local"
    transport.write(me, [(source, Region("hbm", second.offset, 16))]).wait()
    written = transport.view(Region("hbm", second.offset, 16))
    assert torch.equal(written, window[0]), "a self-write copies local -> remote"
    transport.read(me, [(Region("window", 4, 8), Region("window", 0, 8))]).wait()
    expected = [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15]
    assert window[0].tolist() == expected, "an overlapping copy reads the bytes as they were before it"
    assert transport.stats() == TransportStats(posted=3, descriptors=3, bytes_read=24, bytes_written=16), (
        "stats count posted transfers, coalesced descriptors and completed bytes; no peer calls"
    )
    with pytest.raises(RegionError, match="remote region"):
        transport.read(me, [(source, Region("hbm", 1020, 16))])


class _Stuck(Transfer):
    """A backend transfer that never completes; records its abort."""

    aborted: list[str]

    def _poll(self) -> bool:
        return False

    def _abort(self, reason: str) -> TransportError:
        self.aborted.append(reason)
        return TransportError(f"stuck: {reason}")


class _VirtualTime:
    """Stands in for the `time` module of transport/moves.py: the clock moves only by what
    wait() sleeps (plus a microsecond per reading, so its spin ends), never by the machine's
    speed, and every poll of the backend is counted."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept = 0.0

    def monotonic(self) -> float:
        self.now += 1e-6
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept += seconds
        self.now += seconds


def test_transfer_wait_aborts_on_timeout_and_the_error_is_sticky(monkeypatch: pytest.MonkeyPatch) -> None:
    import dualpath_ray.runtime.transport.moves as moves_module

    clock = _VirtualTime()
    monkeypatch.setattr(moves_module, "time", clock)
    done: list[Transfer] = []
    stuck = _Stuck("read", "reader/n1", 8, clock.now + 60, done.append)
    stuck.aborted = []
    assert stuck.done() is False, "a running transfer polls as not done"
    started = clock.now
    with pytest.raises(TransportError, match="wait\\(0.05\\) expired"):
        stuck.wait(0.05)
    waited = clock.now - started
    # Pauses double up to 1 ms: it notices its timeout at most one pause (and a few clock
    # readings) after it passed, and long before the transfer's own deadline 60 s away.
    assert 0.05 <= waited <= 0.05 + 0.0011, f"wait gives up at its timeout: {waited:.4f} s of virtual time"
    assert stuck.aborted == ["wait(0.05) expired"], "giving up aborts the backend transfer exactly once"
    with pytest.raises(TransportError, match="stuck"):
        stuck.done()
    late = _Stuck("write", "reader/n1", 8, clock.now - 1, done.append)
    late.aborted = []
    with pytest.raises(TransportError, match="before the transport timeout"):
        late.done()
    assert done == [], "failed transfers are never counted as done"


def test_ucx_environment_maps_knobs_and_rejects_out_of_range_values() -> None:
    env = ucx_environment(service_level=3, traffic_class=106, tls="rc,cuda_copy", net_devices="mlx5_0:1")
    assert env == {
        "UCX_IB_SL": "3",
        "UCX_IB_TRAFFIC_CLASS": "106",
        "UCX_TLS": "rc,cuda_copy",
        "UCX_NET_DEVICES": "mlx5_0:1",
    }, "each knob sets exactly its UCX variable"
    assert ucx_environment() == {}, "no knobs, no variables"
    for needle, knobs in {
        "service_level": {"service_level": 16},
        "traffic_class": {"traffic_class": -1},
        "ucx_tls": {"tls": " "},
        "ucx_net_devices": {"net_devices": ""},
    }.items():
        with pytest.raises(TransportError, match=needle):
            ucx_environment(**knobs)  # type: ignore[arg-type]


def test_apply_ucx_environment_refuses_to_change_a_set_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_IB_SL", "1")
    apply_ucx_environment({"UCX_IB_SL": "1"})
    with pytest.raises(TransportError, match="UCX_IB_SL is already"):
        apply_ucx_environment({"UCX_IB_SL": "2"})
    monkeypatch.delenv("UCX_IB_TRAFFIC_CLASS", raising=False)
    apply_ucx_environment({"UCX_IB_TRAFFIC_CLASS": "106"})
    assert os.environ["UCX_IB_TRAFFIC_CLASS"] == "106", "an unset variable is applied"
    monkeypatch.delenv("UCX_IB_TRAFFIC_CLASS")


def test_nixl_descriptors_address_pool_base_plus_offset() -> None:
    pool = torch.zeros(64, dtype=torch.uint8)
    local = {"hbm": nixl_pool("hbm", pool)}
    remote = {"buffer": nixl_pool("buffer", pool[32:])}
    groups = descriptor_groups(
        [(Region("hbm", 8, 4), Region("buffer", 0, 4)), (Region("hbm", 20, 2), Region("buffer", 10, 2))], local, remote
    )
    assert list(groups) == [("DRAM", "DRAM")], "host pools on both sides make one DRAM->DRAM transfer"
    own, peer = groups[("DRAM", "DRAM")]
    base = pool.data_ptr()
    assert own.tolist() == [[base + 8, 4, 0], [base + 20, 2, 0]], "local rows are (pool base + offset, nbytes, device)"
    assert peer.tolist() == [[base + 32, 4, 0], [base + 42, 2, 0]], "remote rows use the peer's published base"


def test_make_transport_rejects_bad_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    for needle, kind, name, timeout_s in [
        ("unknown kind", "rdma", "reader/n1", 1.0),
        ("endpoint_name", "gloo", "", 1.0),
        ("timeout_s", "gloo", "reader/n1", 0.0),
    ]:
        with pytest.raises(TransportError, match=needle):
            make_transport(kind, name, namespace="dualpath", timeout_s=timeout_s)
    monkeypatch.setitem(sys.modules, "nixl._api", None)  # what a missing nixl extra looks like
    with pytest.raises(TransportError, match=r"nixl is not installed; pip install '\.\[nixl\]' or use gloo"):
        make_transport("nixl", "reader/n1", namespace="dualpath")


def test_tags_are_unique_per_op_disjoint_between_ops_and_wrap_before_the_limit() -> None:
    counter = _TagCounter()
    reads, more, writes = counter.allocate("read", 3), counter.allocate("read", 2), counter.allocate("write", 4)
    assert len(set(reads) | set(more)) == 5, "tags of one op never repeat between outstanding transfers"
    assert not set(reads + more) & set(writes), "reads and writes share a direction, so their tags are disjoint"
    low, high = _TAG_RANGES["write"]
    assert high <= _MAX_TAG and _TAG_RANGES["read"][1] <= low, "the two ranges do not overlap and fit in int32"
    counter._next["write"] = high - 1
    assert counter.allocate("write", 4) == tuple(range(low, low + 4)), "the counter wraps to its range's start"


def test_endpoint_options_give_the_transport_group_next_to_the_classes_own() -> None:
    options = endpoint_actor_options(4, {"control": 1})
    assert options == {"concurrency_groups": {TRANSPORT_GROUP: 4, "control": 1}}, (
        "endpoint classes get the transport group next to their own groups (no RDT any more)"
    )
    with pytest.raises(TransportError, match="transport_threads"):
        endpoint_actor_options(0)
