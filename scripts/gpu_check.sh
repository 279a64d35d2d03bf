#!/usr/bin/env bash
# GPU check of the Pallas suffix-attention kernels (issue #6), under 10 minutes on one NVIDIA GPU:
#   1. installs what is missing: JAX with CUDA (only if JAX does not already see a GPU), the repository
#      (`pip install -e .`, which maps kernels/ to branch_replay_jax.kernels) and the few packages the
#      kernel tests import;
#   2. runs tests/test_kernels.py with the kernels compiled by Triton (interpret is off off the CPU);
#   3. times forward and forward+backward of the kernel against the jnp reference and
#      jax.nn.dot_product_attention with an explicit mask, (S_anc, T) in {(1k, 128), (8k, 256), (32k, 512)},
#      bf16, Hq=32, Hkv=8, D=128, batch 1: one JSON line per case (branch_replay_jax/benchmarks/attention.py).
#
#   bash scripts/gpu_check.sh
#   JAX_CUDA=cuda12 bash scripts/gpu_check.sh     # CUDA 12 driver (default: cuda13)
#   WHEELS=.whl bash scripts/gpu_check.sh         # offline machine: install from a folder of wheels
#   PYTHON=/path/to/python bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install -q)
if [[ -n "${WHEELS:-}" ]]; then PIP+=(--no-index --find-links "$WHEELS"); fi
export PYTHONUNBUFFERED=1

if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
  echo "== installing jax[${JAX_CUDA:-cuda13}]"
  "${PIP[@]}" -U "jax[${JAX_CUDA:-cuda13}]"
fi

echo "== installing the repository"
# Without build isolation first (no download; needs setuptools and wheel there), else the usual way.
"${PIP[@]}" --no-deps --no-build-isolation -e . || "${PIP[@]}" --no-deps -e .
# Only what the kernel tests import and is missing: a full `-e .` would pull the training stack too.
missing=()
for pair in gguf:gguf flax:flax optax:optax chex:chex safetensors:safetensors tokenizers:tokenizers \
            absl:absl-py einops:einops pytest:pytest; do
  "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
done
if ((${#missing[@]})); then "${PIP[@]}" "${missing[@]}"; fi
"$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())'

status=0
echo "== kernel tests, compiled for the GPU"
# XLA runs float32 matmuls in TF32 on GPUs by default; the tests judge float32 against float64.
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py \
  || status=$?

echo "== timings (median of 5 after compile; ms)"   # runs even when a test failed: the figures still tell
timeout 300 "$PY" -m branch_replay_jax.benchmarks.attention --config=experiments/bench_attention.py || status=$?
exit "$status"
