"""Emulated NIC links: exact byte counters, buckets only when emulation is on."""

from __future__ import annotations

from dualpath_ray.config import DualPathConfig
from dualpath_ray.runtime.emulation import Link, make_link


def test_links_count_every_byte_and_pace_only_when_emulated():
    link = Link("cnic")
    for n in (10, 0, 4096):
        link.take(n)
    assert link.bytes_total == 4106, "the counter is exact"
    off = DualPathConfig().with_overrides(emulation={"enabled": False})
    assert make_link(off, "snic", 1.0).bucket is None, "real hardware: no emulated bucket"
    on = make_link(DualPathConfig(), "snic", 8.0)
    assert on.bucket is not None and on.bucket.rate == 1e9, "8 Gbit/s is 1e9 bytes/s"
