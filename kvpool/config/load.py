"""Filling the tree (`kvpool.config.tree`): defaults < a file < `KVPOOL_*` environment < flags.

    file         TOML or JSON, named by `--config` or `KVPOOL_CONFIG`: one table per section
                 ([pool], [node], ... [up]) and `[[workers]]`; the pool's short names may also
                 stand at the top level (`port = 7600`: the form of files before the tree)
    environment  `KVPOOL_<SECTION>__<FIELD>` for every field (`KVPOOL_ROUTER__PORT=8001`); the
                 fields of [pool], [node], [rpc] and [security] also by their short names
                 (`KVPOOL_DRAM_CAPACITY=4GiB`, `KVPOOL_AUTH_FILE`, `KVPOOL_MASTER`), as ever, and
                 a few by the names the outside world uses (`KVPOOL_MODEL_CACHE`,
                 `KVPOOL_ALLOW_UNTESTED`); lists are "a,b" or JSON, a table JSON
    flags        a command's own options, and `--set SECTION.FIELD=VALUE` for any field

Invariants: `load_settings` returns a fully validated tree, or raises `InvalidArgument` naming
the bad field and where its value came from (file, which variable, flag); an unknown key in a
file is an error naming it (a typo must not quietly run a pool with default capacities); unknown
`KVPOOL_*` variables are left alone (other tools own some). `current_settings()` is the tree of
this process for code that was handed none: what its command line loaded (`use_settings`), else
the environment's and `KVPOOL_CONFIG`'s.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any, Iterable

from pydantic import BaseModel, ValidationError
from pydantic_settings import PydanticBaseSettingsSource

from kvpool.config.tree import SECTIONS, SHORT_NAMES, Settings, hint
from kvpool.errors import InvalidArgument

CONFIG_ENV = "KVPOOL_CONFIG"
ROOT_ENV = {"log_level": "KVPOOL_LOG_LEVEL", "workers": "KVPOOL_WORKERS"}
FLAG = "flag"


def env_names(section: str, field: str) -> list[str]:
    """The variables that set `section.field`, the first found winning."""
    cls = SECTIONS[section]
    names = [f"KVPOOL_{section.upper()}__{field.upper()}"]
    if cls.SHORT_ENV:
        names.append(f"KVPOOL_{field.upper()}")
    if field in cls.ALIASES:
        names.append(cls.ALIASES[field])
    return names


def read_env(environ: Any = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The tree's values in the environment, and where each came from."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, var in ROOT_ENV.items():
        if var in environ:
            values[name], sources[name] = environ[var], f"environment {var}"
    for section, cls in SECTIONS.items():
        for field in cls.model_fields:
            var = next((v for v in env_names(section, field) if v in environ), None)
            if var is not None:
                values.setdefault(section, {})[field] = environ[var]
                sources[f"{section}.{field}"] = f"environment {var}"
    return values, sources


class EnvSource(PydanticBaseSettingsSource):
    """pydantic-settings' view of `read_env` (what `Settings()` reads by itself)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return read_env()[0]


