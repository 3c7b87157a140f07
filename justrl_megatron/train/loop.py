"""The GRPO training loop. `run(cfg)` reads top to bottom like the algorithm:

    sample prompts -> rollout (vLLM) -> rewards (worker pool) [-> more rounds: algo.dynamic_sampling]
    -> reward shaping (algo.overlong_buffer) -> group advantages -> reference logprobs (with algo.kl_coef > 0,
    train/reference.py) -> teacher logprobs (on-policy distillation, algo.distill.teacher: train/teacher.py,
    algo/distill.py) -> old logprobs (skipped for one on-policy optimizer step) -> mini-batch GRPO updates
    -> weight sync -> metrics (+ avg@n on data.val every trainer.eval_every steps, train/validation.py)
    -> checkpoint

Every trainer rank runs this same program (SPMD). Where the rollout engines run is the placement's business
(rollout/placement.py: colocated, the default, or split); the loop asks it for the devices and to publish weights.
Phases 1-3 (prompts -> scored groups: every sampling round of a step, one-step-off's batch in flight, streaming) are
the batch source's (rollout/source.py), which drives the engines through the placement's client (rollout/engines.py);
the reward pool lives on rank 0, which holds the scored batch, computes the advantages and sends each data-parallel
replica only its samples (train/shard.py). The loss settings travel as one
algo.LossConfig.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

from ..algo.grpo import compute_advantages
from ..algo.loss_config import LossConfig
from ..algo.overlong import shape_rewards
from ..checkpoint import CheckpointError, Checkpointer, latest_step, load_latest_checkpoint, save_stop_state
from ..console import quiet_console
from ..convert.export import export_hf_stream
from ..convert.load import load_hf_weights
from ..data.sampler import PromptSampler, load_training_rows, tokenize_prompts
from ..distributed import init_distributed, trainer_broadcast
from ..interrupt import Interruptible
from ..metrics import MetricsLogger, plot_curves, step_metrics
from ..model.lora import has_lora
from ..model.policy import Policy
from ..rewards import make_scorer
from ..rollout import RolloutEngine, RolloutInterrupted, SamplingConfig
from ..rollout.placement import make_placement
from ..rollout.scoring import generate_and_score
from ..rollout.source import make_source
from ..rollout.tools import tool_penalties
from ..slurm import current_job, describe
from .batching import Sample
from .hf_snapshots import HFSnapshots
from .profiling import PhaseTimer, StepProfiler
from .reference import Reference
from .shard import Layout, Shard, logprob_gap, scatter_shards
from .step import compute_logprobs, grpo_update, grpo_update_on_policy, skip_limit_message
from .teacher import Teacher
from .validation import Validation


def run(cfg, model_dir: Path, shape, *, engine: RolloutEngine | None = None) -> int:
    """Train; returns the last completed step. `engine` replaces the vLLM engine the config asks for (tests)."""
    tr, ro, algo = cfg.trainer, cfg.rollout, cfg.algo
    quiet_console(verbose=cfg.logging.verbose)
    placement = make_placement(cfg, model_dir, engine=engine)
    if not placement.join():  # a rollout-only rank: it generated and took weights until the trainer said stop
        return 0
    rank, _ = init_distributed()
    is_leader, run_dir = rank == 0, Path(tr.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    stop = Interruptible().install()  # SIGTERM / SIGUSR1 / Ctrl-C: finish the step, checkpoint, exit 0

    # --- set-up: prompts, policy, rollout engines, verifier, the batch source -------------------------------------
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or model_dir)
    prompts, too_long = tokenize_prompts(load_training_rows(cfg.data, seed=tr.seed), tokenizer, cfg.data)
    sampler = PromptSampler(prompts, tr.prompts_per_step, seed=tr.seed, shuffle=cfg.data.shuffle)
    heldout = _heldout_prompts(cfg, tokenizer)
    validation = Validation(cfg, tokenizer, enabled=is_leader)  # data.val, every trainer.eval_every steps
    policy = Policy.from_config(cfg, shape)
    start_step, inflight_state = _restore(policy, sampler, run_dir, model_dir, progress=is_leader, mode=tr.resume)
    reference = Reference.for_policy(policy, model_dir) if algo.kl_coef > 0 else None  # for the KL penalty
    teacher = Teacher.load(policy, algo.distill.teacher) if algo.distill.teacher else None  # on-policy distillation
    engines = placement.start(_weight_stream(policy, shape))  # every engine's client: admit, take, harvest
    hf_snapshots = HFSnapshots(run_dir, tr.hf_every, tr.keep_last, tr.total_steps, policy.chunks, shape, model_dir)
    checkpoints = Checkpointer(run_dir, async_save=tr.async_save, keep_last=tr.keep_last, shape=shape,
                               hf_source=model_dir)
    scorer = make_scorer(algo, enabled=is_leader)
    loss = LossConfig.from_algo(algo)
    source = make_source(cfg, engines, sampler, scorer, tokenizer, leader=is_leader)
    source.restore(inflight_state, start_step)  # the work in flight at the checkpoint; weights: its step
    logger = MetricsLogger(run_dir, cfg.logging, config=_plain_config(cfg), total_steps=tr.total_steps,
                           start_step=start_step, enabled=is_leader)
    _announce(logger, cfg, run_dir, start_step, too_long, validation)
    profiler = StepProfiler(tr.profile_steps, run_dir, rank)

    step, version, diverged = start_step, start_step, None
    placement.publish(version, source.min_version(version))
    start_accuracy = _evaluate(engines, heldout, scorer, tokenizer, ro) if start_step == 0 else None
    if start_step == 0 and validation.due(0):
        logger.log(0, validation.run(engines, 0))

    while step < tr.total_steps:
        step += 1
        profiler.step_started(step)
        timer = PhaseTimer()

        # 1-3. sample prompts -> rollout (weights of `version` updates) -> rewards, in as many rounds as the step needs
        scored = source.next_batch(step, version, timer)
        if scored is None:  # a stop cut the rollout short: the run ends on the last completed step, saved
            step = _checkpoint_for_stop(step - 1, checkpoints, policy, sampler, source, run_dir)
            logger.print(stop.message(step))
            break
        checkpoints.poll()  # a checkpoint written in the background since the last step is committed once it is done
        if scored.sampling_stats is not None and scored.sampling_stats.shortfall():
            logger.print(f"step {step}: {scored.sampling_stats.shortfall()}")

        # 4. reward shaping (algo.overlong_buffer, algo.tool_*_penalty) and group advantages (algo.advantage) on
        #    rank 0, which sends each DP replica only its samples (train/shard.py)
        shard, samples, shaping_metrics = _samples(scored.batch if is_leader else None, cfg, loss, policy)

        # 5-6. the trainer's turn: reference, teacher (algo.distill) and old logprobs, mini-batch GRPO updates
        with placement.training():
            update, gap = _train(policy, reference, teacher, shard, cfg, loss, timer)

        # 7. weight sync into the rollout engine, which is ready to generate the next step after it
        with timer("sync"):
            version = step
            placement.publish(version, source.min_version(version))

        # 8. metrics, and when due the validation of the new weights (avg@n on data.val) in the same record
        metrics = _step_record(scored, samples, gap, update, timer, shaping_metrics)
        if validation.due(step):
            metrics |= validation.run(engines, step)
        logger.log(step, metrics)

        # 9. checkpoint (periodic, at the end, or when asked to stop; or after too many skipped optimizer steps: the
        #    weights are then still the last good ones). Every rank agrees on the skips (train/step.py).
        diverged = skip_limit_message(policy.skipped_in_a_row, tr.max_skipped_steps)
        stopping = stop.agreed() or diverged is not None
        #    An async save is written while the next steps run; stopping, or the last step, waits for it.
        if stopping or step % tr.save_every == 0 or step == tr.total_steps:
            _checkpoint(checkpoints, step, policy, sampler, source)
        if stopping or step == tr.total_steps:
            _finish_saves(checkpoints, step, sampler, source, run_dir, stopping=stopping)
        hf_snapshots.maybe_save(step)  # trainer.hf_every: run_dir/hf/step_N, an HF folder of the live weights
        if (trace := profiler.step_finished(step, stopping)) is not None:
            logger.print(f"profile of steps {tr.profile_steps[0]}-{step}: {trace}")
        if stopping:
            logger.print(diverged or stop.message(step))
            break

    if step == tr.total_steps:  # held-out accuracy at the end (and at the start: heldout_accuracy.json), curves
        _report_end(logger, run_dir, heldout, start_accuracy, _evaluate(engines, heldout, scorer, tokenizer, ro))
    _close(logger, validation, scorer, placement)
    if diverged is not None:  # a failed run, not a requeue: exit non-zero (the message was printed above)
        raise SystemExit(1)
    return step


# --- helpers (each small; the loop above is the algorithm) ------------------------------------------------------------

def _advantages(batch, cfg, loss: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-sample advantages (algo.advantage; per sampled token) of the shaped rewards: algo.overlong_buffer on the
    whole budget, tool outputs included, and algo.tool_*_penalty. reward/mean stays the verifier's."""
    ro, algo, rollouts = cfg.rollout, cfg.algo, batch.rollouts
    lengths = [len(t) for t in rollouts.token_ids]
    shaped, metrics = shape_rewards(batch.rewards, lengths, rollouts.truncated, max_length=ro.max_response_length,
                                    buffer=algo.overlong_buffer, factor=algo.overlong_penalty_factor,
                                    mask_truncated=loss.mask_truncated)
    shaped, penalty_metrics = tool_penalties(shaped, rollouts.tool_stats, error_penalty=algo.tool_error_penalty,
                                             timeout_penalty=algo.tool_timeout_penalty)
    advantages = compute_advantages(torch.tensor(shaped, dtype=torch.float32), ro.n, estimator=loss.advantage,
                                    norm_by_std=loss.norm_adv_by_std, response_lengths=rollouts.sampled_lengths())
    return advantages, metrics | penalty_metrics


