#!/usr/bin/env bash
# Issue 22's device calls (carry .whl: TorchTitan's MoE wheels).  PARTS picks what runs:
#   tests  build; the C++ grouped-GEMM tests and the Python GPU tests of the shapes, the layer,
#          the integrations and the forward's bits (tests/python/test_gpu_shapes, test_gpu,
#          test_gpu_backward, test_experts, test_hf, test_torchtitan, test_forward_hashes)
#   e2e    bench/bench_e2e.py (Qwen3-30B-A3B-shaped and DeepSeek-V3-family HF models, mok vs grouped_mm)
#   perf   the layer's backward (and forward + backward), then its forward, at the sustained clock,
#          on PERF_SHAPES (default dsv3 qwen3; bench/shapes.py SHAPES and MODELS names)
#   gemm   the backward's GEMM kinds, mok vs torch._grouped_mm, at the sustained clock, on
#          PERF_SHAPES (tools/sustained.py --gemm; GEMM_VARIANTS: its --variants)
#   suite  tools/gpu_check.sh (every GPU test, sanitizers)
# Logs and JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MOK_GEMM_TIMEOUT_S="${MOK_GEMM_TIMEOUT_S:-10}"
status=0
if ls .whl/torchtitan-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/titan .whl/*.whl \
    >"$OUT/pip.log" 2>&1 && export PYTHONPATH="/tmp/titan${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ ! -f build/lib/libmok.so ] || [ ! -x build/tests/cpp/test_gemm_gpu ]; then
  start=$(date +%s)
  cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA=ON >"$OUT/build.log" 2>&1 &&
    ninja -C build >>"$OUT/build.log" 2>&1 || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
  echo "== built in $(( $(date +%s) - start )) s"
fi
export PYTHONPATH="python${PYTHONPATH:+:$PYTHONPATH}"
for part in ${PARTS:-tests}; do
  case $part in
    tests)
      echo "== C++ grouped-GEMM and plan GPU tests"
      for t in test_gemm_gpu test_plan_gpu; do
        timeout 300 build/tests/cpp/$t --gtest_brief=1 >"$OUT/$t.log" 2>&1
        rc=$?
        echo "$t: rc=$rc $(grep -E '^\[  (PASSED|FAILED)' "$OUT/$t.log" | tr '\n' ' ')"
        [ $rc -eq 0 ] || { status=1; tail -20 "$OUT/$t.log"; }
      done
      echo "== Python GPU tests of the shapes, the layer and the integrations"
      timeout "${PYTEST_TIMEOUT_S:-480}" python3 -m pytest -q -rs --durations=8 tests/python/test_gpu_shapes.py \
        tests/python/test_gpu.py tests/python/test_gpu_backward.py tests/python/test_experts.py \
        tests/python/test_hf.py tests/python/test_torchtitan.py tests/python/test_forward_hashes.py ${PYTEST_ARGS:-} 2>&1 |
        tee "$OUT/pytest.log" | tail -25
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      ;;
    e2e)
      echo "== end-to-end training benchmark"
      timeout "${E2E_TIMEOUT_S:-560}" python3 bench/bench_e2e.py --out "$OUT" ${E2E_ARGS:-} 2>&1 | tee "$OUT/e2e.log" | tail -30
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      ;;
    perf)
      for shape in ${PERF_SHAPES:-dsv3 qwen3}; do
        timeout 240 python3 tools/sustained.py $shape --backward 2>&1 | tee -a "$OUT/sustained_bwd.log" | tail -12
        timeout 240 python3 tools/sustained.py $shape 2>&1 | tee -a "$OUT/sustained_fwd.log" | tail -10
      done
      ;;
    gemm)
      for shape in ${PERF_SHAPES:-dsv3 qwen3}; do
        timeout 240 python3 tools/sustained.py $shape --gemm ${GEMM_VARIANTS:+--variants "$GEMM_VARIANTS"} 2>&1 |
          tee -a "$OUT/sustained_gemm.log" | tail -12
      done
      ;;
    suite)
      OUT="$OUT" SANITIZER="${SANITIZER:-1}" bash tools/gpu_check.sh || status=1
      ;;
  esac
done
exit $status
