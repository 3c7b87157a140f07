"""Each launch of a run, kept: run_dir/config_history/0001.yaml, 0002.yaml, ... and what a resume changes.

Rerunning a command on a run dir with a checkpoint resumes it. The config may differ from the previous launch's; the
newest history entry is the previous launch, so before any heavy work the two are compared:
  * settings the checkpoint pins (PINNED: the model and its layout, the prompt stream the saved sampler position
    indexes, the seed) stop the run with one message;
  * every other difference takes effect (the LR schedule too: model/policy.py lets the config override the saved
    scheduler) and is listed once, by rank 0.
Data is pinned by content too: each launch records a fingerprint of every data source it reads (data.train,
data.eval, data.val[i].path) beside its history entry (NNNN.data.json): the sha256 of a local file, the revision a hub
dataset name resolves to (the hub's commit, or offline the cached copy's, as `datasets` loads it). On resume a changed
data.train stops the run (the saved sampler position indexes its rows), a changed data.eval or validation set is read
anew and said so, one line each.
hydra's run_dir/hydra/config.yaml is rewritten by every launch that passed the checks; the history keeps every such
launch, resolved, with the command that made it.
What a launch decides only once the model is built is recorded beside its entry by run_history.record_resolved.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from .run_history import UNSET, history, history_dir, show as _show


_SAMPLER = "the saved sampler position indexes the prompt list this setting builds"
_LAYOUT = ("the checkpoint's optimizer state and RNG states are laid out for the model-parallel sizes it was saved "
           "at (only the number of data-parallel ranks may change); to train at another layout, export the weights "
           "(`justrl-convert mcore-to-hf --ckpt RUN_DIR --out DIR`) and start a new run from DIR")
# key (or a prefix of keys) -> why a checkpoint pins it
PINNED = {
    "model.path": "the checkpoint holds this model's weights",
    "model.tokenizer": "the token ids the policy learned are this tokenizer's",
    "model.dtype": "the optimizer state was saved in this precision",
    "model.make_vocab_size_divisible_by": "it sets the padded vocabulary of the saved embedding",
    "model.lora.enabled": "the checkpoint holds LoRA adapters only, or full weights without adapters",
    "model.lora.rank": "the saved adapters have this rank",
    "model.lora.alpha": "the saved adapters were trained at scale alpha / rank",
    "model.lora.targets": "the saved adapters sit on these linears",
    # What a resume may change in the layout: the data-parallel size (the number of ranks over the fixed TP x PP x CP,
    # and EP inside it): weights, optimizer state (the distributed optimizer's dp_reshardable format too) and schedule
    # reshard, and the run goes on (RNG states, per rank, are then not restored). The model-parallel sizes are pinned:
    # the distributed optimizer's saved state is laid out for them (checkpoint/state.py), and RNG states are per rank.
    "parallel.tensor": _LAYOUT,
    "parallel.pipeline": _LAYOUT,
    "parallel.virtual_pipeline": _LAYOUT,
    "parallel.context": _LAYOUT,
    "parallel.expert": _LAYOUT,
    "parallel.distributed_optimizer": "the optimizer state was saved in this optimizer's format",
    "data.train": _SAMPLER,
    "data.format": _SAMPLER,
    "data.num_generated": _SAMPLER,
    "data.task_options": _SAMPLER,
    "data.template": _SAMPLER + " (prompts over data.max_prompt_length are dropped)",
    "data.system_prompt": _SAMPLER + " (prompts over data.max_prompt_length are dropped)",
    "data.max_prompt_length": _SAMPLER + " (prompts over it are dropped)",
    "data.dedup": _SAMPLER,
    "data.shuffle": _SAMPLER,
    "trainer.seed": "the prompt order and every step's rollout seed derive from it",
    "algo.distill.teacher": "the run distils from this teacher: another one is another objective",
}


def flatten(tree, prefix: str = "") -> dict:
    """{"trainer.lr": 1e-6, ...}: dotted keys of the leaves (lists are leaves; an empty dict is a leaf)."""
    if not isinstance(tree, dict) or not tree:
        return {prefix[:-1]: tree}
    out = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}{key}."))
    return out


def pinned_root(key: str) -> str | None:
    """The PINNED entry that covers `key` (itself, or a dict it lies under), or None."""
    return next((p for p in PINNED if key == p or key.startswith(p + ".")), None)


FINGERPRINTS = ".data.json"  # NNNN.data.json beside NNNN.yaml
_HASH_CHUNK = 1 << 20


def _fingerprint(spec) -> str | None:
    """sha256 of a local data file (of a folder: its data files' names and contents), "revision:<commit>" of a hub
    dataset name, None for the rest (generated:<task> and builtin:<name> are the package's own; a source that does not
    resolve is reported by the data check)."""
    from .data.builtin import BUILTIN_PREFIX

    if not spec or str(spec).startswith(("generated:", BUILTIN_PREFIX)):
        return None
    path = Path(str(spec)).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".parquet", ".jsonl", ".json"))
    else:
        return _hub_revision(str(spec))
    digest = hashlib.sha256()
    for file in files:
        digest.update(str(file.relative_to(path) if file != path else file.name).encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def _hub_revision(name: str) -> str | None:
    """"revision:<commit>" that hub dataset `name` ("owner/name[:config]", data/loaders.py) resolves to, as
    `datasets.load_dataset` resolves it: the hub's newest commit, or offline the newest cached copy's; None when it
    is not a hub name or does not resolve."""
    import logging

    from .data.loaders import _looks_like_path

    if _looks_like_path(name):
        return None
    import datasets

    repo, _, config = name.partition(":")
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.ERROR)  # its "using the latest cached version" lines: the data check says them once
    try:
        revision = datasets.load_dataset_builder(repo, config or None).hash
    except Exception:  # noqa: BLE001  (offline and not cached, unknown name: the data check reports it)
        return None
    finally:
        logger.setLevel(level)
    return f"revision:{revision}" if revision else None


def data_fingerprints(cfg) -> dict:
    """{"data.train": {"path": ..., "fingerprint": "sha256:..." | "revision:..."}, ...} for every data source of the
    config that has one."""
    specs = {"data.train": cfg.data.train, "data.eval": cfg.data.eval}
    specs.update({f"data.val[{i}].path": entry.path for i, entry in enumerate(cfg.data.val)})
    out = {}
    for key, spec in specs.items():
        fingerprint = _fingerprint(spec)
        if fingerprint is not None:
            out[key] = {"path": str(spec), "fingerprint": fingerprint}
    return out


def _saved_fingerprints(entry: Path) -> dict:
    try:
        return json.loads(entry.with_name(entry.stem + FINGERPRINTS).read_text())
    except (OSError, ValueError):
        return {}  # an entry from before fingerprints existed (or damaged): nothing to compare


class ResumeCheck:
    """The previous launch vs this one, for a run dir with a checkpoint at `step` (None: a fresh start).
    `saved_shape` (the checkpoint's metadata "shape") and `shape` (this launch's ModelShape) compare the model itself,
    also for a run from before the history existed."""

    def __init__(self, cfg, step: int | None, *, saved_shape: dict | None = None, shape=None):
        self.step, self.previous, self.changes, self.problems = step, None, [], []
        self.fingerprints = data_fingerprints(cfg)  # recorded with the launch (record_launch)
        if step is None:
            return
        if saved_shape and shape is not None:
            now_shape = dataclasses.asdict(shape)
            differ = [f"{k} {v} -> {now_shape.get(k)}" for k, v in saved_shape.items() if v != now_shape.get(k)]
            if differ:
                self.problems.append(f"model.path={cfg.model.path} is not the model of the checkpoint at step {step} "
                                     f"({', '.join(differ)}); resume with the model the run started from, or start a "
                                     f"new run (another trainer.run_dir)")
        if cfg.trainer.total_steps < step:
            self.problems.append(f"trainer.total_steps={cfg.trainer.total_steps} is below the checkpoint's step "
                                 f"{step}; raise it to continue the run")
        entries = history(cfg.trainer.run_dir)
        if not entries:
            return  # a run from before the history existed: nothing to compare with
        self.previous = entries[-1]
        before = flatten(OmegaConf.to_container(OmegaConf.load(self.previous), resolve=False))
        now = flatten(OmegaConf.to_container(cfg, resolve=True))
        for key in sorted(before.keys() | now.keys()):
            old, new = before.get(key, UNSET), now.get(key, UNSET)
            if old == new:
                continue
            root = pinned_root(key)
            if root is not None and any(k == root or k.startswith(root + ".") for k in before):
                self.problems.append(
                    f"{key} changed since the last launch ({_show(old)} -> {_show(new)}) but the checkpoint at step "
                    f"{step} pins it: {PINNED[root]}. Set it back, or start a new run (another trainer.run_dir)")
            else:
                self.changes.append(f"{key}: {_show(old)} -> {_show(new)}")
        self._compare_data(_saved_fingerprints(self.previous), step)

    def _compare_data(self, saved: dict, step: int) -> None:
        """A data source at the same path or name with other content: data.train is refused, the others are read
        anew."""
        for key, now in self.fingerprints.items():
            then = saved.get(key)
            if then is None or then.get("path") != now["path"] or then.get("fingerprint") == now["fingerprint"]:
                continue  # new, moved (a changed setting: compared above) or unchanged
            what = f"{key}={now['path']}: its content changed since the last launch ({_short(then['fingerprint'])} " \
                   f"-> {_short(now['fingerprint'])})"
            if key == "data.train":
                hub = now["fingerprint"].startswith("revision:")
                restore = ("Make that revision the newest copy in the datasets cache and launch offline "
                           "(HF_HUB_OFFLINE=1)" if hub else "Restore the file")
                self.problems.append(f"{what} but the checkpoint at step {step} pins it: {PINNED['data.train']}. "
                                     f"{restore}, or start a new run (another trainer.run_dir)")
            else:
                self.changes.append(f"{what}; it is read anew")

    def describe(self, run_dir) -> str | None:
        """The changes that take effect, for rank 0 to print once (None when nothing changed)."""
        if not self.changes:
            return None
        lines = "\n".join(f"  {c}" for c in self.changes)
        return (f"resuming {run_dir} at step {self.step} with settings changed since the last launch "
                f"({self.previous.name}):\n{lines}")


def _short(fingerprint: str) -> str:
    """"sha256:0123456789ab" / "revision:0123456789ab": enough of a fingerprint to tell two apart."""
    kind, _, digest = fingerprint.partition(":")
    return f"{kind}:{digest[:12]}"


def record_launch(cfg, step: int | None, fingerprints: dict | None = None) -> Path:
    """Write this launch's resolved config as the next history entry, and its data files' fingerprints beside it
    (`fingerprints`: ResumeCheck's, else computed; rank 0, after the checks passed)."""
    folder = history_dir(cfg.trainer.run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    entries = history(cfg.trainer.run_dir)
    number = int(entries[-1].stem) + 1 if entries else 1
    path = folder / f"{number:04d}.yaml"
    when = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    start = f"resumed at step {step}" if step else "fresh start"
    header = f"# launch {number}, {when}, {start}\n# command: {' '.join(sys.argv)}\n"
    tmp = path.with_name(f".{path.name}.tmp")
    data = path.with_name(path.stem + FINGERPRINTS)
    data_tmp = data.with_name(f".{data.name}.tmp")
    data_tmp.write_text(json.dumps(data_fingerprints(cfg) if fingerprints is None else fingerprints, indent=1))
    os.replace(data_tmp, data)  # before the entry: an entry never lacks the fingerprints it was launched with
    tmp.write_text(header + OmegaConf.to_yaml(cfg, resolve=True))
    os.replace(tmp, path)  # a reader never sees half an entry
    return path

