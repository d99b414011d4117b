#!/usr/bin/env bash
# The accelerator check, prepared so that a session lent an NVIDIA GPU runs it in one go:
#
#   bash benchmarks/device_check.sh        # on the device machine, from the repository root
#
# 1. The compiled Pallas GPU kernels (paged write, window attention) through the same tests as
#    their interpreters: bit-identical writes against the reference, untouched pages, skipped ids
#    under jit, donation in place, attention against the reference with NaN-poisoned pages.
# 2. benchmarks/paged_write.py --gpu (Wan-1.3B shape: bandwidth vs a device-to-device copy and XLA
#    scatter) and benchmarks/window_attention.py --gpu (vs cuDNN dense attention).
#
# Needs jax with CUDA, pytest, chex and numpy; not flax (nothing here imports arkv_jax). Each part
# has its own timeout so the whole stays under 8 minutes. Everything goes to $OUT (default
# ./device_check_out); the last lines of each log are printed at the end. On a machine without a
# GPU the kernel tests are reported as skipped and the benchmarks refuse to run.
set -u
out="${OUT:-device_check_out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

python -c "import jax, platform; print('jax', jax.__version__, 'python', platform.python_version()); \
print(jax.devices())" > "$out/env.txt" 2>&1

timeout 240 python -m pytest -p no:cacheprovider -rs tests/kernels/test_paged_write.py \
  tests/kernels/test_window_attention.py -k "pallas_gpu and not interpret" > "$out/tests.txt" 2>&1
echo "exit status $?" >> "$out/tests.txt"

timeout 120 python -m benchmarks.paged_write --gpu > "$out/paged_write_gpu.txt" 2>&1
echo "exit status $?" >> "$out/paged_write_gpu.txt"

timeout 120 python -m benchmarks.window_attention --gpu > "$out/window_attention_gpu.txt" 2>&1
echo "exit status $?" >> "$out/window_attention_gpu.txt"

for log in env tests paged_write_gpu window_attention_gpu; do
  echo "== $log"
  tail -n 6 "$out/$log.txt"
done
