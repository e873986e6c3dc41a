"""`dualpath cluster up` without starting Ray: the dashboard (the job-submission API) binds
loopback, Ray's token authentication (what guards the GCS and raylet ports, which Ray 2.60 binds
to every interface in a multi-node cluster) is on unless RAY_AUTH_MODE=disabled says otherwise,
and `up` says plainly which it is and how to turn it on."""

from __future__ import annotations

from pathlib import Path

from dualpath_ray.commands.cluster import RayTokenAuth, describe, ray_token_auth
from dualpath_ray.config import parse_config
from dualpath_ray.local_cluster import LocalCluster, NodeProcess, UpOptions, node_commands

PORTS = {"agent": 1001, "client": 1002, "head": 1003, "p0": 1004, "d0": 1005}


def test_the_dashboard_binds_loopback_and_nothing_asks_for_a_wildcard() -> None:
    commands = node_commands(parse_config({}), UpOptions(port=7000, temp_dir=Path("/tmp/dp")), PORTS)
    assert len(commands) == 3, "the head and the default 1P1D's two nodes"
    assert "--dashboard-host=127.0.0.1" in commands[0][2], "the dashboard (job submission) listens on loopback"
    for name, _, args in commands:
        assert not any("0.0.0.0" in arg or "::" in arg for arg in args), f"{name} asks for no wildcard address"


def test_token_auth_is_on_unless_ray_auth_mode_turns_it_off() -> None:
    assert ray_token_auth({}).enabled, "RAY_AUTH_MODE unset: token auth on, as ray.init() does for a local cluster"
    assert ray_token_auth({"RAY_AUTH_MODE": "token"}).enabled, "RAY_AUTH_MODE=token: on"
    off = ray_token_auth({"RAY_AUTH_MODE": "DISABLED"})
    assert not off.enabled, "RAY_AUTH_MODE=disabled (as the tests set it): off"
    said = off.describe()
    assert said.startswith("OFF (RAY_AUTH_MODE=DISABLED)") and "unset RAY_AUTH_MODE" in said, (
        "up says plainly that auth is off and how to turn it on"
    )


def test_up_reports_the_binding_and_the_auth() -> None:
    cluster = LocalCluster("/tmp/state", "127.0.0.1:7000", "http://127.0.0.1:7001",
                           [NodeProcess("head", "head", 1, 1003, "head.log")], ray_temp_dir="/tmp/dp")
    text = describe(cluster, RayTokenAuth(True, None))
    assert "dashboard on 127.0.0.1 only" in text and "every interface" in text, (
        "up says what listens where, Ray's own ports included"
    )
    assert "Ray token auth   on: clients need export RAY_AUTH_MODE=token" in text, (
        "up says auth is on and what a client given the address needs"
    )
