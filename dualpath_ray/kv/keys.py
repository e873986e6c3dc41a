"""The block key format: 32 lowercase hex chars (an xxh3-128 digest, see kv/index.py).

Checked before a key touches a path, so no key can name anything outside a store's root.
"""

from __future__ import annotations

import re

KEY_PATTERN = re.compile(r"[0-9a-f]{32}")


def validate_key(key: object) -> str:
    """Return `key` if it is exactly 32 lowercase hex chars; raise ValueError otherwise."""
    if not isinstance(key, str) or KEY_PATTERN.fullmatch(key) is None:
        raise ValueError(
            f"invalid block key {key!r}: a key is exactly 32 lowercase hex chars "
            "(use dualpath_ray.kv.index.block_keys)"
        )
    return key
