"""Cutting weights stored already quantized by bitsandbytes (quant/prequant.py) on CPU.

Every cut is compared with the same cut of the whole weight dequantized by bitsandbytes: the
block-aligned path must give the stored codes and statistics (bit-identical values), the general
path the exact float values; int8 cuts are always exact.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from quantmesh.quant.base import QuantConfig, QuantError, get_format


def _flat_dequant(packed: torch.Tensor, qs) -> torch.Tensor:
    """The whole weight dequantized with flat blocks: bitsandbytes' CPU kernel given a 2-D shape
    whose rows do not hold whole blocks indexes the statistics per row, unlike its quantizer, so
    the reference is taken over the flattened weight (one row of out*in elements)."""
    import bitsandbytes.functional as F

    flat = F.QuantState(absmax=qs.absmax, shape=torch.Size((1, qs.shape.numel())), code=qs.code,
                        blocksize=qs.blocksize, quant_type=qs.quant_type, dtype=qs.dtype,
                        offset=qs.offset, state2=qs.state2)  # fmt: skip
    return F.dequantize_4bit(packed, flat).view(qs.shape)


def _cut(full: torch.Tensor, dim: int, ranges) -> torch.Tensor:
    return torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim=dim)


@pytest.mark.parametrize(
    "dq, qtype, shape",
    list(itertools.product([False, True], ["nf4", "fp4"], [(512, 64), (96, 40), (33, 128)])),
)
def test_4bit_cuts_are_exact(dq, qtype, shape):
    import bitsandbytes.functional as F

    from quantmesh.quant.prequant import aligned_4bit, dequantize_4bit_slice, slice_4bit

    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    packed, qs = F.quantize_4bit(w, blocksize=64, compress_statistics=dq, quant_type=qtype)
    full = _flat_dequant(packed, qs)
    data = packed.reshape(-1)
    reads: list[tuple[int, int]] = []

    def read(a: int, b: int) -> torch.Tensor:
        reads.append((a, b))
        return data[a:b]

    n_aligned = 0
    for dim in (0, 1):
        n = shape[dim]
        for ranges in [
            ((0, n // 2),),
            ((n // 2, n),),
            ((0, n // 4), (n // 2, 3 * n // 4)),
            ((3, n - 1),),
        ]:
            want = _cut(full, dim, ranges)
            assert torch.equal(dequantize_4bit_slice(qs, dim, ranges, read), want), (dim, ranges)
            if aligned_4bit(shape, 64, dim, ranges):
                reads.clear()
                p2, q2 = slice_4bit(qs, dim, ranges, read)
                assert torch.equal(_flat_dequant(p2, q2), want), (dim, ranges)
                if dim == 0:  # rows: only the bytes of those rows are read
                    assert sum(b - a for a, b in reads) == p2.numel()
                n_aligned += 1
            else:
                with pytest.raises(QuantError, match="cut quantization blocks of 64"):
                    slice_4bit(qs, dim, ranges, read)
    assert n_aligned >= 2  # row halves are aligned for every shape here


def test_4bit_double_quant_stays_nested_on_256_block_cuts():
    import bitsandbytes.functional as F

    from quantmesh.quant.prequant import slice_4bit

    w = torch.randn(512, 64, generator=torch.Generator().manual_seed(1))  # 512 absmax blocks
    packed, qs = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    data = packed.reshape(-1)
    top, q_top = slice_4bit(qs, 0, ((256, 512),), lambda a, b: data[a:b])
    assert q_top.nested and q_top.absmax.dtype == torch.uint8  # 256 blocks = one nested block
    assert torch.equal(F.dequantize_4bit(top, q_top), F.dequantize_4bit(packed, qs)[256:])
    _, q_mid = slice_4bit(qs, 0, ((4, 260),), lambda a, b: data[a:b])
    assert not q_mid.nested and q_mid.absmax.dtype == torch.float32  # exact fp32 statistics
    whole, q_whole = slice_4bit(qs, None, None, lambda a, b: data[a:b])
    assert q_whole is qs and torch.equal(whole, packed)


def test_load_state_puts_codes_into_a_module():
    import bitsandbytes.functional as F

    from quantmesh.quant.prequant import slice_4bit

    fmt = get_format(QuantConfig(format="nf4"))
    full = fmt.new_linear(64, 512, bias=False, device="cpu", dtype=torch.float32)
    fmt.quantize_into(full, torch.randn(512, 64, generator=torch.Generator().manual_seed(2)))
    qs = full.weight.quant_state
    data = full.weight.data.reshape(-1)
    packed, part = slice_4bit(qs, 0, ((256, 512),), lambda a, b: data[a:b])
    shard = fmt.new_linear(64, 256, bias=False, device="meta", dtype=torch.float32)
    fmt.load_state(shard, packed, part, device="cpu")
    x = torch.randn(3, 64)
    torch.testing.assert_close(shard(x), full(x)[:, 256:], rtol=0, atol=0)
    assert torch.equal(fmt.dequantize(shard), F.dequantize_4bit(full.weight.data, qs)[256:])
    other = get_format(QuantConfig(format="fp4"))
    with pytest.raises(QuantError, match=r"stored weight is nf4.*format='nf4'"):
        other.load_state(other.new_linear(64, 256, bias=False, device="meta", dtype=torch.float32),
                         packed, part, device="cpu")  # fmt: skip
    # the in-memory convenience: a transformers-layout state dict, cut on rows
    again = fmt.new_linear(64, 256, bias=False, device="meta", dtype=torch.float32)
    fmt.load_quantized(again, full.state_dict(), device="cpu", dim=0, start=256, stop=512)
    torch.testing.assert_close(again(x), full(x)[:, 256:], rtol=0, atol=0)


def test_int8_cuts_are_exact():
    from quantmesh.quant.prequant import slice_int8

    fmt = get_format(QuantConfig(format="int8"))
    full = fmt.new_linear(96, 32, bias=False, device="cpu", dtype=torch.float32)
    fmt.quantize_into(full, torch.randn(32, 96, generator=torch.Generator().manual_seed(3)))
    cb, scb = full.weight.data, full.weight.SCB
    ref = fmt.dequantize(full)
    for dim, ranges in [(0, ((8, 24),)), (1, ((0, 40), (60, 96))), (0, ((0, 4), (16, 20)))]:
        c2, s2 = slice_int8(_cut(cb, dim, ranges), scb, dim, ranges)
        part = fmt.new_linear(c2.shape[1], c2.shape[0], bias=False, device="meta",
                              dtype=torch.float32)  # fmt: skip
        fmt.load_state(part, c2, s2, device="cpu")
        assert torch.equal(fmt.dequantize(part), _cut(ref, dim, ranges)), (dim, ranges)


@pytest.mark.parametrize("method", ["gptq", "awq", "torchao", "hqq"])
def test_folders_of_other_methods_are_refused(tmp_path, method):
    import json

    from quantmesh.io.prequant import folder_quant

    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": method}})
    )
    with pytest.raises(
        QuantError, match=f"holds a checkpoint quantized by {method} .*load the float model"
    ):
        folder_quant(tmp_path, None)


def test_bitsandbytes_folder_config_is_read(tmp_path):
    import json

    from quantmesh.io.prequant import folder_quant

    def write(qc: dict) -> None:
        qc = {"quant_method": "bitsandbytes", **qc}
        (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))

    write({"load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": True})
    got = folder_quant(tmp_path, None)
    assert got is not None and (got.format, got.double_quant) == ("fp4", True)
    write({"load_in_8bit": True, "llm_int8_threshold": 4.0})
    got = folder_quant(tmp_path, "int8")
    assert got is not None and got.format == "int8"
    assert folder_quant(tmp_path, None).int8_threshold == 4.0  # type: ignore[union-attr]
    with pytest.raises(
        QuantError, match="stored as bitsandbytes int8, but quant= asks for bitsandbytes nf4"
    ):
        folder_quant(tmp_path, "nf4")
    (tmp_path / "config.json").write_text("{}")
    assert folder_quant(tmp_path, "nf4").format == "nf4"  # type: ignore[union-attr]  # a float folder


def test_gptq_keys_are_refused_by_the_loader():
    from quantmesh.io.prequant import stored_weights
    from quantmesh.io.reader import open_checkpoint

    ckpt = open_checkpoint({"m.q_proj.qweight": torch.zeros(2, dtype=torch.int32)})
    with pytest.raises(QuantError, match="holds GPTQ/AWQ-packed weights"):
        stored_weights(ckpt)


def test_4bit_rows_that_cut_blocks_compute_with_the_flat_blocks_on_cpu():
    """in=96 is not a multiple of 64: bitsandbytes 0.50's CPU kernel would read the statistics per
    row; the layer's forward, input gradient and dequantize use the flattened blocks."""
    from quantmesh.quant.bnb import dequantize_4bit_flat

    fmt = get_format(QuantConfig(format="nf4"))
    m = fmt.new_linear(96, 32, bias=True, device="cpu", dtype=torch.float32)
    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(4))
    fmt.quantize_into(m, w)
    flat = dequantize_4bit_flat(m.weight.data, m.weight.quant_state)
    assert torch.equal(fmt.dequantize(m), flat)
    assert (flat - w).abs().max() < 0.2 * w.abs().max()  # close to w: the right blocks
    x = torch.randn(5, 96, requires_grad=True)
    y = m(x)
    torch.testing.assert_close(y, x @ flat.t() + m.bias, rtol=0, atol=1e-5)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(5, 32) @ flat, rtol=0, atol=1e-5)


@pytest.mark.slow  # a CPU compile (inductor's first compile in a process costs the most)
def test_4bit_rows_that_cut_blocks_compute_with_the_flat_blocks_when_compiled_too():
    """Compiled (CPU) the layer took bitsandbytes' kernel and its per-row statistics: the forward
    was off by ~9 and the input gradient by ~3 against the flat blocks. Now the same path as eager."""
    from quantmesh.quant.bnb import dequantize_4bit_flat

    fmt = get_format(QuantConfig(format="nf4"))
    m = fmt.new_linear(96, 32, bias=True, device="cpu", dtype=torch.float32)
    fmt.quantize_into(m, torch.randn(32, 96, generator=torch.Generator().manual_seed(4)))
    flat = dequantize_4bit_flat(m.weight.data, m.weight.quant_state)
    x = torch.randn(5, 96, requires_grad=True)
    y = torch.compile(m, fullgraph=True)(x)
    torch.testing.assert_close(y, x @ flat.t() + m.bias, rtol=0, atol=1e-5)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(5, 32) @ flat, rtol=0, atol=1e-5)