def _samples(batch, cfg, loss: LossConfig, policy) -> tuple[Shard, list[Sample] | None, dict[str, float]]:
    """The update's samples: rank 0 (`batch`: the whole scored batch; None on the other ranks) builds them all and
    plans the passes; every rank gets its DP replica's `Shard` (train/shard.py). Returns (this rank's shard, the
    whole list on rank 0 else None, the reward shaping's metrics on rank 0 else {}). Sample i answers prompt i // n
    (its group) and carries its advantage."""
    samples, shaping_metrics = None, {}
    if batch is not None:
        advantages, shaping_metrics = _advantages(batch, cfg, loss)
        rollouts, n = batch.rollouts, cfg.rollout.n
        samples = [Sample(prompt_ids=batch.prompts[i // n].ids, response_ids=rollouts.token_ids[i],
                          advantage=float(advantages[i]), rollout_logprobs=rollouts.logprobs[i], group=i // n,
                          truncated=bool(rollouts.truncated[i]),
                          routed_experts=None if rollouts.routed_experts is None else rollouts.routed_experts[i],
                          sampled_mask=None if rollouts.sampled_mask is None else rollouts.sampled_mask[i])
                   for i in range(len(rollouts.token_ids))]
    budget = cfg.trainer.max_tokens_per_micro_batch
    shard = scatter_shards(samples, Layout.of(policy, budget), mini_batch_size=_mini_batch_size(cfg, samples),
                           loss_agg=loss.aggregation, mask_truncated=loss.mask_truncated)
    return shard, samples, shaping_metrics


def _on_policy(cfg) -> bool:
    """One optimizer step on samples of the current weights: the update's own forward gives the old logprobs."""
    tr = cfg.trainer
    return tr.mini_batch_size >= tr.prompts_per_step and tr.old_logprobs == "auto"


def _mini_batch_size(cfg, samples) -> int | None:
    """Samples per optimizer step (the whole batch for the on-policy single step); None off rank 0."""
    if samples is None:
        return None
    return max(len(samples), 1) if _on_policy(cfg) else cfg.trainer.mini_batch_size * cfg.rollout.n


def _train(policy, reference, teacher, shard: Shard, cfg, loss: LossConfig, timer) -> tuple[dict, dict]:
    """Reference logprobs (algo.kl_coef), the teacher's (algo.distill.teacher: per-token advantages against it,
    algo/distill.py), old logprobs and the mini-batch GRPO updates on this rank's shard ->
    (update metrics, the trainer vs rollout logprob gap over the whole batch). One optimizer step needs no separate
    old-logprob pass: the update's forward gives them (the proximal policy is the weights before the step, also for
    stale samples, whose behaviour logprobs the rollout correction uses as they are)."""
    budget = cfg.trainer.max_tokens_per_micro_batch
    ref = _reference_logprobs(reference, shard, budget, timer)
    scores = None
    if teacher is not None:
        with timer("teacher_logprob"):
            scores = teacher.score(shard, max_tokens_per_micro_batch=budget)
    if _on_policy(cfg):
        with timer("update"):
            update, old_logprobs = grpo_update_on_policy(policy, shard, max_tokens_per_micro_batch=budget,
                                                         loss=loss, ref_logprobs=ref, teacher=scores)
    else:
        with timer("old_logprob"):
            old_logprobs = compute_logprobs(policy, shard, max_tokens_per_micro_batch=budget)
        with timer("update"):
            update = grpo_update(policy, shard, old_logprobs, mini_batch_size=shard.mini_batch_size,
                                 max_tokens_per_micro_batch=budget, loss=loss, ref_logprobs=ref, teacher=scores)
    return update, logprob_gap(shard, old_logprobs, policy.device)


def _step_record(scored, samples, gap, update, timer, shaping_metrics) -> dict[str, float]:
    """A step's metrics on rank 0 (`samples`: the whole batch there; None elsewhere: {}): rewards, lengths, trainer
    vs rollout logprobs (`gap`), the update's, timings, shaping, rounds."""
    if samples is None:
        return {}
    b, stats = scored.batch, scored.sampling_stats
    metrics = step_metrics(rewards=b.rewards, correct=b.correct, reward_stats=b.reward_stats, rollouts=b.rollouts,
                           prompt_tokens=sum(len(s.prompt_ids) for s in samples), logprob_gap=gap, update=update,
                           phase_seconds=timer.seconds, step_seconds=timer.elapsed())
    metrics |= shaping_metrics | (stats.metrics() if stats is not None else {})
    return metrics | {"rollout/staleness": scored.staleness}


def _checkpoint(checkpoints, step: int, policy, sampler, source) -> None:
    """Save `step`: weights, optimizer, LR schedule, the data position and the batch source's work in flight."""
    inflight = source.state()  # first: a batch that a stop cut short goes back into the sampler
    checkpoints.save(step, policy.chunks, policy.optimizer, policy.scheduler,
                     {"step": step, "sampler": sampler.state_dict(), "inflight": inflight})


def _checkpoint_for_stop(step: int, checkpoints, policy, sampler, source, run_dir) -> int:
    """A stop during step + 1's rollout: save `step` (the state after it, the sampler before step + 1's draw) unless
    the newest checkpoint holds it already (saved at its end, or the one this run resumed from), or it is step 0 (the
    initial state: a rerun starts the same way); returns `step`."""
    if trainer_broadcast(step not in (0, checkpoints.pending_step, latest_step(run_dir))):  # rank 0 decides for all
        _checkpoint(checkpoints, step, policy, sampler, source)
    _finish_saves(checkpoints, step, sampler, source, run_dir, stopping=True)
    return step


def _finish_saves(checkpoints, step: int, sampler, source, run_dir, *, stopping: bool) -> None:
    """Wait for the pending save; at a stop, keep the batch source's work in flight (every admitted group's samples
    so far) beside checkpoint `step`, with the sampler's position after it: a resume continues that work. The engines
    hand it back first, so that they stop where the stop found them instead of generating through the save. A save
    of `step` whose background writer died is written again here (no later save comes; the state is still step's)."""
    work = source.stop_state() if stopping else None
    checkpoints.wait(rewrite_skipped=checkpoints.pending_step == step)
    if work is not None and latest_step(run_dir) == step:
        save_stop_state(run_dir, step, {"sampler": sampler.state_dict(), "inflight": work})


def _weight_stream(policy, shape):
    """bucket bytes -> the policy's full HF-named tensors, as the rollout engines load them (every rank iterates)."""
    return lambda bucket_bytes: export_hf_stream(policy.chunks, shape, bucket_bytes=bucket_bytes,
                                                 include_tied_lm_head=True)


def _reference_logprobs(reference, shard, budget: int, timer):
    """The reference policy's logprobs of every response (None without a reference: algo.kl_coef = 0)."""
    if reference is None:
        return None
    with timer("ref_logprob"):
        return reference.logprobs(shard, max_tokens_per_micro_batch=budget)


def _close(logger, validation, scorer, placement) -> None:
    logger.close()
    validation.close()
    if scorer is not None:
        scorer.close()
    placement.shutdown()


def _announce(logger, cfg, run_dir, start_step: int, too_long: int, validation) -> None:
    """The run's opening lines: a resume, dropped prompts, the validation sets."""
    if start_step > 0:
        logger.print(f"resumed from {run_dir} at step {start_step} ({describe(current_job())})")
    if too_long:
        logger.print(f"{too_long} prompts longer than data.max_prompt_length={cfg.data.max_prompt_length} were dropped")
    if validation.sets:
        logger.print(validation.describe())


def _report_end(logger, run_dir, heldout, start_accuracy, end_accuracy) -> None:
    """Rank 0 at the last step: the held-out accuracy (printed and in heldout_accuracy.json) and the curves."""
    if not logger.enabled:
        return
    if start_accuracy is not None and end_accuracy is not None:  # (None: no held-out set, or a stop cut it short)
        logger.print(f"held-out accuracy (greedy, {len(heldout)} problems): start {start_accuracy:.3f} -> "
                     f"end {end_accuracy:.3f}")
    _write_heldout(run_dir, start_accuracy, end_accuracy)
    logger.print(f"curves: {plot_curves(run_dir)}")


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
    saved = resumed.get("at_stop") or resumed  # a stop's work in flight, kept beside the checkpoint, comes later
    sampler.load_state_dict(saved["sampler"])
    return int(resumed["step"]), saved.get("inflight")


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


def _evaluate(engines, prompts, scorer, tokenizer, ro) -> float | None:
    """Greedy accuracy on the held-out prompts (every rank generates its share; rank 0 scores)."""
    if not prompts:
        return None
    greedy = SamplingConfig(temperature=0.0, max_tokens=ro.max_response_length)
    try:
        got = generate_and_score(engines, prompts, 1, greedy, seed=0, scorer=scorer, tokenizer=tokenizer)
    except RolloutInterrupted:  # a stop: no accuracy; the run stops at its next step boundary
        return None
    return None if scorer is None else sum(got.correct) / len(prompts)


def _plain_config(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)
