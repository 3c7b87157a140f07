"""The hydra entry point of justrl-train: the command line's keys -> compose -> every check that needs neither megatron
nor vLLM (values, model, data, resume), all problems in one message (rc 2) -> the run dir locked (run_lock.py: a
second trainer on it exits 2) -> the launch recorded -> the GRPO loop. Every process the run starts dies with it
(lifeline.py); Ctrl-C saves, twice aborts (train/interrupt.py); a full disk is one line (exit 1)."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import sys
from pathlib import Path

import hydra
from hydra.experimental.callback import Callback

from . import lifeline, run_lock
from .config import (CONFIG_DIR, ConfigError, config_warnings, data_name_problems, key_problem, register,
                     validate)
from .console import quiet_console

register()

# config groups (configs/<group>/<option>.yaml): `group=option` on the command line chooses a file, it sets no key
GROUPS = frozenset(p.name for p in CONFIG_DIR.iterdir() if p.is_dir())
DATA_SAMPLE_ROWS = 4  # rows read to check a data source: enough to see its columns and the template at work

_cli_problems: list[str] = []  # unknown command-line keys, reported together with what check_config finds


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def override_problems(args: list[str]) -> tuple[list[str], list[str]]:
    """(problems, the arguments left for hydra): a problem for every override of a key the schema lacks. hydra
    refuses `key=v` with the advice to append it as `+key=v`, and `+key=v` then composes into the schema."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    problems, kept = [], []
    for arg in args:
        key = None
        if not arg.startswith("-"):
            try:
                (override,) = parser.parse_overrides([arg])
                key = None if override.package else override.key_or_group
            except Exception:  # noqa: BLE001  (not an override, e.g. a flag's value: hydra reads it)
                key = None
        if key is None or key.split(".")[0] == "hydra" or "/" in key or key in GROUPS:
            kept.append(arg)
            continue
        problem = key_problem(key)
        if problem is None:
            kept.append(arg)
        else:
            problems.append(problem)
    return problems, kept


def check_config(cfg, *, also=()):
    """Everything that can be checked without starting megatron or vLLM: the config's keys and values, the model
    folder, the data (a few rows read), on resume what changed since the last launch, then the memory plan
    (apply_memory_plan: cfg gets concrete values). Raises one ConfigError with every problem (`also`: ones the caller
    found), or the plan's MemoryPlanError. On success rank 0 lists the settings a resume changes and records the
    launch, as written, in run_dir/config_history/. Returns (model_dir, ModelShape)."""
    from .run_config import record_launch

    launched = copy.deepcopy(cfg)  # the history keeps what was asked for, not what the memory plan made of it
    problems = list(also)
    run_dir = run_dir_problem(cfg.trainer.run_dir)
    problems += [run_dir] if run_dir else []
    model_dir, shape = _model(cfg, problems)
    if not data_name_problems(cfg.data):  # a bad format or template is reported once, by validate
        found = data_problems(cfg)
        problems += found or (prompt_length_problems(cfg, model_dir) if model_dir is not None else [])
    resume = resume_check(cfg, shape) if _is_rank0() else None  # rank 0 decides; torchrun stops the others
    if resume is not None:
        problems += resume.problems
    validate(cfg, world_size=_world_size(), shape=shape, also=problems)
    if _is_rank0():
        for warning in config_warnings(cfg):
            print(f"justrl-train: warning: {warning}", file=sys.stderr, flush=True)
    apply_memory_plan(cfg, shape)
    if resume is not None:
        note = resume.describe(cfg.trainer.run_dir)
        if note:
            print(f"justrl-train: {note}", flush=True)
        lock_run_dir(cfg)  # (held since hydra started: RunDirLock; a no-op then) before the launch is recorded
        record_launch(launched, resume.step, resume.fingerprints)
    return model_dir, shape


def lock_run_dir(cfg) -> None:
    """Rank 0 takes the run dir's lock for the process' life (run_lock.py; idempotent). Raises RunDirBusy (another
    trainer holds it) or ConfigError (the lock file cannot be created)."""
    if not _is_rank0():
        return
    try:
        run_lock.hold(cfg.trainer.run_dir)
    except OSError as exc:
        raise ConfigError(f"trainer.run_dir={cfg.trainer.run_dir}: cannot write there "
                          f"({exc.strerror or exc})") from None


