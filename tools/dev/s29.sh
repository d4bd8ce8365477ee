#!/usr/bin/env bash
# Session 29's device calls (issue 23, fp8; STAGE a list of stages run in order, e.g.
# STAGE="ep8 fp8", the tree built once).  STAGE=ep8: fp8_block at EP >= 2 on virtual ranks
# (test_ep.py's TestVirtualRanksFp8), then the bf16 EP tests (pytest, gtest EpGpu) as regressions.  STAGE=fp8: the tree built with its tests; the fp8
# GPU tests (every fp8 kind, the quantisers, the layer's CUDA forward (the megakernel's fp8
# policy, bit for bit the launches) and backward against the CPU reference), the bf16 fused
# layer's GPU tests (BF16_TESTS), the layer's time kernel by kernel
# (tools/dev/fp8_breakdown.py), then every fp8 kind and the layer (forward, forward + backward)
# at the sustained clock on SHAPES, FP8_VARIANTS the kinds' knob sets.
# STAGE=e2e8: bench_e2e's qwen3 model in grouped_mm, mok and mok_fp8, 200 steps (parity, PNG).
# STAGE=one: the library and one pytest selection (PYTEST).  Logs under $OUT, packed.
source "$(dirname "$0")/device_env.sh"
build() {  # $1: ON builds the tests too (once a call: a later stage's build is skipped)
  [ -n "${BUILT:-}" ] && return 0
  BUILT=1
  cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=$1 -DMOK_CUDA=ON >"$OUT/build.log" 2>&1 &&
    ninja -C build $([ "$1" = ON ] || echo mok) >>"$OUT/build.log" 2>&1 || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
  echo "== built at $(el) s"
}
for st in ${STAGE:-fp8}; do
case "$st" in
  fp8)
    build ON
    timeout 120 build/tests/cpp/test_gemm_gpu --gtest_filter='*E4m3*' > "$OUT/gtest_fp8.log" 2>&1
    echo "gtest fp8 rc=$? $(grep -E 'PASSED|FAILED' "$OUT/gtest_fp8.log" | tr '\n' ' ')"
    # The megakernel's fp8 policy first (bit for bit the launches): if it fails, the rest runs
    # the launches (MOK_FORWARD_PATH=unfused), so that a hang does not cost every test its deadline
    timeout 120 python3 -m pytest -q -x tests/python/test_fp8_layer_gpu.py -k fused_forward_is_the_launches \
      > "$OUT/pytest_fused8.log" 2>&1
    rc=$?; echo "pytest fused fp8 rc=$rc $(tail -1 "$OUT/pytest_fused8.log") at $(el) s"
    grep -E "^FAILED|^E  " "$OUT/pytest_fused8.log" | cut -c1-400 | head -12
    [ $rc = 0 ] || export MOK_FORWARD_PATH=unfused
    timeout 300 python3 -m pytest -q -rs tests/python/test_fp8_ops.py tests/python/test_fp8.py \
      tests/python/test_fp8_wgrad.py tests/python/test_fp8_layer_gpu.py tests/python/test_fp8_layer_cpu.py \
      > "$OUT/pytest_fp8.log" 2>&1
    echo "pytest fp8 rc=$? $(tail -1 "$OUT/pytest_fp8.log") at $(el) s"
    grep -E "^FAILED|^E  " "$OUT/pytest_fp8.log" | cut -c1-300 | head -16
    if [ -n "${BF16_TESTS:-}" ]; then
      timeout 300 python3 -m pytest -q -x $BF16_TESTS > "$OUT/pytest_bf16.log" 2>&1
      echo "pytest bf16 rc=$? $(tail -1 "$OUT/pytest_bf16.log") at $(el) s"
      grep -E "^FAILED|^E  " "$OUT/pytest_bf16.log" | cut -c1-300 | head -8
    fi
    timeout 120 python3 tools/dev/fp8_breakdown.py ${SHAPES%% *} > "$OUT/breakdown.log" 2>&1
    echo "breakdown rc=$?"; cat "$OUT/breakdown.log" | cut -c1-150 | head -70
    for shape in ${SHAPES:-dsv3}; do
      timeout 200 python3 tools/sustained.py $shape --fp8 --variants "${FP8_VARIANTS:-base}" 2>&1 | tee "$OUT/fp8_$shape.log" | grep -vE "^\s*$" | tail -24
      echo "at $(el) s"
    done ;;
  ep8)
    build ON
    timeout 240 python3 -m pytest -q -x -s tests/python/test_ep.py -k Fp8 > "$OUT/pytest_ep8.log" 2>&1
    echo "pytest ep fp8 rc=$? $(tail -1 "$OUT/pytest_ep8.log") at $(el) s"
    grep -E "^FAILED|^E  |relative Frobenius" "$OUT/pytest_ep8.log" | cut -c1-300 | head -24
    timeout 200 python3 -m pytest -q tests/python/test_ep.py -k "not Fp8 and not MultiGPU" > "$OUT/pytest_ep.log" 2>&1
    echo "pytest ep bf16 rc=$? $(tail -1 "$OUT/pytest_ep.log") at $(el) s"
    grep -E "^FAILED|^E  " "$OUT/pytest_ep.log" | cut -c1-300 | head -12
    timeout ${EPGTEST_TIMEOUT:-120} build/tests/cpp/test_ep_gpu --gtest_filter="${EPGTEST:-*}" > "$OUT/gtest_ep.log" 2>&1
    echo "gtest ep rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$OUT/gtest_ep.log" | tr '\n' ' ') at $(el) s" ;;
  wgncu)  # ncu of the fp8 wgrad kind and the dgrad-down SwiGLU kind (dsv3: 16 experts x 2048 rows)
    build OFF
    cat > /tmp/k8.py <<'PY'
