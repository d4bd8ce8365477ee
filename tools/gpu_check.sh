#!/usr/bin/env bash
# One device call: build if needed, run every GPU test (C++ and Python) and the ceiling
# probe, write logs and JSON under $OUT (default ./out; at most 8 files come back).  Carry
# `build` to skip the build.  PERF=1 adds the measurements of docs/perf.md in the same call:
# grouped GEMMs vs torch, the fused-forward knob sweep, its timing ring, and the layer bench.
# SANITIZER=0 skips compute-sanitizer; GEMM_VARIANTS="base,g4:MOK_TILE_N_GROUP=4" times the
# backward's GEMM kinds against torch at the sustained clock (tools/sustained.py --gemm) on
# dsv3 and qwen3 with those knob settings, interleaved; FWD_MINIBATCHES="0,1024" does the same
# for the fused forward (tools/sustained.py --minibatches) against torch and the bare GEMMs;
# BACKWARD=1 times the layer's backward (tools/sustained.py --backward) on dsv3 and qwen3.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# A kernel that waits forever fails its test in seconds, not a minute per wait
export MOK_GEMM_TIMEOUT_S="${MOK_GEMM_TIMEOUT_S:-10}"
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/gpu.txt" 2>&1
if [ ! -x build/tests/cpp/test_plan_gpu ] || [ ! -f build/lib/libmok.so ]; then
  echo "== building on the device"
  cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA=ON >"$OUT/build.log" 2>&1 && ninja -C build >>"$OUT/build.log" 2>&1 || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
fi
echo "== C++ tests (binaries run directly: the carried CTest files hold this machine's paths)"
for t in build/tests/cpp/test_*; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  start=$(date +%s)
  timeout "${TEST_TIMEOUT_S:-300}" "$t" --gtest_brief=1 >/tmp/$name.log 2>&1
  rc=$?
  echo "  ($name: $(( $(date +%s) - start )) s)"
  cat /tmp/$name.log >>"$OUT/cpp_tests.log"
  echo "$name: rc=$rc $(grep -E '^\[  (PASSED|FAILED|SKIPPED)' /tmp/$name.log | tr '\n' ' ')"
  [ $rc -eq 0 ] || { status=1; tail -30 /tmp/$name.log; }
done
echo "== compute-sanitizer (memcheck, racecheck) on virtual EP=4, small shape (forward and backward)"
for tool in $([ "${SANITIZER:-1}" = 1 ] && echo memcheck racecheck); do
  # --error-exitcode: a reported error fails the check (the test binary's own rc alone would not)
  timeout 300 compute-sanitizer --tool $tool --error-exitcode 17 --print-limit 50 build/tests/cpp/test_ep_gpu \
    --gtest_filter="EpGpu.SanitizerSmall*" >"$OUT/sanitizer_$tool.log" 2>&1
  rc=$?
  verdict="rc=$rc"
  if [ $rc -eq 17 ] && [ "$tool" = racecheck ]; then
    # The one known report: the fused kernels' task hand-off slot (sh.tasks), written by the
    # producer and read by the consumers, ordered by the task_full / task_empty mbarriers, which
    # racecheck does not order (docs/design.md, "The fused backward", Sanitizers).  Any other
    # hazard fails the check.
    other=$(grep -A1 "Race reported" "$OUT/sanitizer_$tool.log" | grep -E "access at" | grep -vcE "produce_tasks.*producer\.cuh|(consume_tasks|ConsumerHandoffs).*consumers\.cuh")
    if [ "$other" -eq 0 ]; then rc=0; verdict="only the task hand-off report (known, mbarrier-ordered)"; fi
  fi
  echo "$tool: $verdict $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log")"
  [ $rc -eq 0 ] || status=1
done
if [ "${SANITIZER:-1}" = 1 ]; then
  # Control for the hand-off report: the stage ring alone (tests/cpp/test_pipeline_gpu.cu: one
  # producer writes a shared slot, mbarriers order the consumers' reads and the slot's reuse, the
  # values are checked).  Hazards here too mean racecheck does not order mbarrier waits.
  timeout 120 compute-sanitizer --tool racecheck --print-limit 5 build/tests/cpp/test_pipeline_gpu \
    --gtest_filter=PipelineGpu.DummyProducerAndConsumersFinish >"$OUT/sanitizer_racecheck_pipeline.log" 2>&1
  echo "racecheck control (mbarrier-ordered stage ring): rc=$? $(grep -E 'RACECHECK SUMMARY' "$OUT/sanitizer_racecheck_pipeline.log")"
fi
if [ -n "${GEMM_VARIANTS:-}" ]; then
  echo "== the backward's GEMM kinds at the sustained clock"
  for shape in dsv3 qwen3; do
    PYTHONPATH=python timeout 240 python3 tools/sustained.py $shape --gemm --variants "$GEMM_VARIANTS" 2>&1 \
      | tee -a "$OUT/sustained_gemm.log"
  done
fi
if [ -n "${FWD_MINIBATCHES:-}" ]; then
  echo "== the fused forward at the sustained clock (minibatch sizes $FWD_MINIBATCHES; 0 = mok's rule)"
  for shape in dsv3 qwen3; do
    PYTHONPATH=python timeout 240 python3 tools/sustained.py $shape --minibatches "$FWD_MINIBATCHES" 2>&1 \
      | tee -a "$OUT/sustained_fwd.log"
  done
fi
if [ "${BACKWARD:-0}" = 1 ]; then
  echo "== the layer's backward at the sustained clock (mok vs the torch autograd pipeline)"
  for shape in dsv3 qwen3; do
    PYTHONPATH=python timeout 240 python3 tools/sustained.py $shape --backward 2>&1 | tee -a "$OUT/sustained_bwd.log"
  done
fi
echo "== Python tests"
PYTHONPATH="python${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -q -rs tests/python ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -15
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "== ceilings"
python3 tools/ceilings.py "$OUT/ceilings.json" | tail -12
if [ "${PERF:-0}" = 1 ]; then
  echo "== grouped GEMMs (mok engine vs torch._grouped_mm)"
  PYTHONPATH=python timeout 240 python3 bench/bench_gemm.py --shapes dsv3,qwen3 --reps 10 2>&1 | tail -6
  echo "== fused forward knob sweep"
  PYTHONPATH=python timeout 240 python3 tools/sweep_forward.py dsv3 2>&1 | tee "$OUT/sweep.log" | tail -40
  echo "== timing ring"
  PYTHONPATH=python timeout 120 python3 tools/trace_forward.py dsv3 --out "$OUT" 2>&1 | tail -16
  echo "== the bars at the sustained clock (interleaved timing after 3 s of load)"
  PYTHONPATH=python timeout 120 python3 tools/sustained.py dsv3 2>&1 | tail -7
  echo "== layer benchmark"
  PYTHONPATH=python timeout 420 python3 bench/bench_layer.py --shapes all --routing uniform,zipf --fwd-only \
    --reps 10 --variants fused/gather --out "$OUT" 2>&1 | tail -20
  if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    echo "== EP benchmark (all GPUs)"
    PYTHONPATH=python timeout 400 python3 bench/bench_ep.py --shapes dsv3,qwen3 --routing uniform --sweep \
      --out "$OUT" 2>&1 | tail -24
  fi
fi
exit $status
