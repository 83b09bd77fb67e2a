"""The lines gemv and the decode attention's two kernels as programmatic dependent launches
(`kernel4.PDL_ENABLED`, QUANTMESH_PDL=1): what a CPU can check is the switch's reach. Off (the
default) or before Hopper the launch is the plain one; on, each kernel gets PDL (its programs wait
for the kernel before them) and the launch says launch_pdl. The kernels' griddepcontrol
instructions run only on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")


class _Recording:
    """Stands in for a Triton kernel: `kernel[grid](*args, **kwargs)` appends the launch's
    keywords to `seen` and launches nothing."""

    def __init__(self, seen: list[dict]) -> None:
        self.seen = seen

    def __getitem__(self, grid: object):
        return lambda *args, **kwargs: self.seen.append(kwargs)


def _launch_kwargs(monkeypatch, pdl: bool) -> dict:
    import bitsandbytes.functional as F

    from quantmesh.quant import _triton4, kernel4

    seen: list[dict] = []
    monkeypatch.setattr(_triton4, "qm_gemv_lines", _Recording(seen))
    monkeypatch.setattr(kernel4, "pdl_on", lambda device: pdl)
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    packed, qs = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    x = torch.randn(1, 256).to(torch.bfloat16)
    cfg = kernel4.gemv_config(1, 64, 256, 64)
    assert cfg.get("KERNEL") == "lines"
    y = kernel4.launch_gemv(x, packed.reshape(-1).view(torch.uint8),
                            *kernel4._statistics(qs, torch.device("cpu")), 64, "nf4", 64, cfg)  # fmt: skip
    assert y.shape == (1, 64) and len(seen) == 1
    return seen[0]


def test_the_gemv_is_a_dependent_launch_only_when_switched_on(monkeypatch) -> None:
    off = _launch_kwargs(monkeypatch, pdl=False)
    assert "PDL" not in off and "launch_pdl" not in off
    on = _launch_kwargs(monkeypatch, pdl=True)
    assert on["PDL"] is True and on["launch_pdl"] is True


def _attention_kwargs(monkeypatch, pdl: bool) -> list[dict]:
    from quantmesh.infer import _triton_attention, attention
    from quantmesh.quant import kernel4

    seen: list[dict] = []
    monkeypatch.setattr(_triton_attention, "qm_decode_attn_split", _Recording(seen))
    monkeypatch.setattr(_triton_attention, "qm_decode_attn_combine", _Recording(seen))
    monkeypatch.setattr(kernel4, "pdl_on", lambda device: pdl)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 1, 64, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(1, 2, 512, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    out = attention.launch_decode_attention(q, k, v, None, 0.125, {"BLOCK_L": 64, "SPLIT": 128})
    assert out.shape == (1, 1, 4, 64)
    assert len(seen) == 2  # the split kernel and the combine (4 splits of 128 keys)
    return seen


def test_the_decode_attention_is_a_dependent_launch_only_when_switched_on(monkeypatch) -> None:
    for kwargs in _attention_kwargs(monkeypatch, pdl=False):
        assert "PDL" not in kwargs and "launch_pdl" not in kwargs
    for kwargs in _attention_kwargs(monkeypatch, pdl=True):
        assert kwargs["PDL"] is True and kwargs["launch_pdl"] is True


def test_the_switch_needs_hopper_and_is_off_by_default(monkeypatch) -> None:
    from quantmesh.quant import kernel4

    assert kernel4.PDL_ENABLED is (os.environ.get("QUANTMESH_PDL") == "1")
    monkeypatch.setattr(kernel4, "PDL_ENABLED", True)
    assert kernel4.pdl_on(torch.device("cpu")) is False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert kernel4.pdl_on(torch.device("cuda", 0)) is False  # Ampere: no programmatic launches
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert kernel4.pdl_on(torch.device("cuda", 0)) is True
    monkeypatch.setattr(kernel4, "PDL_ENABLED", False)
    assert kernel4.pdl_on(torch.device("cuda", 0)) is False
