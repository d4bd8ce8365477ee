#!/usr/bin/env bash
# The main job.  Sets up (missing packages, build), then:
#   with a GPU:    the layer benchmark (bench/bench_layer.py) on one GPU, all shapes, and with
#                  two or more GPUs the EP benchmark over all of them (bench/bench_ep.py);
#   without a GPU: a small layer on the CPU reference backend, checked against float64.
# Extra arguments go to the benchmark (e.g. --shapes dsv3 --fwd-only).
set -euo pipefail
cd "$(dirname "$0")"
bash tools/setup.sh
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="$PATH:/usr/local/cuda/bin"
cmake -S . -B build -G Ninja -DMOK_BUILD_TESTS=ON | grep -E "^-- mok|Error|Warning" || true
ninja -C build mok   # the library alone; test.sh builds the test suites
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(python3 -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$gpus" -ge 1 ]; then
  PYTHONPATH=python python3 bench/bench_layer.py --shapes all --routing uniform,zipf --out out/bench "$@"
  if [ "$gpus" -ge 2 ]; then
    PYTHONPATH=python python3 bench/bench_ep.py --shapes all --routing uniform,zipf --out out/bench
  fi
else
  PYTHONPATH=python python3 tools/demo_cpu.py
fi
