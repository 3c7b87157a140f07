"""Periodic validation inside justrl-train: avg@n and pass@n on the sets of `data.val`.

JustRL validates every 50 steps on AIME24, AIME25 and AMC23 with 32 samples per problem at temperature 0.7, top_p 0.9
(the ValSetConfig defaults). With `trainer.eval_every=K` every set is sampled through the rollout engine (which holds
the weights of the step just taken) at steps K, 2K, ..., at the last step, and at step 0 with
`trainer.eval_before_train`; rank 0 scores and logs `val/<name>/avg@<n>`, `val/<name>/pass@<n>` and
`val/<name>/response_length` with that step's record.

Scoring: a set's `reward` (null: the training reward, algo.reward with its options — JustRL's verl run scores its
validation batches with the training reward function, the strict-box DAPO rule). avg@n counts a sample as solved when
the verifier judges it fully correct, as reward/accuracy does. `justrl-eval` scores with the lenient
`dapo_then_math_verify`; set `reward: dapo_then_math_verify` on a set to compare with it.

Validation leaves the training stream alone, so a (resumed) run with validation trains on exactly the samples one
without would: each call is seeded from (trainer.seed, step, set name) in a range no training seed reaches, python /
numpy / torch global RNG states are restored afterwards, the engine's prefix cache (filled by validation prompts) is
dropped, and the sets have their own verifier instances (the loop's scorer keeps its counters).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from omegaconf import OmegaConf

# Training seeds are trainer.seed * 1_000_003 + step (+ request offsets below 2**24): far below this base
VAL_SEED_BASE = 1 << 61
SEED_BLOCK = 1 << 24  # a call's requests take seed + i * n + k (vllm_engine.sampling_params): room for 16M samples


def val_seed(train_seed: int, step: int, name: str) -> int:
    """The seed of one set's validation call at `step`: reproducible, and disjoint from every training seed."""
    digest = hashlib.sha256(f"{train_seed}:{step}:{name}".encode()).digest()
    return VAL_SEED_BASE + (int.from_bytes(digest[:8], "little") % (1 << 36)) * SEED_BLOCK


def avg_pass_at_n(correct: Sequence, n: int) -> tuple[float, float]:
    """avg@n (mean over problems of the fraction of its n samples that are correct) and pass@n (fraction of problems
    with at least one correct sample); `correct` is flat, prompt-major (n consecutive samples per problem)."""
    if n < 1 or not correct or len(correct) % n:
        raise ValueError(f"need n >= 1 samples per problem and a whole number of problems, got {len(correct)} / {n}")
    groups = [[bool(c) for c in correct[i:i + n]] for i in range(0, len(correct), n)]
    avg = sum(sum(g) / n for g in groups) / len(groups)
    return avg, sum(any(g) for g in groups) / len(groups)


def set_metrics(name: str, n: int, correct: Sequence, lengths: Sequence[int]) -> dict[str, float]:
    """The logged figures of one set: val/<name>/avg@<n>, pass@<n>, response_length (mean sampled tokens)."""
    avg, passed = avg_pass_at_n(correct, n)
    return {f"val/{name}/avg@{n}": avg, f"val/{name}/pass@{n}": passed,
            f"val/{name}/response_length": sum(lengths) / len(lengths)}


@contextlib.contextmanager
def preserved_rng():
    """Run a block without consuming the global RNG streams training may read (python, numpy, torch CPU and CUDA)."""
    import numpy as np
    import torch

    state = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
             torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])
        if state[3] is not None:
            torch.cuda.set_rng_state_all(state[3])


def plain_dict(options) -> dict:
    """A plain dict of a config's options node (null or empty: {})."""
    return OmegaConf.to_container(options, resolve=True) if options else {}


def set_name(entry) -> str:
    """data.val[i].name, or the file stem / task name of its path."""
    if entry.name:
        return str(entry.name)
    path = str(entry.path or "")
    return path.split(":", 1)[1] if path.startswith("generated:") else Path(path.rstrip("/")).name.split(".")[0]


