"""Shared helpers of the benchmark scripts: shapes, the model skeleton, seeded random weights,
FLOPs, memory probes (GPU peaks, host RssAnon sampled from a separate process) and JSON output.

Not part of the quantmesh package: the scripts in this folder import it as a sibling module.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import zlib
from contextlib import contextmanager

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# the smoke shape: every code path of the 7B run, in seconds on 2 CPU cores
SMOKE = dict(layers=2, hidden=128, inter=256, heads=4, vocab=512, seq=64, warmup=1, steps=2)


def log(*a) -> None:
    rank = os.environ.get("RANK")
    tag = f"[{time.strftime('%H:%M:%S')}{'' if rank is None else f' r{rank}'}]"
    print(tag, *a, flush=True)


def shape_args(p: argparse.ArgumentParser) -> None:
    """The model-shape and step flags shared with peer_bench.py (same names, same defaults)."""
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=11008)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default --heads: MHA)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mb", type=int, default=1, help="micro-batch per data-parallel rank")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234, help="seed of the random weights")
    p.add_argument("--cpu", action="store_true", help="run on CPU ranks (gloo)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (implies --cpu)")
    p.add_argument("--out", default=".", help="folder for the result JSON")
    p.add_argument("--tag", default="", help="suffix of the result file name")
    p.add_argument(
        "--inductor",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set torch._inductor.config.KEY (a dotted name: triton.enable_pdl) to VALUE (a Python "
        "literal) for the whole run, e.g. combo_kernels=True; repeatable; recorded in the JSON",
    )


def finish_args(a: argparse.Namespace) -> argparse.Namespace:
    if a.smoke:
        a.cpu = True
        for k, v in SMOKE.items():
            setattr(a, k, v)
    inductor_config(getattr(a, "inductor", []))
    return a


def inductor_options(pairs: list[str]) -> list[tuple[object, str, str, object]]:
    """Each "KEY=VALUE" (`--inductor`, a bench_train.py variant "inductor:KEY=VALUE") checked
    against torch._inductor.config: (the object holding the option, its name there, KEY, the
    value). KEY is one of its options (a dotted name for a nested one), VALUE a Python literal of
    that option's type (an int for a float option is taken). An unknown key or a value that does
    not parse exits with the reason, before anything runs.

    Example:
        >>> [(k, v) for _, _, k, v in inductor_options(["combo_kernels=True"])]
        [('combo_kernels', True)]
    """
    import ast

    import torch._inductor.config as config

    out = []
    for pair in pairs:
        key, eq, text = pair.partition("=")
        if not eq:
            raise SystemExit(f"inductor option {pair!r}: expected KEY=VALUE (combo_kernels=True)")
        owner, _, leaf = key.rpartition(".")
        target: object = config
        for part in owner.split(".") if owner else ():
            target = getattr(target, part, None)
        if target is None or not hasattr(target, leaf):
            raise SystemExit(
                f"inductor option {pair!r}: torch._inductor.config has no option {key!r}"
            )
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise SystemExit(
                f"inductor option {pair!r}: {text!r} is not a Python literal (True, 8, 0.5, 'name')"
            ) from None
        old = getattr(target, leaf)
        if isinstance(old, float) and type(value) is int:
            value = float(value)
        if old is not None and value is not None and type(value) is not type(old):
            raise SystemExit(
                f"inductor option {pair!r}: {key} holds a {type(old).__name__} ({old!r}), not a "
                f"{type(value).__name__}"
            )
        out.append((target, leaf, key, value))
    return out


def inductor_config(pairs: list[str]) -> dict:
    """Set torch._inductor.config's KEY to VALUE for each "KEY=VALUE" (`--inductor`; checked by
    `inductor_options` first, all of them before any is set). Returns {KEY: value} as set.

    Example:
        >>> inductor_config(["combo_kernels=True"])
        {'combo_kernels': True}
    """
    options = inductor_options(pairs)
    for target, leaf, _, value in options:
        setattr(target, leaf, value)
    return {key: value for _, _, key, value in options}


def inductor_patched(pairs: list[str]):
    """`inductor_config(pairs)` while the context lasts, every option as it was after: torch's
    own `torch._inductor.config.patch`, given the options `inductor_options` checked.

    Example:
        >>> with inductor_patched(["combo_kernels=True"]):
        ...     pass
    """
    import torch._inductor.config as config

    return config.patch({key: value for _, _, key, value in inductor_options(pairs)})


@contextmanager
def switched(module, flag: str, value):
    """`module.flag` set to `value` while the context lasts, as it was after (a switch the library
    reads at each call).

    Example:
        >>> from quantmesh.infer import prefill_graph
        >>> with switched(prefill_graph, "ENABLED", False):
        ...     prefill_graph.ENABLED
        False
    """
    before = getattr(module, flag)
    setattr(module, flag, value)
    try:
        yield
    finally:
        setattr(module, flag, before)


def llama_config(a, *, use_cache: bool = False):
    """Llama-2-7B's shape by default (MHA, untied head), as peer_bench.py builds it."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=a.hidden,
        intermediate_size=a.inter,
        num_attention_heads=a.heads,
        num_key_value_heads=getattr(a, "kv_heads", None) or a.heads,
        num_hidden_layers=a.layers,
        vocab_size=a.vocab,
        max_position_embeddings=max(4096, a.seq),
        use_cache=use_cache,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def skeleton(cfg):
    """The transformers model on meta (quantmesh.empty_model): nothing allocated."""
    from transformers import LlamaForCausalLM

    import quantmesh as qm

    with qm.empty_model():
        model = LlamaForCausalLM(cfg)
    model.config.use_cache = cfg.use_cache
    return model


