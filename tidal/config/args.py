"""Flat kebab-case flags and YAML config files -> a ``TidalConfig`` and where each value came from.

The argparse layer is deliberately thin: it only turns strings into typed values. Precedence, lowest
first: the schema default, ``--preset NAME`` (``tidal/presets/NAME.yaml``), ``--config FILE.yaml``,
flags. Unknown flags and keys are errors with a "did you mean" suggestion; a removed flag prints
its entry of the removed-flags registry. All checks across fields happen later, in ``resolve``.

A config file holds flags as keys, either flat (``rollout_batch_size: 32``, dashes allowed) or
grouped by section (``rollout: {rollout_batch_size: 32}``), plus an optional ``preset: NAME``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from tidal.config.environment import format_bytes, parse_size
from tidal.config.provenance import Provenance
from tidal.config.removed import find_removed
from tidal.config.schema import SECTIONS, TidalConfig, field_index
from tidal.errors import ConfigError

PRESET_DIR = Path(__file__).resolve().parent.parent / "presets"
# Flags of the parser that are not config fields.
META_FLAGS = ("--config", "--preset")


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_path(name: str) -> Path:
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        names = preset_names()
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"--preset {name}: no such preset; {hint}available: {', '.join(names)}")
    return path


def flag_of(name: str) -> str:
    """The command-line flag of a field (``rollout_batch_size`` -> ``--rollout-batch-size``)."""
    _, f = field_index()[name]
    return f.metadata.get("flag") or "--" + name.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    name: str
    section: str
    flag: str
    kind: str  # bool | int | float | str | dict | list
    optional: bool  # None is a legal value (resolved later or meaning "unset")
    default: Any
    help: str
    choices: tuple | None
    minimum: float | None
    unit: str | None


def _kind(hint: Any) -> tuple[str, bool]:
    args = typing.get_args(hint)
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        optional = type(None) in args
        hint = next(a for a in args if a is not type(None))
    origin = typing.get_origin(hint) or hint
    return {bool: "bool", int: "int", float: "float", str: "str", dict: "dict", list: "list"}[origin], optional


def fields() -> list[FieldInfo]:
    """Every config field, in section order, with what the CLI and the docs need to know about it."""
    out = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind, optional = _kind(hints[f.name])
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append(
                FieldInfo(
                    name=f.name,
                    section=section,
                    flag=f.metadata.get("flag") or "--" + f.name.replace("_", "-"),
                    kind=kind,
                    optional=optional,
                    default=default,
                    help=f.metadata["help"],
                    choices=f.metadata.get("choices"),
                    minimum=f.metadata.get("min"),
                    unit=f.metadata.get("unit"),
                )
            )
    return out


# Fields whose unset default (None) is filled by a rule of ``tidal.config.validate``.
DERIVED = {
    "rollout_num_gpus", "offload_train", "offload_rollout", "update_weight_transport",
    "global_batch_size", "eps_clip_high", "output_dir", "memory_snapshot_dir", "rollout_compile",
    "rollout_compile_options",
    "offload_host_memory", "use_critic", "critic_lr", "init_on_device", "trained_logits_only", "warm_up",
}  # fmt: skip


def default_text(info: FieldInfo) -> str:
    """A field's default as ``--help`` and docs/cli.md show it."""
    if info.default is None:
        return "derived (see `tidal explain`)" if info.name in DERIVED else "unset"
    if info.unit == "bytes":
        return f"{info.default} ({format_bytes(info.default)})"
    if isinstance(info.default, (dict, list)):
        return json.dumps(info.default)
    return str(info.default)


def _fields_by_name() -> dict[str, FieldInfo]:
    return {f.name: f for f in fields()}


