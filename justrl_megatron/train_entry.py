"""The hydra entry point of justrl-train: the command line's keys and value types -> compose -> every check that needs
neither megatron nor vLLM (values, model, data, resume), all problems in one message (rc 2) -> the run dir locked
(run_lock.py: a second trainer on it exits 2) -> the launch recorded (hydra/, config_history/) -> the GRPO loop. Every
process the run starts dies with it (lifeline.py); Ctrl-C saves, twice aborts (train/interrupt.py); a full disk is one
line (exit 1).

A refused launch leaves nothing behind: hydra writes no files of its own (configs/config.yaml), run_dir/hydra/ and
train_entry.log are written once the checks pass, and a run dir this launch created is removed again. Every rank
refuses (exit 2); local rank 0 says why, once per machine. `--validate-only` runs the same checks and starts nothing
(launch/slurm/train.sbatch calls it on the batch host before srun); `--cfg` refuses the command line's own problems
(unknown keys, wrong types) before hydra prints the config."""

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
from .config.checks import config_warnings, data_name_problems, validate
from .config.keys import composition_problem, key_problem, value_type_problem
from .config.schema import CONFIG_DIR, ConfigError, register
from .console import quiet_console

register()

# config groups (configs/<group>/<option>.yaml): `group=option` on the command line chooses a file, it sets no key
GROUPS = frozenset(p.name for p in CONFIG_DIR.iterdir() if p.is_dir())
DATA_SAMPLE_ROWS = 4  # rows read to check a data source: enough to see its columns and the template at work