import sys, torch
sys.path.insert(0, "python")
import mok
from mok import ops, fp8
E, rows, H, I = 16, 2048, 7168, 2048
R = E * rows
g = torch.Generator(device="cuda").manual_seed(0)
dy = torch.randn(R, H, device="cuda", generator=g).bfloat16()
a = torch.randn(R, I, device="cuda", generator=g).bfloat16()
if sys.argv[1] == "wgrad":
    (qa, sa), (qb, sb) = ops.quantize_cols_fp8(dy), ops.quantize_cols_fp8(a)
    off = torch.arange(E + 1, device="cuda", dtype=torch.int32) * rows
    cnt = torch.full((E,), rows, device="cuda", dtype=torch.int32)
    out = torch.empty(E, H, I, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        ops.grouped_wgrad_fp8(qa, sa, qb, sb, off, cnt, out=out)
else:
    wd = (torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5).bfloat16()
    wg = (torch.randn(E, I, H, device="cuda", generator=g) / H ** 0.5).bfloat16()
    fw = mok.quantize_weights(wg, wg, wd)
    qx, sx = fp8.quantize_rows(dy)
    be = torch.arange(E, device="cuda", dtype=torch.int32).repeat_interleave(rows // 128)
    h = torch.randn(R, 2 * I, device="cuda", generator=g).bfloat16()
    rw = torch.rand(R, device="cuda", generator=g)
    for _ in range(3):
        ops.dgrad_down_swiglu_fp8(qx, sx, fw["w_down"].qt, fw["w_down"].scales, be, h, rw)
torch.cuda.synchronize()
PY
    # KINDS: kinds, each optionally with its environment (kind:VAR=value,VAR2=value)
    for spec in ${KINDS:-swiglu wgrad}; do
      kind=${spec%%:*}; envs=""; [ "$spec" = "$kind" ] || envs=$(echo "${spec#*:}" | tr ',' ' ')
      tag=$(echo "$spec" | tr -c 'A-Za-z0-9_\n' '_')
      k=$([ $kind = wgrad ] && echo wgrad_fp8 || echo grouped_gemm_kernel)
      env $envs timeout 200 ncu --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section SourceCounters -k regex:$k --launch-skip 2 --launch-count 1 \
        -o /tmp/ncu_$tag -f python3 /tmp/k8.py $kind > "$OUT/ncu_run_$tag.log" 2>&1
      echo "ncu $spec rc=$? at $(el) s"; tail -2 "$OUT/ncu_run_$tag.log"
      ncu -i /tmp/ncu_$tag.ncu-rep --page details --csv > "$OUT/ncu_details_$tag.csv" 2>&1
      ncu -i /tmp/ncu_$tag.ncu-rep --page source --csv --print-source sass 2>/dev/null | xz -T4 > "$OUT/ncu_src_$tag.csv.xz"
      grep -E "Duration|Throughput|Warp Cycles Per Issued|Bank|Pipe" "$OUT/ncu_details_$tag.csv" | cut -c1-160 | head -20
    done ;;
  trace8)  # the fused forward's timing ring, bf16 and fp8_block, after 30 calls of load; ncu of the fp8 one
    build OFF
    timeout 120 python3 -m pytest -q tests/python/test_fp8_wgrad.py > "$OUT/pytest_wgrad.log" 2>&1
    echo "pytest wgrad rc=$? $(tail -1 "$OUT/pytest_wgrad.log")"
    for a in "" "--fp8" "--fp8 --ring-all"; do
      timeout 120 python3 tools/trace_forward.py dsv3 --warm 30 --out "$OUT" $a > "$OUT/trace$(echo $a | tr -d ' -').log" 2>&1
      echo "trace $a rc=$?"; grep -vE "^\s*$" "$OUT/trace$(echo $a | tr -d ' -').log" | cut -c1-170 | head -30
    done
    timeout 240 ncu --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis --section SourceCounters -k regex:fused_forward --launch-skip 2 --launch-count 1 \
      -o /tmp/ncu_fwd8 -f python3 tools/trace_forward.py dsv3 --warm 3 --fp8 --out /tmp > "$OUT/ncu_run_fwd8.log" 2>&1
    echo "ncu fwd8 rc=$? at $(el) s"; tail -2 "$OUT/ncu_run_fwd8.log"
    ncu -i /tmp/ncu_fwd8.ncu-rep --page details --csv > "$OUT/ncu_details_fwd8.csv" 2>&1
    ncu -i /tmp/ncu_fwd8.ncu-rep --page source --csv --print-source sass 2>/dev/null | xz -T4 > "$OUT/ncu_src_fwd8.csv.xz"
    grep -E "Duration|Throughput|Warp Cycles Per Issued|Bank|Pipe" "$OUT/ncu_details_fwd8.csv" | cut -c1-160 | head -20 ;;
  e2e8)
    build OFF
    timeout ${E2E_TIMEOUT:-480} python3 bench/bench_e2e.py --models qwen3 --impls grouped_mm,mok,mok_fp8 --steps 200 \
      --out "$OUT/e2e8" 2>&1 | tail -14 ;;
  one)
    build OFF
    timeout 200 python3 -m pytest -q -x $PYTEST 2>&1 | grep -E "^E  |passed|failed" | cut -c1-600 | head -14 ;;
esac
done
[ -n "${NOPACK:-}" ] || (cd "$OUT" && find . -type f ! -name logs.tar.xz | tar -cJf logs.tar.xz -T - && find . -type f ! -name logs.tar.xz -delete)
