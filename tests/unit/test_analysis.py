"""Bottleneck-free P/D bounds (paper 4.2) and the `dualpath bounds` command."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpath_ray.analysis.report import classify_ratio, pd_bounds
from dualpath_ray.cli import main


def test_paper_worked_example_exactly() -> None:
    bounds = pd_bounds(gpus_per_node=8, snic_gbps=400, cnic_gbps=400, dram_gbs=500)
    assert bounds.lower == 1 / 7, "lower bound s/(g-s) = 1/7"
    assert bounds.constraints == {
        "pe_cnic_write": 1 / 7,
        "de_cnic_read": 6.0,
        "de_cnic_write": 3.5,
        "de_dram": 3.5,
    }, "1/7 <= P/D <= min{6, 3.5, 3.5}"
    assert bounds.upper == 3.5, "the upper bound is the minimum, 3.5"
    assert bounds.binding == ("de_cnic_write", "de_dram"), "DE CNIC write and DE DRAM tie at 3.5"
    assert not bounds.is_empty and bounds.empty_reason is None, "the paper's hardware has a range"


def test_each_constraint_formula() -> None:
    bounds = pd_bounds(gpus_per_node=16, snic_gbps=800, cnic_gbps=400, dram_gbs=1000)
    # g=16, s=2, B=50: s/(g-s)=1/7, (g-2s)/s=6, (g-s)/(2s)=3.5, (M/(Bs)-3)/2=(10-3)/2=3.5
    assert bounds.constraints["pe_cnic_write"] == pytest.approx(2 / 14), "s/(g - s)"
    assert bounds.constraints["de_cnic_read"] == pytest.approx(6.0), "(g - 2s)/s"
    assert bounds.constraints["de_cnic_write"] == pytest.approx(3.5), "(g - s)/(2s)"
    assert bounds.constraints["de_dram"] == pytest.approx(3.5), "(M/(B s) - 3)/2"
    slow_dram = pd_bounds(8, 400, 400, 300)
    assert slow_dram.upper == pytest.approx(1.5) and slow_dram.binding == ("de_dram",), (
        "with M = 300 GB/s DRAM alone binds at (6 - 3)/2"
    )


def test_ratio_classification() -> None:
    bounds = pd_bounds(8, 400, 400, 500)
    assert classify_ratio(bounds, 1, 7).inside, "P/D = 1/7 is on the lower bound, inside"
    assert classify_ratio(bounds, 7, 2).inside, "P/D = 3.5 is on the upper bound, inside"
    assert classify_ratio(bounds, 2, 4).inside, "the paper's 2P4D is bottleneck-free"
    low = classify_ratio(bounds, 1, 8)
    assert not low.inside and low.saturates == ("pe_cnic_write",), "below 1/7 the PE CNIC saturates"
    high = classify_ratio(bounds, 4, 1)
    assert high.saturates == ("de_cnic_write", "de_dram"), "at 4 both 3.5 bounds break"
    very_high = classify_ratio(bounds, 7, 1)
    assert very_high.saturates == ("de_cnic_read", "de_cnic_write", "de_dram"), "7 > 6 breaks all three"


def test_empty_range_when_snic_is_half_the_node() -> None:
    bounds = pd_bounds(8, 1600, 400, 500)
    assert bounds.is_empty and bounds.upper is None, "s = g/2 leaves no positive upper bound"
    assert bounds.constraints["de_cnic_read"] is None, "(g - 2s)/s = 0 is reported as None, not 0 or < 0"
    assert "DE CNIC (read)" in (bounds.empty_reason or ""), "the reason names the resource"
    assert not classify_ratio(bounds, 1, 1).inside, "no ratio is inside an empty range"


def test_empty_range_when_lower_exceeds_upper() -> None:
    bounds = pd_bounds(8, 1400, 400, 5000)
    assert bounds.is_empty and "exceeds the upper bound" in (bounds.empty_reason or ""), (
        "s = 3.5: lower 7/9 > upper 2/7 of DE CNIC read"
    )
    assert all(b is None or b > 0 for b in bounds.constraints.values()), "no bound is negative"


def test_snic_above_half_reports_pe_cnic_read() -> None:
    bounds = pd_bounds(8, 4000, 400, 500)
    assert "PE CNIC read" in (bounds.empty_reason or ""), "s = 10 > g/2 saturates the PE CNIC read side"
    assert bounds.constraints["pe_cnic_write"] is None, "s >= g: no ratio meets the PE CNIC write"
    assert "pe_cnic_read" in classify_ratio(bounds, 1, 1).saturates, "the check names pe_cnic_read"


@pytest.mark.parametrize(
    ("args", "field"),
    [((0, 400, 400, 500), "gpus_per_node"), ((8, -1, 400, 500), "snic_gbps"),
     ((8, 400, 0, 500), "cnic_gbps"), ((8, 400, 400, float("nan")), "dram_gbs")],
)
def test_non_positive_inputs_are_errors(args: tuple[float, ...], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        pd_bounds(*args)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    g=st.integers(1, 16),
    snic=st.floats(1, 4000),
    cnic=st.floats(1, 800),
    dram=st.floats(1, 2000),
)
def test_bounds_are_never_negative_and_range_is_consistent(g: int, snic: float, cnic: float, dram: float) -> None:
    bounds = pd_bounds(g, snic, cnic, dram)
    assert all(b is None or b > 0 for b in bounds.constraints.values()), "bounds are positive or None"
    if not bounds.is_empty:
        assert bounds.lower is not None and bounds.upper is not None, "a range has both ends"
        assert bounds.lower <= bounds.upper * (1 + 1e-12), "a non-empty range is ordered"
        assert bounds.binding, "a non-empty range names its binding constraint"


def _cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(["bounds", *argv, "--json"]) == 0, "bounds exits 0 on valid input"
    return json.loads(capsys.readouterr().out)


def test_cli_json_keys_and_values(capsys: pytest.CaptureFixture[str]) -> None:
    data = _cli_json(capsys, "--gpus-per-node", "8", "--snic-gbps", "400", "--cnic-gbps", "400",
                     "--dram-gbs", "500")
    assert {"lower", "upper", "binding", "constraints"} <= data.keys(), "the issue's JSON keys"
    assert "ratio" not in data and "inside" not in data, "no ratio keys without P and D"
    assert data["upper"] == 3.5 and data["binding"] == ["de_cnic_write", "de_dram"], "worked example"
    assert set(data["constraints"]) == {"pe_cnic_write", "de_cnic_read", "de_cnic_write", "de_dram"}, (  # type: ignore[arg-type]
        "constraints are keyed by the four names"
    )


def test_cli_ratio_keys(capsys: pytest.CaptureFixture[str]) -> None:
    inside = _cli_json(capsys, "--prefill-nodes", "2", "--decode-nodes", "4")
    assert inside["ratio"] == 0.5 and inside["inside"] is True and inside["saturates"] == [], "2P4D inside"
    outside = _cli_json(capsys, "--prefill-nodes", "1", "--decode-nodes", "8")
    assert outside["inside"] is False and outside["saturates"] == ["pe_cnic_write"], "1P8D: PE CNIC"


def test_cli_reports_empty_range(capsys: pytest.CaptureFixture[str]) -> None:
    data = _cli_json(capsys, "--snic-gbps", "1600")
    assert data["empty"] is True and data["upper"] is None and data["empty_reason"], (
        "an empty range is reported with its reason, never a negative bound"
    )
    assert main(["bounds", "--snic-gbps", "1600"]) == 0, "text output of an empty range exits 0"
    assert "no bottleneck-free P/D" in capsys.readouterr().out, "the text names the empty range"


@pytest.mark.parametrize(
    "argv",
    [["--snic-gbps", "0"], ["--cnic-gbps", "-400"], ["--dram-gbs", "0"], ["--gpus-per-node", "0"],
     ["--prefill-nodes", "2"], ["--prefill-nodes", "0", "--decode-nodes", "1"]],
)
def test_cli_bad_input_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bounds", *argv]) == 2, f"{argv} is a usage error with exit code 2"
    assert "dualpath bounds:" in capsys.readouterr().err, "the error is explained on stderr"
