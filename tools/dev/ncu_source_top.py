"""Top SASS instructions of an ncu source-page CSV by warp-stall samples, and the samples per
opcode (where the fused kernels' time goes, instruction by instruction).

    ncu -i report.ncu-rep --page source --csv --print-source sass > src.csv
    python3 tools/dev/ncu_source_top.py src.csv [N]"""
import csv
import sys
from collections import Counter

path = sys.argv[1]
top = int(sys.argv[2]) if len(sys.argv) > 2 else 60
with open(path, newline="") as f:
    rows = list(csv.reader(f))
# The header is the first row that names a source column
head_at = next(i for i, r in enumerate(rows) if any("Source" in c for c in r))
head, body = rows[head_at], rows[head_at + 1:]
print("columns:", " | ".join(head))
def col(*words):
    for i, c in enumerate(head):
        if all(w.lower() in c.lower() for w in words):
            return i
    return None
src = col("Source")
addr = col("Address") if col("Address") is not None else 0
samples = col("Sampling", "All") or col("Samples")
if samples is None:
    sys.exit("no stall-sampling column")
def num(v):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0
body = [r for r in body if len(r) > max(src, samples)]
total = sum(num(r[samples]) for r in body) or 1.0
print(f"{len(body)} instructions, {total:.0f} samples")
by_op = Counter()
for r in body:
    by_op[r[src].split()[0] if r[src].split() else "?"] += num(r[samples])
print("samples by opcode (top 25):")
for op, n in by_op.most_common(25):
    print(f"  {op:24} {100 * n / total:5.1f} %")
print(f"top {top} instructions:")
for r in sorted(body, key=lambda r: -num(r[samples]))[:top]:
    print(f"  {r[addr]:>8} {100 * num(r[samples]) / total:5.2f} %  {r[src][:110]}")
