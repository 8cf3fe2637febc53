"""Loading configs: defaults <- model preset <- YAML file <- --set overrides, unknown keys refused."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from aura_hpc.config import strict_yaml
from aura_hpc.config.checks import check_text_value, line_breaking, validate
from aura_hpc.config.tree import CHOICES, SECTIONS, TOP_LEVEL, RunConfig
from aura_hpc.errors import ConfigError, one_line, shown

# Keys resolved relative to the config file they appear in.
_PATH_KEYS = {("data", "path"), ("data", "cache_dir"), ("data", "tokenizer"), ("dist", "deepspeed_config"), ("health", "webhook_url_file")}


def configs_dir() -> Path:
    """Shipped configs: the repo's `configs/` (mapped into the package as aura_hpc.configs)."""
    env = os.environ.get("AURA_HPC_CONFIGS")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2] / "configs"
    if repo.is_dir():
        return repo
    return Path(str(resources.files("aura_hpc.configs")))


def shipped_configs() -> dict[str, Path]:
    return {p.stem: p for p in sorted(configs_dir().glob("*.yaml"))}


def valid_keys() -> list[str]:
    keys = list(TOP_LEVEL)
    for name, cls in SECTIONS.items():
        keys += [f"{name}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


LIST_KEYS = "python -m aura_hpc config --keys"


def _unknown_key(key: str, valid: list[str]) -> ConfigError:
    """One short line: the closest key when there is a close one, and the command that lists them all."""
    if len(key) > 60 or not key.isprintable():
        return ConfigError(f"unknown config key {shown(key)} (fix: see every key with `{LIST_KEYS}`)")
    section, _, name = key.rpartition(".")
    lowered = {k.lower(): k for k in valid}
    # The commonest slip: the key of another section (train.seq_len is data.seq_len), or of none (keep_last: 2).
    elsewhere = [k for k in valid if k.rpartition(".")[2] == name]
    if key.lower() in lowered:  # train.LR, TRAIN.lr
        close = [lowered[key.lower()]]
    elif section in SECTIONS:  # a known section: compare the name with that section's names first
        names = [f.name for f in dataclasses.fields(SECTIONS[section])]
        near = difflib.get_close_matches(name, names, n=1, cutoff=0.75)
        close = [f"{section}.{near[0]}"] if near else elsewhere[:1]
    else:  # a YAML file's section misspelt (trian:) comes first, then a section's key put at the top
        sections = [] if section else difflib.get_close_matches(key, [*SECTIONS, *TOP_LEVEL], n=1, cutoff=0.75)
        close = sections or (elsewhere[:1] if not section else []) or difflib.get_close_matches(key, valid, n=1, cutoff=0.75)
    if close:
        return ConfigError(f"unknown config key '{key}': did you mean '{close[0]}'? (fix: use that, or see every key with `{LIST_KEYS}`)")
    return ConfigError(f"unknown config key '{key}' (fix: see every key with `{LIST_KEYS}`)")


_BOOL_WORDS = {w: "true" for w in ("true", "yes", "on", "1")} | {w: "false" for w in ("false", "no", "off", "0")}


def coerce(key: str, value: Any, typ: Any, from_cli: bool) -> Any:
    typ = typ if isinstance(typ, str) else typ.__name__
    fix = f"(fix: --set {key}=<{typ}>)"
    if typ == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return value.lower() in ("true", "yes", "on", "1")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{key} must be true or false, got {shown(value)} {fix}")
    if typ == "int":
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a whole number, got {shown(value)} {fix}")
        if isinstance(value, int) and abs(value) < 2**63:
            return value
        try:
            f = float(str(value).replace("_", "")) if not isinstance(value, int) else float("inf")
        except ValueError:
            raise ConfigError(f"{key} must be a whole number, got {shown(value)} {fix}") from None
        if not f.is_integer() or abs(f) >= 2**63:
            raise ConfigError(f"{key} must be a whole number below 2**63, got {shown(value)} {fix}")
        return int(f)
    if typ == "float":
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a number, got {shown(value)} {fix}")
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{key} must be a number, got {shown(value)} {fix}") from None
    if typ == "str":
        if value is None:
            return ""
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key} must be a string, got {shown(value)} {fix}")
        if isinstance(value, bool):  # YAML reads `compile: true` as a boolean
            return "true" if value else "false"
        if isinstance(value, float):  # `run_name: 1.50` became "1.5": another run directory than --set run_name=1.50
            name = key.split(".")[-1]
            raise ConfigError(f'{key} is text, and YAML read {shown(value)} as a number (fix: quote it, e.g. {name}: "...")')
        check_text_value(key, str(value))  # before the value is used as a path or anything else
        if CHOICES.get(key) == ("auto", "true", "false") and str(value).lower() in _BOOL_WORDS:
            # --set train.compile=yes (or True, on, 1) as a boolean key takes it; YAML's `compile: True` already was
            return _BOOL_WORDS[str(value).lower()]
        return str(value)
    raise ConfigError(f"{key}: unsupported type {typ}")  # pragma: no cover