def config_problems(cfg) -> list[str]:
    """What is wrong with data.val and trainer.eval_every, one line per problem (config.validate reports them)."""
    from ..data.loaders import FORMATS, _looks_like_path
    from ..rewards import REWARD_NAMES

    tr, ro, sets = cfg.trainer, cfg.rollout, cfg.data.val
    on = tr.eval_every > 0
    problems = []
    if tr.eval_every < 0:
        problems.append(f"trainer.eval_every must be >= 0 (0: no validation), got {tr.eval_every}")
    if on and not sets:
        problems.append(f"trainer.eval_every={tr.eval_every} but data.val has no sets; add some (e.g. data.val="
                        f"[{{path:/data/aime24.parquet,format:aime}}]) or set trainer.eval_every=0")
    names = []
    for i, entry in enumerate(sets):
        where = f"data.val[{i}]"
        path = entry.path
        if not path:
            problems.append(f"{where}: path is missing; give a parquet/jsonl/json file, a hub name or generated:<task>")
            continue
        name = set_name(entry)
        where = f"data.val[{i}] ({name})"
        if not name or "/" in name or name != name.strip():
            problems.append(f"{where}: name must be non-empty, without '/' or surrounding spaces (the metrics are "
                            f"val/<name>/...)")
        elif name in names:
            problems.append(f"{where}: another set is also named {name!r}; give each set its own name")
        names.append(name)
        generated = path.startswith("generated:")
        if on and not generated and not os.path.exists(path) and _looks_like_path(path):
            problems.append(f"{where}: no such file or directory {path}; point data.val[{i}].path at a local copy")
        if entry.format not in FORMATS:
            problems.append(f"{where}: unknown format {entry.format!r}; known: {', '.join(FORMATS)}")
        if entry.n < 1:
            problems.append(f"{where}: n (samples per problem) must be >= 1, got {entry.n}")
        if entry.temperature < 0 or not 0 < entry.top_p <= 1:
            problems.append(f"{where}: temperature must be >= 0 and top_p in (0, 1] (got {entry.temperature}, "
                            f"{entry.top_p})")
        if entry.max_tokens is not None and not 1 <= entry.max_tokens <= ro.max_response_length:
            problems.append(f"{where}: max_tokens must be in [1, rollout.max_response_length = "
                            f"{ro.max_response_length}] (the engine's context), got {entry.max_tokens}; "
                            f"null uses rollout.max_response_length")
        if entry.limit is not None and entry.limit < 1:
            problems.append(f"{where}: limit must be >= 1 (or null: the whole set), got {entry.limit}")
        if generated and entry.limit is None:
            problems.append(f"{where}: a generated set has no natural size; set data.val[{i}].limit")
        if entry.reward is not None and entry.reward not in REWARD_NAMES:
            problems.append(f"{where}: unknown reward {entry.reward!r}; known: {', '.join(REWARD_NAMES)} (null: "
                            f"algo.reward)")
        elif entry.reward is not None or entry.reward_options:
            problems += _verifier_problems(where, entry, cfg.algo)
    return problems


def _verifier_problems(where: str, entry, algo) -> list[str]:
    """The set's reward_options must be its verifier's keywords (as algo.reward_options are algo.reward's)."""
    from ..rewards import REWARD_NAMES, get_reward_fn

    name = entry.reward if entry.reward is not None else algo.reward
    if name not in REWARD_NAMES:
        return []  # algo.reward itself is wrong: config.reward_problems says so
    options = plain_dict(entry.reward_options)
    try:
        get_reward_fn(name, **options)
    except (TypeError, ValueError) as exc:
        return [f"{where}: reward_options={options} do not fit reward {name}: {exc}"]
    return []


def load_set(cfg, entry, tokenizer):
    """(prompts, how many were too long, what the loader read: a LoadResult) of one data.val set: the set as data.eval
    of a copy of data (same template, prompt length, dedup); a generated set is the held-out draw of its task
    (trainer.seed + sampler.HELDOUT_SEED_OFFSET), never training prompts."""
    from ..data.sampler import load_training_source, tokenize_prompts

    data = OmegaConf.to_container(cfg.data, resolve=True)
    set_cfg = OmegaConf.create({**data, "val": [], "eval": entry.path, "eval_format": entry.format,
                                "task_options": plain_dict(entry.task_options)})
    with preserved_rng():  # a generated set draws its rows with reasoning-gym
        loaded = load_training_source(set_cfg, seed=cfg.trainer.seed, split="eval", limit=entry.limit)
    return (*tokenize_prompts(loaded.rows, tokenizer, set_cfg), loaded)


def length_problems(cfg, tokenizer) -> list[str]:
    """A line for every data.val set none of whose prompts fits data.max_prompt_length (with the template)."""
    if cfg.trainer.eval_every <= 0:
        return []
    from ..data.sampler import none_fit

    problems = []
    for i, entry in enumerate(cfg.data.val):
        try:
            prompts, too_long, source = load_set(cfg, entry, tokenizer)
        except Exception:  # noqa: BLE001  (a missing or unreadable set: config_problems or the loader says so)
            continue
        if not prompts and too_long:
            problems.append(f"data.val[{i}] ({set_name(entry)}): {none_fit(too_long, source)} longer than "
                            f"data.max_prompt_length={cfg.data.max_prompt_length} (with data.template="
                            f"{cfg.data.template}); raise it, or drop the set")
    return problems


