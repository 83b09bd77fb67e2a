"""The matmuls of the held bf16 weights in one decode step of the 7B shape (`serve --keep-dequantized`),
at a few rows: the seven projections of each layer one by one, against sibling weights fused
(q, k, v as one (3h, h) matrix; gate and up as one (2i, h)), as the server's bank already fuses
the siblings' adapters. The question it answers: would the server's 32-row step, whose held
weights' matmuls ran at 43% of the HBM rate (docs/benchmarks.md), gain from fusing the base too?

Both forms read the same 32 layers of weights (the separate projections are row slices of the
fused matrices, so the bytes are the same and nothing is cached in L2 between layers), and each
whole step is captured as one CUDA graph and replayed (`qmbench.graph_us`). TB/s = the weights'
bytes / time. The smoke (`--smoke`, CPU, tiny shapes) checks that both forms give the same outputs.

Usage (from the repository root):
    python3 benchmarks/held_gemm_bench.py [--rows 1,16,32,64] [--out DIR] [--smoke]
Writes DIR/held_gemm.json (default DIR: .bench/held-gemm).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import qmbench as qb  # noqa: E402


def layers(n: int, h: int, i: int, device: str, dtype: torch.dtype) -> list[dict]:
    """n layers of fused weights (qkv, o, gate_up, down), random; the separate projections are
    row slices of them (contiguous views)."""
    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for _ in range(n):
        w = {"qkv": (3 * h, h), "o": (h, h), "gate_up": (2 * i, h), "down": (h, i)}
        out.append({k: torch.randn(s, generator=g, device=device, dtype=dtype) * 0.02
                    for k, s in w.items()})  # fmt: skip
    return out


def step_separate(x: torch.Tensor, hid: torch.Tensor, ws: list[dict], h: int, i: int) -> list:
    outs = []
    for w in ws:
        q, k, v = w["qkv"][:h], w["qkv"][h : 2 * h], w["qkv"][2 * h :]
        gate, up = w["gate_up"][:i], w["gate_up"][i:]
        outs += [F.linear(x, q), F.linear(x, k), F.linear(x, v), F.linear(x, w["o"]),
                 F.linear(x, gate), F.linear(x, up), F.linear(hid, w["down"])]  # fmt: skip
    return outs


def step_fused(x: torch.Tensor, hid: torch.Tensor, ws: list[dict], h: int, i: int) -> list:
    outs = []
    for w in ws:
        qkv, gu = F.linear(x, w["qkv"]), F.linear(x, w["gate_up"])
        outs += [*qkv.split(h, dim=-1), F.linear(x, w["o"]), *gu.split(i, dim=-1),
                 F.linear(hid, w["down"])]  # fmt: skip
    return outs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,16,32,64")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--out", default=".bench/held-gemm")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: the two forms agree")
    a = p.parse_args(argv)
    h, i, n = (64, 96, 2) if a.smoke else (4096, 11008, a.layers)
    device = "cpu" if a.smoke else "cuda"
    dtype = torch.float32 if a.smoke else torch.bfloat16
    ws = layers(n, h, i, device, dtype)
    weight_bytes = sum(t.numel() * t.element_size() for w in ws for t in w.values())
    res: dict = {"shape": {"hidden": h, "inter": i, "layers": n}, "weight_GB": weight_bytes / 1e9,
                 "rows": {}}  # fmt: skip
    for m in [int(r) for r in a.rows.split(",")]:
        x = torch.randn(m, h, device=device, dtype=dtype)
        hid = torch.randn(m, i, device=device, dtype=dtype)
        sep, fus = step_separate(x, hid, ws, h, i), step_fused(x, hid, ws, h, i)
        err = max(float((s - f).abs().max()) for s, f in zip(sep, fus, strict=True))
        row: dict = {"max_abs_diff": err}
        if not a.smoke:
            for name, fn in (("separate", step_separate), ("fused", step_fused)):
                us = qb.graph_us(partial(fn, x, hid, ws, h, i), calls=1, replays=20)
                row[name] = {"ms": us / 1e3, "TB_s": weight_bytes / (us * 1e-6) / 1e12}
            row["fused_over_separate"] = row["separate"]["ms"] / row["fused"]["ms"]
        res["rows"][m] = row
        qb.log(f"{m} rows: {json.dumps(row)}")
    if a.smoke:
        assert all(r["max_abs_diff"] < 1e-5 for r in res["rows"].values()), res
    res["versions"] = qb.versions()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "held_gemm.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
