"""Workload files and presets for the benches, the simulator and chaos (issue 26).

A command that takes a workload declares its keys as a `WorkloadFile` subclass (a pydantic model
whose defaults are the command's defaults) and is wrapped by `takes_workload`, which adds:

- `--workload NAME|FILE`: a preset shipped in `kvpool/tools/presets/<command>/NAME.toml`, or a
  TOML (or YAML) file of the same keys, flat;
- `--set KEY=VALUE` (repeatable): one key; VALUE is read as TOML (`4`, `true`, `[1, 2]`), and
  as a plain string when it is not TOML (`--set sizes=64KiB,1MiB`);
- `--dry-run`: print the resolved workload as TOML (itself a valid workload file) and exit.

Precedence, lowest first: the model's defaults, the file or preset, `--set`, then a flag named
like a key (`--rate` sets `rate`): each command keeps such flags for what a person changes
often. An unknown key, or a value of the wrong type, is a usage error naming the key and where
it came from. Relative paths in a file (`PATH_KEYS`) are relative to the file.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import tomllib
from pathlib import Path
from typing import Annotated, Any, Callable, ClassVar, TypeVar

import click
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError

PRESETS = Path(__file__).with_name("presets")  # <command, dashed>/<name>.toml
FILE_SUFFIXES = (".toml", ".yaml", ".yml")

W = TypeVar("W", bound="WorkloadFile")


class WorkloadFile(BaseModel):
    """The keys of one command's workload; a subclass per command, its defaults the command's."""

    model_config = ConfigDict(extra="forbid")
    PATH_KEYS: ClassVar[tuple[str, ...]] = ()  # keys holding a path, relative to the file they are in

    description: str = Field("", description="What this workload is, in a line.")
    _source: str | None = PrivateAttr(None)

    @property
    def source(self) -> str | None:
        """The preset's name or the file's path this came from (None: the defaults)."""
        return self._source

    def settings(self) -> dict[str, Any]:
        """Every key but `description`, for a report's setup."""
        return self.model_dump(exclude={"description"})


