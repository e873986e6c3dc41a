"""The config tree: defaults, YAML loading, and errors that name the bad field."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath_ray.config import ConfigError, DualPathConfig, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]


def test_shipped_configs_load():
    for name in ("local-1p1d.yaml", "bench-1p1d.yaml", "chaos-1p1d.yaml", "bench-2p1d.yaml", "bench-vllm-2p1d.yaml"):
        cfg = load_config(REPO / "cluster_configs" / name)
        assert isinstance(cfg, DualPathConfig), f"{name} must load into the one config tree"


def test_defaults_carry_the_papers_scheduler_constants():
    s = DualPathConfig().scheduler
    assert (s.alpha_seconds, s.beta_seconds, s.compute_quota_ms, s.z_margin) == (3.0, 5.0, 300.0, 1.05), (
        "alpha 3 s, beta 5 s, quota 300 ms and Z margin 1.05 are the paper's constants"
    )


@pytest.mark.parametrize(
    "data, path",
    [
        ({"cluster": {"snic_gbps": 0}}, "cluster.snic_gbps"),
        ({"cluster": {"prefill_nodes": -1}}, "cluster.prefill_nodes"),
        ({"model": {"n_head": 4, "n_kv_head": 3}}, "model"),
        ({"model": {"dtype": "int8"}}, "model.dtype"),
        ({"runtime": {"mode": "fast"}}, "runtime.mode"),
        ({"scheduler": {"z_margin": 0.5}}, "scheduler.z_margin"),
        ({"store": {"backend": "s3"}}, "store.backend"),
    ],
)
def test_bad_values_name_their_yaml_path(data, path):
    with pytest.raises(ConfigError) as err:
        parse_config(data, source="x.yaml")
    assert f"{path}" in str(err.value) and "x.yaml" in str(err.value), (
        f"the error must name the file and the field {path}: {err.value}"
    )


def test_unknown_keys_are_rejected_with_their_path():
    with pytest.raises(ConfigError) as err:
        parse_config({"cluster": {"snic_gbs": 400}, "extra": {}})
    message = str(err.value)
    assert "cluster.snic_gbs: unknown key" in message, "a misspelt key is named with its section"
    assert "extra: unknown key" in message, "an unknown section is named"


def test_every_error_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        parse_config({"cluster": {"snic_gbps": -1, "cnic_gbps": -1}})
    assert "cluster.snic_gbps" in str(err.value) and "cluster.cnic_gbps" in str(err.value), (
        "all bad fields are listed, not just the first"
    )


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: [unclosed")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    top = tmp_path / "list.yaml"
    top.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(top)


def test_overrides_are_validated_like_a_file():
    cfg = DualPathConfig().with_overrides(cluster={"decode_nodes": 3})
    assert cfg.cluster.decode_nodes == 3, "an override replaces the field"
    with pytest.raises(ConfigError, match="cluster.decode_nodes"):
        DualPathConfig().with_overrides(cluster={"decode_nodes": 0})
    with pytest.raises(ConfigError, match="unknown section"):
        DualPathConfig().with_overrides(clusters={})


def test_auto_transport_resolves_once_to_a_concrete_kind():
    import importlib.util

    expected = "nixl" if importlib.util.find_spec("nixl") is not None else "gloo"
    cfg = parse_config({"runtime": {"transport": "auto"}}, source="<t>")
    assert cfg.runtime.transport == expected, "auto means nixl where it is importable, else gloo"
    assert DualPathConfig().runtime.transport == expected, "the default is auto"
    assert parse_config({"runtime": {"transport": "gloo"}}, source="<t>").runtime.transport == "gloo", (
        "an explicit kind is kept"
    )
    with pytest.raises(ConfigError, match="runtime.transport"):
        parse_config({"runtime": {"transport": "tcp"}}, source="<t>")
