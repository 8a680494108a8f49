#!/usr/bin/env python3
"""Static instruction counts of the CUDA kernels, from their SASS: no GPU needed.

    python benchmarks/sass_counts.py csrc/kernels/chunk_bf16.cu [--kernel out_kernel] [--loops]
    python benchmarks/sass_counts.py --cubin build.cubin [--kernel REGEX] [--loops]

Compiles the source for sm_90a (nvcc, the project's flags) or reads a cubin, disassembles it
(cuobjdump -sass, which needs nvdisasm) and prints per kernel: instructions, tensor-core mma
(HMMA), shared loads / stores (LDS / STS), global loads / stores (LDG / STG), special-function
ops (MUFU) and TF32 rounding adds (`VIADD/IADD3 Rd, Rs, 0x1000`: tile::to_tf32 on a read). With
--loops, every loop (a backward branch) that holds an mma: its length and its HMMA, LDS and
rounding-add counts; the inner loops of a product, where one added instruction is paid per k
step. This is the "predict" step of benchmarks/NOTES.md for changes to instruction counts: a
kernel bound by issue (the out kernel, the fused RWKV7 kernels) moves with them, one bound by
shared-memory wavefronts (intra, grad) much less (ncu says which).

cuobjdump and nvdisasm come with a full CUDA toolkit; where the toolkit has only nvcc, take
them from PyPI: `pip download --no-deps nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`, unzip the
wheels and pass their bin folder as --tools (or put it on PATH).
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
ROUNDING_ADD = re.compile(r"^(VIADD|IADD3)\S*\s+R\d+,\s+R\d+,\s+0x1000\b")
KINDS = {"hmma": r"^HMMA", "lds": r"^LDS", "sts": r"^STS", "ldg": r"^LDG", "stg": r"^STG",
         "mufu": r"^MUFU"}


def parse_functions(sass):
    """{kernel name: [(address, instruction text without predicate)]} from cuobjdump -sass."""
    funcs, name = {}, None
    for line in sass.splitlines():
        m = re.match(r"^\s+Function : (\S+)", line)
        if m:
            name = m.group(1)
            funcs[name] = []
            continue
        m = INSTR.match(line)
        if m and name is not None:
            text = re.sub(r"^@!?U?P\w+\s+", "", m.group(2))
            funcs[name].append((int(m.group(1), 16), text))
    return funcs


def counts(instrs):
    """Instruction counts of one body: total and per KINDS, plus TF32 rounding adds."""
    c = {"instr": len(instrs)}
    for k, pat in KINDS.items():
        c[k] = sum(bool(re.match(pat, t)) for _, t in instrs)
    c["tf32_round"] = sum(bool(ROUNDING_ADD.match(t)) for _, t in instrs)
    return c


def mma_loops(instrs):
    """Every loop (a branch back to an earlier address) whose body holds an HMMA: (first, last)
    indices and the body's counts."""
    at = {a: i for i, (a, _) in enumerate(instrs)}
    loops = []
    for i, (a, t) in enumerate(instrs):
        m = re.match(r"^BRA\S*\s+(?:\S+,\s*)?(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", t)
        if not m or int(m.group(1), 16) >= a or int(m.group(1), 16) not in at:
            continue
        j = at[int(m.group(1), 16)]
        c = counts(instrs[j:i + 1])
        if c["hmma"]:
            loops.append((j, i, c))
    return loops


def short_name(name):
    """The kernel's name without the namespaces' mangling prefix (its template arguments kept)."""
    return re.sub(r"^_ZN3fla(\d+\w+?_detail)?\d+", "", name)


def tool(name, tools):
    for d in ([tools] if tools else []) + [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin")]:
        if os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    found = shutil.which(name)
    if not found:
        raise SystemExit(f"sass_counts: {name} not found (see this script's docstring: --tools)")
    return found


def compile_cubin(cu, out):
    import torch.utils.cpp_extension as ext
    inc = [f"-I{p}" for p in ext.include_paths()]
    cmd = [tool("nvcc", None), "-O3", "-lineinfo", "--expt-relaxed-constexpr", "--extended-lambda",
           "-std=c++17", "-arch=sm_90a", "-I", os.path.join(ROOT, "csrc"), "-I",
           os.path.join(ROOT, "csrc", "kernels"), *inc, "-cubin", "-o", out, cu]
    subprocess.run(cmd, check=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cu", nargs="?", help="a .cu file of csrc/kernels to compile for sm_90a")
    ap.add_argument("--cubin", help="read this cubin instead of compiling")
    ap.add_argument("--kernel", default="", help="regex on the kernels' mangled names")
    ap.add_argument("--loops", action="store_true", help="also each loop that holds an mma")
    ap.add_argument("--tools", help="folder holding cuobjdump and nvdisasm")
    a = ap.parse_args(argv)
    if not (a.cu or a.cubin):
        ap.error("give a .cu file or --cubin")
    cuobjdump, nvdisasm = tool("cuobjdump", a.tools), tool("nvdisasm", a.tools)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = a.cubin or os.path.join(tmp, "k.cubin")
        if not a.cubin:
            compile_cubin(a.cu, cubin)
        env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", ""))
        sass = subprocess.run([cuobjdump, "-sass", cubin], check=True, capture_output=True, text=True,
                              env=env).stdout
    cols = ["instr", *KINDS, "tf32_round"]
    print(" ".join(f"{c:>10}" for c in cols), " kernel")
    for name, instrs in sorted(parse_functions(sass).items(), key=lambda kv: short_name(kv[0])):
        if not re.search(a.kernel, name):
            continue
        c = counts(instrs)
        print(" ".join(f"{c[k]:>10}" for k in cols), "", short_name(name))
        if a.loops:
            for j, i, lc in mma_loops(instrs):
                print(f"{'':>10} loop [{j}, {i}]: {lc['instr']} instructions, {lc['hmma']} HMMA, "
                      f"{lc['lds']} LDS, {lc['tf32_round']} rounding adds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
