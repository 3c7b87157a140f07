"""The schema's keys, before any value is judged: unknown keys (hydra's `+key=value` appends even into a structured
schema, so a typo such as +trainer.lrr=1 would compose and train with the default), renamed keys, a command-line
value of the wrong type, a YAML bool that is not true / false; each one line that says what to write instead.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import typing
from pathlib import Path

from omegaconf import OmegaConf

from .schema import JustRLConfig

@functools.lru_cache(maxsize=None)
def schema_keys(cls: type = None, prefix: str = "") -> dict[str, str]:
    """Every dotted key of the schema -> "section" (a dataclass), "free" (a dict: any keys below it) or "value"."""
    cls = cls or JustRLConfig
    keys, hints = {}, typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path, kind = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(kind):
            keys[path] = "section"
            keys.update(schema_keys(kind, path + "."))
        else:
            keys[path] = "free" if kind is dict or typing.get_origin(kind) is dict else "value"
    return keys


# keys that were renamed: the old name -> the new one (an old key is refused in one line that names the new one)
RENAMED = {
    "rollout.max_turns": "rollout.tool.max_turns",
    **{f"rollout.tool_{name}": f"rollout.tool.{name}"
       for name in ("timeout_s", "memory_mb", "max_output_chars", "workers", "sandbox", "packages")},
}


def key_problem(key: str) -> str | None:
    """None when `key` (dotted) is a schema key or lies under a free-form dict field; else what is wrong with it."""
    if key in RENAMED:
        return f"{key} is now {RENAMED[key]}: rename it"
    keys, parts = schema_keys(), key.split(".")
    for i in range(1, len(parts) + 1):
        kind = keys.get(".".join(parts[:i]))
        if kind is None or (kind == "value" and i < len(parts)):
            break
        if kind == "free" or i == len(parts):
            return None
    return f"unknown key {key}{closest_key_hint(key)}"


def _field_type(key: str):
    """The schema's type of a dotted key (typing form, e.g. Optional[int]), or None for a free-form key."""
    cls, kind = JustRLConfig, None
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return None
        kind = typing.get_type_hints(cls).get(part)
        cls = kind
    return kind


_TYPE_WORDS = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}


def value_type_problem(key: str, value) -> str | None:
    """Why `value` (a command-line override of the schema key `key`, as hydra's parser reads it) cannot be its value,
    else None. hydra would refuse it in a multi-line merge error; a bool takes true or false only, where OmegaConf
    would read 2 or "yes" as true. Interpolations are left to the composed config."""
    kind = _field_type(key)
    if kind is None or (isinstance(value, str) and "${" in value):
        return None
    optional = type(None) in typing.get_args(kind)
    base = next((a for a in typing.get_args(kind) if a is not type(None)), kind) if optional else kind
    items = typing.get_args(base)[0] if typing.get_origin(base) is list else None
    words = _TYPE_WORDS.get(base) or ("a list, e.g. [a, b]" if items in _TYPE_WORDS else None)
    wanted = f"{key} must be {words}{' (or null)' if optional else ''}, got {_written(value)}"
    if base is bool and not isinstance(value, bool) and not (optional and value is None):
        return wanted
    probe = OmegaConf.structured(JustRLConfig)
    try:
        OmegaConf.update(probe, key, value, merge=True)
    except Exception as exc:  # noqa: BLE001  (OmegaConf's ValidationError / ConfigKeyError: the value does not fit)
        return wanted if words else f"{key}={_written(value)}: {str(exc).splitlines()[0]}"
    return None


