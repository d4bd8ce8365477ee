#!/usr/bin/env bash
# Session 22's device calls (issue 22).  STAGE=wgrad (run 1, on the tree of its commit): the
# standalone wgrad kinds on 128 x 192 ping-pong tiles (MOK_TMP_WGRAD_TILE=pp192, since removed)
# against 128 x 256 cooperative: the grouped-wgrad float64 tests under each, the --gemm A/B (bits
# checked against the base), and the backward at the sustained clock.  STAGE=suite:
# tools/gpu_check.sh, then the GEMM kinds and the backward at the sustained clock (PERF=0: not).
# STAGE=exp: the tree with tools/dev/experiments/$PATCH applied, built in /tmp/exp: its backward
# and SwiGLU-kind GPU tests (EXP_TESTS: pytest -k), then its backward at the sustained clock.
# STAGE=exp2: the ping-pong backward patch, as it is (pp192) and with the backward's policy at
# 128 x 128 ping-pong (pp128), and variants named dyn* with bwd_pp192_dynamic.patch instead
# (dynamic ownership of ping-pong tiles), built side by side (VARIANTS: which): each one's smoke test
# (tools/dev/bwd_smoke.py) and its backward at the sustained clock on SHAPES.  DIAG=1 then: the
# first variant's backward under larger minibatches (MB_VARIANTS, sustained.py --variants) and
# timing-ring traces of its backward and of the tree's own (cooperative) on qwen3.
# Logs under $OUT.
source "$(dirname "$0")/device_env.sh"
if [ "${STAGE:-suite}" != exp ] && [ "${STAGE:-suite}" != exp2 ] && [ ! -f build/lib/libmok.so ]; then
  cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA=ON >"$OUT/build.log" 2>&1 &&
    ninja -C build ${TARGETS:-} >>"$OUT/build.log" 2>&1 || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
  echo "== built at $(el) s"
