#!/usr/bin/env python3
"""Compare the kernels of two PTX files, or of one source file built from two trees.

  tools/ptx_diff.py BASE.ptx NEW.ptx
  tools/ptx_diff.py --compile-commands build/compile_commands.json --source src/cuda/forward.cu \
      --base-tree /tmp/base --tree . [--ptxas] [--keep DIR]

Each function body (.entry, and .func with --funcs) is compared after dropping .loc / .file
lines, comments, blank lines and indentation, renaming labels ($L__BB0_12 ...) in order of
first appearance and dropping the anonymous-namespace hashes (_GLOBAL__N__6086d356_10_forward_cu_
32c1780a), which change with the file's path.  Registers are kept: identical code has identical
numbering.  With --loose, registers are renamed in order of first appearance too (a
renumbering alone then compares equal); with --erase-regs their numbers and the labels' are dropped,
which leaves the instruction sequence: the smallest diff to read when the code really changed.  --ptxas also assembles both files for the target and reports the
ptxas warnings and C75xx notes (C7517 / C7518: wgmma waits injected or wgmma serialised)
of each.  --sass assembles both without line info and compares each kernel's SASS (needs
nvdisasm on PATH or in --nvdisasm; not in every toolkit install: the PyPI package
nvidia-cuda-nvdisasm ships it), code addresses and jump-table slots normalised.

The trees are built with the command line of --source from compile_commands.json, its
-c -o X.o replaced by -ptx -o X.ptx and its include paths pointed at each tree.
Exit status: 0 when every compared function is identical, 1 otherwise.
"""
import argparse
import difflib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

ANON = re.compile(r"_GLOBAL__N__[0-9a-f]{8}_(\d+)_(\w+?)_[0-9a-f]{8}")
LABEL = re.compile(r"\$L__\w+")
REG = re.compile(r"%(?:rd|rs|r|f|fd|p|h|hh|b)\d+\b")
HEAD = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+|\.extern\s+)*\.(entry|func)\s+(?:\([^)]*\)\s*)?([\w$]+)")


def functions(text, kinds):
    """name -> list of raw lines of the function (header, params, directives and body)."""
    out, lines, i = {}, text.splitlines(), 0
    while i < len(lines):
        m = HEAD.match(lines[i])
        if not m or m.group(1) not in kinds:
            i += 1
            continue
        name, start, depth, opened = m.group(2), i, 0, False
        while i < len(lines):
            line = lines[i].split("//", 1)[0]
            depth += line.count("{") - line.count("}")
            opened |= "{" in line
            i += 1
            if opened and depth == 0:
                break
            if not opened and line.rstrip().endswith(";"):  # a declaration, no body
                break
        if opened:
            out[ANON.sub(r"_GLOBAL__N__\1_\2", name)] = lines[start:i]
    return out


def normalise(lines, loose, erase=False):
    labels, regs, out = {}, {}, []
    for line in lines:
        s = line.strip()
        if not s or s.startswith(".loc") or s.startswith(".file") or s.startswith("//"):
            continue
        s = s.split("//", 1)[0].strip()
        if not s:
            continue
        s = ANON.sub(r"_GLOBAL__N__\1_\2", s)
        s = LABEL.sub(lambda m: "$L" if erase else labels.setdefault(m.group(0), f"$L{len(labels)}"), s)
        if erase and s.startswith(".reg"):
            continue
        if erase:
            s = REG.sub(lambda m: "%" + re.match(r"%([a-z]+)", m.group(0)).group(1), s)
        elif loose and not s.startswith(".reg"):
            s = REG.sub(lambda m: regs.setdefault(m.group(0), f"%v{len(regs)}"), s)
        out.append(" ".join(s.split()))
    return out


def build_ptx(entry, tree, src_rel, out_path):
    """The compile command of `entry` rebuilt for `tree`, emitting PTX into out_path."""
    args = shlex.split(entry["command"]) if "command" in entry else list(entry["arguments"])
    src_abs = os.path.abspath(os.path.join(entry["directory"], entry["file"]))
    old_root = src_abs[: -len(src_rel)].rstrip("/")  # the tree the build folder was made from
    new, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "-o":
            skip = True
            continue
        if a == "-c":
            continue
        if a.startswith("-I") and a[2:].startswith(old_root):
            a = "-I" + tree + a[2 + len(old_root):]
        if a == src_abs:
            a = os.path.join(tree, src_rel)
        new.append(a)
    new += ["-ptx", "-o", out_path]
    r = subprocess.run(new, cwd=entry["directory"], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"nvcc failed for {tree}:\n{r.stderr}")
    return new


def ptxas_warnings(ptx, arch):
    ptxas = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        r = subprocess.run([ptxas, f"-arch={arch}", "-O3", ptx, "-o", cubin.name], capture_output=True, text=True)
    return [l for l in (r.stdout + r.stderr).splitlines() if re.search(r"warning|error|C75\d\d", l, re.I)]