# ---- FLOPs ----------------------------------------------------------------------------------
def param_counts(a) -> dict[str, int]:
    h, i, L, V = a.hidden, a.inter, a.layers, a.vocab
    per_layer = 4 * h * h + 3 * h * i
    return {
        "matmul_params": L * per_layer + h * V,
        "total_params": L * per_layer + 2 * h * V + (2 * L + 1) * h,
    }


def flops_per_token(a) -> int:
    """4N + 12*L*h*s: frozen base (no weight gradients) forward 2N + backward 2N over the matmul
    parameters N (decoder linears and head), attention scores and values 12*L*h*s (not halved for
    causality). LoRA's own FLOPs (~0.6% here) are left out. Same formula as peer_bench.py."""
    return 4 * param_counts(a)["matmul_params"] + 12 * a.layers * a.hidden * a.seq


# ---- seeded random weights --------------------------------------------------------------------
def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(
        (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
    )


def full_value(
    name: str, shape, *, seed: int, gen_device, dtype=torch.bfloat16, std: float = 0.02
) -> torch.Tensor:
    """The full tensor of parameter `name`: a pure function of (seed, name, shape, gen device type).

    Norm weights are ones, other 1-D tensors (biases) zeros, everything else N(0, std) drawn in
    fp32 and rounded to `dtype`, so that any rank, at any tp size, slicing this tensor gets the
    same values (CUDA's Philox stream is the same on every GPU; CPU's differs from CUDA's).
    """
    gen_device = torch.device(gen_device)
    if len(shape) == 1:
        fill = 1.0 if "norm" in name else 0.0
        return torch.full(tuple(shape), fill, dtype=dtype, device=gen_device)
    t = torch.empty(tuple(shape), dtype=torch.float32, device=gen_device)
    t.normal_(0.0, std, generator=_generator(seed, name, gen_device))
    return t.to(dtype)


def _full_shape(m, name: str, sl) -> tuple[int, ...]:
    return tuple(m.full_shape(name))  # checkpoint layout (experts: their 3-D tensors)


@torch.no_grad()
def fill_random(model, *, seed: int, gen_device=None) -> dict[str, float]:
    """Give every base parameter its seeded random value, one tensor at a time.

    ShardedModules get this rank's slice of the full tensor through `load_param` (quantized on their
    device when they have a format); other parameters are filled in place. LoRA adapters keep their
    own initialization. The full tensor of one parameter is the most that is ever materialized, on
    `gen_device` (default: the parameter's device).
    """
    from quantmesh.plan.styles import slice_dim
    from quantmesh.tp.layers import ShardedModule

    t0 = time.perf_counter()
    nbytes = 0
    inside = set()
    for fqn, m in model.named_modules():
        if any(fqn.startswith(p + ".") for p in inside):
            continue
        if isinstance(m, ShardedModule):
            inside.add(fqn)
            dev = torch.device(gen_device) if gen_device is not None else m.device_hint
            for name, sl in m.param_slices().items():
                full = full_value(
                    f"{fqn}.{name}", _full_shape(m, name, sl), seed=seed, gen_device=dev
                )
                part = slice_dim(full, *sl) if sl is not None else full
                m.load_param(name, part.to(m.device_hint))
                nbytes += part.numel() * 2
                del full, part
            continue
        for name, p in m.named_parameters(recurse=False):
            key = f"{fqn}.{name}" if fqn else name
            dev = torch.device(gen_device) if gen_device is not None else p.device
            v = full_value(key, p.shape, seed=seed, gen_device=dev)
            p.copy_(v.to(device=p.device, dtype=p.dtype))
            nbytes += v.numel() * 2
    return {"fill_s": round(time.perf_counter() - t0, 2), "filled_bf16_GB": round(nbytes / 1e9, 3)}


# ---- devices and memory -------------------------------------------------------------------------
def is_kernel(ev) -> bool:
    """Whether a profiler event (or key_averages row) is a device kernel: on a GPU and not a user
    annotation. `record_function` ranges (`Optimizer.step#AdamW.step`, for one) appear on the
    device too, spanning their kernels and the gaps between them; counted as kernels, they count
    their kernels twice (torch's own tables leave them out of device totals)."""
    return ev.device_type != torch.autograd.DeviceType.CPU and not getattr(
        ev, "is_user_annotation", False
    )


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def reset_peaks(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def gpu_mem(device) -> dict[str, float] | None:
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return {
        "peak_alloc_GiB": round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
        "peak_reserved_GiB": round(torch.cuda.max_memory_reserved(device) / 2**30, 3),
        "alloc_now_GiB": round(torch.cuda.memory_allocated(device) / 2**30, 3),
    }


def rss_anon_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


_SAMPLER = r"""
import sys, time
pid, period = sys.argv[1], float(sys.argv[2])
peak = 0
def anon():
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0
import select
while True:
    try:
        peak = max(peak, anon())
    except OSError:
        break
    r, _, _ = select.select([sys.stdin], [], [], period)
    if r:
        sys.stdin.read(1)
        break
print(peak, flush=True)
"""


class RssAnonSampler:
    """Peak RssAnon of this process, sampled every `period` s by a separate process (no GIL).

    Example:
        >>> with RssAnonSampler() as s:  # doctest: +SKIP
        ...     work()
        >>> s.peak
    """

    def __init__(self, period: float = 0.002):
        self.period, self.peak, self.proc = period, None, None

    def __enter__(self) -> RssAnonSampler:
        self.start_bytes = rss_anon_bytes()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SAMPLER, str(os.getpid()), str(self.period)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.05)  # let it take its first sample
        return self

    def __exit__(self, *exc) -> None:
        try:
            out, _ = self.proc.communicate("x", timeout=10)
            self.peak = max(int(out.strip() or 0), rss_anon_bytes())
        except Exception:
            self.proc.kill()
            self.peak = None


# ---- environment and results --------------------------------------------------------------------
def versions() -> dict[str, str | None]:
    import importlib.metadata as md

    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("transformers", "peft", "bitsandbytes", "accelerate", "torchao", "safetensors"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    out["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpus"] = str(torch.cuda.device_count())
        try:
            out["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:
            out["nccl"] = None
    try:
        import quantmesh

        out["quantmesh"] = quantmesh.__version__
        out["quantmesh_commit"] = commit()
        out["quantmesh_tree"] = tree_hash()
    except Exception:
        pass
    return out


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREE_PARTS = ("src/quantmesh", "benchmarks")  # what a result's figures depend on


def commit() -> str:
    """The checkout's commit, with "-dirty" when the files of TREE_PARTS differ from it (a copy of
    a working tree whose .git lags behind it says so instead of naming a commit it is not)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT,
                              timeout=30).stdout.strip()  # fmt: skip

    head = git("rev-parse", "--short", "HEAD")
    if head and git("status", "--porcelain", "--untracked-files=no", "--", *TREE_PARTS):
        head += "-dirty"
    return head


def tree_hash(root: str = ROOT) -> str:
    """A hash of the Python and shell files under TREE_PARTS (paths and contents): the same tree
    gives the same hash wherever it runs, so a result names its code even where .git is missing
    or stale. Compare with a commit's: `git stash; python3 benchmarks/qmbench.py --tree-hash`.

    Example:
        >>> len(tree_hash())  # doctest: +SKIP
        16
    """
    import hashlib

    h = hashlib.sha256()
    for part in TREE_PARTS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, part)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if name.endswith((".py", ".sh")):
                    path = os.path.join(dirpath, name)
                    h.update(os.path.relpath(path, root).encode() + b"\0")
                    with open(path, "rb") as f:
                        h.update(f.read() + b"\0")
    return h.hexdigest()[:16]


def write_json(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


@contextmanager
def record_errors(R: dict, key: str = "error"):
    """Record an exception (message and traceback tail) in R instead of raising it."""
    try:
        yield
    except Exception as e:
        R[key] = f"{type(e).__name__}: {e}"[:2000]
        R[key + "_traceback"] = traceback.format_exc()[-4000:]
        log(f"{key}: {R[key]}")


def graph_us(fn, calls: int = 1, replays: int = 200) -> float:
    """Microseconds per call of `fn` (CUDA): `calls` calls captured in one CUDA graph, replayed
    `replays` times, after 3 warm-up calls on a side stream and one replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(replays):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / (replays * calls) * 1e3


def matmul_peak_tflops(device, n: int = 8192, seconds: float = 2.0) -> dict[str, float]:
    """bf16 n^3 matmul rate on `device`: burst (best of 10 timed batches) and sustained (mean over
    `seconds`). 2*n^3 FLOPs per matmul."""
    device = torch.device(device)
    dt = torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dt)
    b = torch.randn(n, n, device=device, dtype=dt)
    c = torch.empty(n, n, device=device, dtype=dt)
    flop = 2 * n**3
    for _ in range(5):
        torch.mm(a, b, out=c)
    sync(device)
    best = 0.0
    for _ in range(10):
        t0 = time.perf_counter()
        for _ in range(5):
            torch.mm(a, b, out=c)
        sync(device)
        best = max(best, 5 * flop / (time.perf_counter() - t0))
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            torch.mm(a, b, out=c)
        count += 10
        sync(device)
    sustained = count * flop / (time.perf_counter() - t0)
    return {"burst_tflops": round(best / 1e12, 1), "sustained_tflops": round(sustained / 1e12, 1)}


def env_report() -> dict:
    """What the results were measured on: versions, GPUs and their links, CPUs, memory, disk."""

    def sh(*cmd: str) -> str | None:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except Exception as e:
            return f"unavailable: {type(e).__name__}"

    R = {"bench": "env", "versions": versions(), "cpus": os.cpu_count()}
    R["gpus"] = sh("nvidia-smi", "-L")
    R["gpu_topology"] = sh("nvidia-smi", "topo", "-m")
    R["driver"] = sh("nvidia-smi", "--query-gpu=driver_version,clocks.max.sm", "--format=csv")
    R["disk_free_GB"] = round(shutil_free(".") / 1e9, 1)
    R["nccl_env"] = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM"))}
    return R


def shutil_free(path: str) -> int:
    import shutil

    return shutil.disk_usage(path).free


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="write env.json: what the benchmarks ran on")
    p.add_argument("--out", default=".")
    p.add_argument(
        "--tree-hash", action="store_true", help="print this checkout's commit and tree hash only"
    )
    a = p.parse_args()
    if a.tree_hash:
        print(commit(), tree_hash())
    else:
        write_json(os.path.join(a.out, "env.json"), env_report())
