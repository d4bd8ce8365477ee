#!/usr/bin/env bash
# Session 23's device calls (issue 22, the backward bar).  STAGE=prof: the tree (cooperative
# backward) and VARIANTS of the ping-pong backward (dyn: bwd_pp192_dynamic.patch, pp192:
# bwd_pp192.patch) built side by side; for each, the fused backward kernel's SASS (local-memory
# instructions and where they sit beside the HGMMAs) and one ncu profile of its qwen3 backward
# (ring for every row: SOL, warp states, per-instruction stall samples as CSV).  STAGE=ab: variants
# timed side by side (below).  STAGE=fp8: the block-scaled fp8 GEMM step's GPU tests and its
# kinds at the sustained clock.  Logs under $OUT, packed into $OUT/logs.tar.xz.
source "$(dirname "$0")/device_env.sh"
ROOT=$PWD
# A copy of the tree in /tmp/x_$1 for variant $1: base (as it is), old ($OLD_PATCH reversed),
# dyn* (bwd_pp192_dynamic.patch), pp192* (bwd_pp192.patch)
variant_tree() {
  rm -rf /tmp/x_$1 && mkdir -p /tmp/x_$1 && tar --exclude=./build --exclude=./out -cf - . | tar -xf - -C /tmp/x_$1
  case $1 in
    old) (cd /tmp/x_$1 && patch -R -p1 -s < "$OLD_PATCH") ;;
    dyn*) (cd /tmp/x_$1 && patch -p1 -s < tools/dev/experiments/bwd_pp192_dynamic.patch) ;;
    pp192*) (cd /tmp/x_$1 && patch -p1 -s < tools/dev/experiments/bwd_pp192.patch) ;;
  esac || { echo "patch $1"; return 1; }
}
case "${STAGE:-prof}" in
  prof)
    VS="base ${VARIANTS:-dyn}"
    for v in $VS; do
      variant_tree $v || exit 1
      [ -n "${SED_CMD:-}" ] && [ "$v" != base ] && (cd /tmp/x_$v && eval "$SED_CMD")
    done
    for v in $VS; do
      (cd /tmp/x_$v && cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=OFF -DMOK_CUDA=ON >"$OUT/build_$v.log" 2>&1 &&
        ninja -C build -j8 mok >>"$OUT/build_$v.log" 2>&1; echo "build $v rc=$? at $(el) s") &
    done; wait
    for v in $VS; do
      cd /tmp/x_$v
      lib=$(ls build/lib/libmok.so* | head -1)
      cuobjdump -sass "$lib" > /tmp/sass_$v.txt 2>/dev/null
      python3 - "$v" /tmp/sass_$v.txt <<'PY' | tee "$OUT/sass_$v.summary"
import re, sys
v, path = sys.argv[1], sys.argv[2]
funcs, cur = {}, None
for line in open(path, errors="replace"):
    m = re.match(r"\s+Function : (\S+)", line)
    if m:
        cur = m.group(1); funcs[cur] = []; continue
    if cur and re.match(r"\s+/\*[0-9a-f]{4,}\*/", line):
        funcs[cur].append(line.strip())
for name, ins in funcs.items():
    if "fused_backward" not in name and "fused_forward" not in name:
        continue
    ops = [re.sub(r"^/\*[0-9a-f]+\*/\s*", "", s) for s in ins]
    n_hg = sum("HGMMA" in o for o in ops)
    ldl = sum(re.search(r"\bLDL\b", o) is not None for o in ops)
    stl = sum(re.search(r"\bSTL\b", o) is not None for o in ops)
    warp_sync = sum("WARPSYNC" in o or "WARPGROUP.DEPBAR" in o for o in ops)
    # local-memory instructions within 40 instructions of an HGMMA (the K loops)
    hg = [i for i, o in enumerate(ops) if "HGMMA" in o]
    near = sum(1 for i, o in enumerate(ops) if re.search(r"\b(LDL|STL)\b", o) and any(abs(i - j) < 40 for j in hg))
    print(f"{v}: {name[:90]} instrs={len(ops)} HGMMA={n_hg} LDL={ldl} STL={stl} local-near-HGMMA={near} "
          f"WARPGROUP.DEPBAR/ARRIVE={warp_sync}")