def coerce(info: FieldInfo, value: Any, where: str) -> Any:
    """Check and convert one value from a file or a flag; ``where`` names it in errors."""
    if value is None:
        if info.optional:
            return None
        raise ConfigError(f"{where}: cannot be empty; give a {info.kind} value (default {info.default!r})")
    kind = info.kind
    try:
        if kind == "bool":
            if isinstance(value, bool):
                out = value
            elif isinstance(value, str) and value.lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
                out = value.lower() in ("true", "yes", "on", "1")
            else:
                raise ValueError
        elif kind == "int":
            if info.unit == "bytes":
                out = parse_size(value, where)
            elif isinstance(value, bool):
                raise ValueError
            elif isinstance(value, int):
                out = value
            elif isinstance(value, float) and value.is_integer():
                out = int(value)
            elif isinstance(value, str):
                out = int(value)
            else:
                raise ValueError
        elif kind == "float":
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
        elif kind == "str":
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            out = str(value)
        elif kind == "dict":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError:
                    raise ConfigError(
                        f'{where}: expected a JSON object such as \'{{"NAME": "value"}}\', got {value!r}'
                    ) from None
            if not isinstance(value, dict):
                raise ValueError
            out = {str(k): v for k, v in value.items()}
        else:  # list
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, (list, tuple)):
                raise ValueError
            out = [str(v) for v in value]
    except (ValueError, TypeError):
        article = "an" if kind[0] in "aeiou" else "a"
        raise ConfigError(f"{where}: expected {article} {kind}, got {value!r}") from None
    if info.choices is not None and out not in info.choices:
        close = difflib.get_close_matches(str(out), [str(c) for c in info.choices], n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"{where}: {out!r} is not a choice; {hint}choose from {', '.join(map(str, info.choices))}")
    if info.minimum is not None and kind in ("int", "float") and out < info.minimum:
        raise ConfigError(f"{where}: must be at least {info.minimum}, got {out}")
    return out


def _suggest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _unknown_flag(token: str, parser_flags: list[str]) -> ConfigError:
    name = token.split("=", 1)[0]
    removed = find_removed(name)
    if removed is not None:
        return ConfigError(removed.message())
    if not name.startswith("-"):
        return ConfigError(f"unexpected argument {token!r}: every setting is a --flag (see docs/cli.md)")
    return ConfigError(f"unknown flag {name}{_suggest(name, parser_flags)} (all flags: docs/cli.md)")


