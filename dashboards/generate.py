"""Write the DualPath Grafana dashboard from its panel list (dualpath_ray/observability/panels.py).

    .venv/bin/python dashboards/generate.py           # rewrite dashboards/dualpath_grafana_dashboard.json
    .venv/bin/python dashboards/generate.py --check   # exit 1 if the committed JSON is not what the list makes

Run it after changing a panel or a metric; the unit tests run the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dualpath_ray.observability.grafana import ray_minor_version, render  # noqa: E402

DASHBOARD_FILE = Path(__file__).resolve().parent / "dualpath_grafana_dashboard.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the file is stale")
    args = parser.parse_args(argv)
    text = render(ray_minor_version())
    if args.check:
        if not DASHBOARD_FILE.exists() or DASHBOARD_FILE.read_text() != text:
            print(f"{DASHBOARD_FILE} is stale: run python dashboards/generate.py", file=sys.stderr)
            return 1
        return 0
    DASHBOARD_FILE.write_text(text)
    print(f"wrote {DASHBOARD_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
