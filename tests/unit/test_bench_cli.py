"""`dualpath bench` refuses bad input before starting anything: one line naming the flag and
the fix, exit code 2 (no Ray is started by any of these)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from dualpath_ray.cli import main
from dualpath_ray.workload.synth import SynthParams, synthesize
from dualpath_ray.workload.trace import write_table


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(["bench", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, f"bad input exits 2 (got {code}): {err}"
    assert len(err.splitlines()) == 1 and err.startswith("dualpath bench: "), f"one line, no traceback: {err!r}"
    return err


def test_missing_trace_names_the_flag_and_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(["--trace", str(tmp_path / "nope.parquet")], capsys)
    assert "--trace" in err and "no such file" in err and "dualpath trace synth" in err, (
        f"the line names the flag, the problem and how to get a trace: {err}"
    )


def test_non_parquet_trace_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "trace.parquet"
    text.write_text("not parquet\n")
    err = refused(["--trace", str(text)], capsys)
    assert "--trace" in err and "Parquet" in err, f"a file that is not Parquet is named as such: {err}"


def test_synth_trace_longer_than_the_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.parquet"
    write_table(synthesize(SynthParams(agents=2, max_len=16384, seed=1)), trace)
    err = refused(["--trace", str(trace)], capsys)
    assert "max_context" in err and "--trace" in err, f"a trace the model cannot hold says what to change: {err}"


def test_a_workload_with_nothing_left_to_time_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(["--turns", "1"], capsys)
    assert "--warmup-turns 0" in err, f"one-turn trajectories need the warm-up off, and the line says so: {err}"


def test_samples_makes_grouped_sampling_trajectories() -> None:
    from dualpath_ray.cli import build_parser
    from dualpath_ray.commands.bench import load_workload
    from dualpath_ray.demos.demo import demo_config

    args = build_parser().parse_args(["bench", "--agents", "2", "--samples", "3", "--turns", "2", "--first", "128"])
    trajs = load_workload(args, demo_config())
    assert [t.trajectory_id for t in trajs] == [f"p{p}-s{s}" for p in range(2) for s in range(3)], "2 prompts x 3"
    assert len({t.turns[0].appended for t in trajs[:3]}) == 1, "the samples of a prompt share its first turn"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--modes", "basic,turbo"], "--modes"),
        (["--modes", "basic,basic"], "--modes"),
        (["--repeat", "0"], "--repeat"),
        (["--warmup-turns", "-1"], "--warmup-turns"),
        (["--sample-interval", "0"], "--sample-interval"),
        (["--agents", "0"], "--agents"),
        (["--samples", "0"], "--samples"),
    ],
)
def test_bad_flags_name_themselves(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(argv, capsys)
    assert flag in err, f"the error names {flag}: {err}"


def test_plot_without_matplotlib_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    err = refused(["--plot", str(tmp_path / "b.png")], capsys)
    assert "matplotlib" in err and "bench" in err, f"the error says what to install: {err}"
    assert not (tmp_path / "b.png").exists(), "nothing is written"
