#!/usr/bin/env bash
# The GPU-only checks, in one go on a machine with one CUDA GPU (a lent `device`, or your own):
#   1. `autopar calibrate` on a 1-rank nccl job -> $OUT/gpu.toml (compare it with configs/devices/h100.toml)
#   2. tests/test_gpu.py: compiled models on a 1-rank nccl mesh against one GPU; a checkpoint from GPU memory
#   3. scripts/peak_composition.py: GPT-2 small's peak taken apart, saving everything and recomputing whole
#      layers (the plan whose measured peak was furthest above the plan's on the H200, 2026-11-26)
#   4. `autopar fidelity` on one GPU (configs/benchmarks/fidelity_gpu.toml) with the calibrated profile
#   5. scripts/kernel_shapes.py: Llama 3 405B's layer kernels (GEMMs by shape, fused attention) at tp 8 and 4,
#      measured against the h100 profile's prices (issue 32: where the profiles over-predict large runs)
#   6. scripts/phase_prices.py: GPT-2 small's step phase by phase (forward, backward, optimizer), eager PyTorch
#      against the calibrated profile's prices (what the prices get right before autopar's runtime runs the plan)
# Every step's output goes to $OUT (default ./gpu-check); a failing step does not stop the others.
# Python packages autopar needs that the machine lacks can be put in .whl/ (installed to /tmp/site).
set -u
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD AUTOPAR_CONFIG_DIR=$PWD/configs
else
  export PYTHONPATH=$PWD AUTOPAR_CONFIG_DIR=$PWD/configs
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/gpu.txt"
run1() { python3 -m torch.distributed.run --nproc-per-node 1 -m autopar.cli "$@"; }
step() { local name=$1; shift; local t0=$SECONDS; "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name: rc $rc, $((SECONDS - t0)) s"; tail -n "${TAIL:-25}" "$OUT/$name.log"; }
step calibrate timeout 120 bash -c "$(declare -f run1); run1 calibrate --ranks 1 -o $OUT/gpu.toml"
step tests timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q tests/test_gpu.py
for mode in full none; do
  TAIL=30 step "peak-$mode" timeout 150 python3 -m torch.distributed.run --nproc-per-node 1 \
    scripts/peak_composition.py gpt2 --batch 8 --seq 1024 --recompute "$mode" --profile "$OUT/gpu.toml"
done
TAIL=70 step kernel-shapes timeout 120 python3 scripts/kernel_shapes.py --profile h100
TAIL=35 step kernel-shapes-calibrated timeout 90 python3 scripts/kernel_shapes.py --profile "$OUT/gpu.toml" --tp 8
TAIL=14 step phases timeout 120 python3 scripts/phase_prices.py gpt2 --batch 8 --seq 1024 --profile "$OUT/gpu.toml"
TAIL=20 step fidelity timeout "${FIDELITY_TIMEOUT:-300}" bash -c \
  "$(declare -f run1); run1 fidelity --ranks 1 --profile $OUT/gpu.toml --benchmark configs/benchmarks/fidelity_gpu.toml --json $OUT/fidelity.json ${FIDELITY_ARGS:-}"
