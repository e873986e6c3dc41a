"""The vllm engine backend (engine.backend: vllm): each prefill and decode engine actor hosts one
in-process vLLM engine, and DualPath loads and saves its KV through vLLM's KV-connector API.

host.py builds and steps the engine; compute.py is the engines' EngineCompute on top of it;
connector.py is the KVConnectorBase_V1 vLLM loads; steps.py what one step moves; pages.py vLLM's
page layouts as token-major KV; declared.py what vLLM declares about them; version.py the vLLM
versions it is tested with; model_dir.py the model directory. Nothing here is imported
unless engine.backend is vllm, so the package works without vLLM installed.
"""