PY
      xz -T4 -c /tmp/sass_$v.txt > "$OUT/sass_$v.txt.xz"
    done
    echo "sass at $(el) s"
    for v in $VS; do
      cd /tmp/x_$v
      timeout 240 ncu --section SpeedOfLight --section WarpStateStats --section SourceCounters --section Occupancy \
        -k regex:fused_backward --launch-skip 2 --launch-count 1 -o /tmp/ncu_$v -f \
        python3 tools/dev/profile_fused_bwd.py ${NCU_SHAPE:-qwen3} --ring-all --calls 3 > "$OUT/ncu_run_$v.log" 2>&1
      echo "ncu $v rc=$? at $(el) s"; tail -3 "$OUT/ncu_run_$v.log"
      ncu -i /tmp/ncu_$v.ncu-rep --page details --csv > "$OUT/ncu_details_$v.csv" 2>&1
      ncu -i /tmp/ncu_$v.ncu-rep --page source --csv --print-source sass > /tmp/ncu_src_$v.csv 2>&1
      xz -T4 -c /tmp/ncu_src_$v.csv > "$OUT/ncu_src_$v.csv.xz"; ls -la /tmp/ncu_src_$v.csv
      grep -E "Duration|Compute \(SM\) Throughput|Warp Cycles Per Issued|Issue Slots|Stall" "$OUT/ncu_details_$v.csv" | head -12
    done
    echo "at $(el) s" ;;
  fp8)
    # The block-scaled fp8 GEMM step (issue 23): its C++ and Python GPU tests, then the fp8
    # kinds at the sustained clock on SHAPES
    if [ ! -x build/tests/cpp/test_gemm_gpu ]; then
      cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA=ON >"$OUT/build.log" 2>&1 &&
        ninja -C build >>"$OUT/build.log" 2>&1 || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
      echo "== built at $(el) s"
    fi
    timeout 120 build/tests/cpp/test_gemm_gpu --gtest_filter='*E4m3*' > "$OUT/gtest_fp8.log" 2>&1
    echo "gtest fp8 rc=$? $(grep -E 'PASSED|FAILED' "$OUT/gtest_fp8.log" | tr '\n' ' ')"; grep -E "Failure|expected|differing" "$OUT/gtest_fp8.log" | head -8
    timeout 120 python3 -m pytest -q tests/python/test_fp8_ops.py tests/python/test_fp8.py > "$OUT/pytest_fp8.log" 2>&1
    echo "pytest fp8 rc=$? $(tail -1 "$OUT/pytest_fp8.log")"; grep -E "^FAILED|Error" "$OUT/pytest_fp8.log" | head -8
    for shape in ${SHAPES:-dsv3 qwen3}; do
      timeout 150 python3 tools/sustained.py $shape --fp8 --variants "${FP8_VARIANTS:-t128,t256:MOK_TMP_FP8_TILE=256}" 2>&1 | tee "$OUT/fp8_$shape.log" | grep -vE "^\s*$" | tail -16
      echo "at $(el) s"
    done ;;
  ab)
    # VARIANTS: base (the tree), old (the tree with $OLD_PATCH reversed), dyn, pp192;
    # each one's smoke test (ping-pong ones) and its backward at the sustained clock on SHAPES
    VS="${VARIANTS:-base dyn pp192}"
    for v in $VS; do variant_tree $v || exit 1; done
    for v in $VS; do
      (cd /tmp/x_$v && cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=OFF -DMOK_CUDA=ON >"$OUT/build_$v.log" 2>&1 &&
        ninja -C build -j5 mok >>"$OUT/build_$v.log" 2>&1; echo "build $v rc=$? at $(el) s") &
    done; wait
    for v in $VS; do
      case $v in dyn*|pp*) (cd /tmp/x_$v && timeout 70 python3 tools/dev/bwd_smoke.py 2>&1 | tail -3 | sed "s/^/$v: /") ;; esac
    done; echo "at $(el) s"
    for shape in ${SHAPES:-qwen3 dsv3}; do
      for v in $VS; do
        (cd /tmp/x_$v && timeout 90 python3 tools/sustained.py $shape --backward --rounds ${ROUNDS:-10} 2>&1 | tee "$OUT/bwd_${v}_$shape.log" |
          grep -E 'floor|bwd ring=[0-9]* +|bwd ring=.*transposed|bwd unfused|differs|rror' | sed "s/^/$v: /")
      done; echo "at $(el) s"
    done
    if [ "${TRACE:-1}" = 1 ]; then
      for v in $VS; do
        (cd /tmp/x_$v && mkdir -p "$OUT/tr_$v" && timeout 60 python3 tools/trace_forward.py qwen3 --backward --ring-all --warm 20 \
          --out "$OUT/tr_$v" > "$OUT/trace_$v.log" 2>&1; grep -E "fused backward|tiles |tiles busy" "$OUT/trace_$v.log" | sed "s/^/$v: /")
      done
    fi
    echo "at $(el) s" ;;
esac
# The device returns at most eight files a call: everything else under $OUT in one archive
(cd "$OUT" && find . -type f ! -name logs.tar.xz | tar -cJf logs.tar.xz -T - && find . -type f ! -name logs.tar.xz -delete)
