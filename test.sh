#!/usr/bin/env bash
# Builds mok and runs the whole test suite: C++ (CTest/GoogleTest), then Python (pytest).
# GPU tests skip cleanly on a machine without a GPU.  Exit status is non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")"
bash tools/setup.sh
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="$PATH:/usr/local/cuda/bin"
cuda_mode="${MOK_CUDA:-AUTO}"
cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA="$cuda_mode" | grep -E "mok:|Error|error" || true
ninja -C build
ctest --test-dir build --output-on-failure -j2
PYTHONPATH=python python3 -m pytest -q tests/python
