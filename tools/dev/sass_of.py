"""Prints the SASS of the functions of a cuobjdump -sass listing (stdin) whose demangled name
matches every given word, and a count of instructions per matching function.

    cuobjdump -sass build/lib/libmok.so | python3 tools/dev/sass_of.py grouped_gemm_kernel SwiGLUBwd"""
import re
import subprocess
import sys

words = sys.argv[1:]
funcs, cur = {}, None
for line in sys.stdin:
    m = re.match(r"\s*Function : (\S+)", line)
    if m:
        cur = m.group(1)
        funcs[cur] = []
        continue
    if cur is not None:
        funcs[cur].append(line.rstrip())
names = list(funcs)
demangled = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
for name, dem in zip(names, demangled):
    if all(w in dem for w in words):
        body = [l for l in funcs[name] if re.match(r"\s+/\*[0-9a-f]{4,}\*/", l)]
        print(f"==== {dem} ({len(body)} instructions)")
        print("\n".join(body))
