#!/usr/bin/env bash
# TPU check of the suffix-attention path for TPUs (issue #6: splash attention behind
# `suffix_attention`'s signature, kernels/splash_attention.py), under 10 minutes on one TPU VM:
#   1. installs what is missing: JAX with libtpu (only if JAX does not already see a TPU), the
#      repository (`pip install -e .`) and the few packages the kernel tests import;
#   2. runs the splash tests of tests/test_kernels.py compiled by Mosaic (interpret is off off the
#      CPU): accuracy against float64 (error <= 2x the reference's in the same dtype), fully masked
#      rows, the TPU lowering, dispatch, and replay with attention_impl="splash" == "xla";
#   3. times forward and forward+backward of suffix_attention_splash against splash as shipped
#      (make_splash_mha on the concatenated keys, no lse), the jnp reference and
#      jax.nn.dot_product_attention(implementation="xla") with an explicit mask, (S_anc, T) in
#      {(1k, 128), (8k, 256), (32k, 512)}, bf16, Hq=32, Hkv=8, D=128, batch 1: one JSON line per case
#      (branch_replay_jax/benchmarks/attention.py).
#
#   bash scripts/tpu_check.sh
#   WHEELS=.whl bash scripts/tpu_check.sh         # offline machine: install from a folder of wheels
#   PYTHON=/path/to/python bash scripts/tpu_check.sh
#
# Not run yet: no TPU was available when it was written (only the CPU interpreter and the lowering
# to Mosaic MLIR were checked). float32 cases: XLA and Mosaic may run float32 dots in bf16 passes on
# a TPU; JAX_DEFAULT_MATMUL_PRECISION=highest below asks for full float32 in both.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install -q)
if [[ -n "${WHEELS:-}" ]]; then PIP+=(--no-index --find-links "$WHEELS"); fi
export PYTHONUNBUFFERED=1

if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "tpu")' 2>/dev/null; then
  echo "== installing jax[tpu]"
  "${PIP[@]}" -U "jax[tpu]"
fi

echo "== installing the repository"
"${PIP[@]}" --no-deps --no-build-isolation -e . || "${PIP[@]}" --no-deps -e .
missing=()
for pair in gguf:gguf flax:flax optax:optax chex:chex safetensors:safetensors tokenizers:tokenizers \
            absl:absl-py einops:einops pytest:pytest; do
  "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
done
if ((${#missing[@]})); then "${PIP[@]}" "${missing[@]}"; fi
"$PY" -c 'import jax; print("jax", jax.__version__, jax.devices())'

status=0
echo "== splash kernel tests, compiled for the TPU"
# -k splash: the Triton kernels' tests (pallas-*) need a GPU or the CPU interpreter, not a TPU.
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py \
  -k "splash or resolution" || status=$?

echo "== timings (median of 5 after compile; ms)"   # runs even when a test failed: the figures still tell
timeout 300 "$PY" -m branch_replay_jax.benchmarks.attention --config=experiments/bench_attention.py \
  --config.impls=splash,splash_public,reference,dpa_xla || status=$?
exit "$status"
