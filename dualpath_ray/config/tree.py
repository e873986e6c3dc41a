"""The root of the configuration tree, the checks that span sections, and validating a parsed
mapping into it with errors that name the YAML path of each bad field."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError, model_validator

from dualpath_ray.config.model import ModelConfig
from dualpath_ray.config.qos import QosConfig
from dualpath_ray.config.section import ConfigError, Section
from dualpath_ray.config.engine import EngineBackend, EngineConfig
from dualpath_ray.config.sections import (
    ClusterConfig,
    EmulationConfig,
    RuntimeConfig,
    SchedulerConfig,
    SimConfig,
    StoreConfig,
)
from dualpath_ray.config.verbs import VerbsConfig
from dualpath_ray.faults.plan import FaultMode, FaultPlan, FaultSite


class DualPathConfig(Section):
    """The root of the configuration tree."""

    model: ModelConfig = ModelConfig()
    cluster: ClusterConfig = ClusterConfig()
    store: StoreConfig = StoreConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    emulation: EmulationConfig = EmulationConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    engine: EngineConfig = EngineConfig()
    faults: FaultPlan = FaultPlan()
    sim: SimConfig = SimConfig()
    qos: QosConfig = QosConfig()
    verbs: VerbsConfig = VerbsConfig()

    @model_validator(mode="after")
    def _prefill_window_holds_a_prompt(self) -> DualPathConfig:
        if self.cluster.prefill_hbm_tokens < self.model.max_context:
            raise ValueError(
                f"cluster.prefill_hbm_tokens ({self.cluster.prefill_hbm_tokens}) must be >= "
                f"model.max_context ({self.model.max_context}) so that any prompt fits a prefill engine"
            )
        return self

    @model_validator(mode="after")
    def _vllm_computes_for_real(self) -> DualPathConfig:
        if self.engine.backend is EngineBackend.VLLM and self.emulation.compute == "profile":
            raise ValueError(
                "engine.backend vllm computes with vLLM; emulation.compute profile replaces compute with fitted "
                "times: set emulation.compute: model (or engine.backend: native)"
            )
        return self

    @model_validator(mode="after")
    def _vllm_takes_whole_block_hits(self) -> DualPathConfig:
        if self.engine.backend is EngineBackend.VLLM and self.scheduler.partial_block_hits == "on":
            raise ValueError(
                "scheduler.partial_block_hits on: the vllm backend's connector takes hits in whole blocks and computes "
                "the block holding the prompt's last token; set scheduler.partial_block_hits: auto (off for vllm) or off"
            )
        return self

    @model_validator(mode="after")
    def _vllm_kv_pages_hold_a_sequence(self) -> DualPathConfig:
        pages = self.engine.vllm_kv_pages
        if pages is None:
            return self
        # vLLM makes progress while one longest sequence fits (it preempts the others), and with
        # runtime.verify_kv one more beside it: the check's recompute of a prompt before it lands.
        sequences = 2 if self.runtime.verify_kv else 1
        needed = sequences * -(-self.model.max_context // self.store.block_size)
        if pages < needed:
            raise ValueError(
                f"engine.vllm_kv_pages ({pages}) holds fewer than {sequences} sequence(s) of model.max_context "
                f"({self.model.max_context} tokens in pages of store.block_size {self.store.block_size}"
                f"{'; runtime.verify_kv recomputes one beside them' if sequences > 1 else ''}): set "
                f"engine.vllm_kv_pages >= {needed}, or leave it unset (sized to the engine's page books)"
            )
        if not self.runtime.kv_digests:
            raise ValueError(
                "engine.vllm_kv_pages lets vLLM preempt decode sequences, and a filled block pulled from a page it "
                "freed is refused only by its digest: set runtime.kv_digests: true, or leave engine.vllm_kv_pages unset"
            )
        return self

    @property
    def partial_block_hits(self) -> bool:
        """scheduler.partial_block_hits resolved for this deployment's engines (auto: the native
        engine takes them, vLLM's does not)."""
        setting = self.scheduler.partial_block_hits
        return setting == "on" or (setting == "auto" and self.engine.backend is not EngineBackend.VLLM)

    def kv_namespace(self, weight_version: int | None = None) -> str:
        """The key namespace of the blocks these engines write (ModelConfig.kv_namespace at
        store.block_size, for this engine backend and its weights)."""
        return self.model.kv_namespace(
            weight_version, block_size=self.store.block_size, engine=self.engine.backend,
            dummy_weights=self.engine.backend is EngineBackend.VLLM and self.engine.vllm_dummy_weights,
        )

    @model_validator(mode="after")
    def _store_faults_need_files(self) -> DualPathConfig:
        damages_files = any(f.site is FaultSite.STORE_READ and f.mode is FaultMode.CORRUPT for f in self.faults.faults)
        if damages_files and self.store.backend != "local_dir":
            raise ValueError("faults: store_read corrupt damages block files; it needs store.backend: local_dir")
        return self

    def with_overrides(self, **sections: dict[str, Any]) -> DualPathConfig:
        """A copy with some fields of some sections replaced, validated like a file."""
        data = self.model_dump()
        for name, fields in sections.items():
            if name not in data:
                raise ConfigError(f"{name}: unknown section; allowed: {', '.join(data)}")
            data[name].update(fields)
        return parse_config(data, source="<overrides>")


def _describe(error: dict[str, Any]) -> str:
    path = ".".join(str(p) for p in error["loc"]) or "<root>"
    if error["type"] == "extra_forbidden":
        return f"{path}: unknown key; remove it or check its spelling"
    return f"{path}: {error['msg']} (got {error.get('input')!r})"


def parse_config(data: Any, source: str = "<dict>") -> DualPathConfig:
    """Validate a parsed mapping; raise ConfigError naming every bad YAML path."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    try:
        return DualPathConfig.model_validate(data)
    except ValidationError as exc:
        lines = "\n  ".join(_describe(e) for e in exc.errors())
        raise ConfigError(f"{source}: invalid configuration\n  {lines}") from None
