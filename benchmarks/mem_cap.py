"""Run a Python script under a CUDA memory cap, as a smaller card would impose it.

    python benchmarks/mem_cap.py GIB SCRIPT [ARGS...]

Sets `torch.cuda.set_per_process_memory_fraction(GIB / total)` on every visible GPU, then runs
SCRIPT as `__main__` with ARGS: the caching allocator refuses to grow past GIB, so a run that needs
more ends with torch.OutOfMemoryError, as it would on a GIB card (minus the card's own reserve).
Used for "the longest sequence that trains under a 24 GiB cap" in docs/benchmarks.md.
"""

from __future__ import annotations

import runpy
import sys

import torch


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    gib = float(sys.argv[1])
    script = sys.argv[2]
    for d in range(torch.cuda.device_count()):
        total = torch.cuda.get_device_properties(d).total_memory
        frac = gib * 2**30 / total
        if not 0 < frac <= 1:
            sys.exit(f"cap {gib} GiB is outside (0, {total / 2**30:.1f}] GiB of GPU {d}")
        torch.cuda.set_per_process_memory_fraction(frac, d)
    sys.argv = [script, *sys.argv[3:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
