#!/usr/bin/env bash
# The NVIDIA GPU check of every GPU backend, prepared so that a session lent a GPU runs it in one go:
#
#   bash benchmarks/device_check.sh        # on the device machine, from the repository root
#
# 1. The Mosaic GPU kernel (backend="pallas_mgpu") compiled, against the reference on kernel-sized
#    cases with NaN wherever a row must not look, at three tilings. It runs first and alone: a hang
#    there (barrier phases cannot be checked without a GPU) must not eat the rest.
# 2. The other compiled GPU backends through the same tests as their CPU counterparts: the cuDNN
#    gather path (backend="cudnn_gather", the GPU default) and the Triton kernels
#    (backend="pallas_gpu": attention and the paged write), the scatter paged write (run under
#    "cudnn_gather"): bit-identical writes, untouched pages, skipped ids, donation in place,
#    attention against the reference with NaN-poisoned pages; the same for quantized pools (int8,
#    fp8 e4m3fn and e5m2 pages: tests/kernels/test_quantized_pools.py and the quantized wide cases).
# 3. benchmarks/gpu_window_attention.py --gpu: Mosaic GPU, Triton and cuDNN gather against cuDNN on
#    the same tokens held contiguously, Wan-1.3B shape, rows 1 and 4, TFLOP/s against the bf16 peak
#    measured in the same run; Triton and cuDNN gather also over int8 and fp8 pages.
# 4. benchmarks/paged_write.py --gpu at 128- and 1,664-token pages: the scatter write (auto), the
#    Triton write and XLA's own scatter against a device-to-device copy; the Triton write and the
#    scatter also into int8 and fp8 pages.
#
# Needs jax with CUDA, pytest, chex and numpy; not flax (nothing here imports arkv_jax). Timeouts:
# 30 + 90 + 200 + 180 + 2 x 40 = 580 s, under 10 minutes. Everything goes to $OUT (default
# ./device_check_out); the last lines of each log are printed at the end. On a machine without a
# GPU the compiled tests are reported as skipped and the benchmarks refuse to run.
set -u
out="${OUT:-device_check_out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# tests/conftest.py keeps JAX on the host CPU unless JAX_PLATFORMS says otherwise.
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda,cpu}"

timeout 30 python -c "import jax, platform; print('jax', jax.__version__, 'python', \
platform.python_version()); print(jax.devices()); print(jax.devices()[0].device_kind)" \
  > "$out/env.txt" 2>&1
echo "exit status $?" >> "$out/env.txt"

timeout 90 python -m pytest -p no:cacheprovider -rs -x tests/kernels/test_window_attention_gpu.py \
  -k "pallas_mgpu or mosaic_tilings_on_gpu" > "$out/tests_mosaic.txt" 2>&1
echo "exit status $?" >> "$out/tests_mosaic.txt"

timeout 200 python -m pytest -p no:cacheprovider -rs tests/kernels \
  -k "(pallas_gpu or cudnn_gather) and not interpret and not cudnn_gather_xla" \
  > "$out/tests_other.txt" 2>&1
echo "exit status $?" >> "$out/tests_other.txt"

timeout 180 python -m benchmarks.gpu_window_attention --gpu --reps 15 \
  > "$out/gpu_window_attention.txt" 2>&1
echo "exit status $?" >> "$out/gpu_window_attention.txt"

for block in 128 1664; do
  timeout 40 python -m benchmarks.paged_write --gpu --block-size "$block" --rows 4 \
    > "$out/paged_write_gpu_$block.txt" 2>&1
  echo "exit status $?" >> "$out/paged_write_gpu_$block.txt"
done

for log in env tests_mosaic tests_other gpu_window_attention paged_write_gpu_128 \
    paged_write_gpu_1664; do
  echo "== $log"
  tail -n 8 "$out/$log.txt"
done