@dataclass
class _ValSet:
    name: str
    n: int
    prompts: list  # sampler.Prompt
    sampling: object  # rollout.SamplingConfig
    verifier: tuple  # (reward name, options)


class Validation:
    """The validation sets of a run: `due(step)`, then `run(rollout, step)` on every rank (all ranks generate; the
    leader scores and returns the metrics, the others return {})."""

    def __init__(self, cfg, tokenizer, *, enabled: bool):
        from ..rollout import SamplingConfig

        tr, self.tokenizer, self.enabled = cfg.trainer, tokenizer, enabled
        self.every, self.total_steps, self.before_train, self.seed = (
            tr.eval_every, tr.total_steps, tr.eval_before_train, tr.seed)
        self.reward_workers = cfg.algo.reward_workers
        self.sets: list[_ValSet] = []
        self.dropped: dict[str, int] = {}
        self._scorers: dict = {}
        if self.every <= 0:
            return
        for entry in cfg.data.val:
            name = set_name(entry)
            prompts, self.dropped[name], _ = load_set(cfg, entry, tokenizer)
            if not prompts:  # (length_problems refuses this before the model loads)
                raise ValueError(f"data.val set {name!r} ({entry.path}) has no problems within "
                                 f"data.max_prompt_length={cfg.data.max_prompt_length} tokens")
            sampling = SamplingConfig(max_tokens=entry.max_tokens or cfg.rollout.max_response_length,
                                      temperature=entry.temperature, top_p=entry.top_p)
            verifier = ((entry.reward, plain_dict(entry.reward_options))
                        if entry.reward is not None else (cfg.algo.reward, plain_dict(cfg.algo.reward_options)))
            self.sets.append(_ValSet(name, int(entry.n), prompts, sampling, verifier))

    def due(self, step: int) -> bool:
        """Step 0 (the initial weights, with eval_before_train), every eval_every steps, and the last step."""
        if not self.sets:
            return False
        if step == 0:
            return self.before_train
        return step % self.every == 0 or step == self.total_steps

    def describe(self) -> str:
        sets = ", ".join(f"{s.name} ({len(s.prompts)} problems x {s.n}"
                         f"{f', {self.dropped[s.name]} too long dropped' if self.dropped[s.name] else ''})"
                         for s in self.sets)
        return f"validation every {self.every} steps: {sets}"

    def run(self, rollout, step: int) -> dict[str, float]:
        """Sample and score every set with the engine's current weights; the metrics on the leader, {} elsewhere.
        A stop during it (RolloutInterrupted, on every rank) ends it with no metrics: the run then stops after
        this step."""
        from ..rollout import RolloutInterrupted
        from ..rollout.scoring import generate_and_score

        start, metrics = time.perf_counter(), {}
        with preserved_rng():
            for s in self.sets:
                # sample k of prompt i is seeded seed + i * n + k however the engine cuts the set into calls
                try:
                    got = generate_and_score(rollout, s.prompts, s.n, s.sampling,
                                             seed=val_seed(self.seed, step, s.name),
                                             scorer=self._scorer(s.verifier) if self.enabled else None,
                                             tokenizer=self.tokenizer)
                except RolloutInterrupted:
                    return {}
                if self.enabled:
                    metrics.update(set_metrics(s.name, s.n, got.correct, got.rollouts.sampled_lengths()))
        _drop_prefix_cache(rollout)
        if metrics:
            metrics["val/time_s"] = time.perf_counter() - start
        return metrics

    def _scorer(self, verifier):
        from ..rewards import BatchScorer, get_reward_fn

        key = repr(verifier)
        if key not in self._scorers:
            name, options = verifier
            self._scorers[key] = BatchScorer(get_reward_fn(name, **options), num_workers=self.reward_workers)
        return self._scorers[key]

    def close(self) -> None:
        for scorer in self._scorers.values():
            scorer.close()
        self._scorers.clear()


def _drop_prefix_cache(rollout) -> None:
    """Forget the KV blocks validation cached: the next training step then computes its prompts afresh, as it would
    without validation (a cache hit may round differently from a fresh prefill)."""
    llm = getattr(getattr(rollout, "engine", None), "llm", None)
    if llm is not None:
        llm.reset_prefix_cache()