def comma_list(value: Any) -> Any:
    """`"a,b"` -> `["a", "b"]`, a lone number -> `[n]`: a list key given by a flag or `--set`."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value]
    return value


def _size(value: Any) -> Any:
    from kvpool.config import parse_size

    if value is None or (isinstance(value, str) and value.strip().lower() in ("unlimited", "inf", "none")):
        return value
    try:
        parse_size(value)
    except Exception as exc:  # InvalidArgument: pydantic wants a ValueError
        raise ValueError(str(exc)) from None
    return str(value)


def list_of(item: Any) -> Any:
    """A list key that also takes "a,b" (from a flag or `--set`)."""
    return Annotated[list[item], BeforeValidator(comma_list)]


Size = Annotated[str, BeforeValidator(_size)]  # "512MiB", "4TiB", "unlimited"; kept as written


# --- reading -------------------------------------------------------------------------------

def preset_dir(command: str) -> Path:
    return PRESETS / command.replace(" ", "-")


def preset_names(command: str) -> list[str]:
    return sorted(p.stem for p in preset_dir(command).glob("*.toml"))


def _read(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise click.UsageError(f"workload file {path}: {exc.strerror or exc}") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise click.UsageError(f"workload file {path}: reading YAML needs PyYAML (pip install pyyaml); "
                                       "or write it as TOML") from None
            data = yaml.safe_load(text)
        else:
            data = tomllib.loads(text)
    except click.UsageError:
        raise
    except Exception as exc:  # tomllib.TOMLDecodeError, yaml.YAMLError
        raise click.UsageError(f"workload file {path}: not valid {path.suffix[1:].upper()}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise click.UsageError(f"workload file {path}: expected a table of keys, got {type(data).__name__}")
    return data


def read_source(command: str, source: str, schema: type[WorkloadFile],
                presets: str | None = None) -> tuple[dict[str, Any], str]:
    """The keys of `source` (a preset in `presets`' folder, by default the command's, or a file)
    and a phrase naming it for errors."""
    path = Path(source).expanduser()
    looks_like_file = path.suffix in FILE_SUFFIXES or "/" in source or path.is_file()
    if not looks_like_file:
        preset = preset_dir(presets or command) / f"{source}.toml"
        if not preset.is_file():
            names = preset_names(presets or command)
            close = difflib.get_close_matches(source, names, n=1)
            raise click.UsageError(f"unknown workload {source!r} for kvpool {command}: give a preset "
                                   f"({', '.join(names) or 'none'}) or a .toml/.yaml file"
                                   + (f"; did you mean {close[0]!r}?" if close else ""))
        return _read(preset), f"preset {source!r} of kvpool {command}"
    if not path.is_file():
        raise click.UsageError(f"workload file not found: {source}")
    data = _read(path)
    for key in schema.PATH_KEYS:  # relative to the file, not to where the command runs
        if isinstance(data.get(key), str) and data[key] and not Path(data[key]).expanduser().is_absolute():
            data[key] = str(path.parent / data[key])
    return data, f"workload file {source}"


def parse_sets(sets: tuple[str, ...] | list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in sets:
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise click.UsageError(f"--set {item!r}: expected KEY=VALUE")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # a bare word: 64KiB, round_robin, /a/path
        out[key.strip().replace("-", "_")] = value
    return out


def resolve(command: str, schema: type[W], source: str | None = None, sets: tuple[str, ...] | list[str] = (),
            flags: dict[str, Any] | None = None, presets: str | None = None) -> W:
    """The workload of `kvpool <command>`: defaults < `source` < `sets` < `flags` (those not None)."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if source:
        data, where = read_source(command, source, schema, presets)
        layers.append((where, data))
    layers.append(("--set", parse_sets(sets)))
    layers.append(("a flag", {k: v for k, v in (flags or {}).items() if v is not None and v != ()}))
    known = list(schema.model_fields)
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    problems: list[str] = []
    for where, data in layers:
        for key, value in data.items():
            if key not in schema.model_fields:
                close = difflib.get_close_matches(key, known, n=1)
                problems.append(f"{where}: unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
                continue
            merged[key], origin[key] = value, where
    if problems:
        raise click.UsageError("; ".join(problems) + f". Known keys of kvpool {command}: {', '.join(known)}")
    try:
        workload = schema.model_validate(merged)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            key = str(err["loc"][0]) if err["loc"] else "?"
            where = origin.get(key, "the defaults")
            where = f"--{key.replace('_', '-')}" if where == "a flag" else where
            lines.append(f"{where}: key {key!r}: {err['msg']} (got {err.get('input')!r})")
        raise click.UsageError("; ".join(lines)) from None
    workload._source = source
    return workload


# --- writing -------------------------------------------------------------------------------

def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        pairs = (f"{json.dumps(str(k), ensure_ascii=False)} = {_toml_value(v)}" for k, v in value.items())
        return "{" + ", ".join(pairs) + "}"
    raise TypeError(f"no TOML form for {value!r}")


def to_toml(workload: WorkloadFile) -> str:
    """The workload as a TOML file (keys without a value are left as comments)."""
    lines = []
    for key, value in workload.model_dump().items():
        if value is None:
            lines.append(f"# {key} = (not set)")
        elif key != "description" or value:
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def describe(data: dict[str, Any]) -> str:
    """A preset's keys in one line (`kvpool bench presets`)."""
    return ", ".join(f"{k}={_toml_value(v)}" for k, v in data.items() if k != "description") or "(the defaults)"


# --- the click side ------------------------------------------------------------------------

def help_epilog(presets: str, schema: type[WorkloadFile], flags: list[str]) -> str:
    overrides = f"{', '.join(flags)} override the key of that name; " if flags else ""
    lines = ["Workload: --workload takes a preset below or a TOML/YAML file of the keys below; "
             f"--set KEY=VALUE sets one key; {overrides}--dry-run prints the result. "
             "`kvpool bench presets` shows what each preset sets.", "", "\b", "Presets:"]
    for name in preset_names(presets):
        data = _read(preset_dir(presets) / f"{name}.toml")
        lines.append(f"  {name:<16} {data.get('description', '')}")
    lines += ["", "\b", "Keys (default):"]
    for key, field in schema.model_fields.items():
        if key == "description":
            continue
        default = field.get_default(call_default_factory=True)
        shown = "-" if default is None else _toml_value(default)
        lines.append(f"  {key + ' = ' + shown:<26} {field.description or ''}".rstrip())
    return "\n".join(lines)


def takes_workload(command: str, schema: type[WorkloadFile],
                   presets: str | None = None) -> Callable[[click.Command], click.Command]:
    """Put over `@click.command()` of `kvpool <command>`: adds --workload, --set and --dry-run
    and explains them in --help; `presets` names another command's presets to use. The callback
    then gets `workload` (a `schema`) instead of those options and instead of every flag whose
    name is a key (a flag left unset, None or (), leaves the key alone)."""

    def wrap(cmd: click.Command) -> click.Command:
        callback = cmd.callback
        assert callback is not None
        keys = set(schema.model_fields)
        flags = [f"--{p.name.replace('_', '-')}" for p in cmd.params if p.name in keys]
        presets_of = presets or command
        names = preset_names(presets_of)
        cmd.params[:0] = [
            click.Option(["--workload", "-w"], metavar="NAME|FILE",
                         help=f"A preset ({', '.join(names)}) or a TOML/YAML file; see below."),
            click.Option(["--set", "sets"], multiple=True, metavar="KEY=VALUE",
                         help="Set one workload key (repeatable); the keys are listed below."),
            click.Option(["--dry-run"], is_flag=True, help="Print the resolved workload as TOML and exit."),
        ]
        cmd.epilog = help_epilog(presets_of, schema, flags)

        @functools.wraps(callback)
        def run(*args: Any, **kwargs: Any) -> Any:
            source, sets, dry_run = kwargs.pop("workload"), kwargs.pop("sets"), kwargs.pop("dry_run")
            given = {k: kwargs.pop(k) for k in list(kwargs) if k in keys}
            ctx = click.get_current_context()
            if isinstance(cmd, click.Group) and ctx.invoked_subcommand is not None:
                return callback(*args, workload=None, **kwargs)  # the subcommand takes its own
            workload = resolve(command, schema, source, sets, given, presets_of)
            if dry_run:
                click.echo(to_toml(workload), nl=False)
                return None
            return callback(*args, workload=workload, **kwargs)

        cmd.callback = run
        return cmd

    return wrap


def all_presets() -> dict[str, dict[str, dict[str, Any]]]:
    """command -> preset name -> its keys, for every command that has presets."""
    return {d.name.replace("-", " "): {n: _read(d / f"{n}.toml") for n in preset_names(d.name)}
            for d in sorted(PRESETS.iterdir()) if d.is_dir()}


@click.command("presets")
@click.argument("command", required=False)
def presets(command: str | None) -> None:
    """List the workload presets of every bench, sim and chaos command, with what each sets.

    COMMAND narrows the list, e.g. `kvpool bench presets serve` or `kvpool bench presets sim`.
    Use one with `--workload NAME`; `--dry-run` prints what a run would use."""
    found = all_presets()
    if command:
        wanted = {c for c in found if c == command or c.endswith(f" {command}") or c.startswith(f"{command} ")}
        if not wanted:
            raise click.UsageError(f"no presets for {command!r}; commands with presets: {', '.join(found)}")
        found = {c: found[c] for c in found if c in wanted}
    for cmd, table in found.items():
        click.echo(f"kvpool {cmd} --workload NAME")
        for name, data in table.items():
            click.echo(f"  {name}: {data.get('description', '')}")
            click.echo(f"      {describe(data)}")
