#!/usr/bin/env bash
# Test command part "gpu": what a GPU machine runs (tools/gpu-check.sh), in its CPU-only mode so
# that it cannot rot: kvlink-bench's same-host and staged TCP paths on emulated device memory,
# bytes verified, and a real model's KV cache (transformers' Llama, seeded weights, on the CPU)
# prefilled in one process, read by another through kvlink (over TCP), greedy tokens
# equal to one process's. torch and transformers come from .venv-vllm (vLLM's own).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
MIN_GPU=3

label="GPU check, CPU-only mode (tools/gpu-check.sh --cpu-only)"
echo "test: $label"
if ! prepared vllm-old || ! use_wheel .venv-vllm; then
  tally fail --part gpu --label "$label" \
    --why "torch and transformers (.venv-vllm) are missing: $(prepared_why vllm-old)"
  exit 0
fi
cargo build -q --workspace --bin kvlink-bench
export KVLINK_GPU_PYTHON="$repo/.venv-vllm/bin/python" KVLINK_GPU_BENCH="$repo/target/debug/kvlink-bench"
logged_part check gpu "$label" "$MIN_GPU" fail "" tools/gpu-check.sh --cpu-only
