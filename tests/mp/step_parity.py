"""GRPO step parity across parallel layouts on real megatron-core (CPU, gloo). Run under torchrun by tests/test_step.py.

    python -m torch.distributed.run --standalone --nproc-per-node N step_parity.py OUT MODE

MODE ref (1 process): the TP1 reference. Saves the weights (dist_checkpointing) and what one GRPO step produces —
logits of a packed row, per-sample logprobs, loss, grad norm, metrics, gradients — and checks what needs no other
layout: packed logprobs vs padded rows, zero advantages leave the weights unchanged, recompute gives the same grads.
MODE layouts2 (2 processes): TP2, TP2+SP, PP2, DP2 (plain and distributed optimizer), TP2+SP with tied embeddings,
and the vocab-parallel chunked logprob/entropy against the naive full-vocabulary computation; at DP2 and TP2+SP
also the update on the shards trainer rank 0 scatters (train/shard.py) against the one on the whole list.
MODE layouts4 (4 processes): TP2 x PP2, and PP2 x virtual PP2 (x DP2) with tied embeddings; one update per policy
loss (gspo, cispo; ppo is every layout's step) at TP2 x PP2.
MODE guard2 (2 processes): a NaN put into one rank's gradients (DP2, DP2 with the distributed optimizer, TP2) makes
every rank skip the optimizer step together.
Each layout loads the reference weights (resharded by megatron's own dist_checkpointing), runs the same step, and
writes its gradients back through dist_checkpointing so a TP1 model can load them: no code of ours decides how shards
line up. Verdicts: OUT/<mode>_rank<r>.json.
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import json
import os
import random
import sys

import torch
import torch.distributed as dist

from justrl_megatron.distributed import init_distributed, init_model_parallel
from justrl_megatron.model.hf_config import ModelShape
from justrl_megatron.model.policy import Policy
from justrl_megatron.train.batching import Sample, make_micro_batch
from justrl_megatron.train.step import compute_logprobs, grpo_update, grpo_update_on_policy

SHAPES = {
    # vocab 250 pads to 256: the padded columns must stay out of every softmax
    "qwen": ModelShape(family="qwen2", num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                       num_query_groups=2, head_dim=16, vocab_size=250, max_position_embeddings=128,
                       rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=True, tie_word_embeddings=False,
                       init_std=0.02),
    "llama": ModelShape(family="llama", num_layers=4, hidden_size=48, ffn_hidden_size=80, num_attention_heads=4,
                        num_query_groups=2, head_dim=12, vocab_size=250, max_position_embeddings=128,
                        rope_theta=100000.0, rms_norm_eps=1e-5, qkv_bias=False, tie_word_embeddings=True,
                        init_std=0.05),
}
MAX_TOKENS = 48  # forces several micro-batches per DP rank
KINDS = ("gspo", "cispo")  # algo.policy_loss besides ppo: one update each, TP1 vs TP2 x PP2
STEP_KW = dict(clip_low=0.2, clip_high=0.28, dual_clip_c=2.0, loss_agg="token-mean")


def make_samples(n=12, seed=3):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(250) for _ in range(rng.randint(2, 12))]
        response = [rng.randrange(250) for _ in range(rng.randint(1, 24))]
        out.append(Sample(prompt, response, advantage=rng.uniform(-1.5, 1.5), group=i // 4))
    return out


def old_from(logprobs, seed=5):
    """Perturbed 'behaviour policy' logprobs, so that ratios leave the clip range both ways."""
    g = torch.Generator().manual_seed(seed)
    return [lp + 0.4 * torch.randn(lp.shape, generator=g) for lp in logprobs]


def build(shape, tp=1, pp=1, vpp=None, sp=False, distopt=True, recompute="none", weight_decay=0.0):
    return Policy.build(SHAPES[shape], tp=tp, pp=pp, vpp=vpp, sequence_parallel=sp, dtype="fp32",
                        transformer_impl="local", recompute=recompute, lr=1e-3, warmup_steps=0,
                        weight_decay=weight_decay, grad_clip=1.0, distributed_optimizer=distopt, seed=1234)


# --- checkpoints (megatron's dist_checkpointing does all resharding) ------------------------------------------------

def save_ckpt(policy, path):
    from megatron.core import dist_checkpointing
    os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({f"model{i}": c.module.sharded_state_dict() for i, c in enumerate(policy.chunks)}, path)
    dist.barrier()


def load_ckpt(policy, path):
    from megatron.core import dist_checkpointing
    sd = dist_checkpointing.load({f"model{i}": c.module.sharded_state_dict() for i, c in enumerate(policy.chunks)},
                                 path)
    for i, c in enumerate(policy.chunks):
        c.module.load_state_dict(sd[f"model{i}"])


def params(policy):
    return {f"{i}.{n}": p for i, c in enumerate(policy.chunks) for n, p in c.module.named_parameters()}


# --- measurements -------------------------------------------------------------------------------------------------

def packed_logits(policy, samples):
    """Full-vocabulary logits of all samples packed into one row, through megatron's schedule (last stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mb = make_micro_batch(samples, range(len(samples)), pad_to_multiple_of=2)
    out = []

    def forward_step(it, model):
        b = next(it)
        o = model(b.tokens, b.position_ids, None, packed_seq_params=b.packed_seq_params())

        def keep(output):
            out.append(tensor_parallel.gather_from_tensor_model_parallel_region(output)[0, :mb.num_real_tokens,
                                                                                     :250].detach().clone())
            return output.sum() * 0.0, torch.tensor(0, dtype=torch.int), {}
        return o, keep

    chunks = policy.chunks
    # the interleaved schedule wants at least PP micro-batches: repeat the row
    copies = ps.get_pipeline_model_parallel_world_size() if len(chunks) > 1 else 1
    its = [iter([mb] * copies) for _ in chunks] if len(chunks) > 1 else iter([mb])
    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=its,
                                    model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=copies,
                                    seq_length=mb.tokens.size(1), micro_batch_size=1, forward_only=True)
    return out[0] if out else None


