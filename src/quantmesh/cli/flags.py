"""Command-line flags, TOML keys and worker payloads built from dataclasses: one option per field.

A command's config class (`finetune.FinetuneConfig`) has plain fields and sections: a field whose
type is a dataclass (the library's `TrainConfig`, `LoraConfig`, ... from quantmesh.config, or one
of the command's own). The options are the plain fields of the class and, recursively, of its
sections, each named `prefix + field name` (the section field's `metadata["prefix"]`, "" when
absent); a section field's `metadata["skip"]` names fields of that section the command does not
offer (their value comes from elsewhere). An option's name is its TOML key and its key in the JSON
handed to the workers; its flag is `--name-in-kebab-case`:

  int, float, str    `type=` that type;    X | None: the same (None = not given)
  bool               `--x` / `--no-x`      list[X]: nargs="+"
  choices            the field's `metadata["choices"]`: the one tuple the class checks against
  help               the string under the field in its class (its docstring), and its default

Every flag defaults to None (not given), so a flag overrides the TOML file only when it is given.

Example:
    >>> from quantmesh.config import TrainConfig
    >>> [o.flag for o in options(TrainConfig)][:3]
    ['--micro-batch', '--grad-accum', '--lr']
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import textwrap
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import CliError

__all__ = ["Option", "add_flags", "build", "check_keys", "field_docs", "flatten", "options"]

T = TypeVar("T")


@dataclass(frozen=True)
class Option:
    """One option: a plain field of a config class or of one of its sections."""

    name: str
    """The flat name: the TOML key, the JSON key, the flag's dest."""
    path: tuple[str, ...]
    """Attribute path from the config object: ("train", "lr"), or ("model",)."""
    kind: type
    """int, float, str or bool (the element type of a list)."""
    many: bool
    """A list of `kind`."""
    optional: bool
    """None is a value (X | None)."""
    choices: tuple[Any, ...] | None
    help: str
    """The docstring under the field, on one line."""
    default: Any
    """The field's default (dataclasses.MISSING when a factory makes it or there is none)."""
    section: str
    """The section's path ("" for the class's own fields), for the flags' groups."""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


_DOCS: dict[type, dict[str, str]] = {}
_OPTIONS: dict[type, tuple[Option, ...]] = {}


def field_docs(cls: type) -> dict[str, str]:
    """{field name: the string statement right under it} of dataclass `cls`, whitespace folded
    (the attribute docstrings this project writes); inherited fields included.

    Example:
        >>> field_docs(Option)["kind"]
        'int, float, str or bool (the element type of a list).'
    """
    if cls in _DOCS:
        return _DOCS[cls]
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):  # a base's docs first, a subclass's replace them
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
        for stmt, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    _DOCS[cls] = docs
    return docs


