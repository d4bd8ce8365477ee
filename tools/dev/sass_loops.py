"""Local-memory traffic inside the loops of a kernel's SASS (cuobjdump -sass output): for each
innermost loop that issues TMA loads (the producer's) or wgmma (HGMMA, QGMMA: the consumers' K loops), its
length and its LDL / STL counts.  python3 tools/dev/sass_loops.py SASS.txt [name-substring]"""
import re
import sys


def functions(path):
    funcs, cur = {}, None
    for line in open(path, errors="replace"):
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            cur = m.group(1)
            funcs[cur] = []
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*/\*", line) if cur else None
        if m:
            funcs[cur].append((int(m.group(1), 16), m.group(2)))
    return funcs


def loops(ins):
    addr_index = {a: i for i, (a, _) in enumerate(ins)}
    out = []
    for i, (a, op) in enumerate(ins):
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", op)
        if m and int(m.group(1), 16) <= a and int(m.group(1), 16) in addr_index:
            out.append((addr_index[int(m.group(1), 16)], i))
    return out


def main():
    path = sys.argv[1]
    want = sys.argv[2] if len(sys.argv) > 2 else "fused_"
    for name, ins in functions(path).items():
        if want not in name:
            continue
        ops = [o for _, o in ins]
        ldl = sum(bool(re.search(r"\bLDL\b", o)) for o in ops)
        stl = sum(bool(re.search(r"\bSTL\b", o)) for o in ops)
        print(f"{name[:110]}: {len(ops)} instructions, LDL {ldl}, STL {stl}")
        seen = set()
        for lo, hi in sorted(loops(ins), key=lambda r: r[1] - r[0]):
            body = ops[lo:hi + 1]
            # a producer's k-block loop: TMA loads and the full barrier's expect-tx arrival (the
            # elect loops around a single UTMALDG have no arrival)
            tma = any("UTMALDG" in o for o in body) and any("SYNCS.ARRIVE" in o for o in body)
            kind = "tma" if tma else ("gmma" if any("GMMA" in o for o in body) else None)
            if kind is None or any(lo <= a and b <= hi for a, b in seen):
                continue  # not a K loop, or encloses an inner one already listed
            seen.add((lo, hi))
            l = sum(bool(re.search(r"\bLDL\b", o)) for o in body)
            s = sum(bool(re.search(r"\bSTL\b", o)) for o in body)
            print(f"  {kind:5} loop [{lo}, {hi}] {hi - lo + 1:5d} instructions  LDL {l:3d}  STL {s:3d}")


if __name__ == "__main__":
    main()