def one_step(policy, samples, old, **kw):
    grads = {}

    def capture(pol, step):
        if step == 0:
            grads.update({k: p.main_grad.detach().clone() for k, p in params(pol).items()})

    metrics = grpo_update(policy, samples, old, mini_batch_size=len(samples), max_tokens_per_micro_batch=MAX_TOKENS,
                          on_grads=capture, **{**STEP_KW, **kw})
    return metrics, grads


def padded_logprobs(policy, samples):
    """Reference without packing: right-padded rows [B, S], plain causal attention, naive log_softmax."""
    model = policy.chunks[0].module
    longest = max(s.length for s in samples)
    tokens = torch.zeros(len(samples), longest, dtype=torch.long)
    for r, s in enumerate(samples):
        tokens[r, :s.length] = torch.tensor(s.prompt_ids + s.response_ids)
    with torch.no_grad():
        logits = model(tokens, torch.arange(longest).expand(len(samples), longest), None)
    logp = torch.log_softmax(logits[..., :250].double(), dim=-1)
    out = []
    for r, s in enumerate(samples):
        p = len(s.prompt_ids)
        out.append(logp[r, p - 1:s.length - 1].gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1).float())
    return out


def maxdiff(a, b):
    return max(float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b))


def reuse_forward_check(out, shape, correction="none", **layout):
    """One optimizer step two ways on the same weights: old logprobs from a separate forward pass
    (`compute_logprobs` + `grpo_update`) vs from the update's own forward pass (`grpo_update_on_policy`).
    `correction` (tis, ...): the samples are stale (behaviour logprobs of other weights, as after a one-step-off or
    streaming rollout): the proximal policy is still the weights before the step, so both ways must agree too."""
    samples = make_samples()
    sep, reuse = build(shape, **layout), build(shape, **layout)
    load_ckpt(sep, f"{out}/weights_{shape}")
    load_ckpt(reuse, f"{out}/weights_{shape}")
    old = compute_logprobs(sep, samples, max_tokens_per_micro_batch=MAX_TOKENS)
    kw = STEP_KW
    if correction != "none":
        for s, lp in zip(samples, old_from(old)):
            s.rollout_logprobs = lp.tolist()
        kw = {**STEP_KW, "rollout_correction": correction}
    m_sep = grpo_update(sep, samples, old, mini_batch_size=len(samples), max_tokens_per_micro_batch=MAX_TOKENS,
                        **kw)
    m_reuse, old_reuse = grpo_update_on_policy(reuse, samples, max_tokens_per_micro_batch=MAX_TOKENS, **kw)
    a, b = params(sep), params(reuse)
    compared = ["loss", "pg_loss", "grad_norm", "entropy", "logprob_mean", "old_logprob_mean", "num_response_tokens"]
    compared += [k for k in m_sep if k.startswith("rollout_correction/")]
    return {"old_diff": maxdiff(old_reuse, old), "num_samples": len(old_reuse),
            "weight_diff": max(float((a[k] - b[k]).abs().max()) for k in a),
            "metrics_diff": max(abs(m_sep[k] - m_reuse[k]) for k in compared if k in m_sep),
            "compared": [k for k in compared if k in m_sep],
            "ratio": (m_reuse["ratio_min"], m_reuse["ratio_max"]),
            "clip_fracs": [m_reuse[k] for k in ("clip_frac_low", "clip_frac_high", "clip_frac_dual")],
            "grad_norm": m_reuse["grad_norm"]}


