"""What computes an engine's batches: the EngineCompute contract and the model on a device. Below the
emulated compute (emulation/), the vLLM backend (vllm_engine/) and the engines that pick one (engine/).
"""
