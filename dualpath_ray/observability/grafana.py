"""Grafana dashboard JSON from the panel list, in the conventions of Ray's own dashboards.

Like Ray's generated dashboards (ray/dashboard/modules/metrics/grafana_dashboard_factory.py):
a `datasource` template variable every panel uses, a `SessionName` variable every query filters
on, collapsible rows on a 24-column grid with two panels of height 8 per line, schema version
27 and a `rayVersion:` tag; so the dashboard sits next to Ray's defaults in one Grafana and is
provisioned the same way (dashboards/provisioning/).
"""

from __future__ import annotations

import json
from typing import Any

from dualpath_ray.metrics import READ_QUEUE_TOKENS
from dualpath_ray.observability.panels import ROWS, Panel, Row, Target

DASHBOARD_UID = "dualpathDashboard"
DASHBOARD_TITLE = "DualPath"
GRID_WIDTH = 24
PANELS_PER_LINE = 2
PANEL_HEIGHT = 8
ROW_HEIGHT = 1
# The SessionName variable lists the sessions in which readers exported their read queue: every
# deployed reader sets it from its first second, so a running deployment's session is listed.
SESSION_QUERY = f"label_values({READ_QUEUE_TOKENS.exported_name}, SessionName)"


def ray_minor_version() -> str:
    """Ray's major.minor (the project pins one minor version; patch releases share dashboards)."""
    import ray

    return ".".join(ray.__version__.split(".")[:2])


def dashboard(ray_version: str, rows: tuple[Row, ...] = ROWS) -> dict[str, Any]:
    """The whole dashboard as a JSON-ready dict."""
    panels: list[dict[str, Any]] = []
    y = 0
    for row in rows:
        panels.append({"collapsed": False, "gridPos": {"h": ROW_HEIGHT, "w": GRID_WIDTH, "x": 0, "y": y},
                       "id": row.id, "panels": [], "title": row.title, "type": "row"})
        y += ROW_HEIGHT
        for index, panel in enumerate(row.panels):
            panels.append(_panel(panel, index, y))
        y += -(-len(row.panels) // PANELS_PER_LINE) * PANEL_HEIGHT
    return {
        "annotations": {"list": [{"builtIn": 1, "datasource": "-- Grafana --", "enable": True, "hide": True,
                                  "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
                                  "type": "dashboard"}]},
        "description": "DualPath KV loading on a P/D-disaggregated Ray cluster: storage NICs, read paths, "
        "queues, engine loads, latencies, memory and failures (docs/metrics.md).",
        "editable": True,
        "graphTooltip": 1,
        "links": [],
        "panels": panels,
        "refresh": "10s",
        "schemaVersion": 27,
        "style": "dark",
        "tags": ["dualpath", f"rayVersion:{ray_version}"],
        "templating": {"list": [_datasource_variable(), _session_variable()]},
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": DASHBOARD_TITLE,
        "uid": DASHBOARD_UID,
        "version": 1,
    }


def render(ray_version: str, rows: tuple[Row, ...] = ROWS) -> str:
    """The dashboard file's text: stable key order and indentation, so a diff shows real changes."""
    return json.dumps(dashboard(ray_version, rows), indent=2, sort_keys=True) + "\n"


def _panel(panel: Panel, index: int, y: int) -> dict[str, Any]:
    width = GRID_WIDTH // PANELS_PER_LINE
    return {
        "datasource": "${datasource}",
        "description": panel.description,
        "fieldConfig": {
            "defaults": {
                "custom": {"fillOpacity": 10 if panel.stack else 0, "lineWidth": 1, "showPoints": "never",
                           "stacking": {"group": "A", "mode": "normal" if panel.stack else "none"}},
                "min": 0,
                "unit": panel.unit,
            },
            "overrides": [],
        },
        "gridPos": {"h": PANEL_HEIGHT, "w": width, "x": (index % PANELS_PER_LINE) * width,
                    "y": y + (index // PANELS_PER_LINE) * PANEL_HEIGHT},
        "id": panel.id,
        "options": {"legend": {"calcs": ["mean", "lastNotNull", "max"], "displayMode": "table", "placement": "bottom"},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [_target(target, chr(ord("A") + i)) for i, target in enumerate(panel.targets)],
        "title": panel.title,
        "type": "timeseries",
    }


def _target(target: Target, ref_id: str) -> dict[str, Any]:
    return {"datasource": "${datasource}", "exemplar": False, "expr": target.expr, "interval": "",
            "legendFormat": target.legend, "refId": ref_id}


def _datasource_variable() -> dict[str, Any]:
    return {"current": {"selected": False}, "description": "The Prometheus that scrapes the Ray cluster.",
            "hide": 0, "includeAll": False, "label": "Data source", "multi": False, "name": "datasource",
            "options": [], "query": "prometheus", "refresh": 1, "regex": "", "skipUrlSync": False,
            "type": "datasource"}


def _session_variable() -> dict[str, Any]:
    return {"allValue": ".+", "current": {"selected": False}, "datasource": "${datasource}",
            "definition": SESSION_QUERY, "description": "Filter queries to one Ray session (one cluster start).",
            "hide": 0, "includeAll": True, "label": "Session", "multi": False, "name": "SessionName", "options": [],
            "query": {"query": SESSION_QUERY, "refId": "StandardVariableQuery"}, "refresh": 2, "regex": "",
            "skipUrlSync": False, "sort": 2, "type": "query"}


def panel_targets(document: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of a dashboard document, rows included."""
    found = []
    for panel in document["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                found.append((inner["title"], target["expr"]))
    return found