def config_file_problems() -> list[str]:
    """`yaml_bool_problems` for the files hydra.main composed this run from (its primary config and each group's
    choice, in its search path: the package's configs/ and any --config-dir); [] outside hydra.main (`compose`)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    hc = HydraConfig.get()
    folders = [str(source.path) for source in hc.runtime.config_sources if source.schema == "file"]
    files = [("", hc.job.config_name)] + [(group, option) for group, option in hc.runtime.choices.items()
                                          if isinstance(option, str) and not group.startswith("hydra")]
    return yaml_bool_problems(folders, files)


def yaml_bool_problems(folders, files) -> list[str]:
    """A line for every value of a bool key in these YAML files that is not true / false (null where the key is
    Optional): OmegaConf reads a YAML 2 or 1 into a bool field as true, where the command line refuses it
    (value_type_problem). `files`: (group, option) pairs, each read from the first of `folders` that holds
    group/option.yaml; its keys are under its package (the group's, or the one its `# @package` line names).
    Other types need no check here: a value that does not fit them fails at composition."""
    keys, out = schema_keys(), []
    for group, option in files:
        path = next((Path(f, group, f"{option}.yaml") for f in folders if Path(f, group, f"{option}.yaml").is_file()),
                    None)
        if path is None:
            continue
        text = path.read_text()
        header = re.search(r"^#\s*@package\s+(\S+)", text, re.MULTILINE)
        package = header.group(1) if header else "_group_"
        package = "" if package == "_global_" else package.replace("_group_", group.replace("/", "."))
        raw = OmegaConf.to_container(OmegaConf.create(text), resolve=False) or {}
        if not isinstance(raw, dict):
            continue
        stack = [(f"{package}.{k}" if package else str(k), v) for k, v in raw.items() if k not in ("defaults", "hydra")]
        while stack:
            key, value = stack.pop()
            kind = keys.get(key)
            if kind == "section" and isinstance(value, dict):
                stack += [(f"{key}.{k}", v) for k, v in value.items()]
            elif kind == "value" and not (isinstance(value, str) and "${" in value):
                field_type = _field_type(key)
                optional = type(None) in typing.get_args(field_type)
                if bool in (field_type, *typing.get_args(field_type)) and not isinstance(value, bool) \
                        and not (optional and value is None):
                    out.append(f"{path}: {key} must be true or false{' (or null)' if optional else ''}, "
                               f"got {_written(value)}")
    return sorted(out)


def _written(value) -> str:
    """A command-line value as it was written: null, true, 'text', [1, 2]."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value)


def closest_key_hint(key: str) -> str:
    """"; did you mean X?" with the closest schema key: the same name in another section, else the first misspelt
    part corrected where that is a section (trainr.lr -> trainer.lr), else a near spelling of the whole key."""
    all_keys = schema_keys()
    parts = key.split(".")
    match = [k for k, kind in all_keys.items() if kind != "section" and k.rsplit(".", 1)[-1] == parts[-1]]
    bad = next((i for i in range(len(parts)) if ".".join(parts[:i + 1]) not in all_keys), len(parts) - 1)
    if not match and bad < len(parts) - 1:
        prefix = ".".join(parts[:bad] + [""])
        siblings = [k[len(prefix):] for k in all_keys if k.startswith(prefix) and "." not in k[len(prefix):]]
        near = difflib.get_close_matches(parts[bad], siblings, n=1, cutoff=0.5)
        fixed = ".".join(parts[:bad] + near + parts[bad + 1:])
        match = [fixed if fixed in all_keys else prefix + near[0]] if near else []
    match = match or difflib.get_close_matches(key, [k for k, kind in all_keys.items() if kind != "section"], n=1)
    return f"; did you mean {match[0]}?" if match else " (the schema, config/schema.py, has no such key)"


def composition_problem(exc: BaseException) -> str | None:
    """One line for hydra's error when a YAML file of the config sets a key the schema lacks ("recipe/mine:
    rollout.tool_workers is now rollout.tool.workers: rename it"), else None (hydra's own first line says it)."""
    text = str(exc)
    key = re.search(r"full_key: (\S+)", text)
    problem = key_problem(key.group(1)) if key else None
    if problem is None:
        return None
    where = re.match(r"In '([^']+)'", text)
    return f"{where.group(1)}: {problem}" if where else problem


def unknown_keys(cfg) -> list[str]:
    """A problem for every key of a composed config that the schema lacks (those added with hydra's `+`)."""
    def walk(node, prefix, known):
        for k, v in node.items():
            path = f"{prefix}{k}"
            kind = schema_keys().get(path) if known else None
            if kind == "free" or (kind == "value" and not isinstance(v, dict)):
                continue
            if isinstance(v, dict) and v and kind != "value":
                yield from walk(v, path + ".", kind == "section")
            else:
                yield key_problem(path)

    plain = OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False)
    return [p for p in walk({k: v for k, v in plain.items() if k != "hydra"}, "", True) if p is not None]


def _schema_default(key: str):
    """The schema's default of a dotted key, or None (free-form keys, list items, required fields)."""
    node = JustRLConfig()
    for part in key.split("."):
        if not dataclasses.is_dataclass(node) or not hasattr(node, part):
            return None
        node = getattr(node, part)
    return node
