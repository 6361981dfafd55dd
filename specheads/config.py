"""One config dataclass per stage, loaded from YAML plus dotted command-line overrides.

    cfg = load_config(TrainConfig, "configs/eagle3-smollm2.yaml", ["train.lr=3e-4", "data.max_length=1024"])

Unknown keys and bad values fail with the flag (`override 'train.lr=abc'`) or the file, and the key, named; values
are checked against the field types and by each dataclass's `__post_init__`;
`format_config(cfg)` prints the resolved config and `config_to_dict` is what gets written beside outputs.
Nested dataclasses are sections (`train.block.gamma=3`). A section that renamed keys lists them in a class attribute
`RENAMED_KEYS = {old: new}` (keys relative to the section, `new` may be dotted): an old key in a file or an override
is read as its new one, with one warning line naming old -> new; the same setting under both names is an error.
A section whose keys depend on its contents (heads/headspec.py HeadSpec: the kind's own section is named after
head.kind) gives them with the classmethods `section_keys(data) -> {key: type}` and `section_renames(data) ->
{old: new}` (instead of its fields and RENAMED_KEYS), a `SELECTOR` field that picks them (its overrides are
applied first), and writes itself with `to_section()`.
A YAML file may hold a top-level `command:` string (the command that runs it,
torchtune style); it is documentation and is ignored here.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import types
import typing
from pathlib import Path
from typing import Any, Sequence, TypeVar

import yaml

from specheads.utils import SpecheadsError, read_bytes_bounded

log = logging.getLogger(__name__)
T = TypeVar("T")
DOC_KEYS = {"command", "description"}  # documentation keys allowed at the top level of a YAML recipe


def _is_dc_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check/convert `value` to the annotated type `tp` (supports Optional, Union, list, dict, Literal, dataclasses)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if len(args) == 2 and type(None) in args:  # Optional[X]: X's own error (it names the field inside)
            return _coerce(value, next(a for a in args if a is not type(None)), where)
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except SpecheadsError as e:
                errors.append(str(e))
        raise SpecheadsError(f"{where}: {value!r} does not fit {tp}")
    if origin is typing.Literal:
        if value not in args:
            raise SpecheadsError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if origin in (list, tuple, Sequence):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise SpecheadsError(f"{where}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        out = [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise SpecheadsError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if _is_dc_type(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise SpecheadsError(f"{where}: expected a section (mapping), got {value!r}")
        return _from_dict(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise SpecheadsError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise SpecheadsError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if isinstance(value, str):
                try:
                    return float(value)  # YAML reads 3e-4 as a string
                except ValueError:
                    pass
            raise SpecheadsError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return str(value)
            raise SpecheadsError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def _keys(cls: type, data: Any = None) -> dict[str, Any]:
    """{key: type} a section of `cls` holding `data` takes: its fields, or its `section_keys` hook's."""
    hook = getattr(cls, "section_keys", None)
    if hook is not None:
        return hook(data if isinstance(data, dict) else {})
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _renames(cls: type, data: Any = None) -> dict[str, str]:
    """{old key: new} of a section of `cls` holding `data`: its `section_renames` hook's, or RENAMED_KEYS."""
    hook = getattr(cls, "section_renames", None)
    if hook is not None:
        return hook(data if isinstance(data, dict) else {})
    return getattr(cls, "RENAMED_KEYS", {})


