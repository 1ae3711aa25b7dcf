#!/usr/bin/env bash
# The GPU validation run quoted in docs/gpu-validation.md. On the device machine:
#   bash bench/gpu_validation.sh "$OUT"
# (after installing the circuit-tracer wheels: see docs/gpu-validation.md).
set -uo pipefail
out=${1:-/tmp/ct-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 CT_GPU_ARTIFACTS="$out"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee "$out/nvidia-smi.txt"
python3 -c 'import torch, circuit_tracer, nnsight, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "circuit-tracer", circuit_tracer.__version__, "nnsight", nnsight.__version__, "transformers", transformers.__version__)' | tee "$out/versions.txt"
echo "== pytest tests/gpu -v -rs"
python3 -m pytest tests/gpu -v -rs -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.log"
gpu_rc=${PIPESTATUS[0]}
echo "== pytest examples/ on the GPU"
python3 -m pytest --nbmake examples/ example_configs/ --ct-config example_configs/tiny_gemma2.yaml -v -p no:cacheprovider 2>&1 | tee "$out/examples.log"
echo "gpu tests exit code: $gpu_rc"
exit "$gpu_rc"
