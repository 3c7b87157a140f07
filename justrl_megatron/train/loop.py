"""The GRPO training loop. `run(cfg)` reads top to bottom like the algorithm:

    sample prompts -> rollout (vLLM) -> rewards (worker pool) [-> more rounds: algo.dynamic_sampling]
    -> reward shaping (algo.overlong_buffer) -> group advantages -> reference logprobs (with algo.kl_coef > 0,
    train/reference.py) -> old logprobs (skipped for one on-policy optimizer step) -> mini-batch GRPO updates
    -> weight sync -> metrics (+ avg@n on data.val every trainer.eval_every steps, train/validation.py)
    -> checkpoint

Every rank runs this same program (SPMD). Colocated (the default), each rank hosts a vLLM engine (one per rollout-TP
group) that samples its share of the prompts; every rank gets the whole batch back. On GPU the engine sleeps while
the policy trains and wakes after the weight sync (train/placement.py). Split (rollout.placement=split), the last
rollout.num_rollout_ranks ranks run train/split_rollout.serve instead of this loop and the trainer ranks reach them
through the same small interface. The reward pool lives on rank 0 and its results are broadcast, so all trainer
ranks see the same batch and split it by data parallelism themselves. Phases 1-3 are one unit
(train/async_rollout.py) so that one-step-off training (rollout.max_staleness=1) can start the next step's before
this step's update.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from ..algo.dynamic_sampling import ScoredBatch, collect_groups, round_seed
from ..algo.grpo import group_advantages
from ..algo.overlong import shape_rewards
from ..checkpoint import CheckpointError, load_latest_checkpoint, save_checkpoint
from ..console import quiet_console
from ..convert.export import export_hf_stream
from ..convert.load import load_hf_weights
from ..distributed import init_distributed, init_split
from ..metrics import MetricsLogger, plot_curves, step_metrics
from ..model.lora import has_lora
from ..model.policy import Policy
from .reference import Reference
from ..rewards import make_scorer
from ..rollout import RolloutEngine, SamplingConfig, check_staleness, logprob_gap, make_engine
from ..slurm import current_job, describe
from .async_rollout import RolloutPipeline
from .batching import Sample
from .hf_snapshots import HFSnapshots
from .interrupt import Interruptible
from .placement import ColocatedRollout
from .profiling import StepProfiler
from .sampler import PromptSampler, load_training_rows, tokenize_prompts
from .split_rollout import SplitRollout, serve, trainer_broadcast
from .step import compute_logprobs, grpo_update, grpo_update_on_policy, skip_limit_message
from .validation import Validation


def run(cfg, model_dir: Path, shape, *, engine: RolloutEngine | None = None) -> int:
    """Train; returns the last completed step. `engine` replaces the vLLM engine the config asks for (tests)."""
    tr, ro, algo = cfg.trainer, cfg.rollout, cfg.algo
    quiet_console(verbose=cfg.logging.verbose)
    roles = init_split(ro.num_rollout_ranks) if ro.placement == "split" else None
    if roles is not None and not roles.is_trainer:
        serve(cfg, model_dir, roles)  # a rollout rank: generate and take weights until the trainer says stop
        return 0
    rank, _ = init_distributed()
    is_leader = rank == 0
    run_dir = Path(tr.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    stop = Interruptible().install()  # SIGTERM / SIGUSR1 / Ctrl-C: finish the step, checkpoint, exit 0

    # --- set-up: prompts, policy, rollout engine, verifier ----------------------------------------------------------
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or model_dir)
    prompts, too_long = tokenize_prompts(load_training_rows(cfg.data, seed=tr.seed), tokenizer, cfg.data)
    sampler = PromptSampler(prompts, tr.prompts_per_step, seed=tr.seed, shuffle=cfg.data.shuffle)
    heldout = _heldout_prompts(cfg, tokenizer)
    validation = Validation(cfg, tokenizer, enabled=is_leader)  # data.val, every trainer.eval_every steps

    policy = Policy.from_config(cfg, shape)
    start_step, inflight_state = _restore(policy, sampler, run_dir, model_dir, progress=is_leader, mode=tr.resume)
    # the KL penalty's reference policy: adapters off with LoRA, else a frozen copy of the initial weights
    reference = Reference.for_policy(policy, model_dir) if algo.kl_coef > 0 else None
    hf_snapshots = HFSnapshots(run_dir, tr.hf_every, tr.keep_last, tr.total_steps, policy.chunks, shape, model_dir)

    def export(bucket_bytes):
        return export_hf_stream(policy.chunks, shape, bucket_bytes=bucket_bytes, include_tied_lm_head=True)

    if roles is not None:
        rollout = SplitRollout(roles, export, model_dir=model_dir, bucket_mb=ro.weight_sync_bucket_mb)
    else:
        rollout = ColocatedRollout(engine or make_engine(cfg, model_dir, seed=tr.seed), export,
                                   bucket_mb=ro.weight_sync_bucket_mb)
    scorer = make_scorer(algo, enabled=is_leader)
    sampling = SamplingConfig.from_rollout_config(ro)
    pipeline = RolloutPipeline(rollout, sampler, scorer, tokenizer, n=ro.n, sampling=sampling, seed=tr.seed,
                               leader=is_leader, max_staleness=ro.max_staleness)
    inflight = pipeline.restore(inflight_state)  # a batch that was in flight at the checkpoint (one-step-off)
    logger = MetricsLogger(run_dir, cfg.logging, config=_plain_config(cfg), total_steps=tr.total_steps,
                           start_step=start_step, enabled=is_leader)
    if start_step > 0:
        logger.print(f"resumed from {run_dir} at step {start_step} ({describe(current_job())})")
    if too_long:
        logger.print(f"{too_long} prompts longer than data.max_prompt_length={cfg.data.max_prompt_length} were dropped")
    if validation.sets:
        logger.print(validation.describe())
    profiler = StepProfiler(tr.profile_steps, run_dir, rank)

    version = start_step
    rollout.publish(version)
    start_accuracy = _evaluate(rollout, heldout, scorer, tokenizer, ro) if start_step == 0 else None
    if start_step == 0 and validation.due(0):
        logger.log(0, validation.run(rollout, 0))

    step, diverged = start_step, None
    while step < tr.total_steps:
        step += 1
        profiler.step_started(step)
        timer = _PhaseTimer()

        # 1-3. sample prompts -> rollout (version = number of updates so far; seeded per step and round) -> rewards.
        #      Round 0 is one unit (train/async_rollout.py): on-policy it runs now; one-step-off
        #      (rollout.max_staleness=1) it was started before the previous step's update, and the trainer waits only
        #      for what is not done yet (time/wait_rollout_s). With algo.dynamic_sampling, groups whose rewards are
        #      all equal are dropped and more rounds are drawn and generated now until trainer.prompts_per_step groups
        #      are left (at most algo.max_sampling_rounds; algo/dynamic_sampling.py).
        if inflight is None:
            inflight = pipeline.start(step)
        with timer("wait_rollout"):
            first = pipeline.collect(inflight)
        timer.seconds |= first.seconds
        staleness = check_staleness(first.rollouts.weight_version, version, ro.max_staleness)
        first_round = [first.prompts]

        def draw_batch():
            return first_round.pop() if first_round else sampler.next_batch()

        def generate_and_score(prompts, round_index):
            if round_index == 0:
                return ScoredBatch(first.prompts, first.rollouts, first.rewards, first.correct, first.reward_stats)
            return _rollout_and_score(rollout, pipeline, prompts, ro, sampling, timer, version,
                                      seed=round_seed(tr.seed, step, round_index))

        scored, sampling_stats = collect_groups(draw_batch, generate_and_score, group_size=ro.n,
                                                num_groups=tr.prompts_per_step, max_rounds=algo.max_sampling_rounds,
                                                enabled=algo.dynamic_sampling)
        batch, rollouts, rewards, correct, reward_stats = (scored.prompts, scored.rollouts, scored.rewards,
                                                           scored.correct, scored.reward_stats)
        if sampling_stats is not None and sampling_stats.shortfall():
            logger.print(f"step {step}: {sampling_stats.shortfall()}")
        # one-step-off: the next step's round 0 starts now, generating with the current weights while this step updates
        inflight = pipeline.start(step + 1) if pipeline.ahead and step < tr.total_steps else None

        # 4. reward shaping (algo.overlong_buffer: a length penalty; algo.mask_truncated: truncated responses leave
        #    the loss, in the update) and group advantages. reward/mean stays the verifier's reward.
        shaped, shaping_metrics = shape_rewards(
            rewards, [len(t) for t in rollouts.token_ids], rollouts.truncated, max_length=ro.max_response_length,
            buffer=algo.overlong_buffer, factor=algo.overlong_penalty_factor, mask_truncated=algo.mask_truncated)
        advantages = group_advantages(torch.tensor(shaped, dtype=torch.float32), ro.n,
                                      norm_by_std=algo.norm_adv_by_std)
        samples = [Sample(prompt_ids=batch[i // ro.n].ids, response_ids=rollouts.token_ids[i],
                          advantage=float(advantages[i]), rollout_logprobs=rollouts.logprobs[i], group=i // ro.n,
                          truncated=bool(rollouts.truncated[i]))
                   for i in range(len(rollouts.token_ids))]

        # 5-6. the trainer's turn on the devices (a colocated engine sleeps): old logprobs (the policy that sampled,
        #      recomputed by the trainer), then mini-batch GRPO updates. One optimizer step on fresh samples needs no
        #      separate pass: the update's forward gives them.
        step_kw = dict(max_tokens_per_micro_batch=tr.max_tokens_per_micro_batch, clip_low=algo.clip_low,
                       clip_high=algo.clip_high, dual_clip_c=algo.dual_clip_c, loss_agg=algo.loss_agg,
                       kl_coef=algo.kl_coef, kl_estimator=algo.kl_estimator, entropy_coef=algo.entropy_coef,
                       mask_truncated=algo.mask_truncated, rollout_correction=algo.rollout_correction,
                       tis_cap=algo.tis_cap)
        one_fresh_step = rollouts.weight_version == version and tr.mini_batch_size >= tr.prompts_per_step
        with rollout.training():
            if reference is not None:
                with timer("ref_logprob"):
                    step_kw["ref_logprobs"] = reference.logprobs(
                        samples, max_tokens_per_micro_batch=tr.max_tokens_per_micro_batch)
            if one_fresh_step and tr.old_logprobs == "auto":
                with timer("update"):
                    update, old_logprobs = grpo_update_on_policy(policy, samples, **step_kw)
            else:
                with timer("old_logprob"):
                    old_logprobs = compute_logprobs(policy, samples,
                                                    max_tokens_per_micro_batch=tr.max_tokens_per_micro_batch)
                with timer("update"):
                    update = grpo_update(policy, samples, old_logprobs, mini_batch_size=tr.mini_batch_size * ro.n,
                                         **step_kw)

        # 7. weight sync into the rollout engine, which wakes up for the next step
        with timer("sync"):
            version = step
            rollout.publish(version)

        # 8. metrics, and when due the validation of the new weights (avg@n on data.val) in the same record
        metrics = step_metrics(
            rewards=rewards, correct=correct, reward_stats=reward_stats, rollouts=rollouts,
            prompt_tokens=sum(len(s.prompt_ids) for s in samples),
            logprob_gap=logprob_gap(rollouts.logprobs, old_logprobs), update=update,
            phase_seconds=timer.seconds, step_seconds=timer.elapsed())
        metrics |= shaping_metrics | (sampling_stats.metrics() if sampling_stats is not None else {})
        metrics["rollout/staleness"] = staleness
        if validation.due(step):
            metrics |= validation.run(rollout, step)
        logger.log(step, metrics)

        # 9. checkpoint (periodic, at the end, or when asked to stop; or after too many skipped optimizer steps: the
        #    weights are then still the last good ones). Every rank agrees on the skips (train/step.py).
        diverged = skip_limit_message(policy.skipped_in_a_row, tr.max_skipped_steps)
        stopping = stop.agreed() or diverged is not None
        if stopping or step % tr.save_every == 0 or step == tr.total_steps:
            save_checkpoint(run_dir, step, policy.chunks, policy.optimizer, policy.scheduler,
                            {"step": step, "sampler": sampler.state_dict(), "inflight": pipeline.state(inflight)},
                            keep_last=tr.keep_last, shape=shape, hf_source=model_dir)
        hf_snapshots.maybe_save(step)  # trainer.hf_every: run_dir/hf/step_N, an HF folder of the live weights
        trace = profiler.step_finished(step, stopping)
        if trace is not None:
            logger.print(f"profile of steps {tr.profile_steps[0]}-{step}: {trace}")
        if stopping:
            logger.print(diverged or stop.message(step))
            break

    if step == tr.total_steps:
        end_accuracy = _evaluate(rollout, heldout, scorer, tokenizer, ro)
    if is_leader and step == tr.total_steps:
        if start_accuracy is not None:
            logger.print(f"held-out accuracy (greedy, {len(heldout)} problems): start {start_accuracy:.3f} -> "
                         f"end {end_accuracy:.3f}")
        _write_heldout(run_dir, start_accuracy, end_accuracy)
        logger.print(f"curves: {plot_curves(run_dir)}")
    logger.close()
    validation.close()
    if scorer is not None:
        scorer.close()
    rollout.shutdown()
    if diverged is not None:  # a failed run, not a requeue: exit non-zero (the message was printed above)
        raise SystemExit(1)
    return step


# --- helpers (each small; the loop above is the algorithm) ------------------------------------------------------------

class _PhaseTimer:
    """Seconds per phase of one step; each phase is also a named range in a profiler trace."""

    def __init__(self):
        self.seconds, self._t0 = {}, time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, phase):
        t = time.perf_counter()
        with torch.profiler.record_function(phase):
            yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0


def _rollout_and_score(rollout, pipeline, prompts, ro, sampling, timer, version, *, seed) -> ScoredBatch:
    """One extra round of phases 2-3: rollouts of ``prompts`` (ro.n each), checked for staleness, scored on rank 0
    (the pipeline's scoring) and broadcast."""
    with timer("rollout"):
        rollouts = rollout.generate([p.ids for p in prompts], ro.n, sampling, seed=seed)
    check_staleness(rollouts.weight_version, version, ro.max_staleness)
    with timer("reward"):
        rewards, correct, reward_stats = trainer_broadcast(
            pipeline.score(prompts, rollouts) if pipeline.leader else None)
    return ScoredBatch(list(prompts), rollouts, list(rewards), list(correct), reward_stats)


def _restore(policy, sampler, run_dir, model_dir, *, progress: bool, mode: str = "auto") -> tuple[int, dict | None]:
    """Resume from the run dir's latest intact checkpoint (weights, optimizer, LR schedule, sampler), or start from
    the HF weights; returns the step to continue after and the batch that was in flight then (one-step-off). A
    damaged checkpoint is named; trainer.resume=auto falls back to the newest intact one, strict stops (exit code 2,
    no traceback: every rank agrees on the verdict)."""
    def warn(message):
        print(f"justrl-train: warning: {message}", file=sys.stderr, flush=True)

    lora = has_lora(policy.chunks)
    if lora:  # LoRA checkpoints hold the adapters only: the frozen base weights always come from the HF folder
        load_hf_weights(policy.chunks, model_dir, progress=progress)
    try:
        resumed = load_latest_checkpoint(run_dir, policy.chunks, policy.optimizer, policy.scheduler,
                                         strict=mode == "strict", warn=warn)
    except CheckpointError as exc:
        if progress:  # rank 0 speaks for all
            print(f"justrl-train: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if resumed is None:
        if not lora:
            load_hf_weights(policy.chunks, model_dir, progress=progress)
        policy.optimizer.reload_model_params()  # mixed-precision optimizers keep their own fp32 copies
        return 0, None
    sampler.load_state_dict(resumed["sampler"])
    return int(resumed["step"]), resumed.get("inflight")


def _write_heldout(run_dir, start, end) -> None:
    """heldout_accuracy.json, valid JSON in every case: null where there is no number (no held-out set with
    trainer.eval_samples=0, no start after a resume); written atomically."""
    def number(x):
        return None if x is None or not math.isfinite(x) else float(x)

    tmp = run_dir / ".heldout_accuracy.json.tmp"
    tmp.write_text(json.dumps({"start": number(start), "end": number(end)}, allow_nan=False) + "\n")
    os.replace(tmp, run_dir / "heldout_accuracy.json")


def _heldout_prompts(cfg, tokenizer):
    """A fixed set of problems the policy never trains on, for start vs end accuracy."""
    if cfg.trainer.eval_samples <= 0:
        return []
    rows = load_training_rows(cfg.data, seed=cfg.trainer.seed, split="eval", limit=cfg.trainer.eval_samples)
    return tokenize_prompts(rows, tokenizer, cfg.data)[0]


def _evaluate(rollout, prompts, scorer, tokenizer, ro) -> float | None:
    """Greedy accuracy on the held-out prompts (every rank generates its share; rank 0 scores)."""
    if not prompts:
        return None
    greedy = SamplingConfig(temperature=0.0, max_tokens=ro.max_response_length)
    out = rollout.generate([p.ids for p in prompts], 1, greedy, seed=0)
    if scorer is None:
        return None
    texts = tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
    return sum(scorer.evaluate(texts, [p.answer for p in prompts])[1]) / len(prompts)


def _plain_config(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)
