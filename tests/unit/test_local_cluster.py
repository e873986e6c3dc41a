"""`dualpath cluster up/down` without starting Ray: the `ray start` lines carry the role labels,
slot resources and GPU slots of the config's topology; bad flags and missing state are one-line
errors (exit 2). The cluster itself runs in tests/integration/test_observability.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dualpath_ray.cli import main
from dualpath_ray.config import parse_config
from dualpath_ray.local_cluster import (
    LocalCluster,
    LocalClusterError,
    NodeProcess,
    UpOptions,
    down,
    free_port,
    node_commands,
    up,
)

PORTS = {"agent": 1001, "client": 1002, "head": 1003, "p0": 1004, "p1": 1005, "d0": 1006}


def test_ray_start_lines_label_every_node_with_its_role_slot_and_gpus() -> None:
    cfg = parse_config({"cluster": {"prefill_nodes": 2, "decode_nodes": 1, "gpus_per_node": 4, "cpus_per_node": 1.5}})
    options = UpOptions(port=7000, dashboard_port=7001, temp_dir=Path("/tmp/dp"))
    commands = node_commands(cfg, options, PORTS)
    assert [(name, role) for name, role, _ in commands] == [
        ("head", "head"), ("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")
    ], "the head first, then one Ray node per configured node"
    head = commands[0][2]
    for flag in ("--head", "--port=7000", "--dashboard-port=7001", "--include-dashboard=true",
                 '--resources={"dualpath_head": 1}', "--metrics-export-port=1003", "--block"):
        assert flag in head, f"the head's ray start has {flag}"
    for name, role, args in commands[1:]:
        for flag in ("--address=127.0.0.1:7000", "--num-gpus=4", "--num-cpus=2", f"--labels=dualpath/role={role}",
                     f'--resources={{"dualpath_{role}_slot": 1}}', f"--metrics-export-port={PORTS[name]}"):
            assert flag in args, f"{name}'s ray start has {flag}"
    assert all("--temp-dir=/tmp/dp" in args for _, _, args in commands), "every node shares the temp dir"
    default = node_commands(cfg, UpOptions(port=7000), PORTS)
    assert all("--temp-dir=/tmp/dualpath-ray-7000" in args for _, _, args in default), (
        "by default the nodes get a Ray temp dir of their own, so `auto` finds this cluster, not another"
    )


def test_up_refuses_a_port_in_use_before_starting_anything(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(LocalClusterError, match=f"--dashboard-port {port}: the port is in use"):
            up(parse_config({}), UpOptions(state_dir=tmp_path, port=free_port(), dashboard_port=port))
    assert not (tmp_path / "cluster.json").exists(), "nothing was started or recorded"


def test_state_round_trips_and_down_without_state_is_an_error(tmp_path: Path) -> None:
    cluster = LocalCluster(str(tmp_path), "127.0.0.1:7000", "http://127.0.0.1:7001",
                           [NodeProcess("head", "head", 2**22 + 1, 1003, "head.log")])
    cluster.save()
    assert LocalCluster.load(tmp_path) == cluster, "the state file holds the whole cluster"
    assert cluster.metrics_targets() == ["127.0.0.1:1003"], "Prometheus scrapes every node's export port"
    with pytest.raises(LocalClusterError, match="no local cluster recorded"):
        down(tmp_path / "elsewhere")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["cluster", "up", "--port", "70000"], "--port must be a port"),
        (["cluster", "up", "--object-store-mb", "10"], "--object-store-mb must be >= 75"),
        (["cluster", "up", "--scrape-interval", "0"], "--scrape-interval must be > 0"),
        (["status", "--window", "-1"], "--window must be > 0"),
    ],
)
def test_bad_flags_are_one_line_errors_with_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2, f"{argv}: a bad flag exits 2"
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, f"one line naming the flag: {err!r}"


def test_up_refuses_a_state_dir_whose_cluster_still_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    LocalCluster(str(tmp_path), "127.0.0.1:7000", "http://127.0.0.1:7001",
                 [NodeProcess("head", "head", os.getpid(), 1003, "head.log")]).save()
    assert main(["cluster", "up", "--state-dir", str(tmp_path)]) == 2, "a second up on a live state dir exits 2"
    assert "still running" in capsys.readouterr().err, "and says which cluster runs"
    assert json.loads((tmp_path / "cluster.json").read_text())["address"] == "127.0.0.1:7000", "the state is kept"
