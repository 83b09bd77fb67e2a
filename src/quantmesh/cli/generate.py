"""`quantmesh generate MODEL --prompt ...`: text generation on tp ranks, streamed by rank 0.

Every rank runs the same `model.generate` in lock step: the LM head gathers the logits over tp, so
each rank holds the same distribution, and the same seed makes sampling pick the same token
everywhere. transformers' KV cache works unchanged: each rank's attention caches only its own KV
heads (`--no-kv-cache` recomputes instead, to check that both agree).

Example:
    $ quantmesh generate ~/.cache/quantmesh/SmolLM2-135M-Instruct --tp 2 --quant nf4 \\
        --adapter quantmesh-demo/adapter --prompt "Speak of the sea."
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..quant.names import QUANTS
from .errors import CliError, user_errors

__all__ = ["GenerateConfig", "add_parser", "check_adapter", "generate_text", "run"]


@dataclass(kw_only=True)
class GenerateConfig:
    """One `generate` run.

    Example:
        >>> GenerateConfig(model="m", prompts=["Hi"], temperature=0.7).greedy
        False
    """

    model: str
    """transformers model folder."""
    prompts: list[str] = field(default_factory=list)
    """Prompts, answered one after the other."""
    adapter: str | None = None
    """A PEFT LoRA adapter folder (qm.save_adapter or peft's save_pretrained)."""
    tp: int = 1
    """Tensor-parallel ranks (one process each)."""
    quant: str = "none"
    """none, nf4, fp4 or int8."""
    max_new_tokens: int = 128
    """Tokens to generate at most per prompt."""
    temperature: float = 0.0
    """0 = greedy decoding; > 0 samples with this temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold (with temperature > 0)."""
    repetition_penalty: float = 1.0
    """> 1 makes tokens already in the text less likely (1 = off); small models loop without it."""
    seed: int = 0
    """Sampling seed, the same on every rank."""
    chat_template: bool = True
    """Wrap the prompt in the tokenizer's chat template when it has one."""
    kv_cache: bool = True
    """Use transformers' KV cache (False recomputes the whole prefix per token)."""
    fast: bool | None = None
    """Decode with qm.fast_decode (static cache; on GPUs a compiled step replayed as a CUDA
    graph), greedy or sampled: the reply printed when it is complete. None (the default): on
    with CUDA GPUs unless --no-kv-cache asks for transformers' path."""

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise CliError(f"--tp {self.tp}; expected >= 1")
        if self.max_new_tokens < 1:
            raise CliError(f"--max-new-tokens {self.max_new_tokens}; expected >= 1")
        if self.repetition_penalty <= 0:
            raise CliError(f"--repetition-penalty {self.repetition_penalty}; expected > 0")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise CliError(
                f"--temperature {self.temperature} --top-p {self.top_p}; expected temperature "
                ">= 0 (0 = greedy) and 0 < top-p <= 1"
            )
        if self.fast and not self.kv_cache:
            raise CliError(
                "--fast decodes with a static KV cache; drop --no-kv-cache, or drop --fast"
            )
        if not self.prompts or not all(p.strip() for p in self.prompts):
            raise CliError("no prompt given; pass --prompt TEXT (repeat it for several)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def use_fast(self, cuda: bool) -> bool:
        """Whether to decode with qm.fast_decode on this device (`fast` None decides by it)."""
        if self.fast is not None:
            return self.fast
        return cuda and self.kv_cache


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `generate`."""
    p = sub.add_parser(
        "generate",
        help="generate text on tp ranks (optionally with a LoRA adapter), streamed by rank 0",
    )
    p.add_argument("model", help="transformers model folder")
    p.add_argument("--prompt", action="append", required=True, help="prompt (repeatable)")
    p.add_argument("--adapter", help="PEFT LoRA adapter folder")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument(
        "--pp", type=int, default=1, help="pipeline stages: only 1 (generation is not pipelined)"
    )
    p.add_argument("--quant", choices=QUANTS, default="none")
    p.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 curbs loops")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as it is")
    p.add_argument("--no-kv-cache", action="store_true", help="recompute instead of caching")
    p.add_argument(
        "--fast",
        action="store_true",
        default=None,
        help="decode with a static cache and (on GPUs) a CUDA-graphed step, the reply printed "
        "whole (default on GPUs, unless --no-kv-cache)",
    )
    p.add_argument(
        "--no-fast",
        dest="fast",
        action="store_false",
        help="decode with transformers' generate, streaming the reply (the default on CPU)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The `generate` command: check, then launch tp workers (or run in place under torchrun)."""
    from ..io.prequant import folder_quant
    from . import worker
    from .plan_cmd import check_tokenizer, load_skeleton
    from .runner import run_workers

    with user_errors():
        if args.pp != 1:
            raise CliError(
                f"--pp {args.pp}: generation does not run over pipeline stages (each token would "
                f"cross every stage in turn, leaving all but one GPU idle); use --tp "
                f"{args.tp * args.pp} to spread the model over {args.tp * args.pp} GPUs instead"
            )
        cfg = GenerateConfig(
            model=args.model,
            prompts=args.prompt,
            adapter=args.adapter,
            tp=args.tp,
            quant=args.quant,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            chat_template=not args.no_chat_template,
            kv_cache=not args.no_kv_cache,
            fast=args.fast,
        )
        _, model = load_skeleton(cfg.model)
        check_tokenizer(cfg.model)
        folder_quant(cfg.model, None if cfg.quant == "none" else cfg.quant)  # --quant vs folder
        if cfg.adapter:
            check_adapter(model, cfg.adapter)
        from ..plan.auto import auto_plan

        auto_plan(model, cfg.tp).resolve(model, cfg.tp)
        under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        if under_torchrun and int(os.environ["WORLD_SIZE"]) != cfg.tp:
            raise CliError(
                f"generate runs on tp ranks only: --tp {cfg.tp}, but WORLD_SIZE="
                f"{os.environ['WORLD_SIZE']}; launch {cfg.tp} processes or pass --tp "
                f"{os.environ['WORLD_SIZE']}"
            )
    payload = json.dumps(asdict(cfg))
    if under_torchrun:
        return worker.run_in_place("generate", payload)
    return run_workers(
        cfg.tp,
        ["quantmesh.cli.worker", "generate", payload],
        on_signal=lambda sig: print(f"quantmesh generate: stopped ({sig})", file=sys.stderr),
    )


def check_adapter(model, adapter: str | Path) -> None:
    """Raise when the PEFT adapter at `adapter` does not fit `model` (a meta skeleton is enough):
    unknown modules, or A/B shapes that differ from the modules' features.

    Example:
        >>> check_adapter(skeleton, "out/adapter")  # doctest: +SKIP
    """
    from ..io.adapter import adapter_lora_config
    from ..lora.adapter import LoraError
    from ..tp.kinds import expert_tensors, kind_of

    path = Path(adapter).expanduser()
    if not path.is_dir():
        raise CliError(
            f"adapter folder {str(path)!r} does not exist; pass the folder written by "
            "finetune (OUTPUT/adapter) or by peft's save_pretrained"
        )
    lora = adapter_lora_config(path)  # checks adapter_config.json (plain LoRA only)
    shapes = _adapter_shapes(path)
    modules = dict(model.named_modules())
    problems = []
    for fqn in lora.targets:
        if fqn.startswith("*"):  # an expert tensor (PEFT's target_parameters): full name or suffix
            owner, _, tensor = fqn[1:].rpartition(".")
            if not any(
                (n == owner or n.endswith(f".{owner}"))
                and tensor in [t.name for t in expert_tensors(m) or []]
                for n, m in modules.items()
            ):
                problems.append(f"{fqn[1:]}: no such expert tensor in {type(model).__name__}")
            continue
        mod = modules.get(fqn)
        kind = kind_of(mod) if mod is not None else None
        if kind is None or not kind.linear_like:
            problems.append(f"{fqn}: no such linear layer in {type(model).__name__}")
            continue
        assert mod is not None  # kind_of(None) is None
        in_f, out_f = kind.in_out(mod)
        for name, want in (("lora_A", (lora.r, in_f)), ("lora_B", (out_f, lora.r))):
            got = shapes.get(f"{fqn}.{name}")
            if got is not None and got != want:
                problems.append(f"{fqn}.{name}: {got} in the adapter, the model needs {want}")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        cfg = json.loads((path / "adapter_config.json").read_text())
        base = cfg.get("base_model_name_or_path")
        raise LoraError(
            f"adapter {str(path)!r} does not fit the model: "
            + "; ".join(problems[:5])
            + more
            + f". It was trained on {base!r}; pass that model, or an adapter trained on this one"
        )


def _adapter_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """{"<module fqn>.lora_A": shape, ...} from the safetensors header (no tensor is read)."""
    import re

    from safetensors import safe_open

    file = path / "adapter_model.safetensors"
    if not file.is_file():
        return {}  # a .bin adapter: its shapes are checked when it is loaded
    out = {}
    with safe_open(file, framework="pt") as f:
        for key in f.keys():
            m = re.match(r"^(?:base_model\.model\.)?(.+)\.(lora_[AB])(?:\.[^.]+)?\.weight$", key)
            if m:
                out[f"{m.group(1)}.{m.group(2)}"] = tuple(f.get_slice(key).get_shape())
    return out


def generate_text(model, tokenizer, prompt: str, cfg: GenerateConfig, *, stream: bool) -> str:
    """Generate a reply to `prompt`; rank 0 streams it to stdout when `stream`. Collective.

    Example:
        >>> generate_text(model, tok, "Hello", GenerateConfig(model="m", prompts=["Hello"]),
        ...               stream=True)  # doctest: +SKIP
        'Hello! How can I help you today?'
    """
    import torch
    from transformers import TextStreamer

    from ..parallel.state import parallel_state

    mesh = parallel_state(model).mesh
    device = mesh.device
    if cfg.chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        enc = tokenizer(text, add_special_tokens=False, return_tensors="pt")
    else:
        enc = tokenizer(prompt, return_tensors="pt")
    ids = enc["input_ids"].to(device)  # (1, T)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )
    if cfg.use_fast(device.type == "cuda"):
        from ..infer.decode import fast_decode

        eos = model.generation_config.eos_token_id
        eos = tokenizer.eos_token_id if eos is None else eos
        with autocast:  # compiled on GPUs only: on CPU the compile would cost more than it saves
            new = fast_decode(model, ids, cfg.max_new_tokens, eos_token_id=eos,
                              temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
                              repetition_penalty=cfg.repetition_penalty,
                              compile=device.type == "cuda")  # fmt: skip
        text = tokenizer.decode(new[0], skip_special_tokens=True)
        if stream and mesh.rank == 0:
            print(text, flush=True)
        return text
    torch.manual_seed(cfg.seed)  # the same on every rank: sampling draws agree
    streamer = None
    if stream and mesh.rank == 0:
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    kw: dict[str, bool | float | int | None] = {
        "do_sample": False,
        "temperature": None,
        "top_p": None,
        "top_k": None,
    }
    if not cfg.greedy:
        kw = {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": 0}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad(), autocast:
        out = model.generate(
            ids,
            attention_mask=enc["attention_mask"].to(device),
            max_new_tokens=cfg.max_new_tokens,
            use_cache=cfg.kv_cache,
            pad_token_id=pad,
            repetition_penalty=cfg.repetition_penalty,
            streamer=streamer,
            **kw,
        )
    if streamer is not None:
        sys.stdout.flush()
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