_UNSET_VARIABLE = re.compile(r"\$(\w+|\{[^}]*\})")


def _relative_to(base_dir: Path, value: str, key: str) -> str:
    """A path setting as the file (or the command line) meant it: `~` is the user's home (bash does
    not expand it after `--set data.path=`), `$SCRATCH` its value here (as a cluster profile's are), a
    relative path starts at `base_dir`, a URL is kept."""
    if "://" in value:
        return value
    if "$" in value:  # taken literally, runs went to a folder named `${SCRATCH}` beside the config file
        value = os.path.expandvars(value)
        if unset := _UNSET_VARIABLE.search(value):
            raise ConfigError(
                f"{key} names {unset.group(0)}, which is not set here (fix: export {unset.group(1).strip('{}')}=..., or write the path out)"
            )
    value = os.path.expanduser(value)
    return value if os.path.isabs(value) else str((base_dir / value).resolve())


def _merge(
    base: dict[str, Any], raw: dict[str, Any], origin: str, base_dir: Path | None, given: dict[str, str] | None = None, label: str = ""
) -> None:
    """Merge `raw` (a YAML mapping) into `base`, rejecting unknown keys and coercing types.

    `given` records, for each key set here, `label` (where it came from: config or cli). A refusal names
    the file it came from: with a preset, a config file and --set, 'unknown config key' alone left the user to guess.
    """
    try:
        _merge_into(base, raw, origin, base_dir, given, label)
    except ConfigError as exc:
        if origin == "--set" or str(exc).startswith(f"{origin}:"):
            raise
        raise ConfigError(f"{origin}: {exc}") from None


def _merge_into(
    base: dict[str, Any], raw: dict[str, Any], origin: str, base_dir: Path | None, given: dict[str, str] | None, label: str
) -> None:
    valid = valid_keys()
    if not isinstance(raw, dict):
        raise ConfigError(f"{origin}: a config must be a YAML mapping of sections, got {type(raw).__name__}")
    for top, value in raw.items():
        if top in TOP_LEVEL:
            base[top] = coerce(top, value, "str", False)
            if top == "output_dir" and base[top] and base_dir is not None:
                base[top] = _relative_to(base_dir, base[top], top)
            if given is not None:
                given[top] = label
            continue
        if top not in SECTIONS:
            raise _unknown_key(str(top), valid)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{origin}: section '{top}' must be a mapping of keys, got {shown(value)}")
        types = {f.name: f.type for f in dataclasses.fields(SECTIONS[top])}
        for k, v in value.items():
            dotted = f"{top}.{k}"
            if k not in types:
                raise _unknown_key(dotted, valid)
            v = coerce(dotted, v, types[k], False)
            if (top, k) in _PATH_KEYS and v and base_dir is not None:
                v = _relative_to(base_dir, v, dotted)
            base[top][k] = v
            if given is not None:
                given[dotted] = label


