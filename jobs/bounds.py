"""Ray job entrypoint: the bottleneck-free P/D range of the configured hardware, as JSON.

    ray job submit --working-dir . -- python jobs/bounds.py --config cluster_configs/local-1p1d.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Run as a script from a job's working directory: import the package shipped beside it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dualpath_ray.analysis.report import classify_ratio, pd_bounds
from dualpath_ray.commands.bounds import as_json
from dualpath_ray.config import load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=None)
    args = parser.parse_args(argv)
    c = load_config(args.config).cluster
    bounds = pd_bounds(c.gpus_per_node, c.snic_gbps, c.cnic_gbps, c.dram_gbs)
    check = classify_ratio(bounds, c.prefill_nodes, c.decode_nodes)
    print(json.dumps(as_json(bounds, check), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