def _from_dict(cls: type[T], data: dict, where: str) -> T:
    hints = _keys(cls, data)
    unknown = [k for k in data if k not in hints]
    if unknown:
        raise SpecheadsError(f"{where + ': ' if where else ''}unknown key(s) {unknown}; known keys: {sorted(hints)}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    try:
        obj = cls(**kwargs)
    except TypeError as e:
        raise SpecheadsError(f"{where or cls.__name__}: {e}") from None
    return obj


def config_to_dict(cfg: Any) -> dict:
    """A config as plain data (dataclasses.asdict, except that a section with `to_section` writes itself)."""
    if hasattr(cfg, "to_section"):
        return cfg.to_section()
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = config_to_dict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else _deepcopy(v)
    return out


def flatten_config(d: dict, prefix: str = "") -> dict[str, Any]:
    """A config dict (config_to_dict, or a written YAML read back) as {dotted key: value}; lists stay values."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def changed_settings(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (old, new)} of the keys both flat dicts hold with different values (sorted by key); a key only
    one side has (a field added or removed since) cannot be compared and is left out."""
    return {k: (old[k], new[k]) for k in sorted(old.keys() & new.keys()) if old[k] != new[k]}


def _parse_override(raw: str, tp: Any, flag: str) -> Any:
    """A dotted override's value: YAML, except that a string field takes the text as written (YAML would read
    `train.mixed_precision=no` as false); an optional string field also takes null / ~ as None. Text that is not
    valid YAML, or holds a YAML tag (`!!python/...`), is one SpecheadsError naming the override."""
    if raw == "":
        return ""
    str_field = tp is str or (typing.get_origin(tp) in (typing.Union, types.UnionType)
                              and set(typing.get_args(tp)) == {str, type(None)})
    if str_field:
        return None if (tp is not str and raw in ("null", "~", "None")) else raw
    try:  # a tag token's value is (handle, suffix); a verbatim tag `!<tag:...>` has no handle (None)
        tags = [_tag_text(t.value) for t in yaml.scan(raw) if isinstance(t, yaml.TagToken)]
        if tags:
            raise SpecheadsError(f"{flag}: YAML tags are not allowed in a value (found {tags[0]!r}); write the "
                                 f"value plainly, e.g. a number, true/false or a list [a, b]")
        return yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise SpecheadsError(f"{flag}: not a valid value ({_yaml_problem(e)}); lists are written [a, b], "
                             f"mappings {{k: v}}") from None


def _tag_text(value: tuple) -> str:
    """A YAML tag as written: `!!python/...` (handle and suffix) or `!<tag:...>` (verbatim: no handle)."""
    handle, suffix = value
    return f"{handle}{suffix}" if handle is not None else f"!<{suffix}>"


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's error on one line: the problem and, for a one-line text, the column."""
    mark = getattr(e, "problem_mark", None)
    at = f" at column {mark.column + 1}" if mark is not None else ""
    what = getattr(e, "problem", None) or (str(e).splitlines() or [type(e).__name__])[0]
    return f"{what}{at}"


def _set_dotted(data: dict, cls: type, key: str, raw: str, flag: str) -> None:
    parts = key.split(".")
    cur_cls, cur = cls, data
    for i, p in enumerate(parts):
        fields = _keys(cur_cls, cur)
        if p not in fields:
            raise SpecheadsError(f"{flag}: unknown key {'.'.join(parts[: i + 1])!r}; known keys here: {sorted(fields)}")
        tp = fields[p]
        if i == len(parts) - 1:
            cur[p] = _coerce(_parse_override(raw, tp, flag), tp, flag)  # a bad value names the flag, not the file
        else:
            if not _is_dc_type(tp):
                raise SpecheadsError(f"{flag}: {'.'.join(parts[: i + 1])!r} is not a section")
            cur = cur.setdefault(p, {})
            if not isinstance(cur, dict):
                raise SpecheadsError(f"{flag}: {'.'.join(parts[: i + 1])!r} is not a section")
            cur_cls = tp


def renamed_keys(cls: type, prefix: str = "", data: Any = None) -> dict[str, str]:
    """{old dotted key: new dotted key} over `cls` and its sections (their RENAMED_KEYS); `data` (a config dict,
    e.g. config_to_dict of the recipe) for the sections whose renames depend on their contents."""
    data = data if isinstance(data, dict) else {}
    out = {f"{prefix}{old}": f"{prefix}{new}" for old, new in _renames(cls, data).items()}
    for name, tp in _keys(cls, data).items():
        if _is_dc_type(tp):
            out.update(renamed_keys(tp, f"{prefix}{name}.", data.get(name)))
    return out


def _both_names(old: str, new: str) -> SpecheadsError:
    return SpecheadsError(f"{old} and {new}: the same setting under its old and its new name; keep only {new}")


def _upgrade(cls: type, data: dict, where: str, renames: list[tuple[str, str]]) -> dict:
    """A section's mapping with its old keys (cls.RENAMED_KEYS) moved to their new ones, sections recursively. An
    old name that is also a section now (`lora`) is old only when its value is not a mapping."""
    hints = _keys(cls, data)
    fields = set(hints)
    old_map = _renames(cls, data)
    out, moved = {}, []
    for k, v in data.items():
        if k in old_map and not (k in fields and isinstance(v, dict)):
            moved.append((k, v))
        else:
            out[k] = v
    for k, v in moved:
        old, new = (f"{where}.{k}" if where else k), (f"{where}.{old_map[k]}" if where else old_map[k])
        *sections, last = old_map[k].split(".")
        cur = out
        for p in sections:
            cur = cur.setdefault(p, {})
            if not isinstance(cur, dict):
                raise _both_names(old, new)
        if last in cur:
            raise _both_names(old, new)
        cur[last] = v
        renames.append((old, new))
    for k, v in out.items():
        if k in fields and isinstance(v, dict) and _is_dc_type(hints[k]):
            out[k] = _upgrade(hints[k], v, f"{where}.{k}" if where else k, renames)
    return out


def _field_type(cls: type, key: str, data: Any = None) -> Any:
    """The annotated type of dotted `key` in `cls` (holding `data`), or None when it names no field."""
    tp: Any = cls
    for p in key.split("."):
        keys = _keys(tp, data) if _is_dc_type(tp) else {}
        if p not in keys:
            return None
        tp, data = keys[p], data.get(p) if isinstance(data, dict) else None
    return tp


def _selectors(cls: type, prefix: str = "") -> list[str]:
    """Dotted keys of the SELECTOR fields of `cls`'s sections (a field that picks its section's other keys)."""
    out = [f"{prefix}{cls.SELECTOR}"] if getattr(cls, "SELECTOR", None) else []
    if getattr(cls, "section_keys", None) is None:
        for name, tp in _keys(cls).items():
            if _is_dc_type(tp):
                out += _selectors(tp, f"{prefix}{name}.")
    return out


def upgrade_flat(flat: dict[str, Any], renamed: dict[str, str], where: str) -> dict[str, Any]:
    """A flat {dotted key: value} (flatten_config of a written recipe) with its old keys under their new names
    (`renamed`: renamed_keys of the recipe class); `where` names the source in the both-names error."""
    out = {k: v for k, v in flat.items() if k not in renamed}
    for k, v in flat.items():
        if k in renamed:
            if renamed[k] in out:
                raise SpecheadsError(f"{where}: {_both_names(k, renamed[k])}")
            out[renamed[k]] = v
    return out


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Build `cls` from a YAML file (optional) and `key.sub=value` overrides (values parsed as YAML)."""
    data: dict = {}
    where = ""
    if path is not None:
        path = Path(path)
        where = str(path)
        if path.is_dir():
            raise SpecheadsError(f"{path}: is a folder, not a config file")
        try:  # bounded: a recipe is kilobytes, a device or pipe that never ends is refused, not read forever
            loaded = yaml.safe_load(read_bytes_bounded(path, str(path)).decode("utf-8"))
        except FileNotFoundError:
            raise SpecheadsError(f"{path}: config file not found") from None
        except UnicodeDecodeError as e:
            raise SpecheadsError(f"{path}: not a text file (byte {e.start}: {e.reason})") from None
        except OSError as e:
            raise SpecheadsError(f"{path}: cannot read the config file ({e.strerror or e})") from None
        except yaml.YAMLError as e:  # one line: the problem and where (PyYAML's own text spans several lines)
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            what = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise SpecheadsError(f"{path}: not valid YAML{at}: {what}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise SpecheadsError(f"{path}: expected a mapping at the top level")
        data = {k: v for k, v in loaded.items() if k not in DOC_KEYS}
    renames: list[tuple[str, str]] = []
    data = _deepcopy(data)
    selectors = _selectors(cls)
    for ov in overrides:  # a selector first: the file's old keys are read for the section it picks
        given, _, raw = ov.partition("=")
        if given.strip() in selectors:
            _set_dotted(data, cls, given.strip(), raw, f"override {ov!r}")
    try:
        data = _upgrade(cls, data, "", renames)
    except SpecheadsError as e:
        raise SpecheadsError(f"{where}: {e}" if where else str(e)) from None
    said = [f"{old} -> {new} ({where})" for old, new in renames]
    flags: dict[str, str] = {}  # dotted key -> the override that set it
    spelled: dict[str, str] = {}  # dotted key -> how an override spelled it
    renamed = renamed_keys(cls, data=data)
    for ov in overrides:
        if "=" not in ov:
            raise SpecheadsError(f"override {ov!r}: expected key.sub=value")
        given, raw = ov.split("=", 1)
        given = given.strip()
        key = given
        if given in renamed and not (_is_dc_type(_field_type(cls, given, data)) and raw.lstrip().startswith("{")):
            key = renamed[given]
            said.append(f"{given} -> {key} (override {ov!r})")
        if spelled.get(key, given) != given:
            old = given if given != key else spelled[key]
            raise SpecheadsError(f"override {ov!r}: {_both_names(old, key)}")
        spelled[key] = given
        _set_dotted(data, cls, key, raw, f"override {ov!r}")
        flags[key] = f"override {ov!r}"
    if said:
        log.warning("old key names read under their new ones (write the new names): %s", ", ".join(said))
    try:
        return _from_dict(cls, data, "")
    except SpecheadsError as e:
        raise SpecheadsError(_name_source(str(e), flags, where)) from None


def _name_source(msg: str, flags: dict[str, str], path: str) -> str:
    """Prefix an error that starts with a dotted key with where its value came from: the override flag, else the
    file (a default value is never wrong, so one of the two set it)."""
    m = re.match(r"([A-Za-z_][\w.]*)(\[\d+\])?:", msg)
    if m and m.group(1) in flags:
        return f"{flags[m.group(1)]}: {msg}"
    return f"{path}: {msg}" if path else msg


def _deepcopy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deepcopy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deepcopy(v) for v in d]
    if dataclasses.is_dataclass(d) and not isinstance(d, type):  # a list of sections (data.sources)
        return config_to_dict(d)
    return d


def format_config(cfg: Any) -> str:
    """The resolved config as YAML (printed at start, nanoGPT style)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False).rstrip()


