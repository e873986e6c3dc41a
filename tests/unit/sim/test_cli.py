"""`dualpath sim`: a trace in, JCT and the rest out; bad input is one line and exit 2."""

from __future__ import annotations

import json

from dualpath_ray.cli import main
from dualpath_ray.workload.synth import SynthParams, synthesize
from dualpath_ray.workload.trace import write_table


def write_trace(tmp_path, agents: int = 4):
    path = tmp_path / "trace.parquet"
    write_table(synthesize(SynthParams(agents=agents, max_len=4000, mean_turns=6, seed=1)), path)
    return path


def test_sim_prints_the_result_as_json(tmp_path, capsys):
    trace = write_trace(tmp_path)
    assert main(["sim", "--trace", str(trace), "--mode", "basic", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["mode"] == "basic" and result["jct_s"] > 0
    for key in ("ttft_s", "tpot_s", "snic_read_bytes", "snic_balance", "requests_by_path", "attention_balance"):
        assert key in result, f"the result names {key}"
    assert result["requests_by_path"]["de"] == 0, "basic mode never reads through the decode side"


def test_the_quota_scope_defaults_to_the_figures_forward_and_is_recorded(tmp_path, capsys):
    trace = write_trace(tmp_path)
    assert main(["sim", "--trace", str(trace), "--mode", "basic", "--json"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert default["quota_scope"] == "forward", "the CLI's default is the one benchmarks/README.md's figures use"
    assert main(["sim", "--trace", str(trace), "--mode", "basic", "--json", "--quota-scope", "layer"]) == 0
    assert json.loads(capsys.readouterr().out)["quota_scope"] == "layer", "--quota-scope overrides it, and the result says so"
    config = tmp_path / "layer.yaml"
    config.write_text("sim:\n  quota_scope: layer\n")
    assert main(["sim", "--config", str(config), "--trace", str(trace), "--mode", "basic", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quota_scope"] == "layer", "the config's sim.quota_scope is the default"


def test_sim_prints_a_summary(tmp_path, capsys):
    trace = write_trace(tmp_path)
    assert main(["sim", "--config", "cluster_configs/local-1p1d.yaml", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dualpath: JCT") and "SNIC read bytes per node" in out


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["sim", "--trace", str(tmp_path / "missing.parquet")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dualpath:") and "missing.parquet" in err and len(err.splitlines()) == 1
    trace = write_trace(tmp_path)
    assert main(["sim", "--trace", str(trace), "--warmup-turns", "-1"]) == 2
    assert "--warmup-turns" in capsys.readouterr().err
