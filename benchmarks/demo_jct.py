"""Basic vs DualPath JCT on the storage-bound 1P1D config: a thin caller of `dualpath bench`.

    .venv/bin/python benchmarks/demo_jct.py            # = the command below
    .venv/bin/dualpath bench --config cluster_configs/bench-1p1d.yaml --modes basic,dualpath

The measurement (fresh store per mode, first turns untimed, the I/O bound, SNIC balance) lives in
dualpath_ray/bench/run.py; add `--modes basic,dualpath,oracle --repeat 3 --json --plot F.png` or any
other `dualpath bench` flag (later flags override these defaults). benchmarks/README.md has the
committed results.
"""

from __future__ import annotations

import sys

from dualpath_ray.cli import main

DEFAULTS = ["--config", "cluster_configs/bench-1p1d.yaml", "--modes", "basic,dualpath"]

if __name__ == "__main__":
    sys.exit(main(["bench", *DEFAULTS, *sys.argv[1:]]))
