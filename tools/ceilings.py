"""Ceiling probe on the GPU present: dense bf16 matmul rate, HBM copy bandwidth, and the
grouped-GEMM rate of torch._grouped_mm on the expert shapes of docs/benchmarks.md.  Random
data, CUDA events, warm-up, median of repeated runs, inputs rotated where the L2 could hold them.
Writes JSON to the path given (default: stdout only)."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import median_ms  # noqa: E402




def matmul_rate(n=8192):
    a = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    i = [0]

    def run():
        i[0] ^= 1
        torch.mm(a[i[0]], b)

    ms = median_ms(run)
    return {"n": n, "ms": ms, "tflops": 2 * n**3 / ms / 1e9}


def copy_bandwidth(nbytes=4 << 30):
    src = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16).uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return {"bytes": nbytes, "ms": ms, "gbps_read_plus_write": 2 * nbytes / ms / 1e6}


def grouped_rate(experts, rows, k_dim, n_dim):
    x = torch.randn(experts * rows, k_dim, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, n_dim, k_dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * rows
    ms = median_ms(lambda: torch._grouped_mm(x, w, offs=offs))
    return {"experts": experts, "rows": rows, "K": k_dim, "N": n_dim, "ms": ms,
            "tflops": 2 * experts * rows * k_dim * n_dim / ms / 1e9}


def main():
    props = torch.cuda.get_device_properties(0)
    out = {
        "device": props.name, "sms": props.multi_processor_count,
        "l2_bytes": getattr(props, "L2_cache_size", None), "torch": torch.__version__,
        "matmul_bf16": matmul_rate(),
        "copy": copy_bandwidth(),
        "grouped_mm_gateup_16x2048": grouped_rate(16, 2048, 7168, 4096),
        "grouped_mm_down_16x2048": grouped_rate(16, 2048, 2048, 7168),
        "grouped_mm_gateup_128x128": grouped_rate(128, 128, 7168, 4096),
    }
    text = json.dumps(out, indent=2)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