def read_file(path: str | os.PathLike) -> dict[str, Any]:
    """A config file as the tree's nested form; `InvalidArgument` names what is wrong in it."""
    p = Path(path)
    if not p.is_file():
        raise InvalidArgument(f"config file {p} does not exist")
    if p.suffix not in (".toml", ".json"):
        raise InvalidArgument(f"config file {p}: use a .toml or .json file")
    try:
        doc = tomllib.loads(p.read_text()) if p.suffix == ".toml" else json.loads(p.read_text())
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise InvalidArgument(f"config file {p} is not valid {p.suffix[1:].upper()}: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument(f"config file {p} must hold one object of settings, got {type(doc).__name__}")
    values: dict[str, Any] = {}
    for key, value in doc.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise InvalidArgument(f"config file {p}: [{key}] must be a table, got {value!r}")
            for name in value:
                if name not in SECTIONS[key].model_fields:
                    raise InvalidArgument(f"config file {p}: unknown setting {name!r} in [{key}]{hint(name, key)}; "
                                          f"[{key}] has: {', '.join(SECTIONS[key].model_fields)}")
            values.setdefault(key, {}).update(value)
        elif key in ROOT_ENV:
            values[key] = value
        elif key in SHORT_NAMES:  # the flat form
            values.setdefault(SHORT_NAMES[key], {})[key] = value
        else:
            raise InvalidArgument(f"config file {p}: unknown setting {key!r}{hint(key)}; the tree has "
                                  f"{', '.join(f'[{s}]' for s in SECTIONS)}, [[workers]] and log_level "
                                  "(docs/configuration.md)")
    return values


def parse_sets(sets: Iterable[str]) -> dict[str, Any]:
    """`--set SECTION.FIELD=VALUE` (repeatable) as the tree's nested form."""
    values: dict[str, Any] = {}
    for item in sets:
        path, eq, value = item.partition("=")
        path = path.strip().replace("-", "_")
        section, dot, field = path.partition(".")
        if not eq or (dot and section not in SECTIONS) or (not dot and path not in ROOT_ENV and path not in SHORT_NAMES):
            raise InvalidArgument(f"--set {item!r}: expected SECTION.FIELD=VALUE, e.g. --set worker.max_batch=16 "
                                  f"(sections: {', '.join(SECTIONS)})")
        if not dot:
            section, field = (SHORT_NAMES[path], path) if path in SHORT_NAMES else (path, "")
        if not field:
            values[section] = value
        elif field not in SECTIONS[section].model_fields:
            raise InvalidArgument(f"--set {item!r}: [{section}] has no setting {field!r}{hint(field, section)}")
        else:
            values.setdefault(section, {})[field] = value
    return values


def _leaves(values: dict[str, Any]) -> Iterable[str]:
    for key, value in values.items():
        if key in SECTIONS and isinstance(value, dict):
            yield from (f"{key}.{field}" for field in value)
        elif key in SHORT_NAMES:
            yield f"{SHORT_NAMES[key]}.{key}"
        else:
            yield key


def _merge(into: dict[str, Any], values: dict[str, Any]) -> None:
    for key, value in values.items():
        if key in SHORT_NAMES and key not in SECTIONS:  # a flag by its short name
            into.setdefault(SHORT_NAMES[key], {})[key] = value
        elif isinstance(value, dict) and key in SECTIONS:
            into.setdefault(key, {}).update(value)
        else:
            into[key] = value


def _drop_unset(flags: dict[str, Any]) -> dict[str, Any]:
    """Options not given (None) change nothing, inside a section's dict too."""
    out: dict[str, Any] = {}
    for key, value in flags.items():
        if isinstance(value, dict) and key in SECTIONS:
            value = {k: v for k, v in value.items() if v is not None}
            if value:
                out[key] = value
        elif value is not None:
            out[key] = value
    return out


def _explain(exc: ValidationError, sources: dict[str, str]) -> str:
    """One line per bad field: where it is in the tree, pydantic's reason, where the value came from."""
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        path = ".".join(loc)
        origin = sources.get(".".join(loc[:2])) or sources.get(loc[0] if loc else "", "")
        msg = err["msg"].removeprefix("Value error, ")
        where = f" (from {origin})" if origin else ""
        lines.append(f"{path}: {msg}{where}" if path else f"{msg}{where}")
    return "; ".join(lines)


def load_settings(config_file: str | os.PathLike | None = None, *, sets: Iterable[str] = (),
                  **flags: Any) -> Settings:
    """The tree from a file (`config_file`, else `KVPOOL_CONFIG`), the environment, then flags.

    `flags`: a section's values as a dict (`router={"port": 8001}`), a root field, or a short
    name (`port=0`, `dram_capacity="64MiB"`); None values are options not given and change
    nothing. `sets`: `--set SECTION.FIELD=VALUE` items, over the other flags.
    """
    path = config_file or os.environ.get(CONFIG_ENV) or None
    sources: dict[str, str] = {}
    merged: dict[str, Any] = {}
    layers: list[tuple[dict[str, Any], str | None]] = []
    if path:
        layers.append((read_file(path), f"file {path}"))
    env_values, env_sources = read_env()
    layers.append((env_values, None))
    layers.append((_drop_unset(flags), FLAG))
    layers.append((parse_sets(sets), f"{FLAG} --set"))
    for values, origin in layers:
        _merge(merged, values)
        for leaf in _leaves(values):
            sources[leaf] = env_sources.get(leaf, "environment") if origin is None else origin
    try:
        settings = Settings(**merged)
    except ValidationError as exc:
        raise InvalidArgument(f"invalid configuration: {_explain(exc, sources)}") from None
    settings._sources = sources
    return settings


_installed: Settings | None = None
_cached: tuple[tuple, Settings] | None = None


def use_settings(settings: Settings | None) -> None:
    """Make `settings` this process's (a command does, once it has loaded them); None: forget."""
    global _installed, _cached
    _installed, _cached = settings, None


def current_settings() -> Settings:
    """This process's tree: the command line's, else loaded from the environment and
    `KVPOOL_CONFIG` (again whenever a `KVPOOL_*` variable changes)."""
    global _cached
    if _installed is not None:
        return _installed
    key = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("KVPOOL_")))
    if _cached is None or _cached[0] != key:
        _cached = (key, load_settings())
    return _cached[1]


# -- `kvpool config show` ------------------------------------------------------------------------
def _toml(value: Any) -> str:
    """A TOML value: JSON's spelling, but for tables and floats."""
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return repr(value)  # TOML spells inf and nan as Python does; JSON has neither
    return json.dumps(value if isinstance(value, (bool, int, str)) else str(value))


def _line(name: str, value: Any, origin: str, secret: bool = False) -> str:
    if value is None:
        text = f"# {name} =  (not set)"
    elif secret:
        text = f"# {name} = <redacted>"
    else:
        text = f"{name} = {_toml(value)}"
    return f"{text:<48} # {origin}"


def describe(settings: Settings) -> str:
    """The tree in effect as TOML (a config file, secrets left out), each value with its origin."""
    source = settings.source
    out = ["# kvpool configuration in effect; highest first: flags, KVPOOL_* environment, file, defaults",
           _line("log_level", settings.log_level, source("log_level")), ""]
    for name, cls in SECTIONS.items():
        section: BaseModel = getattr(settings, name)
        out.append(f"[{name}]")
        for field in cls.model_fields:
            value = getattr(section, field)
            origin = source(f"{name}.{field}")
            if field in cls.SECRETS and origin == "default" and getattr(section, f"{field}_file", None):
                origin = f"read from {field}_file"
            out.append(_line(field, value, origin, secret=field in cls.SECRETS))
        out.append("")
    origin = source("workers")
    for worker in settings.workers:
        out.append(f"[[workers]]{'':<37} # {origin}")
        out += [f"{k} = {_toml(v)}" for k, v in (("role", worker.role), ("name", worker.name or None),
                                                  *worker.settings.items()) if v is not None]
        out.append("")
    return "\n".join(out)
