"""Stored formats read as values (quantmesh.io.encoded): a rank that reads a block of a weight
(its rows, or its columns under a row-parallel split) decodes that block only, with the values of
the whole weight decoded and cut."""

from __future__ import annotations

import torch

from quantmesh.io.encoded import Fp8Weight, Mxfp4Weight


class _Recorded:
    """A shard of in-memory tensors that records the shape of every block read."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors, self.read = tensors, []

    def info(self, key):
        return tuple(self.tensors[key].shape), self.tensors[key].dtype

    def block(self, key, index):
        out = self.tensors[key][index]
        self.read.append((key, tuple(out.shape)))
        return out

    def close(self):
        pass


def _all(w) -> torch.Tensor:
    return w.block(w.key, tuple(slice(None) for _ in w.shape))


def test_fp8_reads_only_the_rows_and_columns_asked_for() -> None:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 260, generator=g) * 3).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 3, generator=g) + 0.5  # 128 x 128 blocks, the last ones partial
    shard, sshard = _Recorded({"w": w}), _Recorded({"s": scale})
    fp8 = Fp8Weight("w", shard, "s", sshard, (128, 128))
    whole = _all(fp8)
    assert torch.equal(whole[:128, :128], w[:128, :128].float() * scale[0, 0])
    assert torch.equal(whole[290:, 256:], w[290:, 256:].float() * scale[2, 2])
    for rows, cols in [(slice(0, 300), slice(130, 200)), (slice(100, 140), slice(0, 260)),
                       (slice(7, 9), slice(127, 129)), (slice(0, 300), slice(256, 260))]:  # fmt: skip
        shard.read.clear(), sshard.read.clear()
        got = fp8.block("w", (rows, cols))
        assert torch.equal(got, whole[rows, cols]), (rows, cols)
        n_rows, n_cols = rows.stop - rows.start, cols.stop - cols.start
        assert shard.read == [("w", (n_rows, n_cols))], shard.read  # the block, not whole rows
        blocks = -(-cols.stop // 128) - cols.start // 128
        assert sshard.read[0][1][1] == blocks, sshard.read


def test_mxfp4_reads_only_the_experts_and_features_asked_for() -> None:
    g = torch.Generator().manual_seed(1)
    e, out, groups = 3, 10, 4  # (E, in=128, out=10) as gpt-oss holds it
    codes = torch.randint(0, 256, (e, out, groups, 16), generator=g, dtype=torch.uint8)
    exps = torch.randint(120, 134, (e, out, groups), generator=g, dtype=torch.uint8)
    blocks, scales = _Recorded({"t_blocks": codes}), _Recorded({"t_scales": exps})
    mx = Mxfp4Weight("t", ("t_blocks", blocks), ("t_scales", scales))
    assert mx.shape == (3, 128, 10)
    whole = _all(mx)
    # expert 1, input 33 (group 1, code 1: the high nibble of byte 0), output 4
    code = int(codes[1, 4, 1, 0]) >> 4
    lut = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
    assert float(whole[1, 33, 4]) == lut[code] * 2.0 ** (int(exps[1, 4, 1]) - 127)
    for cut in [(slice(0, 3), slice(40, 70), slice(0, 10)), (slice(1, 2), slice(0, 128), slice(3, 7)),
                (slice(0, 3), slice(96, 128), slice(9, 10))]:  # fmt: skip
        blocks.read.clear()
        got = mx.block("t", cut)
        assert torch.equal(got, whole[cut]), cut
        ((_, shape),) = blocks.read
        n_groups = -(-cut[1].stop // 32) - cut[1].start // 32
        assert shape == (cut[0].stop - cut[0].start, cut[2].stop - cut[2].start, n_groups, 16), (
            shape
        )
