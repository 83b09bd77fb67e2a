"""Fully sharded data parallel over the mesh's dp axis, through torch's FSDP2 (`fully_shard`).

Each repeated block (`blocks_of`) is one FSDP group, the output head another (the chunked loss
calls it outside the model's forward; tied to the input embedding, both), then the root holds
what is left (embeddings, norms). Every parameter, the frozen base and the adapters alike, is
split on dim 0 over this rank's dp group and all-gathered one block at a time for forward and
again for backward (the next block's gather is prefetched). Adapter gradients are reduce-scattered (averaged over dp) as FSDP2
does. Composed with tp: a tp shard is a plain tensor, so each tp rank shards *its* shard over the
dp group of its tp coordinate (the "dp" sub-mesh of the DeviceMesh).

What survives sharding bit for bit: plain tensors (fp32/bf16 bases, torchao int8 weight and
scale) and torchao's NF4Tensor, which implements FSDP2's all-gather extension (its codes, block
scales and factors are sharded and gathered as they are). bitsandbytes' Params4bit / Int8Params
carry their statistics beside the tensor (quant_state, SCB), which FSDP2 would drop: refused.

`offload=True` (offload_base): each block's frozen base lives in host memory (pinned on CUDA)
through FSDP2's CPUOffloadPolicy and is copied to the device for its gather; the block's adapters
form a group of their own that stays on the device (so their optimizer step stays there).

Example:
    >>> qm.parallelize(model, mesh, quant=qm.QuantConfig(backend="torchao"), lora=cfg,
    ...                fsdp=True, offload_base=True)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ..config import FsdpError, check_fsdp_options
from ..plan.auto import blocks_of
from ..quant.base import QuantConfig
from ..tp.layers import ShardedModule
from .state import FsdpConfig, parallel_state  # FsdpConfig: recorded in the state

if TYPE_CHECKING:
    from .mesh import Mesh

__all__ = [
    "BlockSharder",
    "FsdpConfig",
    "FsdpError",
    "apply_fsdp",
    "check_fsdp",
    "fsdp_groups",
    "shard_block",
]


def fsdp_blocked_by(model: nn.Module) -> str | None:
    """Why FSDP cannot shard `model` whatever the settings (its experts modules), None when it
    can: parallelize refuses fsdp=True for it, and neither `plan` nor `finetune` proposes it.

    Example:
        >>> fsdp_blocked_by(mixtral)  # doctest: +SKIP
        'experts modules (model.layers.0.mlp.experts, ...): FSDP2 of split and quantized ...'
    """
    from ..tp.experts import find_experts

    found = list(find_experts(model))
    if not found:
        return None
    return (
        f"experts modules ({found[0]}, ...): FSDP2 of split and quantized expert tensors is not "
        "supported yet; train with dp replicas, and tp to split the experts"
    )


def check_fsdp(qcfg: QuantConfig | None, data_parallel: bool, mesh: Mesh) -> None:
    """Raise FsdpError when fsdp cannot be applied exactly (before any allocation or collective).

    Example:
        >>> check_fsdp(QuantConfig(format="nf4"), True, mesh)  # doctest: +SKIP
        FsdpError: ... backend='torchao' ...
    """
    if not data_parallel:
        raise FsdpError("fsdp=True shards over dp; it needs data_parallel=True")
    check_fsdp_options(
        pp=mesh.pp,
        quant=qcfg.format if qcfg is not None else None,
        backend=qcfg.backend if qcfg is not None else "bitsandbytes",
    )
    if len(mesh.devices) > 1:
        raise FsdpError(
            f"fsdp=True with devices_per_rank={len(mesh.devices)}: a layer-split replica cannot "
            "also be sharded by FSDP; use one device per rank (tp and dp instead)"
        )


def _adapters(block: nn.Module) -> list[nn.Module]:
    """The LoRA A/B linears inside `block`, in module order."""
    out: list[nn.Module] = []
    for m in block.modules():
        if isinstance(m, ShardedModule) and (ad := m.lora) is not None:
            out += [ad.lora_A, ad.lora_B]
    return out


def apply_fsdp(
    model: nn.Module, mesh: Mesh, *, offload: bool = False, reshard_after_forward: bool = True
) -> FsdpConfig:
    """fully_shard each repeated block (those `shard_block` did not yet), the output head and
    then the root over this rank's dp group (nf4 layers that cannot split evenly are refused
    first, by name).

    Run by `qm.parallelize(..., fsdp=True)` once every parameter holds its values (for a model
    built under `qm.empty_model()`, `load_checkpoint` shards each block as soon as it is filled
    and calls this at its end). Returns what it did.

    Example:
        >>> apply_fsdp(model, mesh, offload=True).blocks[:1]  # doctest: +SKIP
        ('model.layers.0',)
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    blocks = blocks_of(model)
    if not blocks:
        raise FsdpError(
            f"{type(model).__name__} has no repeated blocks (no nn.ModuleList of layers), so "
            "FSDP would gather the whole model at once; use fsdp=False (plain dp)"
        )
    _check_splits(model, mesh)  # before any fully_shard: every rank raises alike
    for _, block in blocks:
        if not isinstance(block, FSDPModule):
            shard_block(block, mesh, offload=offload, reshard_after_forward=reshard_after_forward)
    kw = _kwargs(model, mesh, reshard_after_forward)
    head = _head_group(model)
    if head:  # called on its own by the chunked loss: gathered by its own hooks, kept to backward
        fully_shard(head, **{**kw, "reshard_after_forward": False})
    fully_shard(model, **kw)  # the root: embeddings, norms; never offloaded
    _link_blocks(model, [b for _, b in blocks])
    cfg = FsdpConfig(tuple(n for n, _ in blocks), offload, reshard_after_forward)
    st = parallel_state(model, required=False)
    if st is not None:
        st.sharded, st.dp = cfg, True
    return cfg