def sharded_check(out, shape, **layout):
    """The step on the shards rank 0 scatters (train/shard.py: each DP replica only its samples) vs on the whole list
    every rank holds, from the same weights: several mini-batches after an old-logprob pass, and the on-policy single
    step, with rollout correction and a KL term (the rollout and reference logprobs travel with the shard). Metrics,
    old logprobs and the first step's gradients must be bitwise equal; the logprob gap's max and count too, its mean
    within float64 reassociation."""
    from justrl_megatron.rollout import logprob_gap as whole_batch_gap
    from justrl_megatron.train.shard import Layout, logprob_gap, scatter_shards

    samples = make_samples()
    for s, lp in zip(samples, torch.load(f"{out}/ref_{shape}.pt")["old"]):
        s.rollout_logprobs = lp.tolist()
    kw = {**STEP_KW, "rollout_correction": "tis", "kl_coef": 0.1}
    verdict = {}
    for name, mini in (("mini_batches", 5), ("on_policy", len(samples))):
        runs = {}
        for way in ("whole", "shard"):
            policy = build(shape, **layout)
            load_ckpt(policy, f"{out}/weights_{shape}")
            grads = {}

            def capture(pol, step):
                if step == 0:
                    grads.update({k: p.main_grad.detach().clone() for k, p in params(pol).items()})

            batch = samples
            if way == "shard":
                batch = scatter_shards(samples if dist.get_rank() == 0 else None, Layout.of(policy, MAX_TOKENS),
                                       mini_batch_size=mini, loss_agg=STEP_KW["loss_agg"])
            ref = [lp - 0.1 for lp in compute_logprobs(policy, batch, max_tokens_per_micro_batch=MAX_TOKENS)]
            if name == "on_policy":
                metrics, old = grpo_update_on_policy(policy, batch, max_tokens_per_micro_batch=MAX_TOKENS,
                                                     ref_logprobs=ref, on_grads=capture, **kw)
            else:
                old = compute_logprobs(policy, batch, max_tokens_per_micro_batch=MAX_TOKENS)
                metrics = grpo_update(policy, batch, old, mini_batch_size=mini, max_tokens_per_micro_batch=MAX_TOKENS,
                                      ref_logprobs=ref, on_grads=capture, **kw)
            gap = (logprob_gap(batch, old, policy.device) if way == "shard"
                   else whole_batch_gap([s.rollout_logprobs for s in samples], old))
            runs[way] = (metrics, old, grads, gap, batch)
        (m_w, old_w, g_w, gap_w, _), (m_s, old_s, g_s, gap_s, shard) = runs["whole"], runs["shard"]
        verdict[name] = {
            "metrics_equal": m_w == m_s, "differing": [k for k in m_w if m_w[k] != m_s.get(k)],
            "old_equal": len(old_w) == len(old_s) and all(torch.equal(a, b) for a, b in zip(old_w, old_s)),
            "grads_equal": bool(g_w) and g_w.keys() == g_s.keys() and all(torch.equal(g_w[k], g_s[k]) for k in g_w),
            "gap_whole": gap_w, "gap_shard": gap_s, "optimizer_steps": m_s["num_optimizer_steps"],
            "held": len(shard.samples), "batch": len(samples)}
    return verdict


# --- modes ----------------------------------------------------------------------------------------------------------

