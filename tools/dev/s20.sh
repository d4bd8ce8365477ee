#!/usr/bin/env bash
# Session 20's device calls (issue 22).  STAGE=suite: tools/gpu_check.sh (every GPU test,
# sanitizers).  STAGE=exp: the tree built as it is and, beside it in /tmp/exp, with
# tools/dev/experiments/$PATCH applied; the layer's GPU tests on the first, EXP_TESTS (pytest
# -k) on the second, the backward A/B (EXP_VARIANTS, sustained.py --variants) in the second,
# timing-ring traces (TRACE_SHAPES) of the first.  STAGE=knob: an experiment built into the tree
# behind a temporary knob (KNOB="NAME=VALUE"): the layer's GPU tests under it, then the forward and
# the backward with and without it, interleaved (sustained.py --variants), on KNOB_SHAPES.
# STAGE=swiglu-ncu: ncu of the standalone dgrad-down kinds, the SwiGLU one and the plain one.
# STAGE=verify: the GEMM and EP C++ GPU tests, the layer's Python GPU tests (the
# transposed weights' and the HF integration's among them), the
# backward and forward at the sustained clock on qwen3 and dsv3 (BWD_VARIANTS: sustained.py's
# --variants for the backward), timing-ring traces of TRACE_SHAPES, and (NCU=1, if the call is
# young enough: NCU_BEFORE_S) ncu's warp states and per-instruction stall samples of the qwen3
# fused backward.  Logs under $OUT.
source "$(dirname "$0")/device_env.sh"
if [ "${STAGE:-suite}" = exp ]; then
  # The experiment's copy of the tree, built beside the tree's own build
  rm -rf /tmp/exp && mkdir -p /tmp/exp && tar --exclude=./build --exclude=./out -cf - . | tar -xf - -C /tmp/exp &&
    (cd /tmp/exp && patch -p1 -s < "tools/dev/experiments/$PATCH") || { echo "patch does not apply"; exit 1; }
  (cd /tmp/exp && cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA=ON >"$OUT/build_exp.log" 2>&1 &&
    ninja -C build -j8 >>"$OUT/build_exp.log" 2>&1) & exp_build=$!
fi
if [ ! -f build/lib/libmok.so ]; then
  cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA=ON >"$OUT/build.log" 2>&1 &&
    ninja -C build >>"$OUT/build.log" 2>&1 || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
  echo "== built at $(el) s"