class RunDirLock(Callback):
    """hydra callback (configs/config.yaml): the lock is taken when the run starts, before hydra writes its files
    (run_dir/hydra/) and before any slow check, so a second trainer on the run dir exits 2 at once, in one line."""

    def on_run_start(self, config, **kwargs) -> None:
        if not _is_rank0():  # the other ranks write only once the lock is this launch's (run_lock.join_launch)
            try:
                run_lock.join_launch(config.trainer.run_dir)
            except run_lock.RunDirBusy:
                sys.exit(2)  # rank 0 says why, in one line
            except TimeoutError as exc:
                print(f"justrl-train: rank {os.environ.get('RANK')}: {exc}", file=sys.stderr)
                sys.exit(1)
            return
        try:
            lock_run_dir(config)
        except (run_lock.RunDirBusy, ConfigError) as exc:
            print(f"justrl-train: {'error: ' if isinstance(exc, run_lock.RunDirBusy) else ''}{exc}", file=sys.stderr)
            sys.exit(2)  # (SystemExit passes hydra's error reporting, which would print a traceback)


def _model(cfg, problems: list[str]):
    """(model_dir, shape), or (None, None) with the reason added to `problems`."""
    from transformers import AutoConfig

    from .assets import resolve_model_path
    from .model.hf_config import model_shape

    if cfg.model.tokenizer:
        from transformers import AutoTokenizer

        folder = Path(cfg.model.tokenizer).expanduser()
        try:
            if not folder.exists() and (cfg.model.tokenizer.startswith((".", "/", "~")) or len(folder.parts) > 2):
                raise FileNotFoundError("no such folder")
            AutoTokenizer.from_pretrained(cfg.model.tokenizer)
        except (OSError, ValueError) as exc:
            problems.append(f"model.tokenizer={cfg.model.tokenizer}: {str(exc).splitlines()[0]} (give a folder with "
                            f"the tokenizer files, or leave it unset for the model's own)")
    try:
        model_dir = resolve_model_path(cfg.model.path)
        return model_dir, model_shape(AutoConfig.from_pretrained(model_dir))
    except (OSError, ValueError) as exc:  # FileNotFoundError is an OSError
        problems.append(str(exc))
        return None, None


def data_problems(cfg) -> list[str]:
    """data.train (and data.eval) read as the loop will read them, a few rows each, through the chat template: a
    missing file, a missing column, an empty or unreadable source become one line each."""
    from .data import build_messages
    from .data.sampler import load_training_rows

    problems = []
    for split, key in (("train", "data.train"), ("eval", "data.eval")):
        if split == "eval" and not cfg.data.eval:
            continue
        try:
            # the loader's summary line would describe the sample, not the data set; the loop prints the real one
            with contextlib.redirect_stderr(io.StringIO()):
                rows = load_training_rows(cfg.data, seed=cfg.trainer.seed, split=split, limit=DATA_SAMPLE_ROWS)
            for row in rows:
                build_messages(row["problem"], cfg.data.template, cfg.data.system_prompt)
        except Exception as exc:  # noqa: BLE001  (whatever the reader raises, the data is the user's to fix)
            what = str(exc) if isinstance(exc, (OSError, ValueError)) else f"{type(exc).__name__}: {exc}"
            problems.append(f"{key}: {what}")
    return problems


def run_dir_problem(run_dir) -> str | None:
    """Why trainer.run_dir cannot hold a run (empty: hydra would write into the current folder; an existing file;
    not writable), else None. Writes nothing."""
    text = "" if run_dir is None else str(run_dir).strip()
    if not text:
        return ("trainer.run_dir is empty: name the folder that holds the run (checkpoints, metrics, logs), e.g. "
                "trainer.run_dir=runs/my_run")
    path = Path(text).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"trainer.run_dir={run_dir}: {existing} is an existing file, not a folder; choose another path"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"trainer.run_dir={run_dir}: {existing} is not writable (read-only); choose a writable folder"
    return None


def _run_dir_of(args: list[str]) -> str | None:
    """trainer.run_dir as the command line's overrides compose it (None where they do not compose: hydra says why)."""
    from omegaconf import OmegaConf

    from .config import compose

    overrides = [a for a in args if not a.startswith("-") and "=" in a
                 and not a.lstrip("+~").startswith("hydra.")]
    try:
        return OmegaConf.select(compose(overrides), "trainer.run_dir", default=None)
    except Exception:  # noqa: BLE001 - hydra reports a bad override itself
        return None