fi
case "${STAGE:-suite}" in
  exp2)
    for v in ${VARIANTS:-pp192 pp128}; do
      patch_file=bwd_pp192.patch; [ "${v#dyn}" != "$v" ] && patch_file=bwd_pp192_dynamic.patch
      rm -rf /tmp/x_$v && mkdir -p /tmp/x_$v && tar --exclude=./build --exclude=./out -cf - . | tar -xf - -C /tmp/x_$v &&
        (cd /tmp/x_$v && patch -p1 -s < tools/dev/experiments/$patch_file) || { echo "patch does not apply"; exit 1; }
    done
    [ -d /tmp/x_pp128 ] && sed -i 's/using BackwardPolicyBf16 = ForwardPolicyBf16;/using BackwardPolicyBf16 = Policy<gemm::PrecisionBf16, false, gemm::TileConfigPingPong>;/' \
      /tmp/x_pp128/src/cuda/fused/policy.cuh
    for v in ${VARIANTS:-pp192 pp128}; do
      (cd /tmp/x_$v && cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA=ON >"$OUT/build_$v.log" 2>&1 &&
        ninja -C build -j8 mok >>"$OUT/build_$v.log" 2>&1; echo "build $v rc=$? at $(el) s") &
    done; wait
    for v in ${VARIANTS:-pp192 pp128}; do
      (cd /tmp/x_$v && timeout 70 python3 tools/dev/bwd_smoke.py 2>&1 | tail -8 | sed "s/^/$v: /")
    done; echo "at $(el) s"
    for shape in ${SHAPES:-qwen3 dsv3}; do
      for v in ${VARIANTS:-pp192 pp128}; do
        (cd /tmp/x_$v && timeout 60 python3 tools/sustained.py $shape --backward --rounds 10 2>&1 | tee "$OUT/bwd_${v}_$shape.log" |
          grep -E 'floor|bwd ring=[0-9]* +|bwd ring=.*transposed|bwd unfused|differs|rror' | sed "s/^/$v: /")
      done; echo "at $(el) s"
    done
    [ "${DIAG:-0}" = 1 ] || exit 0
    set -- ${VARIANTS:-pp192 pp128}; v=$1
    (cd /tmp/x_$v && timeout 100 python3 tools/sustained.py qwen3 --backward --rounds 10 \
      --variants "${MB_VARIANTS:-base,m77:MOK_BACKWARD_MINIBATCH=9856,m154:MOK_BACKWARD_MINIBATCH=19712}" 2>&1 |
      tee "$OUT/bwd_mb_$v.log" | grep -E 'floor|\[|differs|rror' | sed "s/^/$v: /"); echo "at $(el) s"
    (cd /tmp/x_$v && mkdir -p "$OUT/tr_$v" && timeout 100 python3 tools/trace_forward.py qwen3 --backward --ring-all --warm 30 \
      --out "$OUT/tr_$v" > "$OUT/trace_$v.log" 2>&1; grep -E "traced|combine|grid barrier|tiles busy|kind" "$OUT/trace_$v.log" | head -20)
    if [ ! -f build/lib/libmok.so ]; then
      cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA=ON >"$OUT/build.log" 2>&1 && ninja -C build mok >>"$OUT/build.log" 2>&1
    fi
    mkdir -p "$OUT/tr_coop" && timeout 100 python3 tools/trace_forward.py qwen3 --backward --ring-all --warm 30 --out "$OUT/tr_coop" \
      > "$OUT/trace_coop.log" 2>&1; grep -E "traced|combine|grid barrier|tiles busy|kind" "$OUT/trace_coop.log" | head -20
    echo "at $(el) s" ;;
  exp)
    rm -rf /tmp/exp && mkdir -p /tmp/exp && tar --exclude=./build --exclude=./out -cf - . | tar -xf - -C /tmp/exp &&
      (cd /tmp/exp && patch -p1 -s < "tools/dev/experiments/$PATCH") || { echo "patch does not apply"; exit 1; }
    cd /tmp/exp && { cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA=ON >"$OUT/build_exp.log" 2>&1 &&
      ninja -C build mok >>"$OUT/build_exp.log" 2>&1 || { echo "experiment build failed"; tail -30 "$OUT/build_exp.log"; exit 1; }; }
    echo "== experiment built at $(el) s"
    timeout 240 python3 -m pytest -q -x tests/python/test_gpu_backward.py tests/python/test_gpu.py -k "${EXP_TESTS:-backward or swiglu}" \
      >"$OUT/exp_pytest.log" 2>&1; echo "experiment pytest rc=$? $(tail -1 "$OUT/exp_pytest.log") at $(el) s"
    grep -E "^FAILED|Error|rror:" "$OUT/exp_pytest.log" | head -10
    for shape in ${SHAPES:-qwen3 dsv3}; do
      timeout 110 python3 tools/sustained.py $shape --backward 2>&1 | tee "$OUT/exp_bwd_$shape.log" | grep -E 'floor|ring=|unfused|differs|Error'
      echo "at $(el) s"
    done ;;
  wgrad)
    for v in base pp192; do
      MOK_TMP_WGRAD_TILE=$v timeout 120 python3 -m pytest -q tests/python/test_gpu.py -k "wgrad" >"$OUT/pytest_$v.log" 2>&1
      echo "pytest wgrad $v rc=$? $(tail -1 "$OUT/pytest_$v.log") at $(el) s"; grep -E "^FAILED|Error" "$OUT/pytest_$v.log" | head
    done
    for shape in ${SHAPES:-qwen3 dsv3}; do
      timeout 150 python3 tools/sustained.py $shape --gemm --variants "base,pp192:MOK_TMP_WGRAD_TILE=pp192" 2>&1 |
        tee "$OUT/gemm_$shape.log" | grep -E "dense|wgrad|differs|Error" ; echo "at $(el) s"
    done
    for shape in ${BWD_SHAPES:-qwen3 dsv3}; do
      timeout 110 python3 tools/sustained.py $shape --backward 2>&1 | tee "$OUT/bwd_$shape.log" | grep -E 'floor|ring=|unfused|differs|Error'
      echo "at $(el) s"
    done ;;
  suite)
    OUT="$OUT" SANITIZER="${SANITIZER:-1}" bash tools/gpu_check.sh > "$OUT/suite.log" 2>&1; rc=$?
    grep -vE "^\s*\(" "$OUT/suite.log" | tail -40; echo "suite rc=$rc at $(el) s"
    [ "${PERF:-1}" = 1 ] || exit 0
    for shape in qwen3 dsv3; do
      timeout 100 python3 tools/sustained.py $shape --gemm 2>&1 | tee "$OUT/gemm_$shape.log" | grep -E "dense|mok" ; echo "at $(el) s"
      timeout 110 python3 tools/sustained.py $shape --backward 2>&1 | tee "$OUT/bwd_$shape.log" | grep -E 'floor|ring=|unfused|differs|Error'
      echo "at $(el) s"
    done ;;
esac