def mode_ref(out):
    samples = make_samples()
    verdict = {}
    for shape in SHAPES:
        policy = build(shape)
        save_ckpt(policy, f"{out}/weights_{shape}")
        logits = packed_logits(policy, samples)
        lp, ent = compute_logprobs(policy, samples, max_tokens_per_micro_batch=MAX_TOKENS, with_entropy=True)
        old = old_from(lp)
        # packed (several micro-batches, THD) vs padded rows; entropy vs the naive one from the same logits
        pad = padded_logprobs(policy, samples)
        row_lp = torch.log_softmax(logits.double(), -1)
        naive_ent = -(row_lp.exp() * row_lp).sum(-1)
        starts = [0]
        for s in samples:
            starts.append(starts[-1] + s.length)
        ent_ref = [naive_ent[a + len(s.prompt_ids) - 1:b - 1].float() for s, a, b in zip(samples, starts, starts[1:])]
        metrics, grads = one_step(policy, samples, old)
        # two mini-batches of 11 and 1 samples (under DP2 one rank gets an empty filler micro-batch)
        pol = build(shape)
        load_ckpt(pol, f"{out}/weights_{shape}")
        uneven = grpo_update(pol, samples, old, mini_batch_size=11, max_tokens_per_micro_batch=MAX_TOKENS, **STEP_KW)
        torch.save({"logits": logits, "logprobs": lp, "entropy": ent, "old": old, "metrics": metrics,
                    "grads": grads, "uneven": uneven}, f"{out}/ref_{shape}.pt")
        v = {"packed_vs_padded": maxdiff(lp, pad), "entropy_vs_naive": maxdiff(ent, ent_ref),
             "num_micro_batches": metrics["num_micro_batches"], "metrics": metrics,
             "grad_scale": max(float(g.abs().max()) for g in grads.values())}

        # recompute (full, selective) changes memory, not numbers
        for rc in ("full", "selective"):
            pol = build(shape, recompute=rc)
            load_ckpt(pol, f"{out}/weights_{shape}")
            m, g = one_step(pol, samples, old)
            v[f"recompute_{rc}_grad_diff"] = max(float((g[k] - grads[k]).abs().max()) for k in grads)
            v[f"recompute_{rc}_loss_diff"] = abs(m["loss"] - metrics["loss"])

        # all-zero advantages: zero gradient, so Adam (no weight decay) leaves every weight as it was
        pol = build(shape)
        load_ckpt(pol, f"{out}/weights_{shape}")
        before = {k: p.detach().clone() for k, p in params(pol).items()}
        zero = [Sample(s.prompt_ids, s.response_ids, 0.0, group=s.group) for s in samples]
        mz, _ = one_step(pol, zero, old)
        v["zero_adv_max_change"] = max(float((p - before[k]).abs().max()) for k, p in params(pol).items())
        v["zero_adv_grad_norm"] = mz["grad_norm"]
        # ... while the same step with the real advantages does move them (the check above is not vacuous)
        one_step(pol, samples, old)
        v["real_adv_max_change"] = max(float((p - before[k]).abs().max()) for k, p in params(pol).items())
        v["uneven_steps"] = uneven["num_optimizer_steps"]
        v["reuse_forward"] = reuse_forward_check(out, shape)
        v["reuse_forward_stale"] = reuse_forward_check(out, shape, correction="tis")
        verdict[shape] = v

    # the layer spec really in use on the CPU: SDPA core attention and the SP-capable RMSNorm
    from justrl_megatron.model.attention import SDPAttention
    from justrl_megatron.model.norm import RMSNorm
    layer = policy.chunks[0].module.decoder.layers[0]
    verdict["spec"] = {"impl": policy.transformer_impl,
                       "core_attention": isinstance(layer.self_attention.core_attention, SDPAttention),
                       "norms": isinstance(layer.input_layernorm, RMSNorm)
                       and isinstance(policy.chunks[0].module.decoder.final_layernorm, RMSNorm)}

    # linear warmup from 0 over warmup_steps RL steps (one scheduler step per grpo_update), then constant
    pol = Policy.build(SHAPES["qwen"], dtype="fp32", transformer_impl="local", lr=1e-3, warmup_steps=2)
    lrs = [grpo_update(pol, samples[:2], old_from(compute_logprobs(pol, samples[:2], max_tokens_per_micro_batch=64)),
                       mini_batch_size=2, max_tokens_per_micro_batch=64)["lr"] for _ in range(4)]
    verdict["warmup_lrs"] = lrs

    # KL penalty (reference logprobs) and entropy bonus flow through the same step
    pol = build("qwen")
    load_ckpt(pol, f"{out}/weights_qwen")
    ref = torch.load(f"{out}/ref_qwen.pt")
    ref_lp = [x - 0.1 for x in ref["logprobs"]]
    m = grpo_update(pol, samples, ref["old"], mini_batch_size=len(samples), max_tokens_per_micro_batch=MAX_TOKENS,
                    kl_coef=0.5, entropy_coef=0.01, ref_logprobs=ref_lp, **STEP_KW)
    verdict["kl_entropy"] = {k: m.get(k) for k in ("loss", "pg_loss", "kl_loss", "entropy_loss", "entropy")}

    # the other policy losses (algo.policy_loss): their TP1 gradients, for the TP2 x PP2 comparison (layouts4)
    verdict["kinds"] = {}
    for kind in KINDS:
        pol = build("qwen")
        load_ckpt(pol, f"{out}/weights_qwen")
        m, g = one_step(pol, samples, torch.load(f"{out}/ref_qwen.pt")["old"], policy_loss=kind)
        torch.save({"grads": g, "metrics": m}, f"{out}/ref_qwen_{kind}.pt")
        verdict["kinds"][kind] = {"loss": m["loss"], "grad_norm": m["grad_norm"]}

    # bf16 params (megatron's Float16 optimizer with fp32 master weights) on the same weights: close to fp32
    pol = Policy.build(SHAPES["qwen"], dtype="bf16", transformer_impl="local", lr=1e-3, warmup_steps=0)
    load_ckpt(pol, f"{out}/weights_qwen")
    ref = torch.load(f"{out}/ref_qwen.pt")
    lp = compute_logprobs(pol, samples, max_tokens_per_micro_batch=MAX_TOKENS)
    m, _ = one_step(pol, samples, ref["old"])
    verdict["bf16"] = {"param_dtype": str(next(pol.chunks[0].module.parameters()).dtype),
                       "logprob_diff": maxdiff(lp, ref["logprobs"]), "loss": m["loss"],
                       "ref_loss": ref["metrics"]["loss"], "grad_norm": m["grad_norm"],
                       "ref_grad_norm": ref["metrics"]["grad_norm"]}
    return verdict


