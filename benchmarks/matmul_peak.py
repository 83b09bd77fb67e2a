"""The bf16 matmul rate every MFU figure is measured against: an 8192^3 bf16 matmul on each GPU.

Burst = best of 10 timed batches of 5 matmuls; sustained = mean over --seconds of back-to-back
matmuls (the rate a long training step can count on). The summary is the mean over GPUs.

Usage: python benchmarks/matmul_peak.py --out DIR        (--smoke: CPU, n=256)
Writes DIR/matmul_peak.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qmbench as qb  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--out", default=".")
    p.add_argument("--smoke", action="store_true", help="CPU, n=256, 0.2 s")
    a = p.parse_args(argv)
    R = {"bench": "matmul_peak", "n": a.n, "ok": False, "versions": qb.versions()}
    with qb.record_errors(R):
        if a.smoke or not torch.cuda.is_available():
            a.n, a.seconds = (256, 0.2) if a.smoke else (a.n, a.seconds)
            devices = [torch.device("cpu")]
        else:
            devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        R["n"] = a.n
        R["per_device"] = {str(d): qb.matmul_peak_tflops(d, a.n, a.seconds) for d in devices}
        vals = list(R["per_device"].values())
        R["summary"] = {
            k: round(sum(v[k] for v in vals) / len(vals), 1)
            for k in ("burst_tflops", "sustained_tflops")
        }
        R["ok"] = True
        qb.log("matmul peak", R["per_device"])
    qb.write_json(os.path.join(a.out, "matmul_peak.json"), R)
    return 0 if R["ok"] else 1


if __name__ == "__main__":
    from quantmesh.cli.runner import exit_fast  # no module teardown: seconds at exit

    exit_fast(main)