def load_file(path: str | os.PathLike, *, label: str | None = None) -> tuple[dict[str, Any], str | None]:
    """Read a config file into flat ``{field: value}`` (checked and converted) and its ``preset`` key."""
    label = label or str(path)
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"{label}: not valid YAML{at}; fix the file's syntax") from None
    if data is None:
        return {}, None
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: expected a mapping of flag names to values at the top level")
    infos = _fields_by_name()
    keys = list(infos) + list(SECTIONS) + ["preset"]
    flat: dict[str, Any] = {}
    preset: str | None = None

    def put(key: str, value: Any, where: str, section: str | None) -> None:
        name = str(key).replace("-", "_")
        removed = find_removed(name)
        if removed is not None:
            raise ConfigError(f"{label}: key {key}: {removed.message()}")
        if name not in infos:
            raise ConfigError(f"{label}: unknown key {where}{_suggest(name, keys)}")
        if section is not None and infos[name].section != section:
            raise ConfigError(f"{label}: {key} belongs to section {infos[name].section}, not {section}; move it there")
        if name in flat:
            raise ConfigError(f"{label}: {key} is given twice; keep one")
        flat[name] = coerce(infos[name], value, f"{label}: {key}")

    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name == "preset":
            if not isinstance(value, str):
                raise ConfigError(f"{label}: preset must be a preset name, got {value!r}")
            preset = value
        elif name in SECTIONS and isinstance(value, dict):
            for k, v in value.items():
                put(k, v, f"{key}.{k}", name)
        else:
            put(key, value, str(key), None)
    return flat, preset


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(message)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config``, ``--preset`` and one flag per config field, grouped by section.

    Every flag defaults to ``argparse.SUPPRESS`` so that only flags actually given appear in the
    namespace: the parser must know which values the user chose (see ``Provenance``).
    """
    parser.add_argument(
        "--config", metavar="FILE.yaml", default=argparse.SUPPRESS, help="Config file; flags override it."
    )
    parser.add_argument(
        "--preset",
        metavar="NAME",
        default=argparse.SUPPRESS,
        help=f"Start from tidal/presets/NAME.yaml ({', '.join(preset_names())}); the file and flags override it.",
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for info in fields():
        group = groups.get(info.section) or groups.setdefault(info.section, parser.add_argument_group(info.section))
        shown = default_text(info).replace("%", "%%")
        kw: dict[str, Any] = dict(dest=info.name, default=argparse.SUPPRESS, help=f"{info.help} [default: {shown}]")
        if info.kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif info.kind == "list":
            kw["nargs"] = "*"
            kw["metavar"] = "STR"
        else:
            kw["metavar"] = {"int": "BYTES" if info.unit == "bytes" else "N", "float": "X", "dict": "JSON"}.get(
                info.kind, "STR"
            )
            if info.choices is not None:
                kw["metavar"] = "{" + ",".join(map(str, info.choices)) + "}"
        group.add_argument(info.flag, **kw)


def build_parser(prog: str = "tidal") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, allow_abbrev=False, description="tidal configuration flags (docs/cli.md).")
    add_arguments(parser)
    return parser


def _parser_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--")]


def split_sglang_flags(argv: list[str], known: list[str]) -> tuple[list[str], list[str]]:
    """Take every ``--sglang-X [values]`` that is not a tidal flag out of ``argv``, as ``--X [values]``.

    These go to the SGLang server tidal starts (``--sglang-server sglang``), as slime passes its
    ``--sglang-*`` flags on to SGLang's ``ServerArgs``; values are the tokens up to the next flag.
    """
    rest: list[str] = []
    passthrough: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if not (name.startswith("--sglang-") and name not in known):
            rest.append(token)
            i += 1
            continue
        passthrough.append("--" + token[len("--sglang-") :])
        i += 1
        while "=" not in token and i < len(argv) and not argv[i].startswith("--"):
            passthrough.append(argv[i])
            i += 1
    return rest, passthrough


def parse(argv: list[str], prog: str = "tidal train") -> tuple[TidalConfig, Provenance]:
    """Flags (+ ``--config FILE.yaml``, ``--preset NAME``) -> unresolved config and provenance.

    Values are typed and checked one by one here; ``resolve`` then checks them together and fills
    the derived fields.
    """
    parser = build_parser(prog)
    argv, passthrough = split_sglang_flags(list(argv), _parser_flags(parser))
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        raise _unknown_flag(unknown[0], _parser_flags(parser))
    given = vars(ns)
    infos = _fields_by_name()
    prov = Provenance()
    values: dict[str, Any] = {}

    file_values: dict[str, Any] = {}
    file_preset: str | None = None
    config_path = given.pop("config", None)
    if config_path is not None:
        file_values, file_preset = load_file(config_path)
    preset = given.pop("preset", None) or file_preset
    if preset is not None:
        preset_values, nested = load_file(preset_path(preset), label=f"preset {preset}")
        if nested is not None:
            raise ConfigError(f"preset {preset}: presets cannot name another preset")
        for name, value in preset_values.items():
            values[name] = value
            prov.set(name, "preset", preset)
    for name, value in file_values.items():
        values[name] = value
        prov.set(name, "file", str(config_path))
    typed = {a.split("=", 1)[0] for a in argv}
    for name, value in given.items():
        info = infos[name]
        values[name] = coerce(info, value, info.flag)
        negative = "--no-" + info.flag[2:]
        prov.set(name, "flag", negative if info.kind == "bool" and value is False and negative in typed else info.flag)

    if passthrough:
        values["sglang_server_args"] = list(values.get("sglang_server_args", [])) + passthrough
        prov.set("sglang_server_args", "flag", "--sglang-*")
    sections: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for name, value in values.items():
        sections[infos[name].section][name] = value
    cfg = TidalConfig(**{s: SECTIONS[s](**kw) for s, kw in sections.items()})
    return cfg, prov


def to_yaml(cfg: TidalConfig) -> str:
    """The config grouped by section, in the format ``--config`` reads back."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)


def config_from_dict(data: dict[str, Any]) -> TidalConfig:
    """Rebuild a config from ``TidalConfig.to_dict()`` output (e.g. a run's saved config)."""
    index = field_index()
    sections: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for section, body in data.items():
        for name, value in body.items():
            if name not in index or index[name][0] != section:
                raise ConfigError(f"saved config: unknown key {section}.{name}")
            sections[section][name] = value
    return TidalConfig(**{s: SECTIONS[s](**kw) for s, kw in sections.items()})
