"""A run dir's config_history/: one entry per launch (NNNN.yaml, written by run_config.record_launch) and, beside
it, what that launch decided only once its model was built (NNNN.resolved.yaml, `record_resolved`).

What is resolved late: model.attention_backend=auto (measured on rank 0 and broadcast) and the fast paths after
JUSTRL_FAST_PATHS_OFF (model/fast_paths.py). A launch that resolves them otherwise than the launch before says so in
one line, or stops under model.fast_paths.strict_resume: the two attention kernels' bf16 gradients differ by up to
3e-2, so a resumed run would not continue on the numerics it started with.
This module imports nothing of the project: the policy (model/) records through it, and the resume check
(run_config.py) reads the same entries.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf

HISTORY_DIR = "config_history"
RESOLVED = ".resolved.yaml"  # NNNN.resolved.yaml beside NNNN.yaml
UNSET = "(unset)"  # a key one of the two configs lacks (a setting added or removed by a code update)


def history_dir(run_dir) -> Path:
    return Path(run_dir) / HISTORY_DIR


def history(run_dir) -> list[Path]:
    """The history entries of a run dir, oldest first."""
    folder = history_dir(run_dir)
    return sorted(p for p in folder.glob("[0-9][0-9][0-9][0-9]*.yaml")
                  if not p.name.endswith(RESOLVED)) if folder.is_dir() else []


def show(value) -> str:
    return repr(value) if isinstance(value, str) and value != UNSET else str(value)


class ResolvedChoiceChanged(RuntimeError):
    """A launch resolved its fast paths otherwise than the one before, under model.fast_paths.strict_resume."""


def _resolved_of(entry: Path) -> dict | None:
    path = entry.with_name(entry.stem + RESOLVED)
    try:
        return dict(OmegaConf.to_container(OmegaConf.load(path)))
    except (OSError, ValueError):
        return None  # an entry from before resolved choices were recorded: nothing to compare


def record_resolved(run_dir, choices: dict, *, strict: bool = False) -> str | None:
    """Write `choices` (dotted key -> value, e.g. FastPaths.record()) beside the newest history entry, this launch's
    (rank 0, after the model is built), and compare them with the launch before. Returns one line naming what
    differs (None: nothing, or nothing to compare with); raises ResolvedChoiceChanged instead under `strict`.
    Writes nothing where the run dir has no history (a policy built outside justrl-train)."""
    entries = history(run_dir)
    if not entries:
        return None
    current = entries[-1]
    path = current.with_name(current.stem + RESOLVED)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.create(dict(choices))))
    os.replace(tmp, path)  # a reader never sees half a record
    before = _resolved_of(entries[-2]) if len(entries) > 1 else None
    if before is None:
        return None
    differ = [f"{k} {show(before.get(k, UNSET))} -> {show(v)}" for k, v in choices.items()
              if before.get(k, UNSET) != v]
    if not differ:
        return None
    line = (f"this launch resolved {', '.join(differ)} where the last launch ({entries[-2].name}) had the other "
            f"(numerics differ slightly: bf16 gradients of the two attention kernels by up to 3e-2); set the keys "
            f"explicitly to keep the earlier choice")
    if strict:
        raise ResolvedChoiceChanged(f"{line}; model.fast_paths.strict_resume=true stops the run")
    return line
