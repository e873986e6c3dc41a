"""The `verbs` config section: which RDMA port the pyverbs transport uses, and its queue pairs.

Read only when `runtime.transport: verbs`. The KV service level / traffic class of the queue
pairs come from the `qos` section (config/qos.py), not from here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class VerbsConfig(BaseModel):
    """RDMA device and queue-pair settings of `runtime.transport: verbs`."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    devices: tuple[str, ...] = Field(
        (), description="RDMA devices by GPU index (e.g. [mlx5_0, mlx5_1, ...]): engine gN uses devices[N % len], "
        "the compute NIC paired with its GPU; readers use devices[0]. Empty: the first device found.",
    )
    port: int = Field(1, ge=1, le=255, description="Port number of the device.")
    gid_index: int = Field(
        0, ge=0, le=255, description="GID table index of the port: 0 on InfiniBand; on RoCE the RoCE v2 GID "
        "(often 3; `show_gids` lists them).",
    )
    path_mtu: Literal[256, 512, 1024, 2048, 4096] = Field(4096, description="Path MTU in bytes.")
    send_queue_depth: int = Field(
        1024, ge=16, le=32768, description="Work requests one queue pair holds at once: the largest batch one "
        "doorbell posts (a larger transfer is split into several batches).",
    )
    max_rd_atomic: int = Field(
        16, ge=1, le=255, description="RDMA reads one queue pair keeps outstanding (the responder's limit is "
        "the same value).",
    )

    @field_validator("devices")
    @classmethod
    def _device_names(cls, devices: tuple[str, ...]) -> tuple[str, ...]:
        for name in devices:
            if not name or name.strip() != name or ":" in name:
                raise ValueError(f"device {name!r} must be a device name such as 'mlx5_0' (the port is `port`)")
        return devices

    def device_for(self, gpu: int | None) -> str | None:
        """The device of the engine on GPU `gpu` (None: a reader); None = the first one found."""
        if not self.devices:
            return None
        return self.devices[0 if gpu is None else gpu % len(self.devices)]
