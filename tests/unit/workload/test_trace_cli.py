"""`dualpath trace synth | import-mooncake | stats` as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpath_ray.cli import main
from dualpath_ray.workload.synth import SynthParams, synthesize
from dualpath_ray.workload.trace import read_table, read_trace


def test_synth_writes_the_trace_it_describes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.parquet"
    code = main(["trace", "synth", "--agents", "6", "--max-len", "16K", "--seed", "9", "--out", str(out)])
    assert code == 0, "synth succeeds"
    assert read_table(out).equals(synthesize(SynthParams(agents=6, max_len=16384, seed=9))), (
        "the CLI writes exactly synthesize(SynthParams(...)) with 16K parsed as 16384"
    )
    assert "steady_hit_rate" in capsys.readouterr().out, "synth prints the trace statistics"


def test_stats_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.parquet"
    main(["trace", "synth", "--agents", "4", "--max-len", "8192", "--out", str(out)])
    capsys.readouterr()
    assert main(["trace", "stats", str(out), "--json", "--vocab-size", "300"]) == 0, "stats runs"
    stats = json.loads(capsys.readouterr().out)
    assert stats["trajectories"] == 4 and stats["block_size"] == 64, (
        "stats reports every trajectory and the default block size from the config"
    )


def test_import_mooncake(tmp_path: Path) -> None:
    source = tmp_path / "m.jsonl"
    source.write_text(
        json.dumps({"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [1, 2]})
        + "\n"
        + json.dumps({"timestamp": 1500, "input_length": 600, "output_length": 5, "hash_ids": [1, 3]})
        + "\n"
    )
    out = tmp_path / "m.parquet"
    assert main(["trace", "import-mooncake", str(source), "--out", str(out), "--vocab-size", "1000"]) == 0
    trajectories = read_trace(out, 1000)
    assert [t.arrival_s for t in trajectories] == [0.0, 1.5], "arrivals are timestamp / 1000"


def test_errors_exit_2_and_name_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert main(["trace", "import-mooncake", str(bad), "--out", str(tmp_path / "o.parquet")]) == 2, (
        "a malformed Mooncake file exits with 2"
    )
    assert "line 1" in capsys.readouterr().err, "the error names the line"
    assert main(["trace", "synth", "--agents", "0", "--out", str(tmp_path / "s.parquet")]) == 2, (
        "a bad synth parameter exits with 2"
    )
    assert "synth.agents" in capsys.readouterr().err, "the error names the parameter"
    assert main(["trace", "stats", str(tmp_path / "absent.parquet")]) == 2, "a missing file exits 2"
    assert not (tmp_path / "o.parquet").exists(), "a failed import writes nothing"
