#!/usr/bin/env bash
# The NVIDIA GPU check of every GPU backend, prepared so that a session lent a GPU runs it in one go:
#
#   bash benchmarks/device_check.sh        # on the device machine, from the repository root
#
# 1. The Mosaic GPU kernel (backend="pallas_mgpu") compiled, against the reference on kernel-sized
#    cases with NaN wherever a row must not look, at three tilings. It runs first and alone: a hang
#    there (barrier phases cannot be checked without a GPU) must not eat the rest. It runs in 8
#    processes, so that a case that hangs holds one of them and the others go on; each result is
#    logged as it comes and every test's time at the end (the first run, 2026-12-06, one process,
#    passed 4 cases in a 60 s limit and left unknown whether the fifth hung or compiled slowly).
# 2. The other compiled GPU backends through the same tests as their CPU counterparts: the cuDNN
#    gather path (backend="cudnn_gather", the GPU default) and the Triton kernels
#    (backend="pallas_gpu": attention and the paged write), the scatter paged write (run under
#    "cudnn_gather"): bit-identical writes, untouched pages, skipped ids, donation in place,
#    attention against the reference with NaN-poisoned pages; the same for quantized pools (int8,
#    fp8 e4m3fn and e5m2 pages: tests/kernels/test_quantized_pools.py and the quantized wide cases).
# 3. benchmarks/generate.py --shape wan-1.3b: the product at its real shape, random weights: one
#    Self-Forcing session (4 steps + commit) through Rollout.step() over the paged cache, then the
#    streaming VAE decode of its chunk at 480x832; frames/s; then the DiT part over int8 pages
#    against bf16 pages, stepped in turn.
# 4. benchmarks/gpu_window_attention.py --gpu: Mosaic GPU, Triton and cuDNN gather against cuDNN on
#    the same tokens held contiguously, Wan-1.3B shape, rows 1 and 4, TFLOP/s against the bf16 peak
#    measured in the same run; Triton and cuDNN gather also over int8 and fp8 pages.
# 5. benchmarks/paged_write.py --gpu at 1,664-token pages: the scatter write (auto), the Triton
#    write and XLA's own scatter against a device-to-device copy; the Triton write and the scatter
#    also into int8 and fp8 pages.
#
# Needs jax with CUDA, flax, pytest, pytest-xdist, chex and numpy (the lent machine's image has
# them). The compiled tests run in 8 (step 1) and 12 (step 2) processes that allocate GPU memory
# as they go; the benchmarks share a persistent compilation cache in $TMPDIR (default /tmp).
# $PYTHON (default python3) runs everything. Timeouts: 30 + 120 + 130 + 120 + 120 + 40 = 560 s,
# under 10 minutes. Everything goes to $OUT (default ./device_check_out); the last lines of each
# log are printed at the end. On a machine without a GPU the compiled tests are reported as
# skipped and the benchmarks refuse to run (generate runs on the host: skip it there).
set -u
py="${PYTHON:-python3}"
out="${OUT:-device_check_out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# tests/conftest.py keeps JAX on the host CPU unless JAX_PLATFORMS says otherwise.
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda,cpu}"

# step NAME LIMIT COMMAND...: COMMAND under a LIMIT-second timeout, its output in $out/NAME.txt,
# then its exit status and wall seconds there too.
step() {
  local name="$1" limit="$2" began=$SECONDS
  shift 2
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "exit status $? after $((SECONDS - began)) s (limit $limit s)" >> "$out/$name.txt"
}

step env 30 "$py" -c "import jax, flax, platform; print('jax', jax.__version__, 'flax', \
flax.__version__, 'python', platform.python_version()); print(jax.devices()); \
print(jax.devices()[0].device_kind)"

XLA_PYTHON_CLIENT_PREALLOCATE=false step tests_mosaic 120 "$py" -m pytest -p no:cacheprovider -rs -v \
  -n 8 --durations=0 tests/kernels/test_window_attention_gpu.py -k "pallas_mgpu or mosaic_tilings_on_gpu"

XLA_PYTHON_CLIENT_PREALLOCATE=false step tests_other 130 "$py" -m pytest -p no:cacheprovider -rs \
  -n 12 tests/kernels -k "(pallas_gpu or cudnn_gather) and not interpret and not cudnn_gather_xla"

export JAX_COMPILATION_CACHE_DIR="${TMPDIR:-/tmp}/arkv_jax_compile_cache"
step generate_wan 120 "$py" -m benchmarks.generate --shape wan-1.3b --sessions 1 --kv-dtype int8

step gpu_window_attention 120 "$py" -m benchmarks.gpu_window_attention --gpu --reps 10

step paged_write_gpu_1664 40 "$py" -m benchmarks.paged_write --gpu --block-size 1664 --rows 4

for log in env tests_mosaic tests_other generate_wan gpu_window_attention paged_write_gpu_1664; do
  echo "== $log"
  tail -n 12 "$out/$log.txt"
done