_cli_problems: list[str] = []  # the command line's unknown keys and wrong types, reported with check_config's
_created: list[Path] = []  # what this launch creates for the run dir (created_by_launch), undone on a refusal


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _speaks() -> bool:
    """Whether this rank prints a refusal: local rank 0 (every rank composes the same config; once per machine, so a
    problem seen on one node only is said too)."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) == 0


def refuse(message: str, code: int = 2, *, run_dir=None):
    """Exit with `code` after `message` (written once, in one piece, so ranks never interleave), undoing what this
    launch created for `run_dir` (rank 0, the lock holder)."""
    if _speaks():
        os.write(2, f"justrl-train: {message}\n".encode())
    if run_dir is not None and _is_rank0() and _created:
        run_lock.release(run_dir)
        remove_unused(run_dir, _created[0])
    sys.exit(code)


def created_by_launch(run_dir) -> Path | None:
    """What taking the run dir's lock creates: the outermost of the lock file and the folders above it that does not
    exist yet, or None."""
    lock = Path(run_dir).expanduser().absolute() / run_lock.LOCK_FILE
    missing = [p for p in (lock, *lock.parents) if not p.exists()]
    return missing[-1] if missing else None


def remove_unused(run_dir, created: Path) -> None:
    """Undo what a refused launch created (`created`: created_by_launch's, before the lock was taken): the lock file,
    and the folders up to `created` while the lock file is all they hold; whatever else is there stays."""
    path = Path(run_dir).expanduser().absolute()
    lock = path / run_lock.LOCK_FILE
    if created != lock and (not path.is_dir() or any(p != lock for p in path.iterdir())):
        return
    with contextlib.suppress(FileNotFoundError):
        lock.unlink()
    if created == lock:
        return
    for folder in (path, *path.parents):
        try:
            folder.rmdir()
        except OSError:  # not empty: something else lives there
            return
        if folder == created:
            return


def override_problems(args: list[str]) -> tuple[list[str], list[str]]:
    """(problems, the arguments left for hydra): a problem for every override of a key the schema lacks (hydra
    refuses `key=v` with the advice to append it as `+key=v`, and `+key=v` then composes into the schema) and for
    every value of the wrong type (hydra: a multi-line merge error)."""
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
        if problem is None and not override.is_delete() and not override.is_sweep_override():
            problem = value_type_problem(key, override.value())
        if problem is None:
            kept.append(arg)
        else:
            problems.append(problem)
    return problems, kept


def check_config(cfg, *, also=(), launch: bool = True):
    """Everything that can be checked without starting megatron or vLLM: the config's keys and values, the model
    folder, the data (a few rows read), on resume what changed since the last launch, then the memory plan
    (apply_memory_plan: cfg gets concrete values). Raises one ConfigError with every problem (`also`: ones the caller
    found), or the plan's MemoryPlanError. On success, when `launch`, rank 0 lists the settings a resume changes and
    records the launch, as written, in run_dir/config_history/ (launch=False: --validate-only, nothing written).
    Returns (model_dir, ModelShape)."""
    from .run_config import record_launch
    from .train.teacher import problems as teacher_problems

    launched = copy.deepcopy(cfg)  # the history keeps what was asked for, not what the memory plan made of it
    problems = list(also)
    run_dir = run_dir_problem(cfg.trainer.run_dir)
    problems += [run_dir] if run_dir else []
    model_dir, shape = _model(cfg, problems)
    problems += teacher_problems(cfg, model_dir, shape)  # algo.distill.teacher: folder, vocabulary, layout
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
    if resume is not None and launch:
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
    """trainer.run_dir as the command line's overrides compose it (None where they do not compose: hydra says why,
    unless a YAML file sets a key the schema lacks: refused here in one line, composition_problem)."""
    from omegaconf import OmegaConf

    from .config.schema import compose

    try:
        return OmegaConf.select(compose(_task_overrides(args)), "trainer.run_dir", default=None)
    except Exception as exc:  # noqa: BLE001 - hydra reports a bad override itself
        problem = composition_problem(exc)
        if problem is not None:
            refuse(f"invalid config: {problem}")
        return None


def _task_overrides(args: list[str]) -> list[str]:
    """The command line's overrides of the config itself (hydra's flags, their values and hydra.* left out), and
    hydra's `--config-dir` as a search path: what a launch composes, without hydra's run context."""
    from hydra._internal.utils import get_args_parser

    known, _ = get_args_parser().parse_known_args(args)
    extra = [f"hydra.searchpath=[file://{os.path.abspath(known.config_dir)}]"] if known.config_dir else []
    return [a for a in args if not a.startswith("-") and "=" in a
            and not a.lstrip("+~").startswith("hydra.")] + extra


def prompt_length_problems(cfg, model_dir) -> list[str]:
    """A problem for each data split (data.train, data.eval as the held-out evaluation reads it, every data.val set)
    whose prompts are all longer than data.max_prompt_length (after the chat template): a few rows first, all of them
    only when none of those fits."""
    from transformers import AutoTokenizer

    from .data.sampler import load_training_rows, load_training_source, none_fit, tokenize_prompts
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
            source = load_training_source(cfg.data, seed=cfg.trainer.seed, split=split, limit=limit)
            prompts, too_long = tokenize_prompts(source.rows, tokenizer, cfg.data)
            if not prompts:
                problems.append(f"data.max_prompt_length={cfg.data.max_prompt_length}: "
                                f"{none_fit(too_long, source, key)} longer (with data.template={cfg.data.template}); "
                                f"raise it or use shorter prompts")
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
    launched = copy.deepcopy(cfg)  # hydra's record keeps the config as composed, before the memory plan
    try:
        model_dir, shape = check_config(cfg, also=_cli_problems)
    except (ConfigError, FileNotFoundError, ValueError) as exc:  # MemoryPlanError is a ValueError
        refuse(str(exc), run_dir=cfg.trainer.run_dir)
    except run_lock.RunDirBusy as exc:  # another trainer's run dir: nothing of it is undone
        refuse(f"error: {exc}")
    if _is_rank0():
        keep_hydra_record(launched)
    quiet_console(verbose=cfg.logging.verbose)  # the composed config decides (a recipe may set it)
    from .checkpoint import CheckpointError, CheckpointWriteError, commit_pending
    from .liveness import PeerLost
    from .train.loop import run

    try:
        run(cfg, model_dir, shape)
    except (CheckpointWriteError, CheckpointError) as exc:  # a full disk (where, how much), non-finite weights
        # (every rank raises it; the checkpoints already there are kept)
        if _is_rank0():
            print(f"justrl-train: error: {exc}", file=sys.stderr, flush=True)
        lifeline.end_after_rank_0_said(_is_rank0())
    except PeerLost as exc:  # a rollout rank stopped answering (every trainer rank raises it at the same point)
        commit_pending()  # the save being written when it happened is kept
        if _is_rank0():
            from .checkpoint import latest_step

            latest = latest_step(cfg.trainer.run_dir)
            kept = f"latest checkpoint: step {latest}" if latest is not None else "no checkpoint yet"
            print(f"justrl-train: error: {exc}; the run ends as for a dead rank ({kept})", file=sys.stderr,
                  flush=True)
        lifeline.end_after_rank_0_said(_is_rank0())


def keep_hydra_record(cfg) -> None:
    """run_dir/hydra/ as hydra writes it (config.yaml, hydra.yaml, overrides.yaml) and the log file
    run_dir/train_entry.log, once the checks passed (configs/config.yaml turns hydra's own writing off)."""
    import logging

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    hydra_cfg = HydraConfig.get()
    out = Path(hydra_cfg.runtime.output_dir)
    (out / "hydra").mkdir(parents=True, exist_ok=True)
    for name, node in (("config.yaml", cfg), ("hydra.yaml", HydraConfig.instance().cfg),
                       ("overrides.yaml", hydra_cfg.overrides.task)):
        (out / "hydra" / name).write_text(OmegaConf.to_yaml(node))
    root = logging.getLogger()
    handler = logging.FileHandler(out / f"{hydra_cfg.job.name}.log")
    handler.setFormatter(next((h.formatter for h in root.handlers if h.formatter), None))
    root.addHandler(handler)


def validate_only(args: list[str]) -> int:
    """justrl-train --validate-only [overrides]: every check a launch makes (check_config) with nothing written and
    nothing started; the same lines and exit 2 as a launch on a problem, else one line and 0. WORLD_SIZE (default 1)
    is the launch's number of processes (launch/slurm/train.sbatch: nodes x processes per node)."""
    from .config.schema import compose

    problems, kept = override_problems(args)
    try:
        cfg = compose(_task_overrides(kept))
        check_config(cfg, also=problems, launch=False)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"justrl-train: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:  # noqa: BLE001  (hydra's composition errors: an unknown recipe, a bad override)
        print(f"justrl-train: invalid config: {composition_problem(exc) or str(exc).splitlines()[0]}",
              file=sys.stderr, flush=True)
        return 2
    print(f"justrl-train: config ok for {_world_size()} process(es)", flush=True)
    return 0


def _prints_config(args: list[str]) -> bool:
    """Whether hydra's --cfg / -c is on the command line (hydra then prints the config and runs nothing)."""
    from hydra._internal.utils import get_args_parser

    known, _ = get_args_parser().parse_known_args(args)
    return known.cfg is not None


def main() -> None:
    """justrl-train [overrides]: unknown keys and values of the wrong type are taken off the command line (so that
    hydra composes the rest and every other problem is found too) and reported with them."""
    lifeline.bind_helpers_to_this_process()  # before any helper process exists
    run_lock.adopt_inherited()  # under justrl's launcher: the run dir's lock, taken for the whole launch
    _cli_problems[:], sys.argv[1:] = override_problems(sys.argv[1:])
    if _cli_problems and _prints_config(sys.argv[1:]):  # the printed config would lack the keys taken off
        refuse(str(ConfigError.listing(_cli_problems)))
    # before hydra, which creates the run dir (an empty value: the current folder)
    run_dir = _run_dir_of(sys.argv[1:])
    problem = run_dir_problem(run_dir) if run_dir is not None else None
    if problem is not None:  # with the command line's own problems, if any: every problem at once
        refuse(str(ConfigError.listing([*_cli_problems, problem])) if _cli_problems else f"invalid config: {problem}")
    created = created_by_launch(run_dir) if run_dir is not None else None
    _created[:] = [created] if created is not None else []
    try:
        _hydra_main()
    except KeyboardInterrupt:  # Ctrl-C before the loop's own handler (train/interrupt.py) is in place
        print("justrl-train: interrupted before training started; nothing was saved", file=sys.stderr)
        sys.exit(130)
