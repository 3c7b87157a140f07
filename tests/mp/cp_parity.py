"""Context-parallel parity on real megatron-core (CPU, gloo, fp32). Run under torchrun by tests/test_context_parallel.py.

    python -m torch.distributed.run --standalone --nproc-per-node N cp_parity.py OUT

N = 2: the CP attention op against plain packed attention (values and input gradients, GQA, odd lengths, a sequence
shorter than 2 x CP chunks); then CP2 against CP1 (DP2 on the same 2 ranks) for a GQA model with a qkv bias, for
one with tied embeddings and for tool samples (a tool's output masked out of the loss); a CP2 checkpoint's save and
resume. N = 4: CP2 x TP2 against TP2 x DP2, CP2 x DP2 against DP4, CP2 x TP2 with sequence parallelism against TP2+SP x DP2,
CP2 x PP2 against PP2 x DP2.
A layout comparison builds both policies with the same layout but CP (same TP/PP shards on every rank), gives the
CP one the reference's weights, and compares logprobs, entropy, the step's loss and metrics, the gradients after
megatron's reduction (plain optimizer: every rank holds the reduced gradients) and the weights after one Adam step
(distributed optimizer, sharded over DP x CP). Each case is its own verdict: OUT/rank<r>.json, {case: {...}} or
{case: {"error": ...}}.
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import json
import os
import random
import sys
import traceback

import torch
import torch.distributed as dist

from justrl_megatron.distributed import init_distributed, init_model_parallel
from justrl_megatron.model.hf_config import ModelShape
from justrl_megatron.model.policy import Policy
from justrl_megatron.train.batching import Sample
from justrl_megatron.train.step import compute_logprobs, grpo_update, plan_micro_batches

SHAPES = {
    # GQA (4 heads over 2 KV groups), qkv bias, padded vocab
    "qwen": ModelShape(family="qwen2", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                       num_query_groups=2, head_dim=16, vocab_size=250, max_position_embeddings=128,
                       rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=True, tie_word_embeddings=False,
                       init_std=0.02),
    # tied embeddings (the output weight's gradient sums the embedding's), MHA
    "llama": ModelShape(family="llama", num_layers=2, hidden_size=48, ffn_hidden_size=80, num_attention_heads=4,
                        num_query_groups=4, head_dim=12, vocab_size=250, max_position_embeddings=128,
                        rope_theta=100000.0, rms_norm_eps=1e-5, qkv_bias=False, tie_word_embeddings=True,
                        init_std=0.05),
}
MAX_TOKENS = 48
STEP_KW = dict(clip_low=0.2, clip_high=0.28, dual_clip_c=2.0, loss_agg="token-mean")
LR = 1e-6  # JustRL's: Adam's first step moves every weight by ~lr, and ~1e-10 gradient noise cannot flip more


def make_samples(n=10, seed=3, tools=False):
    """Odd and even lengths, and one sample of 2 tokens: fewer than the 2 x CP = 4 chunks it is cut into.
    `tools`: responses of 4+ tokens carry a tool's output in the middle (`sampled_mask` 0 there: context, not
    trained), as multi-turn rollouts produce them; the masked span crosses the CP chunk boundaries."""
    rng = random.Random(seed)
    out = [Sample([rng.randrange(250)], [rng.randrange(250)], advantage=0.9, group=0)]
    for i in range(1, n):
        prompt = [rng.randrange(250) for _ in range(rng.randint(2, 12))]
        response = [rng.randrange(250) for _ in range(rng.randint(1, 24))]
        mask = None
        if tools and len(response) >= 4:
            a = rng.randint(1, len(response) - 2)
            b = rng.randint(a + 1, len(response) - 1)
            mask = [1] * a + [0] * (b - a) + [1] * (len(response) - b)
        out.append(Sample(prompt, response, advantage=rng.uniform(-1.5, 1.5), group=i // 4, sampled_mask=mask))
    return out


def build(shape, cp=1, tp=1, pp=1, sp=False, distopt=False):
    return Policy.build(SHAPES[shape], tp=tp, pp=pp, cp=cp, sequence_parallel=sp, dtype="fp32",
                        transformer_impl="local", lr=LR, warmup_steps=0, weight_decay=0.0, grad_clip=1.0,
                        distributed_optimizer=distopt, seed=1234)


def params(policy):
    return {f"{i}.{n}": p for i, c in enumerate(policy.chunks) for n, p in c.module.named_parameters()}


def copy_weights(src, dst):
    with torch.no_grad():
        theirs = params(src)
        for k, p in params(dst).items():
            p.copy_(theirs[k])
    dst.optimizer.reload_model_params()


def maxdiff(a, b):
    return max((float((x - y).abs().max()) for x, y in zip(a, b) if x.numel()), default=0.0)


def old_from(logprobs, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [lp + 0.4 * torch.randn(lp.shape, generator=g) for lp in logprobs]


def one_step(policy, samples, old):
    grads = {}

    def capture(pol, step):
        grads.update({k: p.main_grad.detach().clone() for k, p in params(pol).items()})

    m = grpo_update(policy, samples, old, mini_batch_size=len(samples), max_tokens_per_micro_batch=MAX_TOKENS,
                    on_grads=capture, **STEP_KW)
    return m, grads


METRIC_KEYS = ("loss", "pg_loss", "entropy", "logprob_mean", "old_logprob_mean", "approx_kl", "clip_frac_low",
               "clip_frac_high", "clip_frac_dual", "ratio_min", "ratio_max", "grad_norm", "num_response_tokens")


def compare_layout(shape, tools=False, **layout):
    """CP2 x layout against the same layout with CP1 (the freed ranks data-parallel); `tools`: tool samples."""
    from megatron.core import parallel_state as ps

    samples = make_samples(tools=tools)
    ref = build(shape, **layout)
    ref_lp, ref_ent = compute_logprobs(ref, samples, max_tokens_per_micro_batch=MAX_TOKENS, with_entropy=True)
    ref_tp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    ref_tokens = sum(mb.tokens.size(1) for mb in plan_micro_batches(ref, samples, range(len(samples)), MAX_TOKENS))
    old = old_from(ref_lp)
    ref_before = {k: p.detach().clone() for k, p in params(ref).items()}
    ref_m, ref_g = one_step(ref, samples, old)

    cp = build(shape, cp=2, **layout)
    assert (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()) == ref_tp, \
        "the reference and CP layouts must give this rank the same TP/PP shard"
    # the CP policy starts from the reference's weights (before its step)
    with torch.no_grad():
        for k, p in params(cp).items():
            p.copy_(ref_before[k])
    cp.optimizer.reload_model_params()
    # this rank's share of the tokens (CP really splits: about half of the reference's, padding aside)
    tokens = sum(mb.tokens.size(1) for mb in plan_micro_batches(cp, samples, range(len(samples)), MAX_TOKENS))
    lp, ent = compute_logprobs(cp, samples, max_tokens_per_micro_batch=MAX_TOKENS, with_entropy=True)
    m, g = one_step(cp, samples, old)
    v = {"cp": ps.get_context_parallel_world_size(), "dp": ps.get_data_parallel_world_size(),
         "dp_cp": ps.get_data_parallel_world_size(with_context_parallel=True),
         "tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
         "rank_tokens": tokens, "ref_rank_tokens": ref_tokens, "all_tokens": sum(s.length for s in samples),
         "logprob_diff": maxdiff(lp, ref_lp), "entropy_diff": maxdiff(ent, ref_ent),
         "num_logprobs": sum(x.numel() for x in lp), "ref_num_logprobs": sum(x.numel() for x in ref_lp),
         "metric_diffs": {k: abs(m[k] - ref_m[k]) for k in METRIC_KEYS}, "loss": m["loss"], "ref_loss": ref_m["loss"],
         "clip_fracs": [ref_m[k] for k in ("clip_frac_low", "clip_frac_high", "clip_frac_dual")],
         "grad_diff": max(float((g[k] - ref_g[k]).abs().max()) for k in ref_g),
         "grad_scale": max(float(x.abs().max()) for x in ref_g.values()),
         "weight_diff_plain_adam": max(float((p - params(ref)[k]).abs().max()) for k, p in params(cp).items()),
         "model_tokens": sum(sum(s.sampled_mask) if s.sampled_mask is not None else len(s.response_ids)
                             for s in samples), "response_tokens": sum(len(s.response_ids) for s in samples),
         "trained_tokens": m["num_response_tokens"], "ref_trained_tokens": ref_m["num_response_tokens"]}

    # the distributed optimizer (sharded over DP x CP): weights after one Adam step
    ref_d = build(shape, distopt=True, **layout)
    copy_weights(ref, ref_d)  # (ref has stepped; any common start point will do)
    start = {k: p.detach().clone() for k, p in params(ref_d).items()}
    ref_old = compute_logprobs(ref_d, samples, max_tokens_per_micro_batch=MAX_TOKENS)
    grpo_update(ref_d, samples, old_from(ref_old), mini_batch_size=len(samples),
                max_tokens_per_micro_batch=MAX_TOKENS, **STEP_KW)
    cp_d = build(shape, cp=2, distopt=True, **layout)
    with torch.no_grad():
        for k, p in params(cp_d).items():
            p.copy_(start[k])
    cp_d.optimizer.reload_model_params()
    grpo_update(cp_d, samples, old_from(ref_old), mini_batch_size=len(samples),
                max_tokens_per_micro_batch=MAX_TOKENS, **STEP_KW)
    mine, theirs = params(cp_d), params(ref_d)
    v["weight_diff_distopt_adam"] = max(float((p - theirs[k]).abs().max()) for k, p in mine.items())
    v["weight_change_distopt_adam"] = max(float((p - start[k]).abs().max()) for k, p in mine.items())
    return v


def checkpoint_roundtrip(out):
    """A CP2 run's checkpoint (weights, distributed-optimizer state sharded over DP x CP, scheduler) resumes at CP2:
    after the resume, one more step gives the same weights as the run that never stopped."""
    from justrl_megatron.checkpoint import load_latest_checkpoint, save_checkpoint

    samples = make_samples()

    def step(policy):
        old = old_from(compute_logprobs(policy, samples, max_tokens_per_micro_batch=MAX_TOKENS))
        grpo_update(policy, samples, old, mini_batch_size=len(samples), max_tokens_per_micro_batch=MAX_TOKENS,
                    **STEP_KW)

    run = build("qwen", cp=2, distopt=True)
    step(run)
    save_checkpoint(os.path.join(out, "run"), 1, run.chunks, run.optimizer, run.scheduler, {"note": "cp2"},
                    shape=SHAPES["qwen"])
    resumed = build("qwen", cp=2, distopt=True)
    before = max(float((p - params(run)[k]).abs().max()) for k, p in params(resumed).items())
    extra = load_latest_checkpoint(os.path.join(out, "run"), resumed.chunks, resumed.optimizer, resumed.scheduler,
                                   strict=True)
    loaded = max(float((p - params(run)[k]).abs().max()) for k, p in params(resumed).items())
    step(run)
    step(resumed)
    after = max(float((p - params(run)[k]).abs().max()) for k, p in params(resumed).items())
    return {"step": extra["step"], "note": extra.get("note"), "diff_before_load": before, "diff_after_load": loaded,
            "diff_after_next_step": after}


def attention_op():
    """context_parallel_attention on this rank's chunks == plain packed causal attention of the whole row, values
    and the gradients of q, k, v (k/v gradients summed over the CP ranks that read them)."""
    from megatron.core import parallel_state as ps
    from justrl_megatron.model import attention
    from justrl_megatron.model.attention import ContextParallelPlan, context_parallel_attention, \
        packed_causal_attention

    init_model_parallel(cp=dist.get_world_size())
    group, n, r = ps.get_context_parallel_group(), ps.get_context_parallel_world_size(), \
        ps.get_context_parallel_rank()
    lengths = [5, 1, 12, 3, 8]  # odd, a single token, shorter than 2n chunks; padded below to multiples of 2n
    padded = [-(-x // (2 * n)) * (2 * n) for x in lengths]
    cu = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(7)
    t, heads, groups, d = int(cu[-1]), 4, 2, 8
    q, k, v, w = (torch.randn(t, h, d, generator=g, dtype=torch.float64) for h in (heads, groups, groups, heads))
    scale = 0.3
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = packed_causal_attention(*ref_in, cu, max(padded), scale)
    (ref * w).sum().backward()
    local = []
    for a, p in zip(cu.tolist(), padded):
        c = p // (2 * n)
        for j in (r, 2 * n - 1 - r):
            local += range(a + j * c, a + (j + 1) * c)
    local = torch.tensor(local)
    verdict = {"cp": n, "grad_scale": min(float(b.grad.abs().max()) for b in ref_in), "local_tokens": len(local),
               "tokens": t, "out_diff": 0.0, "grad_diffs": [0.0, 0.0, 0.0]}
    default = attention._CP_MASK_ELEMENTS
    for limit in (default, 5):  # also with blocks of a query or two (forward and backward cut into many calls)
        attention._CP_MASK_ELEMENTS = limit
        try:
            mine = [x[local].clone().requires_grad_() for x in (q, k, v)]
            out = context_parallel_attention(*mine, ContextParallelPlan(cu, n, r), group, scale)
            (out * w[local]).sum().backward()
        finally:
            attention._CP_MASK_ELEMENTS = default
        verdict["out_diff"] = max(verdict["out_diff"], float((out - ref[local]).abs().max()))
        verdict["grad_diffs"] = [max(d, float((a.grad - b.grad[local]).abs().max()))
                                 for d, a, b in zip(verdict["grad_diffs"], mine, ref_in)]
    return verdict


def main(out):
    rank, world = init_distributed()
    torch.set_num_threads(1)
    if world == 2:
        cases = {"attention_op": attention_op, "cp2_gqa": lambda: compare_layout("qwen"),
                 "cp2_tied": lambda: compare_layout("llama"), "checkpoint": lambda: checkpoint_roundtrip(out),
                 "cp2_tool_samples": lambda: compare_layout("qwen", tools=True)}
    else:
        cases = {"cp2_tp2": lambda: compare_layout("qwen", tp=2), "cp2_dp2": lambda: compare_layout("qwen"),
                 "cp2_tp2_sp": lambda: compare_layout("llama", tp=2, sp=True),
                 "cp2_pp2": lambda: compare_layout("llama", pp=2)}
    verdict = {}
    for name, case in cases.items():
        try:
            verdict[name] = case()
        except Exception as exc:  # noqa: BLE001  (each case its own verdict)
            verdict[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(verdict, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
