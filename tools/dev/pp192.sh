#!/usr/bin/env bash
# EXPERIMENT: 128 x 192 ping-pong tiles in the standalone GEMM kinds (MOK_TMP_TILE)
# Apply first: git apply tools/dev/experiments/pp192.patch (the device tree is a copy)
set -uo pipefail
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MOK_GEMM_TIMEOUT_S=10 PYTHONPATH="python${PYTHONPATH:+:$PYTHONPATH}"
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
if [ ! -f build/lib/libmok.so ]; then
  cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA=ON >"$OUT/build.log" 2>&1 &&
    ninja -C build mok >>"$OUT/build.log" 2>&1 || { echo "build failed"; tail -30 "$OUT/build.log"; exit 1; }
  echo "== built at $(el) s"
fi
MOK_TMP_TILE=pp192 timeout 120 python3 -m pytest -q tests/python/test_gpu.py -k "grouped_mm" > "$OUT/pytest_pp192.log" 2>&1
echo "pytest pp192 rc=$? $(tail -1 "$OUT/pytest_pp192.log") at $(el) s"; grep -E "^FAILED|Error" "$OUT/pytest_pp192.log" | head
for shape in ${SHAPES:-qwen3 dsv3}; do
  timeout 150 python3 tools/sustained.py $shape --gemm --variants "base,pp192:MOK_TMP_TILE=pp192,coop:MOK_TMP_TILE=coop" 2>&1 | tee "$OUT/gemm_$shape.log" | grep -vE "^\s*$" | tail -22
  echo "at $(el) s"
done
