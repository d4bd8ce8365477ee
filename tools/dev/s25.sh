#!/usr/bin/env bash
# Session 25's device calls (issue 23, fp8).  STAGE=fp8: the tree built with its tests; the fp8
# GPU tests (the block-scaled GEMM, the quantisers, the layer's CUDA forward against the CPU
# reference), then every fp8 kind and the layer's forward at the sustained clock on SHAPES.
# STAGE=prof8: one ncu profile of the block-scaled gate/up kind on dsv3 (SOL, warp states,
# per-instruction stall samples as CSV) and the kernels' SASS K loops (tools/dev/sass_loops.py).  Logs under $OUT, packed into $OUT/logs.tar.xz.
source "$(dirname "$0")/device_env.sh"
cat > /tmp/gu8.py <<'PY'
import sys, torch
sys.path.insert(0, "python")
from mok import fp8, ops
E, rows, H, I = 16, 2048, 7168, 2048
M = E * rows
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(M, H, device="cuda", generator=g).bfloat16()
w = [(torch.randn(E, I, H, device="cuda", generator=g) / H ** 0.5).bfloat16() for _ in range(2)]
(qx, sx), (qg, sg), (qu, su) = fp8.quantize_rows(x), fp8.quantize_blocks(w[0]), fp8.quantize_blocks(w[1])
be = torch.arange(E, device="cuda", dtype=torch.int32).repeat_interleave(rows // 128)
out = torch.empty(M, I, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    ops.grouped_mm_fp8(qx, sx, qg, sg, be, qu, su, out=out, kind="gate_up")
torch.cuda.synchronize()
PY

case "${STAGE:-fp8}" in
  fp8)
    cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA=ON >"$OUT/build.log" 2>&1 &&
      ninja -C build >>"$OUT/build.log" 2>&1 || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
    echo "== built at $(el) s"
    cuobjdump -sass build/lib/libmok.so > /tmp/sass.txt 2>/dev/null
    python3 tools/dev/sass_loops.py /tmp/sass.txt E4m3Block > "$OUT/sass_loops.txt" 2>&1; head -8 "$OUT/sass_loops.txt"
    timeout 120 build/tests/cpp/test_gemm_gpu --gtest_filter='*E4m3*' > "$OUT/gtest_fp8.log" 2>&1
    echo "gtest fp8 rc=$? $(grep -E 'PASSED|FAILED' "$OUT/gtest_fp8.log" | tr '\n' ' ')"
    timeout 300 python3 -m pytest -q -rs tests/python/test_fp8_ops.py tests/python/test_fp8.py \
      tests/python/test_fp8_wgrad.py tests/python/test_fp8_layer_gpu.py tests/python/test_fp8_layer_cpu.py -s \
      > "$OUT/pytest_fp8.log" 2>&1
    echo "pytest fp8 rc=$? $(tail -1 "$OUT/pytest_fp8.log")"; grep -E "^FAILED|relative Frobenius" "$OUT/pytest_fp8.log" | head -12
    timeout 240 python3 bench/bench_gemm.py --shapes dsv3 --fp8 --out "$OUT/bench_gemm" 2>&1 | tail -8
    for shape in ${SHAPES:-dsv3 qwen3}; do
      timeout 180 python3 tools/sustained.py $shape --fp8 --variants "${FP8_VARIANTS:-base}" 2>&1 |
        tee "$OUT/fp8_$shape.log" | grep -vE "^\s*$" | tail -20
      echo "at $(el) s"
    done ;;
  e2e8)  # training parity: the Qwen3-30B-A3B-shaped model in fp8_block against bf16, 200 steps
    cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=OFF -DMOK_CUDA=ON >"$OUT/build.log" 2>&1 &&
      ninja -C build mok >>"$OUT/build.log" 2>&1 || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
    echo "== built at $(el) s"
    timeout 480 python3 bench/bench_e2e.py --models qwen3 --impls grouped_mm,mok,mok_fp8 --steps 200 \
      --out "$OUT/e2e8" 2>&1 | tail -12 ;;
  one)  # the library and one pytest selection (PYTEST)
    cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=OFF -DMOK_CUDA=ON >"$OUT/build.log" 2>&1 &&
      ninja -C build mok >>"$OUT/build.log" 2>&1 || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
    echo "== built at $(el) s"
    timeout 120 python3 -m pytest -q -x $PYTEST 2>&1 | grep -E "^E  |passed|failed" | cut -c1-600 | head -12 ;;
  prof8)
    cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=OFF -DMOK_CUDA=ON >"$OUT/build.log" 2>&1 &&
      ninja -C build mok >>"$OUT/build.log" 2>&1 || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
    echo "== built at $(el) s"
    cuobjdump -sass build/lib/libmok.so > /tmp/sass.txt 2>/dev/null
    python3 tools/dev/sass_loops.py /tmp/sass.txt E4m3Block 2>&1 | tee "$OUT/sass_loops.txt" | head -12
    for t in 256; do
      timeout 200 ncu --section SpeedOfLight --section WarpStateStats --section SourceCounters \
        -k regex:grouped_gemm_kernel --launch-skip 2 --launch-count 1 -o /tmp/ncu_t$t -f python3 /tmp/gu8.py \
        > "$OUT/ncu_run_t$t.log" 2>&1
      echo "ncu t$t rc=$? at $(el) s"
      ncu -i /tmp/ncu_t$t.ncu-rep --page details --csv > "$OUT/ncu_details_t$t.csv" 2>&1
      ncu -i /tmp/ncu_t$t.ncu-rep --page source --csv --print-source sass 2>/dev/null | xz -T4 > "$OUT/ncu_src_t$t.csv.xz"
      grep -E "Duration|Compute \(SM\) Throughput|Warp Cycles Per Issued|Stall" "$OUT/ncu_details_t$t.csv" | head -12
    done ;;
esac
[ -n "${NOPACK:-}" ] || (cd "$OUT" && find . -type f ! -name logs.tar.xz | tar -cJf logs.tar.xz -T - && find . -type f ! -name logs.tar.xz -delete)
