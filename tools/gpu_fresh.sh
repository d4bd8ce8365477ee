#!/usr/bin/env bash
# One device call that tries mok the way a new user does on a GPU machine: no build folder, the
# README's commands, a build made there (its own toolchain), logs under $OUT.
#   STEP=test  ./test.sh (C++ and GPU tests, the Python suite on the -static-libstdc++ libmok,
#              the packaging tests: pip install . into a fresh venv, pip wheel . into another,
#              find_package from an outside project), then the symbol experiment below;
#   STEP=experiment  the symbol experiment alone (after a build);
#   STEP=run   ./run.sh (the layer benchmark), extra arguments passed on.
# The symbol experiment links libmok.so from the same objects without the export map and loads
# it next to torch: the crash the map prevents (std:: symbols interposed across two libstdc++).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# No network on the device machine: pip builds with the scikit-build-core already installed.
export MOK_PIP_NO_BUILD_ISOLATION=1
{
  echo "host: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)"
  echo "g++: $(g++ --version | head -1)   cmake: $(cmake --version | head -1)   python: $(python3 --version)"
  echo "torch: $(python3 -c 'import torch; print(torch.__version__)' 2>&1 | tail -1)"
  echo "scikit-build-core: $(python3 -c 'import scikit_build_core as s; print(s.__version__)' 2>&1 | tail -1)"
  echo "build folder before: $([ -d build ] && echo present || echo absent)"
} | tee "$OUT/env.txt"
status=0
case "${STEP:-test}" in
  test)
    start=$(date +%s)
    ./test.sh >"$OUT/test_sh.log" 2>&1 || status=1
    echo "./test.sh: rc=$status in $(( $(date +%s) - start )) s"
    grep -E "tests passed|tests failed|^[0-9]+ (passed|failed)|FAILED|Error" "$OUT/test_sh.log" | tail -25
    echo "== libmok.so as built here"
    ldd build/lib/libmok.so | awk '{print "  " $1}'
    echo "  non-mok exports: $(nm -D --defined-only build/lib/libmok.so | grep -vc ' mok')"
    ;;&
  test|experiment)
    echo "== symbol experiment: the same objects linked without the export map"
    probe='import torch, mok; from mok import functional as F
ws = F.create_workspace(256, 128, 8, 2, 64, device="cuda"); print("workspace ok:", ws.describe().splitlines()[0])'
    for flags in "" "-static-libstdc++ -static-libgcc"; do
      lib=/tmp/nomap$(echo "$flags" | tr -d ' -')/libmok.so
      mkdir -p "$(dirname "$lib")"
      g++ -shared -o "$lib" build/CMakeFiles/mok.dir/src/capi/version.cpp.o -Wl,--whole-archive build/libmok_core.a \
        -Wl,--no-whole-archive $flags -L/usr/local/cuda/lib64 -lcudart_static -lpthread -ldl -lrt || continue
      echo "  flags '${flags}': $(nm -D --defined-only "$lib" | grep -vc ' mok') non-mok exports"
      PYTHONPATH=python MOK_LIBRARY="$lib" timeout 120 python3 -c "$probe" 2>&1 | tail -2 | sed 's/^/    /'; echo "    rc=${PIPESTATUS[0]}"
    done
    echo "  with the map (build/lib):"
    PYTHONPATH=python MOK_LIBRARY="$PWD/build/lib/libmok.so" timeout 120 python3 -c "$probe" 2>&1 | tail -2 | sed 's/^/    /'
    ;;
  run)
    start=$(date +%s)
    ./run.sh "$@" 2>&1 | tee "$OUT/run_sh.log" | tail -60
    status=${PIPESTATUS[0]}
    echo "./run.sh: rc=$status in $(( $(date +%s) - start )) s"
    cp out/bench/*.json "$OUT/" 2>/dev/null
    ;;
esac
exit $status
