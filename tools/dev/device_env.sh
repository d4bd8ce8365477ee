# Sourced by the session scripts of tools/dev (sNN.sh): the repository root, $OUT, the device's
# environment (NVLink multicast off, short wait deadlines, the tree's Python package) and el(),
# the seconds since the script started.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MOK_GEMM_TIMEOUT_S=10 PYTHONPATH="python${PYTHONPATH:+:$PYTHONPATH}"
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
