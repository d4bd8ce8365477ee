#!/usr/bin/env bash
# Session 21's device calls (issue 22): the fused forward on 128 x 192 ping-pong tiles.  Builds,
# checks the forward's bits (hash test), then STAGE=ab: times the forward against the cooperative
# 128 x 256 tile (MOK_TMP_FORWARD_TILE=coop, a knob of run 3's tree, removed since; interleaved
# in one run, outputs checked equal) and runs the GPU tests the forward touches; STAGE=final:
# compute-sanitizer (memcheck, racecheck) on the virtual-EP test as tools/gpu_check.sh runs it,
# the trace test and test_experts.  Logs under $OUT.
source "$(dirname "$0")/device_env.sh"
cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA=ON >"$OUT/build.log" 2>&1 &&
  ninja -C build >>"$OUT/build.log" 2>&1 || { echo "build failed"; grep -E "error" "$OUT/build.log" | head -20; exit 1; }
echo "== built at $(el) s"
timeout 120 python3 -m pytest -q -x tests/python/test_forward_hashes.py > "$OUT/pytest_hash.log" 2>&1
echo "hashes rc=$? $(tail -1 "$OUT/pytest_hash.log") at $(el) s"; grep -E "^FAILED|Error" "$OUT/pytest_hash.log" | head
if [ "${STAGE:-ab}" = final ]; then
  for tool in memcheck racecheck; do
    timeout 200 compute-sanitizer --tool $tool --error-exitcode 17 --print-limit 50 build/tests/cpp/test_ep_gpu \
      --gtest_filter="EpGpu.SanitizerSmall*" >"$OUT/sanitizer_$tool.log" 2>&1
    echo "$tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log") at $(el) s"
    grep -A1 "Race reported" "$OUT/sanitizer_$tool.log" | grep -E "access at" | sort | uniq -c | head -8
  done
  timeout 60 build/tests/cpp/test_ep_gpu --gtest_brief=1 >"$OUT/test_ep_gpu.log" 2>&1
  echo "test_ep_gpu: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$OUT/test_ep_gpu.log" | tr '\n' ' ') at $(el) s"
  timeout ${PYTEST_S:-240} python3 -m pytest -q tests/python/test_gpu.py tests/python/test_gpu_backward.py \
    ${FINAL_TESTS:-tests/python/test_experts.py} > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$? $(tail -1 "$OUT/pytest.log") at $(el) s"; grep -E "^FAILED|Error" "$OUT/pytest.log" | head -20
  # The backward after the consumer-role refactor: a sanity figure (across runs: not an A/B)
  [ "${BWD:-1}" = 1 ] && timeout 100 python3 tools/sustained.py qwen3 --backward 2>&1 | tee "$OUT/bwd.log" | grep -E "floor|ring=|unfused"
  echo "at $(el) s"
  exit 0
fi
if [ "${PERF:-1}" = 1 ]; then
  for shape in ${SHAPES:-qwen3 dsv3}; do
    timeout 100 python3 tools/sustained.py $shape --variants "base,coop:MOK_TMP_FORWARD_TILE=coop" 2>&1 | tee "$OUT/fwd_$shape.log" | tail -9
  done; echo "at $(el) s"
fi
for t in test_ep_gpu test_gemm_gpu test_transposed; do
  timeout 150 build/tests/cpp/$t --gtest_brief=1 >"$OUT/$t.log" 2>&1
  echo "$t: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$OUT/$t.log" | tr '\n' ' ') at $(el) s"
done
timeout ${PYTEST_S:-300} python3 -m pytest -q tests/python/test_gpu.py tests/python/test_gpu_shapes.py \
  tests/python/test_gpu_transposed.py tests/python/test_gpu_backward.py tests/python/test_hf.py ${PYTEST_ARGS:-} > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? $(tail -1 "$OUT/pytest.log") at $(el) s"; grep -E "^FAILED|Error" "$OUT/pytest.log" | head -20