def save_config(cfg: Any, path: str | Path) -> None:
    from specheads.utils import atomic_write_text

    atomic_write_text(path, format_config(cfg) + "\n")


def non_default_settings(cfg: Any) -> dict[str, Any]:
    """{dotted key: value} of `cfg`'s settings that differ from its class's defaults, in the config's order. The
    defaults are built with `cfg`'s own selectors (head.kind, ...), so a kind's own section is compared with that
    kind's defaults; a key the defaults lack counts as differing."""
    flat = flatten_config(config_to_dict(cfg))
    selectors = [k for k in _selectors(type(cfg)) if k in flat]
    picks = [f"{k}={flat[k] if isinstance(flat[k], str) else json.dumps(flat[k])}" for k in selectors]  # JSON: YAML
    defaults = flatten_config(config_to_dict(load_config(type(cfg), None, picks)))
    plain = flatten_config(config_to_dict(load_config(type(cfg))))  # a selector differs from these (head.kind)
    defaults.update({k: plain.get(k) for k in selectors})
    return {k: v for k, v in flat.items() if k not in defaults or defaults[k] != v}


def format_changes(cfg: Any, full: str | Path, same_as: str | Path | None = None) -> str:
    """What a command prints of its resolved config: one line when it equals the config written at `same_as` (train
    after prepare of the same recipe), else the settings that differ from the defaults, one per line; `full` names
    the file holding the whole resolved config."""
    mine = yaml.safe_load(format_config(cfg))
    if same_as is not None and Path(same_as).is_file():
        try:
            if yaml.safe_load(Path(same_as).read_text()) == mine:
                return f"recipe: as prepared ({same_as}); the full resolved config: {full}"
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            pass  # unreadable: the settings below say it all
    changed = non_default_settings(cfg)
    show = {k: v if isinstance(v, str) else json.dumps(v) for k, v in changed.items()}
    return "\n".join([f"recipe: {len(changed)} settings differ from the defaults (the full resolved config: {full})"]
                     + [f"  {k}: {v}" for k, v in show.items()])