def _unpack(hint: Any) -> tuple[Any, bool, bool]:
    """(base type, many, optional) of an annotation: X, X | None, list[X], list[X] | None."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1 or len(typing.get_args(hint)) != 2:
            raise TypeError(f"{hint}: only X | None unions become options")
        hint, optional = args[0], True
    many = typing.get_origin(hint) is list
    if many:
        (hint,) = typing.get_args(hint)
    return hint, many, optional


def _is_section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def options(cls: type) -> tuple[Option, ...]:
    """Every option of config class `cls` (its plain fields, then its sections'), in field order.
    Raises TypeError for two options of one name or a field of a type no flag takes.

    Example:
        >>> from quantmesh.config import LoraConfig
        >>> [o.name for o in options(LoraConfig)]
        ['r', 'alpha', 'dropout', 'targets', 'seed']
    """
    if cls in _OPTIONS:
        return _OPTIONS[cls]
    out: list[Option] = []
    _collect(cls, (), "", "", (), out)
    seen: dict[str, Option] = {}
    for o in out:
        if o.name in seen:
            raise TypeError(
                f"{cls.__name__}: two options named {o.name!r} ({o.path}, {seen[o.name].path})"
            )
        seen[o.name] = o
    _OPTIONS[cls] = tuple(out)
    return _OPTIONS[cls]


def _collect(
    cls: type, path: tuple[str, ...], prefix: str, section: str, skip: Iterable[str], out: list
) -> None:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    subsections = []
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        hint = hints[f.name]
        if _is_section(hint):
            subsections.append((f, hint))
            continue
        kind, many, optional = _unpack(hint)
        if kind not in (int, float, str, bool) or (many and kind is bool):
            raise TypeError(f"{cls.__name__}.{f.name}: {hint} has no flag")
        choices = f.metadata.get("choices")
        out.append(
            Option(
                name=prefix + f.name,
                path=(*path, f.name),
                kind=kind,
                many=many,
                optional=optional,
                choices=tuple(choices) if choices is not None else None,
                help=docs.get(f.name, ""),
                default=f.default,
                section=section,
            )
        )
    for f, hint in subsections:
        _collect(
            hint,
            (*path, f.name),
            prefix + f.metadata.get("prefix", ""),
            ".".join((*path, f.name)),
            f.metadata.get("skip", ()),
            out,
        )


def _help(o: Option) -> str:
    text = o.help
    if o.default not in (dataclasses.MISSING, None, ""):
        text += f" (default: {o.default})"
    return text.replace("%", "%%")  # argparse formats help with %


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    aliases: Mapping[str, tuple[str, ...]] | None = None,
) -> None:
    """Add one flag per option of `cls` to `parser` (the class's own fields on the parser, each
    section's in an argument group titled by the section, described by its docstring); `aliases`:
    {option name: more flags for it}.

    Example:
        >>> p = argparse.ArgumentParser()
        >>> from quantmesh.config import TrainConfig
        >>> add_flags(p, TrainConfig, aliases={"grad_accum": ("--microbatches",)})
        >>> p.parse_args(["--microbatches", "4", "--no-progress"]).grad_accum
        4
    """
    aliases = aliases or {}
    docs = _section_docs(cls)
    groups: dict[str, Any] = {}
    for o in options(cls):
        if o.section and o.section not in groups:
            groups[o.section] = parser.add_argument_group(o.section, docs.get(o.section))
        target = groups[o.section] if o.section else parser
        kw: dict[str, Any] = {"dest": o.name, "default": None, "help": _help(o)}
        if o.kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = o.kind
            if o.many:
                kw["nargs"] = "+"
            if o.choices is not None:
                kw["choices"] = o.choices
        target.add_argument(o.flag, *aliases.get(o.name, ()), **kw)


def _section_docs(cls: type, path: str = "") -> dict[str, str]:
    """{section path: the docstring under the section's field}."""
    out: dict[str, str] = {}
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if _is_section(hints[f.name]):
            where = f"{path}.{f.name}" if path else f.name
            out[where] = docs.get(f.name, "").replace("%", "%%")
            out.update(_section_docs(hints[f.name], where))
    return out


def check_keys(cls: type, keys: Iterable[str], *, where: str = "") -> None:
    """Raise CliError naming the first key that is no option of `cls`, a close match, and the
    valid keys. `where` prefixes the message (a file name).

    Example:
        >>> from quantmesh.config import TrainConfig
        >>> check_keys(TrainConfig, ["lr", "warmup"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        quantmesh.cli.errors.CliError: unknown key 'warmup'; did you mean 'warmup_steps'? (valid keys: ...
    """
    names = [o.name for o in options(cls)]
    for key in keys:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise CliError(f"{where}unknown key {key!r}{hint} (valid keys: {', '.join(names)})")


_WHAT = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _checked(o: Option, value: Any, where: str = "") -> Any:
    """`value` as option `o` takes it (an int for a float, one string for a list of strings), or
    CliError naming the option, the value and what it takes (after `where`: a file name)."""
    if value is None and o.optional:
        return None

    def one(v: Any) -> Any:
        if o.kind is bool:
            ok = isinstance(v, bool)
        elif o.kind is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            v = float(v) if ok else v
        elif o.kind is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        else:
            ok = isinstance(v, o.kind)
        if not ok:
            raise TypeError
        return v

    try:
        if o.many:
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, (list, tuple)):
                raise TypeError
            return [one(v) for v in items]
        return one(value)
    except TypeError:
        what = _WHAT[o.kind]
        what = f"a list of {what.replace('an ', '').replace('a ', '')}s" if o.many else what
        unset = " (or leave it unset)" if o.optional else ""
        raise CliError(f"{where}{o.name}={value!r}; expected {what}{unset}") from None


def check_types(obj: Any) -> None:
    """Raise CliError for the first option of config object `obj` whose value is not of its
    field's type (a config built in code, not through `build`)."""
    for o in options(type(obj)):
        _checked(o, _get(obj, o.path))


def build(cls: type[T], settings: Mapping[str, Any], *, where: str = "") -> T:
    """A `cls` from flat settings {option name: value} (TOML keys, flags, a worker's JSON): names
    and types checked (CliError), every section built by its own class (which checks its rules),
    fields not given left at their defaults.

    Example:
        >>> from quantmesh.config import TrainConfig
        >>> build(TrainConfig, {"lr": 1, "steps": 3}).lr
        1.0
    """
    check_keys(cls, settings, where=where)
    values = {
        o.name: _checked(o, settings[o.name], where) for o in options(cls) if o.name in settings
    }
    by_path = {o.path: o.name for o in options(cls)}
    return _construct(cls, (), values, by_path)


def _construct(cls: type, path: tuple[str, ...], values: dict, by_path: dict) -> Any:
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        here = (*path, f.name)
        if _is_section(hints[f.name]):
            kw[f.name] = _construct(hints[f.name], here, values, by_path)
        elif here in by_path and by_path[here] in values:
            kw[f.name] = values[by_path[here]]
    return cls(**kw)


def _get(obj: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        obj = getattr(obj, name)
    return obj


def flatten(obj: Any) -> dict[str, Any]:
    """{option name: value} of config object `obj`: what `build(type(obj), ...)` takes back.

    Example:
        >>> from quantmesh.config import TrainConfig
        >>> flatten(TrainConfig(lr=1e-3))["lr"]
        0.001
    """
    return {o.name: _get(obj, o.path) for o in options(type(obj))}
