"""MoE checks across expert-parallel layouts on real megatron-core (CPU, gloo). Run by tests/test_moe.py under torchrun,
once per world size:

    python -m torch.distributed.run --standalone --nproc-per-node N moe_checks.py OUT family=HF_DIR [family=HF_DIR ...]

Per tiny MoE model (Mixtral, Qwen3-MoE) and per layout of this world size (2: EP2; 4: TP2 x EP2, and PP2 x EP2):
  logits     HF -> live Megatron (`load_hf_weights`, each EP rank reads only its own experts), logits through megatron's
             schedule vs transformers' (fp32);
  roundtrip  the live model streamed back (`export_hf_stream`, small buckets: experts EP-broadcast one at a time)
             against the original safetensors, every tensor bitwise, and every expert present;
  convert    (world 2) `justrl-convert hf-to-mcore --ep 2`, `mcore-to-hf --ep 1` (the dist checkpoint resharded
             from EP2 to EP1) bitwise equal to the original files, and `verify --ep 2` within 1e-5; the same at
             --tp 2 / --tp 1 (attention split over TP2, every expert whole on each TP rank: expert TP 1);
  grpo       (world 2) one GRPO update at EP2 vs at EP1 on the same ranks and data (DP2 both): loss, grad norm,
             and every gradient of this rank by its global Megatron name (expert gradients on their EP rank); then
             EP2 with the distributed optimizer: loss, grad norm and the logprobs after the optimizer step.
  resume     (world 2, last model) EP2 with the distributed optimizer: a training checkpoint after one update, saved
             asynchronously (sharded, dp_reshardable) while the live policy takes the next update; that update vs the
             same from a fresh policy resumed from it: loss, grad norm, every weight after it (bitwise).
Each case writes its own verdict; every rank writes OUT/rank{r}.json.
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import json
import sys
import traceback

import torch
import torch.distributed as dist

from _common import random_samples
from justrl_megatron.convert import export_hf_stream, load_hf_weights
from justrl_megatron.convert.load import SafetensorsFolder
from justrl_megatron.convert.mapping import live_parameters
from justrl_megatron.convert.verify import hf_logits, megatron_logits, random_tokens
from justrl_megatron.distributed import init_distributed
from justrl_megatron.model.hf_config import model_shape
from justrl_megatron.model.policy import Policy
from justrl_megatron.train.step import compute_logprobs, grpo_update

LAYOUTS = {2: {"ep2": dict(ep=2)}, 4: {"tp2ep2": dict(tp=2, ep=2), "pp2ep2": dict(pp=2, ep=2)}}
BUCKET_BYTES = 32 << 10  # small: many buckets, experts of one layer spread over several
MAX_TOKENS = 40  # several micro-batches per DP rank
STEP_KW = dict(clip_low=0.2, clip_high=0.28, dual_clip_c=2.0, loss_agg="token-mean")


def build(hf_dir, shape, tp=1, pp=1, ep=1, distopt=False):
    # plain optimizer by default: every rank's main_grad holds its parameters' whole reduced gradient
    policy = Policy.build(shape, tp=tp, pp=pp, ep=ep, dtype="fp32", transformer_impl="local", lr=1e-3,
                          grad_clip=1.0, distributed_optimizer=distopt, seed=1234)
    load_hf_weights(policy.chunks, hf_dir, progress=False)
    policy.optimizer.reload_model_params()
    return policy


def case_logits(policy, shape, ref_logits, tokens):
    ours = megatron_logits(policy.chunks, tokens, shape.vocab_size)
    if ours is None:  # not the last pipeline stage
        return {"ok": True, "last_stage": False}
    diff = float((ours - ref_logits).abs().max())
    return {"ok": diff <= 1e-5, "max_abs_diff": diff, "ref_max": float(ref_logits.abs().max())}


def case_roundtrip(policy, shape, original):
    seen, bad, buckets = set(), [], 0
    for bucket in export_hf_stream(policy.chunks, shape, bucket_bytes=BUCKET_BYTES):
        buckets += 1
        for name, t in bucket:
            seen.add(name)
            if name not in original or not torch.equal(t, original[name]):
                bad.append(name)
    missing = sorted(set(original) - seen)
    experts = sum(".experts." in n for n in seen)
    return {"ok": not bad and not missing and experts == 3 * shape.num_experts * shape.num_layers,
            "bad": bad[:5], "missing": missing[:5], "buckets": buckets, "expert_tensors": experts}



def one_update(policy, samples, old):
    grads = {}

    def capture(pol, step):
        live = live_parameters(pol.chunks)
        grads.update({n: p.main_grad.detach().clone() for n, p in live.items()})

    metrics = grpo_update(policy, samples, old, mini_batch_size=len(samples), max_tokens_per_micro_batch=MAX_TOKENS,
                          on_grads=capture, **STEP_KW)
    return metrics, grads


def case_grpo(hf_dir, shape):
    """EP1 then EP2 in this process (megatron's groups rebuilt by Policy.build), same DP2 split of the same data."""
    samples = random_samples(shape.vocab_size)
    ep1 = build(hf_dir, shape, ep=1)
    lp = compute_logprobs(ep1, samples, max_tokens_per_micro_batch=MAX_TOKENS)
    g = torch.Generator().manual_seed(5)
    old = [x + 0.3 * torch.randn(x.shape, generator=g) for x in lp]  # ratios leave the clip range both ways
    m1, g1 = one_update(ep1, samples, old)
    del ep1
    ep2 = build(hf_dir, shape, ep=2)
    lp2 = compute_logprobs(ep2, samples, max_tokens_per_micro_batch=MAX_TOKENS)
    m2, g2 = one_update(ep2, samples, old)
    after_ep2 = compute_logprobs(ep2, samples, max_tokens_per_micro_batch=MAX_TOKENS)
    del ep2
    ep2d = build(hf_dir, shape, ep=2, distopt=True)
    m3 = grpo_update(ep2d, samples, old, mini_batch_size=len(samples), max_tokens_per_micro_batch=MAX_TOKENS,
                     **STEP_KW)
    after_distopt = compute_logprobs(ep2d, samples, max_tokens_per_micro_batch=MAX_TOKENS)
    grad_diff = max(float((g2[n] - g1[n]).abs().max()) for n in g2)
    experts_here = sorted({int(n.split("local_experts.")[1].split(".")[0]) for n in g2 if "local_experts." in n})
    out = {"loss": (m1["loss"], m2["loss"]), "grad_norm": (m1["grad_norm"], m2["grad_norm"]),
           "logprob_diff": max(float((a - b).abs().max()) for a, b in zip(lp, lp2)),
           "grad_diff": grad_diff, "grads_compared": len(g2), "experts_here": experts_here,
           "grad_norm_nonzero": m1["grad_norm"] > 1e-3,
           "distopt": {"loss": m3["loss"], "grad_norm": m3["grad_norm"],
                       "logprob_diff_after_step": max(float((a - b).abs().max())
                                                      for a, b in zip(after_ep2, after_distopt))}}
    out["ok"] = (abs(m1["loss"] - m2["loss"]) <= 1e-6 and abs(m1["grad_norm"] - m2["grad_norm"]) <= 1e-5
                 and grad_diff <= 1e-6 and out["logprob_diff"] <= 1e-5 and out["grad_norm_nonzero"]
                 and len(experts_here) == shape.num_experts // 2
                 and abs(m3["loss"] - m2["loss"]) <= 1e-6 and abs(m3["grad_norm"] - m2["grad_norm"]) <= 1e-5
                 and out["distopt"]["logprob_diff_after_step"] <= 1e-5)
    return out


def case_convert(hf_dir, shape, original, out, flag="--ep"):
    from justrl_megatron.convert import cli
    from justrl_megatron.convert.load import SafetensorsFolder

    def run(*argv):
        args = cli._parser().parse_args([str(a) for a in argv])  # main() would end the process group
        return {"hf-to-mcore": cli.hf_to_mcore, "mcore-to-hf": cli.mcore_to_hf, "verify": cli.verify}[argv[0]](args)

    ckpt, back = f"{out}/mcore_{shape.family}{flag}", f"{out}/hf_{shape.family}{flag}"
    codes = [run("hf-to-mcore", "--hf", hf_dir, "--out", ckpt, flag, 2, "--force"),
             run("mcore-to-hf", "--ckpt", ckpt, "--out", back, flag, 1, "--force"),
             run("verify", "--hf", hf_dir, "--ckpt", ckpt, flag, 2, "--tol", 1e-5)]
    dist.barrier()
    files = SafetensorsFolder(back)
    bad = sorted(n for n in original if n not in files.names() or not torch.equal(files.read(n, None, 0, 0),
                                                                                    original[n]))
    extra = sorted(files.names() - set(original))
    return {"ok": codes == [0, 0, 0] and not bad and not extra, "codes": codes, "bad": bad[:5], "extra": extra[:5],
            "tensors": len(files.names())}


def case_resume(hf_dir, shape, out):
    from justrl_megatron.checkpoint import Checkpointer, load_latest_checkpoint

    samples = random_samples(shape.vocab_size)
    live = build(hf_dir, shape, ep=2, distopt=True)
    old = [x + 0.1 for x in compute_logprobs(live, samples, max_tokens_per_micro_batch=MAX_TOKENS)]
    update = dict(mini_batch_size=len(samples), max_tokens_per_micro_batch=MAX_TOKENS, **STEP_KW)
    grpo_update(live, samples, old, **update)
    saver = Checkpointer(f"{out}/run_{shape.family}", async_save=True, shape=shape, hf_source=hf_dir)
    saver.save(1, live.chunks, live.optimizer, live.scheduler, {})
    m_live = grpo_update(live, samples, old, **update)  # while the checkpoint is written
    saver.wait()
    after_live = compute_logprobs(live, samples, max_tokens_per_micro_batch=MAX_TOKENS)
    weights_live = {n: p.detach().clone() for n, p in live_parameters(live.chunks).items()}
    del live
    resumed = build(hf_dir, shape, ep=2, distopt=True)
    step = load_latest_checkpoint(f"{out}/run_{shape.family}", resumed.chunks, resumed.optimizer,
                                  resumed.scheduler)["step"]
    m_resumed = grpo_update(resumed, samples, old, **update)
    after_resumed = compute_logprobs(resumed, samples, max_tokens_per_micro_batch=MAX_TOKENS)
    diff = max(float((a - b).abs().max()) for a, b in zip(after_live, after_resumed))
    weights = live_parameters(resumed.chunks)
    unequal = sorted(n for n, w in weights_live.items() if not torch.equal(w, weights[n]))
    return {"ok": step == 1 and m_live["loss"] == m_resumed["loss"] and m_live["grad_norm"] == m_resumed["grad_norm"]
            and diff == 0.0 and not unequal and len(weights_live) > 0, "step": step,
            "loss": (m_live["loss"], m_resumed["loss"]), "grad_norm": (m_live["grad_norm"], m_resumed["grad_norm"]),
            "logprob_diff_after": diff, "weights_unequal": unequal[:5], "weights_compared": len(weights_live)}


def run_case(verdict, key, fn, *args):
    try:
        verdict[key] = fn(*args)
    except Exception:  # noqa: BLE001  (each case its own verdict; the others still run)
        verdict[key] = {"ok": False, "error": traceback.format_exc()[-3000:]}


def main():
    from transformers import AutoConfig

    out = sys.argv[1]
    models = dict(arg.split("=", 1) for arg in sys.argv[2:])
    rank, world = init_distributed()
    verdict = {}
    for family, hf_dir in models.items():
        shape = model_shape(AutoConfig.from_pretrained(hf_dir))
        files = SafetensorsFolder(hf_dir)
        original = {n: files.read(n, None, 0, 0) for n in files.names()}
        tokens = random_tokens(shape.vocab_size, batch=2, seq_len=48, seed=7)
        ref_logits = hf_logits(hf_dir, tokens)
        for name, layout in LAYOUTS[world].items():
            try:
                policy = build(hf_dir, shape, **layout)
            except Exception:  # noqa: BLE001
                verdict[f"{family}/{name}/build"] = {"ok": False, "error": traceback.format_exc()[-3000:]}
                continue
            run_case(verdict, f"{family}/{name}/logits", case_logits, policy, shape, ref_logits, tokens)
            run_case(verdict, f"{family}/{name}/roundtrip", case_roundtrip, policy, shape, original)
            del policy
        if world == 2:
            run_case(verdict, f"{family}/ep2/convert", case_convert, hf_dir, shape, original, out)
            run_case(verdict, f"{family}/tp2/convert", case_convert, hf_dir, shape, original, out, "--tp")
            run_case(verdict, f"{family}/ep2_vs_ep1/grpo", case_grpo, hf_dir, shape)
    if world == 2:  # one model is enough: the checkpoint code does not depend on the family
        run_case(verdict, f"{family}/ep2/resume", case_resume, hf_dir, shape, out)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(verdict, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
