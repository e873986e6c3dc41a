"""The Ray-free parts of the KV transport: ticket checks, lifecycle, UCX knobs, tags, digests."""

from __future__ import annotations

import os

import pytest
import torch

from dualpath_ray.runtime.transport import (
    TRANSPORT_GROUP,
    TransferTicket,
    TransportError,
    TransportState,
    check_offer_tensors,
    check_pull_targets,
    endpoint_actor_options,
    make_transport,
    next_state,
    tensors_digest,
)
from dualpath_ray.runtime.transport_gloo import _MAX_TAG, _TagCounter
from dualpath_ray.runtime.transport_nixl import apply_ucx_environment, ucx_environment


def _ticket(*shapes: tuple[int, ...]) -> TransferTicket:
    nbytes = sum(torch.Size(s).numel() for s in shapes)
    return TransferTicket("src#x-0", "src", nbytes, tuple(shapes), handle=None)


def test_matching_targets_pass_and_each_mismatch_is_named() -> None:
    pool = torch.zeros(4, 2, 8, 16, dtype=torch.uint8)
    ticket = _ticket((8, 16), (8, 16))
    check_pull_targets(ticket, [pool[3, 1], pool[0, 0]])
    cases = {
        "2 tensors": [pool[3, 1]],
        "shape": [pool[3, 1], pool[0, 0, :4]],
        "dtype": [pool[3, 1], torch.zeros(8, 16)],
        "contiguous": [pool[3, 1], torch.zeros(16, 8, dtype=torch.uint8).t()],
    }
    for needle, targets in cases.items():
        with pytest.raises(TransportError, match=needle):
            check_pull_targets(ticket, targets)


def test_offers_must_be_non_empty_contiguous_uint8() -> None:
    pool = torch.zeros(4, 2, 8, dtype=torch.uint8)
    check_offer_tensors([pool[3, 1], pool[1, 0]])
    for needle, tensors in {
        "empty": [],
        "dtype": [pool[0, 0].float()],
        "contiguous": [pool[:, 0]],
    }.items():
        with pytest.raises(TransportError, match=needle):
            check_offer_tensors(tensors)


def test_lifecycle_allows_rejoining_and_forbids_leaving_closed() -> None:
    state = next_state(TransportState.AWAITING_WORLD, TransportState.READY)
    state = next_state(state, TransportState.BROKEN)
    state = next_state(state, TransportState.READY)
    assert next_state(state, TransportState.READY) is TransportState.READY, "a world may be formed again"
    closed = next_state(state, TransportState.CLOSED)
    with pytest.raises(TransportError, match="closed to ready"):
        next_state(closed, TransportState.READY)
    with pytest.raises(TransportError, match="awaiting_world to broken"):
        next_state(TransportState.AWAITING_WORLD, TransportState.BROKEN)


def test_ucx_environment_maps_knobs_and_rejects_out_of_range_values() -> None:
    env = ucx_environment(service_level=3, traffic_class=106, tls="rc,cuda_copy", net_devices="mlx5_0:1")
    assert env == {
        "UCX_IB_SL": "3",
        "UCX_IB_TRAFFIC_CLASS": "106",
        "UCX_TLS": "rc,cuda_copy",
        "UCX_NET_DEVICES": "mlx5_0:1",
    }, "each knob sets exactly its UCX variable"
    assert ucx_environment() == {}, "no knobs, no variables"
    with pytest.raises(TransportError, match="service_level"):
        ucx_environment(service_level=16)
    with pytest.raises(TransportError, match="traffic_class"):
        ucx_environment(traffic_class=-1)
    with pytest.raises(TransportError, match="ucx_tls"):
        ucx_environment(tls=" ")


def test_apply_ucx_environment_refuses_to_change_a_set_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_IB_SL", "1")
    apply_ucx_environment({"UCX_IB_SL": "1"})
    with pytest.raises(TransportError, match="UCX_IB_SL is already"):
        apply_ucx_environment({"UCX_IB_SL": "2"})
    monkeypatch.delenv("UCX_IB_TRAFFIC_CLASS", raising=False)
    apply_ucx_environment({"UCX_IB_TRAFFIC_CLASS": "106"})
    assert os.environ["UCX_IB_TRAFFIC_CLASS"] == "106", "an unset variable is applied"
    monkeypatch.delenv("UCX_IB_TRAFFIC_CLASS")


def test_make_transport_rejects_bad_arguments() -> None:
    with pytest.raises(TransportError, match="unknown kind"):
        make_transport("rdma", "reader/n1", namespace="dualpath")
    with pytest.raises(TransportError, match="endpoint_name"):
        make_transport("gloo", "", namespace="dualpath")
    with pytest.raises(TransportError, match="timeout_s"):
        make_transport("gloo", "reader/n1", namespace="dualpath", timeout_s=0)


def test_gloo_transport_waits_for_a_world_before_offering() -> None:
    transport = make_transport("gloo", "reader/n1", namespace="dualpath")
    assert transport.state is TransportState.AWAITING_WORLD, "a gloo endpoint starts outside any world"
    with pytest.raises(TransportError, match="setup_gloo_world"):
        transport.offer([torch.zeros(4, dtype=torch.uint8)])
    transport.close()
    with pytest.raises(TransportError, match="closed"):
        transport.register(torch.zeros(4, dtype=torch.uint8))


def test_tags_are_unique_and_wrap_before_the_gloo_limit() -> None:
    counter = _TagCounter()
    first, second = counter.allocate(3), counter.allocate(2)
    assert len(set(first) | set(second)) == 5, "tags never repeat between outstanding transfers"
    counter._next = _MAX_TAG - 1
    wrapped = counter.allocate(4)
    assert wrapped == (1, 2, 3, 4), "the counter wraps to 1 instead of overflowing int32"


def test_digest_is_order_and_content_sensitive() -> None:
    a, b = torch.arange(8, dtype=torch.uint8), torch.arange(8, 16, dtype=torch.uint8)
    assert tensors_digest([a, b]) == tensors_digest([a.clone(), b.clone()]), "equal bytes, equal digest"
    assert tensors_digest([a, b]) != tensors_digest([b, a]), "order matters"


def test_endpoint_options_enable_rdt_and_the_transport_group() -> None:
    options = endpoint_actor_options(4, {"control": 1})
    assert options == {
        "enable_tensor_transport": True,
        "concurrency_groups": {TRANSPORT_GROUP: 4, "control": 1},
    }, "endpoint classes get RDT and the transport group next to their own groups"
    with pytest.raises(TransportError, match="transport_threads"):
        endpoint_actor_options(0)