def run_layout(out, name, shape, uneven=False, sharded=False, **layout):
    from megatron.core import parallel_state as ps

    samples = make_samples()
    ref = torch.load(f"{out}/ref_{shape}.pt")
    policy = build(shape, **layout)
    load_ckpt(policy, f"{out}/weights_{shape}")
    logits = packed_logits(policy, samples)
    lp = compute_logprobs(policy, samples, max_tokens_per_micro_batch=MAX_TOKENS)
    metrics, grads = one_step(policy, samples, ref["old"])
    entry = {
        "logprob_diff": maxdiff(lp, ref["logprobs"]),
        "loss": metrics["loss"], "ref_loss": ref["metrics"]["loss"],
        "grad_norm": metrics["grad_norm"], "ref_grad_norm": ref["metrics"]["grad_norm"],
        "metrics_diff": max(abs(metrics[k] - ref["metrics"][k]) for k in
                            ("entropy", "clip_frac_low", "clip_frac_high", "clip_frac_dual", "ratio_min",
                             "ratio_max", "approx_kl", "logprob_mean", "num_response_tokens")),
        "clip_fracs": [ref["metrics"]["clip_frac_low"], ref["metrics"]["clip_frac_high"],
                       ref["metrics"]["clip_frac_dual"]],
        "sequence_parallel": bool(policy.config.sequence_parallel),
        "dp": ps.get_data_parallel_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(), "chunks": len(policy.chunks),
        "has_grads": bool(grads),
    }
    if logits is not None:
        entry["logit_diff"] = float((logits - ref["logits"]).abs().max())
    if uneven:
        pol = build(shape, **layout)
        load_ckpt(pol, f"{out}/weights_{shape}")
        m = grpo_update(pol, samples, ref["old"], mini_batch_size=11, max_tokens_per_micro_batch=MAX_TOKENS, **STEP_KW)
        entry["uneven"] = {k: (m[k], ref["uneven"][k]) for k in
                           ("loss", "grad_norm", "grad_norm_max", "num_optimizer_steps", "num_micro_batches",
                            "num_response_tokens", "entropy")}
    entry["reuse_forward"] = reuse_forward_check(out, shape, **layout)
    if sharded:
        entry["sharded"] = sharded_check(out, shape, **layout)
    if layout.get("distopt", True) and ps.get_data_parallel_world_size() > 1:
        return entry, False  # the distributed optimizer leaves only this rank's shard of the grads reduced
    with torch.no_grad():
        for k, p in params(policy).items():
            p.copy_(grads[k])
    save_ckpt(policy, f"{out}/grads_{name}")
    return entry, True


