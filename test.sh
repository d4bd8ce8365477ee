#!/usr/bin/env bash
# Builds mok and runs the whole test suite; exit status is non-zero on any failure.
#   1. C++: CTest (GoogleTest suites, the C++ example, the export check of libmok.so);
#   2. Python on a second libmok.so linked with -static-libstdc++ (what toolchains that link
#      libstdc++ statically produce; the process also holds torch's libstdc++);
#   3. Python on the normal build, with the packaging tests: pip install . into a fresh
#      virtual environment, pip wheel . installed into another, and an outside CMake project
#      built with find_package(mok) against an installed tree (MOK_TEST_PACKAGING=0 skips them).
# GPU tests run when a GPU is present and skip cleanly otherwise.  Build folder: build/.
set -euo pipefail
cd "$(dirname "$0")"
bash tools/setup.sh
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="$PATH:/usr/local/cuda/bin"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON -DMOK_CUDA="${MOK_CUDA:-AUTO}" -DMOK_STATIC_CXX_VARIANT=ON \
  | grep -E "^-- mok|Error|error|Warning" || true
ninja -C build
ctest --test-dir build --output-on-failure -j"$(nproc)"
echo "== Python suite on the -static-libstdc++ libmok.so"
MOK_TEST_PACKAGING=0 MOK_LIBRARY="$PWD/build/lib-static-cxx/libmok.so" PYTHONPATH=python \
  python3 -m pytest -q -p no:cacheprovider tests/python
echo "== Python suite (with the packaging tests)"
MOK_TEST_PACKAGING="${MOK_TEST_PACKAGING:-1}" PYTHONPATH=python python3 -m pytest -q -rs tests/python