def _field_type(key: str) -> str | None:
    if key in TOP_LEVEL:
        return "str"
    section, _, name = key.partition(".")
    types = {f.name: f.type for f in dataclasses.fields(SECTIONS[section])} if section in SECTIONS else {}
    typ = types.get(name)
    return None if typ is None else typ if isinstance(typ, str) else typ.__name__


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`--set section.key=value` strings to a nested mapping (values parsed as YAML scalars)."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {shown(item)} is not KEY=VALUE (fix: e.g. --set train.lr=3e-4)")
        key, _, text = item.partition("=")
        key = key.strip()
        # A line break or control character is kept as typed (YAML would fold it away silently) and
        # refused by the value checks; so is text YAML cannot read.
        value: Any = text
        if text.strip() and line_breaking(text) is None and _field_type(key) != "str":  # text as typed: `4:00:00`, `~/data`
            try:
                value = strict_yaml.load(text)
            except (yaml.YAMLError, ValueError):  # ValueError: an integer longer than Python converts
                value = text
        if isinstance(value, (dict, list)):
            value = text
        if _field_type(key) == "str" and text.strip() in ("null", "Null", "NULL"):
            value = None  # as YAML has it: unset
        if "." in key:
            section, _, name = key.partition(".")
            if section not in SECTIONS or not name:
                raise _unknown_key(key, valid_keys())
            out.setdefault(section, {})[name] = value
        elif key in SECTIONS:
            raise ConfigError(f"--set {key}=... names a whole section (fix: one key of it, --set {key}.NAME=VALUE; see `{LIST_KEYS}`)")
        elif key not in TOP_LEVEL:
            owners = [f"{name}.{key}" for name, cls in SECTIONS.items() if key in {f.name for f in dataclasses.fields(cls)}]
            if len(owners) == 1:
                raise ConfigError(f"unknown config key {shown(key)} (fix: --set {owners[0]}=...; every key: `{LIST_KEYS}`)")
            raise _unknown_key(key, valid_keys())
        else:
            out[key] = value
    return out


# A config is a few hundred values; YAML aliases can make a few hundred bytes stand for billions of
# them ("billion laughs"). Both limits are far above any real config.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_VALUES = 10_000


def _count_values(data: Any, budget: int) -> int:
    """Values in `data` as if every alias were expanded, counting down from `budget` (stops below 0)."""
    stack = [data]
    while stack and budget >= 0:
        item = stack.pop()
        budget -= 1
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return budget


def _load_yaml(path: Path) -> dict[str, Any]:
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {path} is {size:,} bytes, not a config (fix: pass the YAML config, under 1 MB)")
        data = strict_yaml.load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at position {exc.start}) "
            "(fix: save it as UTF-8, e.g. iconv -f latin1 -t utf-8)"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"config {path} is a folder (fix: pass a .yaml file inside it, or a preset name)") from None
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found (fix: pass an existing file or a preset name)") from None
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        where = f" line {line + 1}" if line is not None else ""
        problem = one_line(str(getattr(exc, "problem", exc)))
        fix = "keep one of them" if "appears twice" in problem else "check the brackets, quotes and indentation there"
        raise ConfigError(f"config file {path}{where} is not valid YAML: {problem[:90]} (fix: {fix})") from None
    except ValueError as exc:  # PyYAML's int() of a number longer than Python converts (4,300 digits)
        what = one_line(str(exc))[:90]
        raise ConfigError(f"config file {path} holds a value YAML cannot read ({what}) (fix: write numbers out plainly)") from None
    except OSError as exc:  # unreadable: permissions, a broken link, an I/O error of a network filesystem
        why = exc.strerror or type(exc).__name__
        raise ConfigError(f"config file {path} cannot be read ({why}) (fix: check its permissions)") from None
    except RecursionError:
        raise ConfigError(f"config file {path} nests deeper than Python can read (fix: a config is sections of plain values)") from None
    if _count_values(data, MAX_CONFIG_VALUES) < 0:
        raise ConfigError(
            f"config file {path} expands to more than {MAX_CONFIG_VALUES:,} values through YAML aliases (&/*) "
            "(fix: write the values out; a config holds a few hundred)"
        )
    return data or {}


