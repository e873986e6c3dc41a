"""The committed Grafana dashboard is what the panel list generates, in Ray's conventions, and
names only metrics that dualpath_ray/metrics.py defines (every one of them somewhere). That each
query returns data from a real Prometheus is tests/integration/test_observability.py's job."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from dualpath_ray.metrics import ALL_METRICS, MetricKind
from dualpath_ray.observability.grafana import GRID_WIDTH, panel_targets
from dualpath_ray.observability.panels import GLOBAL_FILTERS

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "dashboards"
SERIES = re.compile(r"(ray_dualpath_[a-z0-9_]+)(\{[^}]*\})?")


def committed() -> dict:
    return json.loads((DASHBOARDS / "dualpath_grafana_dashboard.json").read_text())


def exported_series() -> dict[str, str]:
    """Every series name Prometheus can hold -> the metric it belongs to."""
    names = {}
    for spec in ALL_METRICS:
        suffixes = ("_bucket", "_sum", "_count") if spec.kind is MetricKind.HISTOGRAM else ("",)
        names.update({spec.exported_name + s: spec.name for s in suffixes})
    return names


def test_committed_dashboard_is_what_the_panel_list_generates() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate", DASHBOARDS / "generate.py")
    assert spec is not None and spec.loader is not None
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    assert generate.main(["--check"]) == 0, "dashboards/dualpath_grafana_dashboard.json is stale: run dashboards/generate.py"


def test_queries_name_only_defined_metrics_and_every_metric_has_a_panel() -> None:
    known = exported_series()
    used = set()
    for title, expr in panel_targets(committed()):
        found = SERIES.findall(expr)
        assert found, f"{title}: its query reads a dualpath metric"
        for name, selector in found:
            assert name in known, f"{title}: {name} is not a metric of dualpath_ray/metrics.py"
            assert GLOBAL_FILTERS in selector, f"{title}: {name} is filtered by the dashboard's SessionName"
            used.add(known[name])
    assert used == {spec.name for spec in ALL_METRICS}, (
        f"every metric is on the dashboard; missing: {sorted({s.name for s in ALL_METRICS} - used)}"
    )


def test_dashboard_follows_rays_conventions() -> None:
    document = committed()
    variables = {v["name"]: v for v in document["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus", (
        "a Prometheus datasource variable, as in Ray's dashboards"
    )
    assert "SessionName" in variables and variables["SessionName"]["includeAll"], "a SessionName variable"
    assert any(tag.startswith("rayVersion:") for tag in document["tags"]), "tagged with the Ray version"
    assert document["schemaVersion"] == 27, "Ray's dashboards' schema version"
    panels = [p for p in document["panels"] if p["type"] != "row"]
    rows = [p for p in document["panels"] if p["type"] == "row"]
    ids = [p["id"] for p in document["panels"]]
    assert len(ids) == len(set(ids)), "panel and row ids are unique"
    assert len(rows) >= 5 and len(panels) >= 18, f"rows of panels ({len(rows)} rows, {len(panels)} panels)"
    cells = set()
    for panel in panels:
        assert panel["datasource"] == "${datasource}", f"{panel['title']} uses the datasource variable"
        pos = panel["gridPos"]
        assert pos["w"] == GRID_WIDTH // 2 and pos["h"] == 8 and pos["x"] + pos["w"] <= GRID_WIDTH, (
            f"{panel['title']}: two panels of height 8 per line on the 24-column grid"
        )
        cell = (pos["x"], pos["y"])
        assert cell not in cells, f"{panel['title']} overlaps another panel at {cell}"
        cells.add(cell)


def test_provisioning_file_points_grafana_at_the_dashboards_folder() -> None:
    provider = yaml.safe_load((DASHBOARDS / "provisioning" / "dualpath.yml").read_text())
    (entry,) = provider["providers"]
    assert provider["apiVersion"] == 1 and entry["type"] == "file", "a Grafana file provider"
    assert entry["options"]["path"] == "${DUALPATH_DASHBOARDS_DIR}", "its path comes from the environment"
