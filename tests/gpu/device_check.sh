#!/usr/bin/env bash
# One GPU, under 10 minutes: the GPU-marked tests (pinned buffers, CUDA copies, sleep/wake freeing
# and restoring HBM, the prefill layer's CUDA event, the weight group's backend on CUDA, NCCL where
# two GPUs exist), the engines' tokens/s on CUDA in bf16, and the whole runtime on CUDA in bf16 with
# KV byte-exactness and log-probs checked against a recompute, then on that cluster: readers'
# buffers pinned, kv_digests off still byte-exact, sleep/wake of HBM, a trainer's weight broadcast.
#   PYTHON=/path/to/python bash tests/gpu/device_check.sh   (default: .venv/bin/python, else python3)
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} PYTHONUNBUFFERED=1
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'device_check: torch sees no CUDA device')"
"$PYTHON" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"
echo "== GPU-marked tests"
timeout 180 "$PYTHON" -m pytest -q -m gpu tests
echo "== engine throughput (in-process cores, CUDA, bf16)"
timeout 120 "$PYTHON" benchmarks/engine_throughput.py --device cuda --dtype bfloat16 --repeats 3 --context 1024 --prefill-cached 2048 --prefill-new 512
echo "== runtime on CUDA, bf16 (embedded 1P1D sharing this GPU), then the GPU path's checks"
timeout 420 "$PYTHON" tests/gpu/device_check.py
if "$PYTHON" -c "import vllm" >/dev/null 2>&1; then
  echo "== vLLM engine backend on CUDA, bf16 (embedded 1P1D sharing this GPU)"
  timeout 480 "$PYTHON" tests/gpu/vllm_check.py
else
  echo "== vLLM engine backend: skipped (vLLM is not installed; pip install -e '.[vllm]')"
fi
