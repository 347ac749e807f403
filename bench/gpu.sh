#!/usr/bin/env bash
# sft, dpo and grpo on the Qwen2.5-0.5B architecture (random weights, bf16) on one GPU: trained tokens/s and MFU.
# On a GPU machine with the project installed (README's first command, or `pip install torch==2.13.0 && pip install -e .`):
#     bash bench/gpu.sh                 # under 8 minutes on one H200; the table at the end
#     bash bench/gpu.sh --out /tmp/gpu  # where the model, data and artifacts go (default: state-gpu-bench/)
# The launcher variant (accelerate, every GPU, grpo once more with vLLM when installed): python -m bench.gpu_launch
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if ! nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; then
    echo "bench/gpu.sh: no NVIDIA GPU here (nvidia-smi failed); for a dry run on a CPU: python -m bench.gpu --tiny" >&2
    exit 1
fi
exec timeout 480 python -m bench.gpu "$@"