def shard_block(
    block: nn.Module, mesh: Mesh, *, offload: bool = False, reshard_after_forward: bool = True
) -> None:
    """fully_shard one repeated block over this rank's dp group (with offload: its base in host
    memory, its adapters a group of their own on the device). Local: no collective.

    Example:
        >>> shard_block(model.model.layers[0], mesh)  # doctest: +SKIP
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    _check_splits(block, mesh)
    kw = _kwargs(block, mesh, reshard_after_forward)
    if offload and "ignored_params" in kw:
        raise FsdpError(
            "offload_base=True at dp=1 with a torchao nf4 base: torch's FSDP2 cannot gather an "
            "NF4Tensor on a one-rank group; use dp >= 2, or an unquantized / int8 base"
        )
    policy = CPUOffloadPolicy(pin_memory=mesh.device.type == "cuda") if offload else OffloadPolicy()
    if offload:
        adapters = _adapters(block)
        if adapters:  # trainable: stay on the device, a group of their own
            fully_shard(adapters, **kw)
    fully_shard(block, offload_policy=policy, **kw)


def _kwargs(module: nn.Module, mesh: Mesh, reshard_after_forward: bool) -> dict[str, Any]:
    """fully_shard's mesh (this tp coordinate's dp group), resharding and ignored parameters."""
    kw: dict[str, Any] = {
        "mesh": mesh.device_mesh["dp"],
        "reshard_after_forward": reshard_after_forward,
    }
    # torch 2.13's FSDP2 copies only the first all-gather input on a 1-rank group, which breaks
    # tensor subclasses gathered as several tensors (NF4Tensor): at dp=1 such weights are left
    # out of FSDP. Nothing is lost: a 1-rank shard is the whole weight anyway.
    subclass = _multi_input_params(module) if mesh.dp == 1 else set()
    if subclass:
        kw["ignored_params"] = subclass
    return kw


def _check_splits(module: nn.Module, mesh: Mesh) -> None:
    """Raise FsdpError naming the first nf4 layer whose weight does not split over dp evenly."""
    for m in module.modules():
        why = None
        if isinstance(m, ShardedModule) and hasattr(m.fmt, "fsdp_problem"):
            w = cast(torch.Tensor, m.local.weight)
            if not w.is_meta and not _is_dtensor(w):  # not yet filled / sharded already
                why = m.fmt.fsdp_problem(w)
        if why is not None:
            raise FsdpError(
                f"{m.fqn}: its nf4 weight cannot be sharded over dp={mesh.dp} exactly ({why}); "
                f"skip it (QuantConfig(skip=[...'{m.fqn}'])) or use a dp that divides it"
            )


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class BlockSharder:
    """Shards each repeated block as soon as `load_checkpoint` has written every tensor of it, so
    a rank holds one block whole at a time, not its whole tp shard.

    Example:
        >>> sharder = BlockSharder(model, pending={"model.layers.0": {"model.layers.0.w"}})  # doctest: +SKIP
        >>> sharder.filled(["model.layers.0.w"])  # doctest: +SKIP  (layer 0 is sharded now)
    """

    def __init__(self, model: nn.Module, pending: dict[str, set[str]]):
        st = parallel_state(model)
        self.mesh, self.offload = st.mesh, st.offload_base
        self.blocks = dict(blocks_of(model))
        self.pending = {b: set(keys) for b, keys in pending.items() if b in self.blocks}
        self.owner = {k: b for b, keys in self.pending.items() for k in keys}
        self.sharded: list[str] = []

    def filled(self, keys: list[str]) -> None:
        """`keys` hold their values now; shard the blocks that are complete."""
        for k in keys:
            b = self.owner.pop(k, None)
            if b is None:
                continue
            left = self.pending[b]
            left.discard(k)
            if not left:
                shard_block(self.blocks[b], self.mesh, offload=self.offload)
                self.sharded.append(b)


def _multi_input_params(model: nn.Module) -> set[nn.Parameter]:
    """Parameters whose tensor subclass all-gathers several inner tensors (fsdp_pre_all_gather)."""
    out = set()
    for p in model.parameters():
        if type(p.data) is not torch.Tensor and hasattr(p.data, "fsdp_pre_all_gather"):
            out.add(p)
    return out


def _head_group(model: nn.Module) -> list[nn.Module]:
    """The output head (and the input embedding when the two share a weight) of a transformers
    model: the chunked loss (train/loss.py) calls the head outside the model's forward, so it
    is an FSDP group of its own. Empty for other models."""
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    if not isinstance(head, nn.Module) or not list(head.parameters()):
        return []
    get_in = getattr(model, "get_input_embeddings", None)
    emb = get_in() if callable(get_in) else None
    if isinstance(emb, nn.Module) and emb is not head:
        ids = {id(p) for p in head.parameters()}
        if any(id(p) in ids for p in emb.parameters()):  # tied: one tensor, one group
            return [head, emb]
    return [head]


def _link_blocks(model: nn.Module, blocks: list[nn.Module]) -> None:
    """Prefetch the next block's gather in forward and the previous one's in backward (one ahead)."""
    fsdp: list[Any] = blocks  # FSDPModule after fully_shard (a dynamic subclass)
    for i, b in enumerate(fsdp):
        if i + 1 < len(fsdp):
            b.set_modules_to_forward_prefetch([fsdp[i + 1]])
        if i > 0:
            b.set_modules_to_backward_prefetch([fsdp[i - 1]])


def fsdp_groups(model: nn.Module) -> list[nn.Module]:
    """The modules fully_shard was applied to (blocks, adapter groups' first module, root).

    Example:
        >>> len(fsdp_groups(model))  # doctest: +SKIP
        3
    """
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def local_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: the local shard of a DTensor (FSDP), else `t` itself.

    Example:
        >>> local_of(model.lm_head.weight).shape  # doctest: +SKIP
        torch.Size([64, 128])
    """
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def whole(t: torch.Tensor) -> torch.Tensor:
    """`t` whole over dp: a DTensor is all-gathered (a collective: every dp rank calls it in the
    same order), a plain tensor is returned as it is.

    Example:
        >>> whole(q_proj.lora_A.weight).shape  # doctest: +SKIP
        torch.Size([4, 128])
    """
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def dp_chunk(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The rows of the whole tensor `t` that the DTensor `like` holds on this rank (FSDP2's
    dim-0 chunks); `t` itself when `like` is a plain tensor.

    Example:
        >>> dp_chunk(torch.arange(5), sharded_param_of_5_rows_on_dp_rank_1)  # doctest: +SKIP
        tensor([3, 4])
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor):
        return t
    dm = like.device_mesh
    n, r = dm.size(), dm.get_local_rank()
    chunks = torch.chunk(t, n, dim=0)
    if r < len(chunks):
        return chunks[r]
    return t.new_empty((0, *t.shape[1:]))


def fill_from_whole(p: torch.Tensor, value: torch.Tensor) -> None:
    """Copy this rank's part of `value` (whole over dp) into parameter `p` (FSDP shard or plain).

    Example:
        >>> fill_from_whole(q_proj.lora_A.weight, torch.zeros(4, 128))  # doctest: +SKIP
    """
    local_of(p).copy_(dp_chunk(value, p).to(dtype=p.dtype))


def like_param(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`value` (whole over dp) laid out like parameter `p`: a DTensor of this rank's rows when `p`
    is one (an optimizer state for an FSDP parameter), else `value` itself.

    Example:
        >>> like_param(torch.zeros(4, 128), q_proj.lora_A.weight).to_local().shape  # doctest: +SKIP
        torch.Size([2, 128])
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return value
    local = dp_chunk(value, p).to(device=p.device).contiguous()
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def is_sharded(model: nn.Module) -> bool:
    """True once apply_fsdp sharded `model` (then every dp rank takes part in gathers).

    Example:
        >>> is_sharded(model)  # doctest: +SKIP
        True
    """
    st = parallel_state(model, required=False)
    return st is not None and st.sharded is not None
