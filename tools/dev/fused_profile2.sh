#!/usr/bin/env bash
# One device call for the next step of docs/perf.md session 12 ("What would close the bars"):
# why the fused backward's tiles run 4-9 % longer than the standalone kinds.  Build; the SASS of
# the fused backward kernel (spill sites with context, fences); ncu's per-instruction stall
# samples of one dsv3 fused backward and of the standalone wgrad gate/up kind.  Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export PYTHONPATH=python MOK_GEMM_TIMEOUT_S=60 PYTHONUNBUFFERED=1
{ [ -f build/build.ninja ] || cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA=ON; } >"$OUT/build.log" 2>&1
ninja -C build >>"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
cuobjdump -sass build/lib/libmok.so 2>/dev/null | python3 tools/dev/sass_of.py fused_backward_kernel >/tmp/fb.sass
echo "fused backward SASS: $(grep -c . /tmp/fb.sass) lines, STL $(grep -c STL /tmp/fb.sass), LDL $(grep -c LDL /tmp/fb.sass), MEMBAR $(grep -c MEMBAR /tmp/fb.sass), HGMMA $(grep -c HGMMA /tmp/fb.sass)"
grep -n -B4 -A2 "STL\|LDL" /tmp/fb.sass | cut -c1-110 >"$OUT/fb_spills.txt"
grep -n -B2 -A2 "MEMBAR" /tmp/fb.sass | cut -c1-110 >"$OUT/fb_fences.txt"
timeout 300 ncu --section WarpStateStats --section SourceCounters -k regex:fused_backward --launch-skip 1 --launch-count 1 \
  -o /tmp/fb -f python3 tools/dev/profile_fused_bwd.py dsv3 >"$OUT/ncu_run.log" 2>&1
ncu -i /tmp/fb.ncu-rep --page source --csv --print-source sass >/tmp/fb_src.csv 2>>"$OUT/ncu_run.log"
python3 tools/dev/ncu_source_top.py /tmp/fb_src.csv 80 >"$OUT/fb_source_top.txt" 2>&1
head -40 "$OUT/fb_source_top.txt"
# The same samples of the standalone wgrad gate/up kind (the fused kernel's wgrad tiles ran
# 9 % longer than these in session 12): its stage waits against the fused kernel's
timeout 200 ncu --section WarpStateStats --section SourceCounters -k regex:grouped_wgrad --launch-skip 1 --launch-count 1 \
  -o /tmp/wg -f python3 tools/profile_kinds.py dsv3 --kinds wgrad_gate_up >>"$OUT/ncu_run.log" 2>&1
ncu -i /tmp/wg.ncu-rep --page source --csv --print-source sass >/tmp/wg_src.csv 2>>"$OUT/ncu_run.log"
python3 tools/dev/ncu_source_top.py /tmp/wg_src.csv 40 >"$OUT/wgrad_source_top.txt" 2>&1
head -30 "$OUT/wgrad_source_top.txt"