def resolve_config_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    shipped = shipped_configs()
    # A preset's name is the preset's, whatever lies in the current folder: its run directory has that name
    # (`--config tiny --output-dir .` made ./tiny, and the same command then refused it as "a folder").
    if name_or_path in shipped and os.sep not in name_or_path:
        return shipped[name_or_path]
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    near = difflib.get_close_matches(name_or_path.replace("_", "-").lower(), list(shipped), n=1, cutoff=0.75)
    if near:
        raise ConfigError(
            f"config '{name_or_path}' is neither a file nor a shipped preset: did you mean '{near[0]}'? (fix: --config {near[0]})"
        )
    raise ConfigError(
        f"config '{name_or_path}' is neither a file nor a shipped preset (fix: use one of {', '.join(shipped)}, or a path to a .yaml file)"
    )


def load_config(
    config: str | None = None,
    overrides: list[str] | None = None,
    output_dir: str | None = None,
    run_name: str | None = None,
    given: dict[str, str] | None = None,
) -> RunConfig:
    """defaults <- model preset <- config file <- --set overrides <- --output-dir/--run-name.

    `given`, when passed, is filled with each key the config file ("config") or the command
    line ("cli") set, so later layers (a cluster profile) know what not to override.
    """
    merged = RunConfig().to_dict()
    file_raw: dict[str, Any] = {}
    base_dir: Path | None = None
    if config:
        path = resolve_config_path(config)
        file_raw = _load_yaml(path)
        # Relative paths in a user's file are relative to that file; in a shipped preset
        # (data.path: data/es-prepared) to where the command runs.
        base_dir = Path.cwd() if path.parent.resolve() == configs_dir().resolve() else path.parent.resolve()
    cli_raw = parse_overrides(overrides or [])
    # A model preset names a shipped config whose model section is the base for model keys.
    file_model = (file_raw.get("model") or {}) if isinstance(file_raw, dict) else {}
    preset = (cli_raw.get("model") or {}).get("preset") or (file_model.get("preset") if isinstance(file_model, dict) else None)
    preset_model: dict[str, Any] = {}
    if preset:
        shipped = shipped_configs()
        if str(preset) not in shipped:
            raise ConfigError(f"model.preset '{preset}' is unknown (fix: use one of {', '.join(shipped)})")
        preset_model = _load_yaml(shipped[str(preset)]).get("model") or {}
        _merge(merged, {"model": preset_model}, str(shipped[str(preset)]), None)
    _merge(merged, file_raw, str(config), base_dir, given, "config")
    if (cli_raw.get("model") or {}).get("preset"):  # asked for on the command line: its shape, not the file's
        _merge(merged, {"model": preset_model}, str(preset), None)
    _merge(merged, cli_raw, "--set", Path.cwd(), given, "cli")
    if output_dir is not None:
        if output_dir.startswith("~") or "$" in output_dir:  # --output-dir=~/runs: bash leaves `~` after `=` to us
            output_dir = _relative_to(Path.cwd(), output_dir, "--output-dir")
        merged["output_dir"] = output_dir
        if given is not None:
            given["output_dir"] = "cli"
    if run_name is not None:
        merged["run_name"] = run_name
        if given is not None:
            given["run_name"] = "cli"
    cfg = from_dict(merged)
    validate(cfg)
    return cfg


def from_dict(d: dict[str, Any]) -> RunConfig:
    return RunConfig(
        run_name=d["run_name"],
        output_dir=d["output_dir"],
        **{name: cls(**d.get(name, {})) for name, cls in SECTIONS.items()},
    )


def load_run_file(path: str | Path) -> RunConfig:
    """A resolved config.yaml from a run directory (already complete; still validated)."""
    merged = RunConfig().to_dict()
    _merge(merged, _load_yaml(Path(path)), str(path), None)
    cfg = from_dict(merged)
    validate(cfg)
    return cfg