def kinds_on_layout(out, **layout):
    """One update per policy loss on this layout, from the reference weights; its gradients saved for TP1 to load."""
    samples, verdict = make_samples(), {}
    old = torch.load(f"{out}/ref_qwen.pt")["old"]
    for kind in KINDS:
        policy = build("qwen", **layout)
        load_ckpt(policy, f"{out}/weights_qwen")
        metrics, grads = one_step(policy, samples, old, policy_loss=kind)
        verdict[kind] = {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}
        with torch.no_grad():
            for k, p in params(policy).items():
                p.copy_(grads[k])
        save_ckpt(policy, f"{out}/grads_kind_{kind}")
    return verdict


def compare_kinds(out, verdict):
    for kind in KINDS:
        ref = torch.load(f"{out}/ref_qwen_{kind}.pt")
        pol = build("qwen")
        load_ckpt(pol, f"{out}/grads_kind_{kind}")
        verdict[kind]["ref_loss"], verdict[kind]["ref_grad_norm"] = ref["metrics"]["loss"], ref["metrics"]["grad_norm"]
        verdict[kind]["grad_diff"] = max(float((p.detach() - ref["grads"][k]).abs().max())
                                         for k, p in params(pol).items())
        verdict[kind]["grad_scale"] = max(float(g.abs().max()) for g in ref["grads"].values())


def compare_grads(out, verdict, names_shapes):
    """Load every layout's gradients into a TP1 model and compare with the reference gradients."""
    for name, shape in names_shapes:
        ref = torch.load(f"{out}/ref_{shape}.pt")
        pol = build(shape)
        load_ckpt(pol, f"{out}/grads_{name}")
        verdict[name]["grad_diff"] = max(float((p.detach() - ref["grads"][k]).abs().max())
                                         for k, p in params(pol).items())
        verdict[name]["grad_scale"] = max(float(g.abs().max()) for g in ref["grads"].values())


def vocab_parallel_logprobs_check():
    """Chunked vocab-parallel logprob + entropy (TP2, padded vocab) vs naive full-vocab, values and gradients."""
    from megatron.core import parallel_state as ps
    from justrl_megatron.model.logprobs import logprobs_from_hidden, logprobs_from_logits

    init_model_parallel(tp=2, pp=1)
    group, rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(11)
    n, h, vocab, padded = 53, 24, 250, 256
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(padded, h, generator=g, dtype=torch.float64)
    targets = torch.randint(0, vocab, (n,), generator=g)
    g_lp, g_ent = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)

    hn, wn = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = hn @ wn.t()
    ls = torch.log_softmax(logits[:, :vocab], -1)
    lp_ref, ent_ref = ls.gather(-1, targets[:, None]).squeeze(-1), -(ls.exp() * ls).sum(-1)
    (lp_ref * g_lp + ent_ref * g_ent).sum().backward()

    half = padded // 2
    w_shard = weight[rank * half:(rank + 1) * half].clone().requires_grad_()
    hs = hidden.clone().requires_grad_()
    lp, ent = logprobs_from_hidden(hs, w_shard, targets, vocab_size=vocab, with_entropy=True, chunk_size=7,
                                   group=group)
    (lp * g_lp + ent * g_ent).sum().backward()
    grad_h = hs.grad.clone()
    dist.all_reduce(grad_h, group=group)  # what megatron's copy-to-TP region does in backward
    z = (hidden @ weight.t())[:, rank * half:(rank + 1) * half].clone().requires_grad_()
    lp2, ent2 = logprobs_from_logits(z, targets, vocab_size=vocab, with_entropy=True, chunk_size=5, group=group)
    (lp2 * g_lp + ent2 * g_ent).sum().backward()
    zref = logits.detach().clone().requires_grad_()
    ls2 = torch.log_softmax(zref[:, :vocab], -1)
    ent_r = -(ls2.exp() * ls2).sum(-1)
    (ls2.gather(-1, targets[:, None]).squeeze(-1) * g_lp + ent_r * g_ent).sum().backward()
    return {
        "logprob_diff": float((lp - lp_ref).abs().max()), "entropy_diff": float((ent - ent_ref).abs().max()),
        "grad_hidden_diff": float((grad_h - hn.grad).abs().max()),
        "grad_weight_diff": float((w_shard.grad - wn.grad[rank * half:(rank + 1) * half]).abs().max()),
        "logits_path_logprob_diff": float((lp2 - lp_ref).abs().max()),
        "logits_path_grad_diff": float((z.grad - zref.grad[:, rank * half:(rank + 1) * half]).abs().max()),
        "grad_scale": float(hn.grad.abs().max()),
    }


