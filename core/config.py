"""Strict dataclass <-> dict/YAML conversion and `section.key=value` overrides.

Every stage has a small `@dataclass(kw_only=True)` config next to its code. This module
turns plain dicts (from YAML) into those dataclasses with type checks: unknown keys, wrong
types and values outside a `Literal[...]` are `ConfigError`s that name the key and what
is allowed. Nothing here knows the concrete configs.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A config value, key or file is wrong; the message says which and what is allowed."""


def field_docs(cls: type) -> dict[str, str]:
    """One-line docs of a dataclass's fields: the string literal under each field."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for prev, node in zip(body, body[1:], strict=False):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = node.value.value.strip().splitlines()[0]
    return docs


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return f"list[{_type_name(arg)}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _finite(value: float, where: str) -> float:
    """Every float field of every config is finite: YAML's .nan / .inf (or 1e999) would pass a
    `> 0` check (inf) or none (nan: every comparison is false) and reach torch or the planner."""
    if not math.isfinite(value):
        raise ConfigError(f"{where}: {value} is not a finite number; give a number such as 0.1")
    return value


def finite_float(text: str) -> float:
    """argparse `type=` of a float option: nan / inf are refused as the config's are."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against type `tp` (coercing int->float), or raise ConfigError naming `where`."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(
                f"{where}: {value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}"
            )
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{where}: null is not allowed; expected {_type_name(tp)}")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:  # `float | None` and the like: the one type's own reason
            raise ConfigError(errors[0])
        raise ConfigError(f"{where}: {value!r} is not a valid {_type_name(tp)}")
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [coerce(v, arg, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return _finite(float(value), where)
        # YAML 1.1 reads an exponent without a dot (1e-4, 3e-05: what Python's :g writes) as
        # a string
        if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
            return _finite(float(value), where)
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise ConfigError(f"{where}: unsupported config type {tp!r}")  # pragma: no cover


def from_dict(cls: type, data: Any, where: str = "") -> Any:
    """Build dataclass `cls` from a mapping; unknown keys and bad values are ConfigErrors."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where or cls.__name__}: unknown key(s) {', '.join(unknown)}; "
            f"allowed keys are {', '.join(sorted(fields))}"
        )
    kwargs = {
        name: coerce(value, hints[name], f"{where}.{name}" if where else name)
        for name, value in data.items()
    }
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if where and not str(e).startswith(where):
            raise ConfigError(f"{where}.{e}") from None
        raise
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{where or cls.__name__}: {e}") from None


MASK = "***"
"""What a credential reads as wherever a config is printed or stored."""


def secret_field(default: Any = None) -> Any:
    """A credential field: masked by `to_dict` (so in every printed or stored config) and left
    out of the dataclass repr (so out of tracebacks and log lines)."""
    return dataclasses.field(default=default, repr=False, metadata={"secret": True})


def is_secret(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("secret"))


def to_dict(obj: Any, *, mask: bool = True) -> Any:
    """A dataclass as plain JSON/YAML-able data (nested); a set `secret_field` reads MASK
    unless mask=False (what is printed, stored or sent to another process never holds one)."""
    if dataclasses.is_dataclass(obj):
        return {
            f.name: MASK
            if mask and is_secret(f) and getattr(obj, f.name) is not None
            else to_dict(getattr(obj, f.name), mask=mask)
            for f in dataclasses.fields(obj)
        }
    if isinstance(obj, list | tuple):
        return [to_dict(v, mask=mask) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v, mask=mask) for k, v in obj.items()}
    return obj


def load_yaml(path: str | Path) -> dict:
    """Read a YAML mapping, with errors that name the file. A key written twice in one mapping
    (two `train:` sections, say) is refused: YAML would keep the last and drop the first."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(
            f"config file {p} is a directory; pass a YAML file (e.g. configs/demo.yaml)"
        )
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist; pass an existing file (see configs/)")
    try:
        data = _strict_load(p.read_text(), p)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {p} is not UTF-8 text ({e}); pass a YAML file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {p} must hold a mapping of sections, got {type(data).__name__}"
        )
    return data


_MERGE = "tag:yaml.org,2002:merge"  # `<<: *base`: its keys may be overridden, on purpose


def _strict_load(text: str, path: Path) -> Any:
    """yaml.safe_load, refusing a key written twice in one mapping (at any depth)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicates(node, path, [], set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_duplicates(node: yaml.Node, path: Path, where: list[str], seen: set[int]) -> None:
    if id(node) in seen:  # an alias met again (or a recursive one)
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicates(item, path, [*where, f"[{i}]"], seen)
        return
    if not isinstance(node, yaml.MappingNode):
        return
    lines: dict[tuple[str, str], int] = {}
    for key, value in node.value:
        if key.tag == _MERGE:
            continue
        name = key.value if isinstance(key, yaml.ScalarNode) else None
        line = key.start_mark.line + 1
        if name is not None and (key.tag, name) in lines:
            dotted = ".".join([*where, name]).replace(".[", "[")
            raise ConfigError(
                f"config file {path}: key {dotted} is written twice (lines "
                f"{lines[key.tag, name]} and {line}); YAML would keep only the second and drop "
                "the first's settings: merge them into one"
            )
        if name is not None:
            lines[key.tag, name] = line
        _refuse_duplicates(value, path, [*where, str(name)], seen)


NULLS = ("null", "Null", "NULL", "~")
"""How an override spells null on purpose (any other text that YAML reads as null is refused)."""


def _hashes(value: Any) -> int:
    """'#' characters in the strings of a parsed YAML value (a comment's are gone)."""
    if isinstance(value, str):
        return value.count("#")
    if isinstance(value, dict):
        return sum(_hashes(k) + _hashes(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_hashes(v) for v in value)
    return 0


def apply_override(data: dict, spec: str) -> None:
    """Apply one `section.key=value` override to nested dict `data` (value parsed as YAML)."""
    if "=" not in spec:
        raise ConfigError(
            f"override {spec!r} must look like section.key=value (e.g. train.lr=0.01)"
        )
    key, raw = spec.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"override {spec!r}: key must be section.key (e.g. train.lr=0.01)")
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError:
        value = raw
    if raw.strip() not in ("", *NULLS) and (value is None or _hashes(value) < raw.count("#")):
        what = "null" if value is None else repr(value)
        raise ConfigError(
            f"override '{spec}' reads as {key}={what}: in YAML a '#' at the start or after a "
            f"space begins a comment; quote the value, e.g. --set '{key}=\"{raw}\"' (in double "
            "quotes \\n is a newline), or write null for null"
        )
    node = data
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {spec!r}: {p} is not a section")
        node = child
    node[parts[-1]] = value