fi
case "${STAGE:-suite}" in
  verify)
    if [ "${TESTS:-1}" = 1 ]; then
      for t in test_gemm_gpu test_ep_gpu test_transposed; do
        timeout 200 build/tests/cpp/$t --gtest_brief=1 >"$OUT/$t.log" 2>&1
        echo "$t: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$OUT/$t.log" | tr '\n' ' ') at $(el) s"
      done
      timeout 360 python3 -m pytest -q tests/python/test_gpu_transposed.py tests/python/test_hf.py \
        tests/python/test_experts.py tests/python/test_gpu_backward.py tests/python/test_gpu.py \
        tests/python/test_forward_hashes.py tests/python/test_gpu_shapes.py ${PYTEST_ARGS:-} > "$OUT/pytest.log" 2>&1
      echo "pytest rc=$? $(tail -1 "$OUT/pytest.log") at $(el) s"; grep -E "^FAILED|Error" "$OUT/pytest.log" | head -20
    fi
    [ "${PERF:-1}" = 1 ] || exit 0
    for shape in qwen3 dsv3; do
      timeout 100 python3 tools/sustained.py $shape --backward ${BWD_VARIANTS:+--variants "$BWD_VARIANTS"} 2>&1 | tee -a "$OUT/bwd.log" | grep -E 'floor|ring=|unfused|transposed'
      timeout 100 python3 tools/sustained.py $shape 2>&1 | tee -a "$OUT/fwd.log" | tail -4
    done; echo "at $(el) s"
    for shape in ${TRACE_SHAPES:-}; do
      mkdir -p "$OUT/tr_$shape"
      timeout 100 python3 tools/trace_forward.py $shape --backward --ring-all --warm 30 --out "$OUT/tr_$shape" \
        > "$OUT/trace_$shape.log" 2>&1; grep -E "traced|combine|grid barrier|tiles busy" "$OUT/trace_$shape.log"
    done
    if [ "${NCU:-1}" = 1 ] && [ "$(el)" -lt "${NCU_BEFORE_S:-280}" ]; then
      timeout 200 ncu --section WarpStateStats --section SourceCounters -k regex:fused_backward --launch-skip 1 \
        --launch-count 1 -o /tmp/fb -f python3 tools/dev/profile_fused_bwd.py qwen3 >"$OUT/ncu_run.log" 2>&1
      echo "ncu rc=$? at $(el) s"
      ncu -i /tmp/fb.ncu-rep --page details >"$OUT/ncu_details.txt" 2>>"$OUT/ncu_run.log"
      ncu -i /tmp/fb.ncu-rep --page source --csv --print-source sass >/tmp/fb_src.csv 2>>"$OUT/ncu_run.log"
      python3 tools/dev/ncu_source_top.py /tmp/fb_src.csv 120 >"$OUT/fb_source_top.txt" 2>&1
      grep -iE "stall|warp cycles|issued" "$OUT/ncu_details.txt" | head -30
    fi ;;
  suite)
    OUT="$OUT" SANITIZER="${SANITIZER:-1}" bash tools/gpu_check.sh; echo "suite rc=$? at $(el) s" ;;
  exp)
    timeout 300 python3 -m pytest -q tests/python/test_gpu_backward.py tests/python/test_gpu_transposed.py \
      tests/python/test_forward_hashes.py ${PYTEST_ARGS:-} >"$OUT/pytest.log" 2>&1
    echo "pytest rc=$? $(tail -1 "$OUT/pytest.log") at $(el) s"; grep -E "^FAILED|Error" "$OUT/pytest.log" | head -20
    wait $exp_build || { echo "experiment build failed"; tail -30 "$OUT/build_exp.log"; exit 1; }
    echo "== experiment built at $(el) s"
    if [ -n "${EXP_TESTS:-}" ]; then
      (cd /tmp/exp && timeout 200 python3 -m pytest -q tests/python/test_gpu_backward.py -k "$EXP_TESTS" \
        >"$OUT/exp_pytest.log" 2>&1); echo "experiment pytest rc=$? $(tail -1 "$OUT/exp_pytest.log")"
    fi
    for shape in ${TRACE_SHAPES:-}; do
      mkdir -p "$OUT/tr_$shape"
      timeout 100 python3 tools/trace_forward.py $shape --backward --ring-all --warm 30 --out "$OUT/tr_$shape" \
        > "$OUT/trace_$shape.log" 2>&1; grep -E "traced|combine|grid barrier|tiles busy|kind" "$OUT/trace_$shape.log" | head -20
    done
    for shape in ${EXP_SHAPES:-qwen3 dsv3}; do
      (cd /tmp/exp && PYTHONPATH=python timeout 150 python3 tools/sustained.py $shape --backward --rounds ${ROUNDS:-20} \
        --variants "$EXP_VARIANTS" 2>&1) | tee -a "$OUT/bwd_exp.log" | grep -E "floor|ring="
    done; echo "at $(el) s" ;;
  knob)
    env "$KNOB" timeout 300 python3 -m pytest -q tests/python/test_gpu_backward.py tests/python/test_gpu.py \
      tests/python/test_forward_hashes.py tests/python/test_gpu_transposed.py ${PYTEST_ARGS:-} >"$OUT/pytest_knob.log" 2>&1
    echo "pytest under $KNOB rc=$? $(tail -1 "$OUT/pytest_knob.log") at $(el) s"; grep -E "^FAILED|Error" "$OUT/pytest_knob.log" | head -20
    for shape in ${KNOB_SHAPES:-qwen3 dsv3}; do
      timeout 100 python3 tools/sustained.py $shape --variants "base,knob:${KNOB}" 2>&1 | tee -a "$OUT/fwd_knob.log" |
        grep -E "dense|experts|mok"
      timeout 120 python3 tools/sustained.py $shape --backward --variants "knob:${KNOB}" 2>&1 | tee -a "$OUT/bwd_knob.log" |
        grep -E "floor|ring="
    done; echo "at $(el) s" ;;
  swiglu-ncu)
    # ncu of the standalone dgrad-down kinds (qwen3; tools/profile_kinds.py: a warm-up call of
    # each, then the profiled ones): the SwiGLU one (launch 2), then the plain one (launch 3)
    for skip in ${NCU_SKIPS:-2 3}; do
      timeout 150 ncu --section SpeedOfLight --section WarpStateStats --section SourceCounters \
        --section MemoryWorkloadAnalysis -k regex:grouped_gemm --launch-skip $skip --launch-count 1 -o /tmp/k$skip -f \
        python3 tools/profile_kinds.py ${NCU_SHAPE:-qwen3} --kinds dgrad_down_swiglu,dgrad_down >"$OUT/ncu_run_$skip.log" 2>&1
      echo "ncu (skip $skip) rc=$? at $(el) s"
      ncu -i /tmp/k$skip.ncu-rep --page details >"$OUT/ncu_details_$skip.txt" 2>>"$OUT/ncu_run_$skip.log"
      ncu -i /tmp/k$skip.ncu-rep --page source --csv --print-source sass >/tmp/k${skip}_src.csv 2>>"$OUT/ncu_run_$skip.log"
      python3 tools/dev/ncu_source_top.py /tmp/k${skip}_src.csv 80 >"$OUT/source_top_$skip.txt" 2>&1
      grep -iE "duration|throughput|warp cycles|Block Size|Function Name|Registers" "$OUT/ncu_details_$skip.txt" | head -24
    done ;;
esac
