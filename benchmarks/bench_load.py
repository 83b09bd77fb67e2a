"""Loading a 7B-shaped bf16 safetensors checkpoint into a tp=2 nf4 model: time and host memory.

Steps (one command runs them all; `load` is also a torchrun entry point of its own):
  prepare   write a sharded HF-style checkpoint (model-0000k-of-0000n.safetensors + index +
            config.json) of seeded random bf16 weights, streamed tensor by tensor: the host holds
            one tensor at a time (safetensors' own writer needs a whole file in memory). Reused
            when already complete.
  readrate  drop the page cache, read every file once with a 64 MiB buffer: the disk read rate.
  load      drop the page cache again; under torchrun each rank builds the model on meta,
            parallelizes it (tp, nf4, no LoRA) and times qm.load_checkpoint into it, sampling its
            anonymous RSS (RssAnon) from a separate process; it also checks a few loaded values
            against the seeded generator.

Usage:
    python benchmarks/bench_load.py --dir CKPT_DIR --out DIR [--nproc 2 --tp 2 --quant nf4]
    python benchmarks/bench_load.py --smoke --dir CKPT_DIR --out DIR        (CPU, tiny, gloo)
Writes DIR/result_load.json. Dropping the page cache needs root; without it the result says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time

import torch

from quantmesh.quant.names import QUANTS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qmbench as qb  # noqa: E402

INDEX = "model.safetensors.index.json"
READ_BUF = 64 << 20


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("step", nargs="?", default="all", choices=["all", "prepare", "readrate", "load"])
    qb.shape_args(p)
    p.add_argument("--dir", required=True, help="checkpoint folder (on a real disk, not tmpfs)")
    p.add_argument("--shard-gb", type=float, default=5.0, help="max size of one file")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the load step")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--quant", default="nf4", choices=QUANTS)
    p.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    a = qb.finish_args(p.parse_args(argv))
    if a.smoke:
        a.shard_gb = 0.0003  # several files even for the tiny model
    return a


# ---- prepare ------------------------------------------------------------------------------------
def tensor_list(a) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter, in the model's order, from a meta skeleton."""
    model = qb.skeleton(qb.llama_config(a))
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def plan_files(items, shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    files, cur, size = [], [], 0
    for name, shape in items:
        n = math.prod(shape) * 2
        if cur and size + n > shard_bytes:
            files.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += n
    if cur:
        files.append(cur)
    return files


def write_safetensors(path: str, items, *, seed: int, gen_device) -> int:
    """Stream one safetensors file: the header first (all shapes are known), then each tensor's
    bytes as soon as it is generated. Returns the bytes of tensor data written."""
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape in items:
        n = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path + ".part", "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for name, shape in items:
            t = qb.full_value(name, shape, seed=seed, gen_device=gen_device).cpu().contiguous()
            f.write(t.view(torch.uint8).numpy().data)
            del t
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".part", path)
    return off


def complete(a, files) -> bool:
    idx = os.path.join(a.dir, INDEX)
    if not os.path.exists(idx):
        return False
    with open(idx) as f:
        meta = json.load(f).get("metadata", {})
    want = {"seed": a.seed, "shape": shape_key(a), "files": len(files)}
    return all(str(meta.get(k)) == str(v) for k, v in want.items())


def shape_key(a) -> str:
    return f"L{a.layers}_h{a.hidden}_i{a.inter}_H{a.heads}_V{a.vocab}"


