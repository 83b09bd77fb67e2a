"""The 4-bit gemv with the LoRA adapters' B products inside its launch (`kernel4.GEMV_LORA_ENABLED`)
run by Triton's interpreter on CPU, in a module of its own so that it runs beside
test_triton_interpreter.py on another worker (the cases live there, family "low_rank"):
- the kernel: each output the plain gemv's plus its delta rounded on its own, within an ulp, at
  one share of K and several, ranks of a power of two and not, a member's columns of t running
  to its end; bad delta tensors refused before any launch;
- `fast_decode` of a small fp16 Llama (nf4 + LoRA) with the switch on: the switch-off tokens,
  eager and compiled, the siblings' codes joined or not, every step's launch carrying its delta
  (counted); and at tp=2 (colwise shards fused, rowwise ones plain).
"""

from __future__ import annotations

import pytest

from tests.unit.test_triton_interpreter import run_family


@pytest.mark.slow  # about 50 s on 2 cores
def test_gemv_adds_the_adapters_deltas_in_the_interpreter() -> None:
    run_family("low_rank")