def sass(ptx, arch, nvdisasm, out_dir):
    """kernel name -> normalised SASS lines of the PTX assembled without line info."""
    text = open(ptx).read()
    plain = os.path.join(out_dir, os.path.basename(ptx) + ".noline.ptx")
    with open(plain, "w") as f:
        f.write("\n".join(l for l in text.splitlines() if not l.strip().startswith((".loc", ".file"))))
    cubin = plain + ".cubin"
    ptxas = shutil.which("ptxas") or "/usr/local/cuda/bin/ptxas"
    subprocess.run([ptxas, f"-arch={arch}", "-O3", plain, "-o", cubin], check=True, capture_output=True)
    listing = subprocess.run([nvdisasm, "-c", cubin], check=True, capture_output=True, text=True).stdout
    out, name = {}, None
    for line in listing.splitlines():
        m = re.match(r"\s*\.text\.([\w$]+):", line)
        if m:
            name = ANON.sub(r"_GLOBAL__N__\1_\2", m.group(1))
            out[name] = []
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;?\s*(/\*.*\*/)?\s*$", line)
        if name is None or not m:
            if name is not None and re.match(r"^\s*\.L_x_\d+:", line):
                out[name].append("LABEL")
            continue
        ins = re.sub(r"\.L_x_\d+", "L", m.group(1))
        ins = re.sub(r"MOV (R\d+), 0x[0-9a-f]+$", r"MOV \1, ADDR", ins)  # return addresses
        ins = re.sub(r"BRX (R\d+) -?0x[0-9a-f]+", r"BRX \1 OFF", ins)
        ins = re.sub(r"c\[0x2\]\[(R\d+)(\+0x[0-9a-f]+)?\]", r"c[0x2][\1+T]", ins)  # jump-table slots
        out[name].append(ins)
    return out



def report(name, b, n, a, tag):
    """Prints whether one kernel's normalised lines are identical and, if not, the diff; True
    when identical."""
    if b == n:
        print(f"{tag}identical  {name} ({len(b)} lines)")
        return True
    diff = list(difflib.unified_diff(b, n, "base", "new", n=a.context, lineterm=""))
    changed = sum(1 for l in diff if l[:1] in "+-" and not l.startswith(("+++", "---")))
    print(f"{tag}DIFFERENT  {name} ({len(b)} -> {len(n)} lines, {changed} changed)")
    for line in diff[: a.max_diff]:
        print("    " + line)
    if len(diff) > a.max_diff:
        print(f"    ... {len(diff) - a.max_diff} more diff lines")
    return False

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ptx", nargs="*", help="BASE.ptx NEW.ptx (instead of building)")
    ap.add_argument("--compile-commands")
    ap.add_argument("--source", help="source path relative to the trees, e.g. src/cuda/forward.cu")
    ap.add_argument("--base-tree")
    ap.add_argument("--tree")
    ap.add_argument("--keep", help="directory for the built PTX files (default: a temporary one)")
    ap.add_argument("--funcs", action="store_true", help="compare non-inlined .func bodies too")
    ap.add_argument("--loose", action="store_true", help="also rename registers in order of first use")
    ap.add_argument("--erase-regs", action="store_true",
                    help="drop register and label numbers (and .reg counts): what is left is the "
                         "instruction sequence")
    ap.add_argument("--ptxas", action="store_true", help="assemble both and list ptxas warnings")
    ap.add_argument("--sass", action="store_true", help="also compare the SASS (needs nvdisasm)")
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm"), help="the nvdisasm to use")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--context", type=int, default=3, help="diff context lines")
    ap.add_argument("--max-diff", type=int, default=200, help="diff lines shown per function")
    a = ap.parse_args()

    if a.ptx:
        if len(a.ptx) != 2:
            ap.error("give two PTX files, or the build options")
        base_ptx, new_ptx = a.ptx
    else:
        if not (a.compile_commands and a.source and a.base_tree and a.tree):
            ap.error("--compile-commands, --source, --base-tree and --tree are needed to build")
        entries = [e for e in json.load(open(a.compile_commands)) if e["file"].endswith(a.source)]
        if not entries:
            sys.exit(f"{a.source} is not in {a.compile_commands}")
        out_dir = a.keep or tempfile.mkdtemp(prefix="ptx_diff_")
        os.makedirs(out_dir, exist_ok=True)
        stem = os.path.basename(a.source).rsplit(".", 1)[0]
        base_ptx, new_ptx = os.path.join(out_dir, f"{stem}.base.ptx"), os.path.join(out_dir, f"{stem}.new.ptx")
        build_ptx(entries[0], os.path.abspath(a.base_tree), a.source, base_ptx)
        build_ptx(entries[0], os.path.abspath(a.tree), a.source, new_ptx)
        print(f"PTX: {base_ptx} {new_ptx}")

    kinds = {"entry", "func"} if a.funcs else {"entry"}
    base = functions(open(base_ptx).read(), kinds)
    new = functions(open(new_ptx).read(), kinds)
    same = True
    for name in sorted(set(base) | set(new)):
        if name not in base or name not in new:
            print(f"ONLY IN {'NEW' if name in new else 'BASE'}: {name}")
            same = False
            continue
        b, n = normalise(base[name], a.loose, a.erase_regs), normalise(new[name], a.loose, a.erase_regs)
        same = report(name, b, n, a, "") and same
    if a.sass:
        if not a.nvdisasm:
            sys.exit("--sass needs nvdisasm (PATH or --nvdisasm)")
        out_dir = tempfile.mkdtemp(prefix="ptx_diff_sass_")
        sb, sn = sass(base_ptx, a.arch, a.nvdisasm, out_dir), sass(new_ptx, a.arch, a.nvdisasm, out_dir)
        for name in sorted(set(sb) & set(base) | set(sn) & set(new)):
            same = report(name, sb.get(name, []), sn.get(name, []), a, "SASS ") and same
    if a.ptxas:
        found = {}
        for label, path in (("base", base_ptx), ("new", new_ptx)):
            found[label] = ptxas_warnings(path, a.arch)
            print(f"ptxas {label}: {len(found[label])} warning(s) / note(s)")
            for line in found[label]:
                print("    " + line)
        # The PTX line a note points at moves with the file; the rest must match
        key = lambda l: ANON.sub(r"_GLOBAL__N__\1_\2", re.sub(r"line \d+", "line N", l))
        gained = sorted(set(map(key, found["new"])) - set(map(key, found["base"])))
        print(f"ptxas: {len(gained)} warning(s) / note(s) not in base")
        for line in gained:
            print("    " + line)
        same &= not gained
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
