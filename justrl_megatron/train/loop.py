"""The GRPO training loop. `run(cfg)` reads top to bottom like the algorithm:

    sample prompts -> rollout (vLLM) -> rewards (worker pool) -> group advantages -> old logprobs
    (skipped for one on-policy optimizer step) -> mini-batch GRPO updates -> weight sync -> metrics -> checkpoint

Every rank runs this same program (SPMD). Each rank hosts a vLLM engine (colocated, one per rollout-TP group) that
samples its share of the prompts; every rank gets the whole batch back. The reward pool lives on rank 0 and its
results are broadcast, so all ranks see the same batch and split it by data parallelism themselves.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..algo.grpo import group_advantages
from ..distributed import init_distributed
from ..metrics import MetricsLogger, gpu_stats, plot_curves
from ..slurm import StopSignal, current_job, describe, requeue_message
from .sampler import PromptSampler, load_training_rows, tokenize_prompts


def run(cfg, model_dir: Path, shape) -> int:
    """Train; returns the last completed step."""
    from transformers import AutoTokenizer

    from ..convert.export import export_hf_stream
    from ..convert.load import load_hf_weights
    from ..model.policy import Policy
    from ..rewards import BatchScorer, get_reward_fn
    from ..rollout import SamplingConfig, check_staleness, logprob_gap, make_engine
    from .batching import Sample
    from .checkpoint import load_latest_checkpoint, save_checkpoint
    from .step import compute_logprobs, grpo_update, grpo_update_on_policy

    tr, ro, algo, par = cfg.trainer, cfg.rollout, cfg.algo, cfg.parallel
    _quiet_libraries()
    rank, _ = init_distributed()
    is_leader = rank == 0
    run_dir = Path(tr.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    stop = StopSignal().install()  # SIGTERM / SIGUSR1 (Slurm's warning): finish the step, checkpoint, exit 0

    # --- set-up: prompts, policy, rollout engine, verifier ----------------------------------------------------------
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or model_dir)
    prompts, too_long = tokenize_prompts(load_training_rows(cfg.data, seed=tr.seed), tokenizer, cfg.data)
    sampler = PromptSampler(prompts, tr.prompts_per_step, seed=tr.seed, shuffle=cfg.data.shuffle)
    heldout = _heldout_prompts(cfg, tokenizer)

    policy = Policy.build(
        shape, tp=par.tensor, pp=par.pipeline, vpp=par.virtual_pipeline, sequence_parallel=par.sequence_parallel,
        dtype=cfg.model.dtype, transformer_impl=cfg.model.transformer_impl, recompute=cfg.model.recompute, lr=tr.lr,
        warmup_steps=tr.warmup_steps, weight_decay=tr.weight_decay, grad_clip=tr.grad_clip, adam_beta1=tr.adam_beta1,
        adam_beta2=tr.adam_beta2, adam_eps=tr.adam_eps, distributed_optimizer=par.distributed_optimizer,
        make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by, seed=tr.seed)
    resumed = load_latest_checkpoint(run_dir, policy.chunks, policy.optimizer, policy.scheduler)
    if resumed is None:
        load_hf_weights(policy.chunks, model_dir, progress=is_leader)
        policy.optimizer.reload_model_params()  # mixed-precision optimizers keep their own fp32 copies
        start_step = 0
    else:
        start_step = int(resumed["step"])
        sampler.load_state_dict(resumed["sampler"])

    engine = make_engine(cfg, model_dir, seed=tr.seed)
    verifier = get_reward_fn(algo.reward, **dict(algo.reward_options or {}))
    scorer = BatchScorer(verifier, num_workers=algo.reward_workers) if is_leader else None
    sampling = SamplingConfig.from_rollout_config(ro)
    logger = MetricsLogger(run_dir, cfg.logging, config=_plain_config(cfg), total_steps=tr.total_steps,
                           start_step=start_step, enabled=is_leader)
    if resumed is not None:
        logger.print(f"resumed from {run_dir} at step {start_step} ({describe(current_job())})")
    if too_long:
        logger.print(f"{too_long} prompts longer than data.max_prompt_length={cfg.data.max_prompt_length} were dropped")

    version = start_step
    _sync_weights(policy, engine, shape, version, ro.weight_sync_bucket_mb, export_hf_stream)
    start_accuracy = _evaluate(engine, heldout, scorer, tokenizer, ro) if start_step == 0 else None

    step = start_step
    while step < tr.total_steps:
        step += 1
        timer = _PhaseTimer()

        # 1. sample prompts
        batch = sampler.next_batch()

        # 2. rollout with the current weights (version = number of updates so far); seeded per step, so a resumed
        #    run samples what an uninterrupted one would have
        with timer("rollout"):
            rollouts = engine.generate_all([p.ids for p in batch], ro.n, sampling, seed=tr.seed * 1_000_003 + step)
        check_staleness(rollouts.weight_version, version, ro.max_staleness)

        # 3. rewards
        with timer("reward"):
            responses = None
            if is_leader:
                texts = tokenizer.batch_decode(rollouts.token_ids, skip_special_tokens=True)
                answers = [batch[i // ro.n].answer for i in range(len(texts))]
                rewards, correct = scorer.evaluate(texts, answers)
                responses = (rewards, correct, dict(scorer.stats))
            rewards, correct, reward_stats = _broadcast(responses)

        # 4. group advantages
        advantages = group_advantages(torch.tensor(rewards, dtype=torch.float32), ro.n,
                                      norm_by_std=algo.norm_adv_by_std)
        samples = [Sample(prompt_ids=batch[i // ro.n].ids, response_ids=rollouts.token_ids[i],
                          advantage=float(advantages[i]), rollout_logprobs=rollouts.logprobs[i], group=i // ro.n)
                   for i in range(len(rollouts.token_ids))]

        # 5-6. old logprobs (the policy that sampled, recomputed by the trainer), then mini-batch GRPO updates.
        #      One optimizer step on fresh samples needs no separate pass: the update's forward gives them.
        step_kw = dict(max_tokens_per_micro_batch=tr.max_tokens_per_micro_batch, clip_low=algo.clip_low,
                       clip_high=algo.clip_high, dual_clip_c=algo.dual_clip_c, loss_agg=algo.loss_agg,
                       kl_coef=algo.kl_coef, entropy_coef=algo.entropy_coef)
        one_fresh_step = rollouts.weight_version == version and tr.mini_batch_size >= tr.prompts_per_step
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

        # 7. weight sync into the rollout engine
        with timer("sync"):
            version = step
            _sync_weights(policy, engine, shape, version, ro.weight_sync_bucket_mb, export_hf_stream)

        # 8. metrics
        lengths = [len(r) for r in rollouts.token_ids]
        metrics = {
            "reward/mean": sum(rewards) / len(rewards),
            "reward/accuracy": sum(correct) / len(correct),
            "reward/worker_timeouts": reward_stats.get("timeouts", 0),
            "reward/worker_crashes": reward_stats.get("crashes", 0),
            "reward/verifier_errors": reward_stats.get("errors", 0),
            "response/length_mean": sum(lengths) / len(lengths),
            "response/length_max": max(lengths),
            "response/truncated_ratio": sum(rollouts.truncated) / len(lengths),
            **{f"rollout/{k}": v for k, v in logprob_gap(rollouts.logprobs, old_logprobs).items()},
            "rollout/weight_version": rollouts.weight_version,
            **{f"actor/{k}": v for k, v in update.items()},
            **timer.metrics(tokens=sum(lengths) + sum(len(s.prompt_ids) for s in samples)),
            **gpu_stats(),
        }
        logger.log(step, metrics)

        # 9. checkpoint (periodic, at the end, or when asked to stop)
        stopping = stop.agreed()
        if stopping or step % tr.save_every == 0 or step == tr.total_steps:
            save_checkpoint(run_dir, step, policy.chunks, policy.optimizer, policy.scheduler,
                            {"step": step, "sampler": sampler.state_dict()}, keep_last=tr.keep_last, shape=shape,
                            hf_source=model_dir)
        if stopping:
            logger.print(requeue_message(step))
            break

    if step == tr.total_steps:
        end_accuracy = _evaluate(engine, heldout, scorer, tokenizer, ro)
    if is_leader and step == tr.total_steps:
        if start_accuracy is not None:
            logger.print(f"held-out accuracy (greedy, {len(heldout)} problems): start {start_accuracy:.3f} -> "
                         f"end {end_accuracy:.3f}")
        (run_dir / "heldout_accuracy.json").write_text(
            f'{{"start": {start_accuracy if start_accuracy is not None else "null"}, "end": {end_accuracy}}}\n')
        logger.print(f"curves: {plot_curves(run_dir)}")
    logger.close()
    if scorer is not None:
        scorer.close()
    engine.shutdown()
    return step


# --- helpers (each small; the loop above is the algorithm) ------------------------------------------------------------

class _PhaseTimer:
    def __init__(self):
        self.seconds, self._t0 = {}, time.perf_counter()

    def __call__(self, phase):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[phase] = timer.seconds.get(phase, 0.0) + time.perf_counter() - self.t
        return _Ctx()

    def metrics(self, tokens: int) -> dict:
        total = time.perf_counter() - self._t0
        out = {f"time/{k}_s": v for k, v in self.seconds.items()}
        out["time/step_s"] = total
        out["throughput/tokens_per_s"] = tokens / total
        return out


def _broadcast(obj):
    """Rank 0's object on every rank."""
    if dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _sync_weights(policy, engine, shape, version, bucket_mb, export_hf_stream):
    """Every rank takes part in the export (TP all-gather / PP broadcast) and feeds its own engine."""
    stream = export_hf_stream(policy.chunks, shape, bucket_bytes=int(bucket_mb) << 20, include_tied_lm_head=True)
    engine.update_weights(stream, version)


def _heldout_prompts(cfg, tokenizer):
    """A fixed set of problems the policy never trains on, for start vs end accuracy."""
    if cfg.trainer.eval_samples <= 0:
        return []
    rows = load_training_rows(cfg.data, seed=cfg.trainer.seed, split="eval", limit=cfg.trainer.eval_samples)
    return tokenize_prompts(rows, tokenizer, cfg.data)[0]


def _evaluate(engine, prompts, scorer, tokenizer, ro) -> float | None:
    """Greedy accuracy on the held-out prompts (every rank generates its share; rank 0 scores)."""
    if not prompts:
        return None
    from ..rollout import SamplingConfig

    greedy = SamplingConfig(temperature=0.0, max_tokens=ro.max_response_length)
    out = engine.generate_all([p.ids for p in prompts], 1, greedy, seed=0)
    if scorer is None:
        return None
    texts = tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
    return sum(scorer.evaluate(texts, [p.answer for p in prompts])[1]) / len(prompts)


def _quiet_libraries() -> None:
    """megatron logs every parameter name and vLLM every engine detail at INFO: keep the console for the run."""
    import logging

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for name in ("megatron", "megatron.core", "vllm"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _plain_config(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)