def prompt_length_problems(cfg, model_dir) -> list[str]:
    """A problem for each data split (data.train, data.eval as the held-out evaluation reads it, every data.val set)
    whose prompts are all longer than data.max_prompt_length (after the chat template): a few rows first, all of them
    only when none of those fits."""
    from transformers import AutoTokenizer

    from .data.sampler import load_training_rows, tokenize_prompts
    from .train.validation import length_problems

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or model_dir)
    splits = [("train", "data.train", None)]
    if cfg.data.eval and cfg.trainer.eval_samples > 0:
        splits.append(("eval", "data.eval", cfg.trainer.eval_samples))
    problems = []
    with contextlib.redirect_stderr(io.StringIO()):
        for split, key, limit in splits:
            rows = load_training_rows(cfg.data, seed=cfg.trainer.seed, split=split, limit=DATA_SAMPLE_ROWS)
            if tokenize_prompts(rows, tokenizer, cfg.data)[0]:
                continue
            rows = load_training_rows(cfg.data, seed=cfg.trainer.seed, split=split, limit=limit)
            prompts, too_long = tokenize_prompts(rows, tokenizer, cfg.data)
            if not prompts:
                problems.append(f"data.max_prompt_length={cfg.data.max_prompt_length}: all {too_long} prompts of "
                                f"{key} are longer (with data.template={cfg.data.template}); raise it or use shorter "
                                f"prompts")
        problems += length_problems(cfg, tokenizer)
    return problems


def resume_check(cfg, shape):
    """A run_config.ResumeCheck of this launch against the run dir's checkpoint and config history."""
    from .run_config import ResumeCheck

    run_dir = Path(cfg.trainer.run_dir)
    if not (run_dir / "checkpoints").is_dir():
        return ResumeCheck(cfg, None)
    from .checkpoint import latest_step, read_meta, step_dir  # megatron: only when there is something to resume

    step = latest_step(run_dir)
    saved_shape = read_meta(step_dir(run_dir, step)).get("shape") if step is not None else None
    return ResumeCheck(cfg, step, saved_shape=saved_shape, shape=shape)


def apply_memory_plan(cfg, shape):
    """Resolve model.recompute (auto) and clamp trainer.max_tokens_per_micro_batch with the memory plan, so the loop
    and Policy.build see concrete values (the end of check_config: nothing writes into cfg after it). On a GPU the
    plan is printed in one line (rank 0); on the CPU auto becomes none and the budget stays. Raises MemoryPlanError
    (a ValueError) when a manual setting cannot fit."""
    from .model.memory import resolve_recompute
    from .rollout.placement import trainer_world_size

    plan = resolve_recompute(cfg, shape, trainer_world_size(cfg, _world_size()))
    if plan is not None and _is_rank0():
        print(f"justrl-train: {plan.describe()}", flush=True)
    return plan


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base=None)
def _hydra_main(cfg) -> None:
    try:
        model_dir, shape = check_config(cfg, also=_cli_problems)
    except (ConfigError, FileNotFoundError, ValueError) as exc:  # MemoryPlanError is a ValueError
        print(f"justrl-train: {exc}", file=sys.stderr)
        sys.exit(2)
    except run_lock.RunDirBusy as exc:
        print(f"justrl-train: error: {exc}", file=sys.stderr)
        sys.exit(2)
    quiet_console(verbose=cfg.logging.verbose)  # the composed config decides (a recipe may set it)
    from .checkpoint import CheckpointError, CheckpointWriteError
    from .train.loop import run

    try:
        run(cfg, model_dir, shape)
    except (CheckpointWriteError, CheckpointError) as exc:  # a full disk (where, how much), non-finite weights
        # (every rank raises it; the checkpoints already there are kept)
        if _is_rank0():
            print(f"justrl-train: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)


def main() -> None:
    """justrl-train [overrides]: unknown keys are taken off the command line (so that hydra composes the rest and
    every other problem is found too) and reported with them."""
    lifeline.bind_helpers_to_this_process()  # before any helper process exists
    run_lock.adopt_inherited()  # under justrl's launcher: the run dir's lock, taken for the whole launch
    _cli_problems[:], sys.argv[1:] = override_problems(sys.argv[1:])
    # before hydra, which creates the run dir and writes into it (an empty value: into the current folder)
    run_dir = _run_dir_of(sys.argv[1:]) if not _cli_problems else None
    problem = run_dir_problem(run_dir) if run_dir is not None else None
    if problem is not None:
        print(f"justrl-train: invalid config: {problem}", file=sys.stderr)
        sys.exit(2)
    try:
        _hydra_main()
    except KeyboardInterrupt:  # Ctrl-C before the loop's own handler (train/interrupt.py) is in place
        print("justrl-train: interrupted before training started; nothing was saved", file=sys.stderr)
        sys.exit(130)
