"""The Scheduler actor as a thin shell (issue 35, item 2), without Ray: fewer than 20 methods,
every status query answered by one view builder with its declared view type, and abort targets
that say what is wrong with them."""

from __future__ import annotations

import ast
import inspect
import typing

import pytest

from dualpath_ray.protocol.aborts import AbortTarget
from dualpath_ray.runtime.control import scheduler, status
from dualpath_ray.runtime.telemetry.status_views import STATUS_VIEWS, StatusQuery

MAX_METHODS = 19


def actor_methods() -> list[str]:
    tree = ast.parse(inspect.getsource(scheduler))
    actor = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler")
    return [n.name for n in actor.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_the_actor_has_fewer_than_twenty_methods() -> None:
    methods = actor_methods()
    assert len(methods) <= MAX_METHODS, f"the actor stays a thin shell ({len(methods)} methods: {methods})"
    assert "status" in methods, "what it knows is read through one entry point"


def test_every_status_query_has_a_builder_answering_its_declared_view() -> None:
    assert set(STATUS_VIEWS) == set(StatusQuery), "each query names the view type it answers with"
    for query in StatusQuery:
        builder = status._VIEWS[query]
        answered = typing.get_type_hints(builder)["return"]
        assert answered is STATUS_VIEWS[query], f"{query}: its builder returns {answered}, not {STATUS_VIEWS[query]}"


def test_a_status_query_of_the_wrong_type_is_refused_naming_the_choices() -> None:
    with pytest.raises(TypeError, match="StatusQuery"):
        status.status_view(None, "calls")  # type: ignore[arg-type]


def test_an_abort_target_names_one_thing_to_stop() -> None:
    assert AbortTarget.request("t/0") == AbortTarget(request_id="t/0"), "one request"
    assert AbortTarget.trajectory("t/").prefix == "t/", "one trajectory"
    everything = AbortTarget.everything()
    assert everything.request_id is None and everything.prefix is None, "everything in flight"
    with pytest.raises(ValueError, match="request_id and prefix both set"):
        AbortTarget(request_id="t/0", prefix="t/")
    with pytest.raises(ValueError, match="AbortTarget.prefix is empty"):
        AbortTarget.trajectory("")
