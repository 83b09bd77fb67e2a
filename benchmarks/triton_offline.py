"""Compile one of quantmesh's Triton kernels for a GPU without one, and say what the compiler made
of its loop: the checks behind the gemv's layout notes (DEVELOPERS.md, "A Triton kernel can be
compiled without a GPU").

For `qm_gemv_lines` (default), `qm_gemv_4bit` or `qm_mma_4bit` (the tensor-core kernel), with
the constexprs given (the rest at the library's tile), it prints:
- the layouts Triton chose (`#blocked` lines of the TTGIR) and the layout conversions inside a
  loop (`ttg.convert_layout` in an `scf.for` body; some move no data);
- PTX counts: shared-memory stores and loads, `bar.sync`, warp shuffles, fp32 fused
  multiply-adds, tensor-core instructions and `cp.async`, and the shared-memory ones inside
  loops: a conversion that moves data between lanes every step shows there (the gemv's loop
  should have none; the tensor-core kernel's moves x into shared memory, as wgmma reads it);
- registers and spills from `ptxas -v` (the copy beside Triton's own), where it is found.

Use the GPU image's Triton version (3.6 in its CUDA 13 image): 3.6 and 3.9 break ties between
equally contiguous dimensions differently. The project's CPU packages hold Triton 3.8 (for the
interpreter test); install 3.6 beside them, e.g. in a virtualenv of its own (no torch needed):

    python3 -m venv /path/tri36 && /path/tri36/bin/pip install --no-deps triton==3.6.0
    /path/tri36/bin/python benchmarks/triton_offline.py --const ROWS=8 BLOCK_N=4 SB=16

Writes the TTGIR and PTX to --out (default .bench/triton-offline) for a closer read.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import re
import subprocess
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_SRC = os.path.join(os.path.dirname(_HERE), "src", "quantmesh", "quant", "_triton4.py")

# pointer arguments' element types (int32 words of x and the codes; 8-bit statistics)
POINTERS = {
    "x_ptr": "*i32", "q_ptr": "*i32", "am_ptr": "*u8", "am2_ptr": "*fp32",
    "code2_ptr": "*fp32", "off_ptr": "*fp32", "lut_ptr": "*fp32", "y_ptr": "*bf16",
    "part_ptr": "*fp32", "cnt_ptr": "*i32", "t_ptr": "*fp32", "e_ptr": "*fp32",
    "col_ptr": "*i32", "sc_ptr": "*fp32", "b_ptr": "*bf16",
}  # fmt: skip
# the library's one-row tile and statistics (kernel4.GEMV_TILE, double quant, bf16)
DEFAULTS = {
    "qm_gemv_lines": dict(
        BS2=256,
        NESTED=1,
        BLOCK_N=2,
        SB=32,
        NS=1,
        LUT=1,
        BF16=1,
        WK=1,
        ROWS=1,
        OFFS=0,
        RL=16,
        LORA=0,
        BIAS=0,
    ),
    "qm_gemv_4bit": dict(BS2=256, NESTED=1, BLOCK_N=32, NS=1, LUT=1, BF16=1),
    "qm_mma_4bit": dict(
        BS2=256, NESTED=1, BLOCK_N=64, BLOCK_M=32, NB=2, NS=1, LUT=1, BF16=1, OFFS=0
    ),
}
# integers the launcher passes as multiples of 16 (int32 words or bytes of a row of codes: `in`
# a multiple of 64), which Triton specializes as such at run time
ALIGNED_INTS = ("KW", "KH")
# pointers a kernel takes otherwise (the tensor-core kernel reads the codes as bytes)
KERNEL_POINTERS = {"qm_mma_4bit": {"q_ptr": "*u8"}}
# warps a kernel runs with by default (the gemvs: WK, else 1)
WARPS = {"qm_mma_4bit": 4}


def loop_conversions(ttgir: str) -> list[str]:
    """The `ttg.convert_layout` lines inside an `scf.for` body of the TTGIR text (by nesting of
    braces from each `scf.for` line)."""
    found, depth, loops = [], 0, []
    for line in ttgir.splitlines():
        if "scf.for" in line:
            loops.append(depth)
        if loops and "ttg.convert_layout" in line:
            found.append(line.strip())
        depth += line.count("{") - line.count("}")
        while loops and depth <= loops[-1]:
            loops.pop()
    return found


def ptx_counts(ptx: str) -> dict[str, int]:
    """Instructions of interest in the PTX text."""
    return {
        "st.shared": len(re.findall(r"\bst\.shared", ptx)),
        "ld.shared": len(re.findall(r"\bld\.shared", ptx)),
        "bar.sync": len(re.findall(r"\bbar\.sync", ptx)),
        "shfl": len(re.findall(r"\bshfl\.", ptx)),
        "fma.f32": len(re.findall(r"\bfma\.rn\.f32", ptx)),
        "mma": len(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)", ptx)),
        "cp.async": len(re.findall(r"\bcp\.async\.(?:ca|cg|bulk)", ptx)),
    }


def ptx_loop_shared(ptx: str) -> dict[str, int]:
    """Shared-memory loads, stores and barriers inside the PTX's loops: the lines from a label
    to a later branch back to it."""
    lines = ptx.splitlines()
    at = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"^(\$L__\w+):", ln))}
    inside = [False] * len(lines)
    for i, ln in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", ln)
        if m and at.get(m.group(1), len(lines)) < i:  # a branch back: a loop
            for j in range(at[m.group(1)], i + 1):
                inside[j] = True
    body = "\n".join(ln for ln, x in zip(lines, inside, strict=True) if x)
    return {k: v for k, v in ptx_counts(body).items() if k.endswith(("shared", "sync"))}


def ptxas_info(triton_dir: str, ptx_path: str, arch: int) -> list[str]:
    """`ptxas -v`'s register and spill lines, or why they are missing."""
    ptxas = os.path.join(triton_dir, "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        return [f"no ptxas beside Triton ({ptxas})"]
    r = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", ptx_path, "-o", os.devnull],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    lines = [ln.strip() for ln in r.stderr.splitlines() if "registers" in ln or "spill" in ln]
    return lines or [f"ptxas said: {r.stderr.strip()[:300]}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kernel", default="qm_gemv_lines", choices=sorted(DEFAULTS))
    p.add_argument("--const", nargs="*", default=[], metavar="KEY=INT",
                   help="constexprs over the defaults, e.g. ROWS=8 BLOCK_N=4 SB=16")  # fmt: skip
    p.add_argument("--num-warps", type=int, default=None,
                   help="default: qm_mma_4bit 4; the gemvs WK, else 1")  # fmt: skip
    p.add_argument("--num-stages", type=int, default=1, help="software pipelining (default 1)")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    p.add_argument("--out", default=os.path.join(".bench", "triton-offline"))
    a = p.parse_args(argv)
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        print("needs Triton importable (see this file's docstring)", file=sys.stderr)
        return 2
    const = dict(DEFAULTS[a.kernel])
    for item in a.const:
        key, sep, value = item.partition("=")
        if not sep or key not in const:
            p.error(f"--const {item!r}: KEY=INT, KEY one of {sorted(const)}")
        const[key] = int(value)
    for key in ("ROWS", "BLOCK_N", "BLOCK_M", "NB", "NS"):  # tl.arange lengths
        if key in const and const[key] & (const[key] - 1):
            p.error(f"{key}={const[key]}: a power of two (the kernel's tl.arange lengths)")
    spec = importlib.util.spec_from_file_location("_triton4", _SRC)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the kernels alone, without importing quantmesh (torch)
    fn = getattr(module, a.kernel)
    params = list(inspect.signature(fn.fn).parameters)
    const = {k: v for k, v in const.items() if k in params}
    pointers = dict(POINTERS, **KERNEL_POINTERS.get(a.kernel, {}))
    sig = {n: "constexpr" if n in const else pointers.get(n, "i32") for n in params}
    aligned = [n for n in (*pointers, *ALIGNED_INTS) if n in params]
    attrs = {(params.index(n),): [["tt.divisibility", 16]] for n in aligned}
    warps = a.num_warps or WARPS.get(a.kernel) or const.get("WK", 1)
    compiled = triton.compile(ASTSource(fn, sig, const, attrs=attrs),
                              target=GPUTarget("cuda", a.arch, 32),
                              options=dict(num_warps=warps, num_stages=a.num_stages))  # fmt: skip
    os.makedirs(a.out, exist_ok=True)
    tag = "_".join(f"{k}{v}" for k, v in sorted(const.items()))
    stem = os.path.join(a.out, f"{a.kernel}_{tag}_w{warps}_s{a.num_stages}")
    for kind in ("ttgir", "ptx"):
        with open(f"{stem}.{kind}", "w") as f:
            f.write(compiled.asm[kind])
    ttgir, ptx = compiled.asm["ttgir"], compiled.asm["ptx"]
    print(
        f"{a.kernel} (Triton {triton.__version__}, sm_{a.arch}, {warps} warp(s), "
        f"{a.num_stages} stage(s)): {const}"
    )
    for line in ttgir.splitlines():
        if line.startswith(("#blocked", "#linear")):
            print("  " + line.split(" = ", 1)[-1][:150])
    moves = loop_conversions(ttgir)
    print(f"  layout conversions inside a loop (TTGIR; some move no data): {len(moves)}")
    for line in moves[:4]:
        print("    " + line[:160])
    print(f"  PTX: {ptx_counts(ptx)}; inside loops: {ptx_loop_shared(ptx)} (want none)")
    for line in ptxas_info(os.path.dirname(triton.__file__), f"{stem}.ptx", a.arch):
        print(f"  ptxas: {line}")
    print(f"  written: {stem}.ttgir, {stem}.ptx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