def skip_together(**layout):
    """One good step, then a NaN in rank 1's gradients only (after the DP reduction: the replicas now disagree), then
    a good step again. Per rank: what was skipped, whether its weights moved."""
    samples = make_samples()
    policy = build("qwen", **layout)

    def step(**kw):
        old = compute_logprobs(policy, samples, max_tokens_per_micro_batch=MAX_TOKENS)
        return grpo_update(policy, samples, old, mini_batch_size=len(samples), max_tokens_per_micro_batch=MAX_TOKENS,
                           **STEP_KW, **kw)

    def poison(pol, step_index):
        if dist.get_rank() == 1:
            next(pol.chunks[0].module.parameters()).main_grad.view(-1)[0] = float("nan")

    first = step()
    before = {k: p.detach().clone() for k, p in params(policy).items()}
    bad = step(on_grads=poison)
    unchanged = all(torch.equal(p, before[k]) for k, p in params(policy).items())
    streak = policy.skipped_in_a_row
    good = step()
    moved = any(not torch.equal(p, before[k]) for k, p in params(policy).items())
    return {"skipped": [first["skipped_steps"], bad["skipped_steps"], good["skipped_steps"]],
            "unchanged_after_nan": unchanged, "streak_after_nan": streak, "streak_after_good": policy.skipped_in_a_row,
            "moved_after_good": moved, "finite": all(bool(torch.isfinite(p).all()) for p in params(policy).values())}


def main(out, mode):
    rank, world = init_distributed()
    if mode == "ref":
        verdict = mode_ref(out)
    elif mode == "guard2":
        verdict = {"dp2": skip_together(distopt=False), "dp2_distopt": skip_together(distopt=True),
                   "tp2": skip_together(tp=2)}
    else:
        verdict = {}
        if mode == "layouts2":
            verdict["vocab_parallel"] = vocab_parallel_logprobs_check()
            layouts = {"tp2": ("qwen", dict(tp=2)), "tp2_sp": ("qwen", dict(tp=2, sp=True, sharded=True)),
                       "pp2": ("qwen", dict(pp=2)), "dp2": ("qwen", dict(distopt=False, sharded=True)),
                       "dp2_distopt": ("qwen", dict(distopt=True, uneven=True, sharded=True)),
                       "tp2_sp_tied": ("llama", dict(tp=2, sp=True))}
        else:
            layouts = {"tp2pp2": ("qwen", dict(tp=2, pp=2)),
                       "pp2vpp2_tied": ("llama", dict(pp=2, vpp=2, distopt=False))}
        saved = []
        for name, (shape, layout) in layouts.items():
            verdict[name], has_grads = run_layout(out, name, shape, **layout)
            if has_grads:
                saved.append((name, shape))
        compare_grads(out, verdict, saved)
        if mode == "layouts4":  # every policy loss through TP2 x PP2 against TP1
            verdict["kinds"] = kinds_on_layout(out, tp=2, pp=2)
            compare_kinds(out, verdict["kinds"])
    with open(os.path.join(out, f"{mode}_rank{rank}.json"), "w") as f:
        json.dump(verdict, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
