"""Which weights an engine computes with, and the check every request passes before it does.

A request names its weights by its key namespace (RequestSpec.namespace: model id, weight
version, seed, KV layout, and a tenant's salt: config/model.py `kv_namespace`, kv/index.py). An
engine computes a request only under the namespace of the weights it holds: KV computed with
one version's weights and stored under another's would be served to every later turn that hits
it, and tokens sampled with old weights under a new version are a silent off-policy sample.

So every engine holds a `HeldWeights`: its version, the fingerprint of what it loaded
(model/weights.py `weights_fingerprint`; `config_fingerprint` for the weights its config builds)
and whether it is ready. A restarted engine comes back with its config's weights; until it has
loaded the weights published last (runtime/weights/ledger.py) it is not ready: it refuses
every request, and the scheduler routes around it (EngineReport.ready, EngineHoldings.ready).
A refusal is the retryable `StaleWeightsError` (ErrorKind.STALE_WEIGHTS): the scheduler places
the request's next attempt on another engine. Pure: no Ray, no torch.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Callable

import xxhash

from dualpath_ray.kv.index import unsalted_namespace
from dualpath_ray.protocol.messages import RequestSpec
from dualpath_ray.protocol.weights import WeightsId

if TYPE_CHECKING:
    from dualpath_ray.config import DualPathConfig


class StaleWeightsError(RuntimeError):
    """A request names other weights than this engine holds (or it holds none yet): nothing
    of it was computed here; another engine (or this one, once ready) serves its retry."""


def config_fingerprint(cfg: DualPathConfig) -> str:
    """The fingerprint of the weights `cfg` builds (random from model.seed, a checkpoint
    directory, or vLLM's dummy weights, engine.vllm_dummy_weights): every engine of a deployment
    builds the same ones."""
    # The version is not part of it: a fingerprint names tensors, a version names their role.
    model = cfg.model.model_dump(mode="json", exclude={"weight_version"})
    fields: dict[str, object] = {"model": model, "backend": cfg.engine.backend}
    if cfg.engine.vllm_dummy_weights:
        fields["vllm_dummy_weights"] = True  # other tensors; absent otherwise, so other fingerprints stay
    return "config:" + xxhash.xxh3_128_hexdigest(json.dumps(fields, sort_keys=True).encode())


class HeldWeights:
    """An engine's weights (its WeightsPort, runtime/engine/ports.py). Read by the engine's worker and control threads,
    changed by an update or a restarted engine's catch-up: one lock."""

    def __init__(self, namespace_of: Callable[[int], str], held: WeightsId, ready: bool = True) -> None:
        self._namespace_of = namespace_of
        self._held = held
        self._namespace = namespace_of(held.version)
        self._ready = ready
        self._lock = threading.Lock()
        self.refused = 0  # requests refused for naming other weights (or arriving before ready)

    @classmethod
    def of_config(cls, cfg: DualPathConfig) -> HeldWeights:
        """The weights an engine builds from its config, ready."""
        return cls(cfg.kv_namespace, WeightsId(cfg.model.weight_version, config_fingerprint(cfg)))

    @property
    def held(self) -> WeightsId:
        with self._lock:
            return self._held

    def ready(self) -> bool:
        with self._lock:
            return self._ready

    def is_current(self, published: WeightsId) -> bool:
        """Whether these are the `published` weights."""
        with self._lock:
            return self._held == published

    def check(self, spec: RequestSpec) -> None:
        with self._lock:
            ready, namespace, held = self._ready, self._namespace, self._held
            named = unsalted_namespace(spec.namespace)
            if ready and named == namespace:
                return
            self.refused += 1
        if not ready:
            raise StaleWeightsError(
                f"{spec.owner}: this engine restarted and has not loaded the published weights yet "
                f"(it holds version {held.version}, its config's)"
            )
        raise StaleWeightsError(
            f"{spec.owner}: the request names key namespace {named!r}, this engine holds weight version "
            f"{held.version} ({namespace!r})"
        )

    def awaiting(self) -> None:
        """Not ready until `now_holds` (a restarted engine before its catch-up)."""
        with self._lock:
            self._ready = False

    def now_holds(self, weights: WeightsId) -> None:
        """These weights are loaded (an update, or a catch-up): ready under their version."""
        namespace = self._namespace_of(weights.version)
        with self._lock:
            self._held, self._namespace, self._ready = weights, namespace, True