def prepare(a, R: dict) -> None:
    items = tensor_list(a)
    files = plan_files(items, int(a.shard_gb * 1e9))
    total = sum(math.prod(s) * 2 for _, s in items)
    R.update(checkpoint_bytes=total, files=len(files), tensors=len(items))
    R["largest_tensor_bytes"] = max(math.prod(s) * 2 for _, s in items)
    gen = "cuda:0" if torch.cuda.is_available() and not a.cpu else "cpu"
    R["gen_device"] = gen
    if complete(a, files):
        R["reused"] = True
        return
    os.makedirs(a.dir, exist_ok=True)
    free = shutil.disk_usage(a.dir).free
    if free < total + (1 << 30):
        raise RuntimeError(
            f"{a.dir} has {free / 1e9:.1f} GB free; the checkpoint needs {total / 1e9:.1f}"
        )
    t0 = time.perf_counter()
    n = len(files)
    weight_map = {}
    for k, group in enumerate(files, 1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors"
        write_safetensors(os.path.join(a.dir, fname), group, seed=a.seed, gen_device=gen)
        weight_map.update({name: fname for name, _ in group})
    qb.llama_config(a).to_json_file(os.path.join(a.dir, "config.json"))
    meta = {"total_size": total, "seed": a.seed, "shape": shape_key(a), "files": n, "gen": gen}
    with open(os.path.join(a.dir, INDEX), "w") as f:
        json.dump({"metadata": meta, "weight_map": weight_map}, f, indent=1)
    dt = time.perf_counter() - t0
    R.update(reused=False, write_s=round(dt, 2), write_GBps=round(total / dt / 1e9, 3))
    qb.log(f"wrote {total / 1e9:.2f} GB in {n} files in {dt:.1f} s")


# ---- page cache and read rate --------------------------------------------------------------------
def drop_caches(smoke: bool = False) -> bool | str:
    """sync, then drop clean page cache (root only). True, or the reason it did not happen."""
    if smoke:
        return "skipped (smoke run)"
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError as e:
        return f"{type(e).__name__}: {e}"


def fs_type(path: str) -> str:
    path = os.path.realpath(path)
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt, fst = parts[1], parts[2]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, fst
    return kind


def ckpt_files(d: str) -> list[str]:
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors"))


def readrate(a, R: dict) -> None:
    R["fs_type"] = fs_type(a.dir)
    R["drop_caches"] = drop_caches(a.smoke)
    buf = bytearray(READ_BUF)
    mv = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for path in ckpt_files(a.dir):
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(mv)
                if not n:
                    break
                total += n
    dt = time.perf_counter() - t0
    R.update(read_bytes=total, read_s=round(dt, 3), read_GBps=round(total / dt / 1e9, 3))
    qb.log(f"read {total / 1e9:.2f} GB in {dt:.2f} s: {total / dt / 1e9:.2f} GB/s ({R['fs_type']})")


# ---- load (torchrun entry point) -----------------------------------------------------------------
def largest_slice_bytes(model) -> int:
    """Bytes (as stored, bf16) of the largest slice this rank requests from the checkpoint."""
    from quantmesh.tp.layers import ShardedModule

    best = 0
    inside: set[str] = set()
    for fqn, m in model.named_modules():
        if any(fqn.startswith(p + ".") for p in inside):
            continue
        if isinstance(m, ShardedModule):
            inside.add(fqn)
            for name in m.param_slices():
                best = max(best, math.prod(m.local_shape(name)) * 2)
        else:
            for p in m.parameters(recurse=False):
                best = max(best, p.numel() * 2)
    return best


@torch.no_grad()
def fallback_load(model, source: str) -> None:
    """What qm.load_checkpoint does, for a tree where it has not landed yet: every ShardedModule
    reads its slices (quantized on its device by load_param), other parameters their whole
    tensor."""
    from quantmesh.io.reader import open_checkpoint
    from quantmesh.tp.layers import ShardedModule

    inside: set[str] = set()
    with open_checkpoint(source) as ck:
        for fqn, m in model.named_modules():
            if any(fqn.startswith(p + ".") for p in inside):
                continue
            pre = f"{fqn}." if fqn else ""
            if isinstance(m, ShardedModule):
                inside.add(fqn)
                for name, sl in m.param_slices().items():
                    dim, ranges = sl if sl is not None else (None, None)
                    t = ck.read(pre + name, dim, ranges, dtype=m.float_dtype, device=m.device_hint)
                    m.load_param(name, t)
                continue
            for name, p in m.named_parameters(recurse=False):
                p.copy_(ck.read(pre + name, dtype=p.dtype, device=p.device))


@torch.no_grad()
def spot_check(model, a, gen: str) -> dict:
    """A few loaded values against the seeded generator (same device type as the writer's)."""
    from quantmesh.plan.styles import slice_dim

    out = {}
    head = model.lm_head
    name = "lm_head.weight"
    full = qb.full_value(name, (a.vocab, a.hidden), seed=a.seed, gen_device=gen)
    if hasattr(head, "param_slices"):
        sl = head.param_slices()["weight"]
        full = slice_dim(full, *sl) if sl is not None else full
    out["lm_head_exact"] = bool(torch.equal(head.weight.detach().cpu(), full.cpu()))
    q = model.model.layers[0].self_attn.q_proj
    fq = "model.layers.0.self_attn.q_proj"
    full = qb.full_value(f"{fq}.weight", (a.hidden, a.hidden), seed=a.seed, gen_device=gen)
    sl = q.param_slices()["weight"]
    want = (slice_dim(full, *sl) if sl is not None else full).float().cpu()
    got = (q.fmt.dequantize(q.local) if q.fmt is not None else q.weight).float().cpu()
    out["q_proj_rel_err"] = round(float((got - want).norm() / want.norm()), 4)
    out["norm_ones"] = bool(torch.all(model.model.norm.weight.detach().float() == 1).item())
    out["ok"] = out["lm_head_exact"] and out["norm_ones"] and out["q_proj_rel_err"] < 0.2
    return out


def load_rank(a) -> None:
    import torch.distributed as dist

    import quantmesh as qm

    t_proc = time.perf_counter()
    mesh = qm.init_mesh(tp=a.tp, backend="gloo" if a.cpu else None)
    dev = mesh.device
    R: dict = {"rank": mesh.rank}
    try:
        with open(os.path.join(a.dir, INDEX)) as f:
            gen = json.load(f)["metadata"]["gen"]
        t0 = time.perf_counter()
        model = qb.skeleton(qb.llama_config(a))
        quant = None if a.quant == "none" else a.quant
        qm.parallelize(model, mesh, quant=quant, dtype=torch.bfloat16)
        qb.sync(dev)
        R["parallelize_s"] = round(time.perf_counter() - t0, 2)
        R["largest_slice_bytes"] = largest_slice_bytes(model)
        loader = "qm.load_checkpoint"
        try:
            load = qm.load_checkpoint
        except AttributeError:
            try:  # written, not yet exported
                from quantmesh.io.load import load_checkpoint as load

                loader = "quantmesh.io.load.load_checkpoint"
            except ImportError:
                loader = "fallback (quantmesh.io.reader reader + ShardedModule.load_param)"

                def load(m, src, **_):
                    fallback_load(m, src)

        R["loader"] = loader
        if mesh.rank == 0:
            R["drop_caches"] = drop_caches(a.smoke)
        dist.barrier()
        R["rss_anon_before"] = qb.rss_anon_bytes()
        with qb.RssAnonSampler() as s:
            t0 = time.perf_counter()
            res = load(model, a.dir, progress=False)
            qb.sync(dev)
            R["load_s"] = round(time.perf_counter() - t0, 3)
        R["bytes_read"] = getattr(res, "bytes_read", None)
        R["rss_anon_peak"] = s.peak
        R["rss_anon_after"] = qb.rss_anon_bytes()
        R["gpu_mem"] = qb.gpu_mem(dev)
        # CUDA's Philox stream is the same on every GPU: regenerate on this rank's own device
        R["spot_check"] = spot_check(model, a, dev if torch.device(gen).type == dev.type else gen)
        R["process_to_loaded_s"] = round(time.perf_counter() - t_proc, 2)
        R["ok"] = True
    except Exception as e:
        import traceback

        R.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        R["traceback"] = traceback.format_exc()[-4000:]
        qb.log("FAILED", R["error"])
    parts = [None] * mesh.world_size
    dist.all_gather_object(parts, R)
    if mesh.rank == 0:
        qb.write_json(os.path.join(a.out, "load_ranks.json"), {"ranks": parts})
    dist.destroy_process_group()


def run_load(a, R: dict) -> None:
    """Launch the load step on --nproc ranks and fold their report into R."""
    here = os.path.abspath(__file__)
    flags = ["--dir", a.dir, "--out", a.out, "--tp", str(a.tp), "--quant", a.quant]
    flags += ["--seed", str(a.seed), "--layers", str(a.layers), "--hidden", str(a.hidden)]
    flags += ["--inter", str(a.inter), "--heads", str(a.heads), "--vocab", str(a.vocab)]
    flags += ["--smoke"] if a.smoke else ["--cpu"] if a.cpu else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={a.nproc}", here, "load", *flags]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd)
    R["torchrun_s"] = round(time.perf_counter() - t0, 2)
    R["torchrun_rc"] = proc.returncode
    path = os.path.join(a.out, "load_ranks.json")
    if not os.path.exists(path):
        raise RuntimeError(f"the load ranks wrote no report (torchrun exit {proc.returncode})")
    with open(path) as f:
        ranks = json.load(f)["ranks"]
    os.remove(path)
    R["ranks"] = ranks
    ok = [r for r in ranks if r and r.get("ok")]
    if len(ok) != len(ranks):
        raise RuntimeError("a load rank failed: " + "; ".join(str(r.get("error")) for r in ranks))
    load_s = max(r["load_s"] for r in ok)
    R["load_s"] = load_s
    R["load_GBps"] = round(R["checkpoint_bytes"] / load_s / 1e9, 3)
    if R.get("read_GBps"):
        R["load_vs_read"] = round(R["load_GBps"] / R["read_GBps"], 3)
    peak = max(r["rss_anon_peak"] or 0 for r in ok)
    R["rss_anon_peak_GiB"] = round(peak / 2**30, 3)
    R["rss_anon_growth_GiB"] = round(
        max((r["rss_anon_peak"] or 0) - r["rss_anon_before"] for r in ok) / 2**30, 3
    )
    R["largest_slice_GiB"] = round(max(r["largest_slice_bytes"] for r in ok) / 2**30, 3)
    R["rss_bound_GiB"] = round(R["largest_slice_GiB"] + 1, 3)
    R["rss_within_bound"] = R["rss_anon_peak_GiB"] <= R["rss_bound_GiB"]
    R["spot_check_ok"] = all(r["spot_check"]["ok"] for r in ok)
    R["loader"] = ok[0]["loader"]


def main(argv=None) -> int:
    a = parse(argv)
    if a.step == "load":
        load_rank(a)
        return 0
    R: dict = {
        "bench": "load",
        "args": {k: v for k, v in vars(a).items() if k not in ("out", "dir")},
        "versions": qb.versions(),
        "ok": False,
    }
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    with qb.record_errors(R):
        if a.step in ("all", "prepare"):
            prepare(a, R)
        if a.step in ("all", "readrate"):
            readrate(a, R)
        if a.step == "all":
            run_load(a, R)
            qb.log(
                f"load {R['load_s']} s = {R['load_GBps']} GB/s (read {R.get('read_GBps')} GB/s), "
                f"RssAnon peak {R['rss_anon_peak_GiB']} GiB (bound {R['rss_bound_GiB']}), "
                f"spot check {R['spot_check_ok']}"
            )
        R["ok"] = True
    if a.step == "all" and not a.keep and os.path.isdir(a.dir):
        shutil.rmtree(a.dir, ignore_errors=True)
    R["wall_s"] = round(time.time() - t0, 1)
    qb.write_json(os.path.join(a.out, "result_load.json"), R)
    return 0 if R["ok"] else 1


if __name__ == "__main__":
    from quantmesh.cli.runner import exit_fast  # no module teardown: seconds at exit

    exit_fast(main)
