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
import os
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


def build(hf_dir, shape, tp=1, pp=1, ep=1, distopt=False, **kw):
    # plain optimizer by default: every rank's main_grad holds its parameters' whole reduced gradient
    policy = Policy.build(shape, tp=tp, pp=pp, ep=ep, dtype="fp32", transformer_impl="local", lr=1e-3,
                          grad_clip=1.0, distributed_optimizer=distopt, seed=1234, **kw)
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


def _move_routers(policy, seed=11):
    """The same random step on every router on every rank: natural routing now differs from the recorded one."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in policy.modules[0].decoder.layers:
            w = layer.mlp.router.weight
            w.add_(torch.randn(w.shape, generator=g))


def _routing_maps(policy):
    """Hooks collecting (layer, routing map) of every router call, in call order."""
    calls = []
    hooks = [layer.mlp.router.register_forward_hook(lambda m, a, out, i=layer.layer_number - 1:
                                                    calls.append((i, out[1].detach().clone())))
             for layer in policy.modules[0].decoder.layers]
    return calls, hooks


def _per_sample(calls, plans):
    """{(layer, sample): routing map of its real tokens} from the calls of the forwards of `plans`, in order."""
    out = {}
    assert len(calls) % max(len(plans), 1) == 0, (len(calls), len(plans))
    per_mb = len(calls) // max(len(plans), 1)
    for j, mb in enumerate(plans):
        for layer, routing_map in calls[j * per_mb:(j + 1) * per_mb]:
            for k, sid in enumerate(mb.sample_ids):
                a, b = int(mb.cu_seqlens[k]), int(mb.cu_seqlens[k + 1])
                out[(layer, sid)] = routing_map[a:b]
    calls.clear()
    return out


def case_replay_dp2(hf_dir, shape):
    """routing_replay=old at EP2 (DP2), unequal lengths, two mini-batches of several micro-batches: a sample's
    update may run on another DP rank than its old-logprob pass; after the routers move, every token of the update
    still takes exactly the experts the old pass chose for it (on whichever rank that pass ran, fetched in pieces of
    a few tokens). After the old pass a rank holds the routes of its own samples only."""
    from justrl_megatron.train.step import plan_micro_batches

    from justrl_megatron.model.moe import RoutingReplay

    samples = random_samples(shape.vocab_size)
    policy = build(hf_dir, shape, ep=2, routing_replay="old", shared_prompt="auto")
    policy.routing_replay.PIECE_BYTES = 12  # the fetch in messages of 3 tokens' routes: many rounds
    assert RoutingReplay.PIECE_BYTES == 64 << 20
    calls, hooks = _routing_maps(policy)
    old = compute_logprobs(policy, samples, max_tokens_per_micro_batch=MAX_TOKENS)
    mine = _per_sample(calls, plan_micro_batches(policy, samples, range(len(samples)), MAX_TOKENS))
    stored_after_recording = sorted(policy.routing_replay.routes)  # this rank's samples only
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    recorded = {k: v for part in everyone for k, v in part.items()}
    _move_routers(policy)
    half = len(samples) // 2
    m = grpo_update(policy, samples, old, mini_batch_size=half, max_tokens_per_micro_batch=MAX_TOKENS, **STEP_KW)
    plans = [mb for ids in (range(half), range(half, len(samples)))
             for mb in plan_micro_batches(policy, samples, list(ids), MAX_TOKENS)]
    replayed = _per_sample(calls, plans)
    for h in hooks:
        h.remove()
    moved = sorted({sid for (_, sid) in replayed if (0, sid) not in mine})  # recorded on the other rank
    differ = sum(int((replayed[k] != recorded[k]).any(-1).sum()) for k in replayed)
    lengths = sorted({s.length for s in samples})
    recorded_here = sorted({sid for (_, sid) in mine})
    out = {"moved_samples": moved, "replayed": len(replayed), "tokens_not_replayed": differ,
           "shared_prompt": policy.shared_prompt, "optimizer_steps": m["num_optimizer_steps"],
           "micro_batches": m["num_micro_batches"], "distinct_lengths": len(lengths),
           "stored_after_recording": stored_after_recording, "recorded_here": recorded_here}
    out["ok"] = (differ == 0 and bool(moved) and len(replayed) > 0 and not policy.shared_prompt
                 and m["num_optimizer_steps"] == 2 and m["num_micro_batches"] > 2 and len(lengths) > 2
                 and stored_after_recording == recorded_here and len(recorded_here) < len(samples))
    return out


def case_replay_store_dp2_vs_dp1(hf_dir, shape):
    """Routing replay (old) holds each rank's own samples only: at DP2 (TP1) a rank's store holds the samples its
    old-logprob pass recorded (its bytes: their tokens x MoE layers x top-k x 1 byte), and during each of the two
    mini-batches those plus the ones its micro-batches train, fetched from the other rank (dropped at the next
    mini-batch); at DP1 (TP2 x EP2, sequence parallel: the same samples, one replica) the store holds every sample. The
    routers move between the old-logprob pass and the update, and the DP2 update equals the DP1 one: loss, grad
    norm and every gradient of both optimizer steps. Aux loss off (its value depends on the micro-batch packing)."""
    from megatron.core import parallel_state as ps
    from justrl_megatron.train.step import plan_micro_batches

    samples = random_samples(shape.vocab_size, n=12, seed=9)
    half, g = len(samples) // 2, torch.Generator().manual_seed(6)
    old, runs = None, {}
    for name, layout in (("dp1", dict(tp=2, ep=2)), ("dp2", {})):
        policy = build(hf_dir, shape, routing_replay="old", moe_aux_loss_coef=0.0, **layout)
        store = policy.routing_replay
        lp = compute_logprobs(policy, samples, max_tokens_per_micro_batch=MAX_TOKENS)
        if old is None:
            old = [x + 0.3 * torch.randn(x.shape, generator=g) for x in lp]
        mine = sorted({k for mb in plan_micro_batches(policy, samples, range(len(samples)), MAX_TOKENS)
                       for k in mb.sample_ids})
        row = len(store.layers) * store.top_k  # bytes per token (uint8 experts)
        recorded = {"ids": sorted(store.routes), "expected": mine, "bytes": store.nbytes(),
                    "expected_bytes": sum(samples[i].length for i in mine) * row}
        _move_routers(policy)
        live = live_parameters(policy.chunks)
        grads, held = [], []

        def capture(pol, step, live=live, grads=grads, held=held, store=store):
            ids = range(step * half, min((step + 1) * half, len(samples)))
            trains = {k for mb in plan_micro_batches(pol, samples, list(ids), MAX_TOKENS) for k in mb.sample_ids}
            held.append({"ids": sorted(store.routes), "bytes": store.nbytes(), "trains": sorted(trains),
                         "fetched": sorted(set(store.routes) - store.recorded)})
            grads.append({n: p.main_grad.detach().clone() for n, p in live.items()})

        m = grpo_update(policy, samples, old, mini_batch_size=half, max_tokens_per_micro_batch=MAX_TOKENS,
                        on_grads=capture, **STEP_KW)
        runs[name] = m, grads, recorded, held, ps.get_tensor_model_parallel_rank(), policy.config.sequence_parallel
        del policy, store
    (m1, g1, rec1, held1, tp_rank, sp), (m2, g2, rec2, held2, _, _) = runs["dp1"], runs["dp2"]
    diff = 0.0
    for a, b in zip(g1, g2):  # a TP-split tensor of the DP1 run: this rank's contiguous part of the DP2 one (experts:
        # this EP rank's, whole)
        for n, grad in a.items():
            ref = b[n]
            split = [d for d in range(grad.dim()) if grad.shape[d] != ref.shape[d]]
            ref = ref.chunk(2, dim=split[0])[tp_rank] if split else ref
            diff = max(diff, float((grad - ref).abs().max()))
    every = list(range(len(samples)))
    total = sum(s.length for s in samples) * (rec2["bytes"] // max(sum(samples[i].length for i in rec2["ids"]), 1))
    out = {"loss": (m1["loss"], m2["loss"]), "grad_norm": (m1["grad_norm"], m2["grad_norm"]), "grad_diff": diff,
           "steps": (len(g1), len(g2)), "sequence_parallel_dp1": sp, "dp1_recorded": rec1, "dp2_recorded": rec2,
           "dp2_held": held2, "dp1_held_ids": [h["ids"] for h in held1],
           # what this rank held before (every sample, a uint8 buffer and an int16 copy): 3 bytes per route
           "bytes_all_samples_before": 3 * total, "bytes_dp2_recorded": rec2["bytes"],
           "bytes_dp2_peak": max((h["bytes"] for h in held2), default=0)}
    out["ok"] = (sp and len(g1) == len(g2) == 2 and diff <= 1e-6 and m1["grad_norm"] > 1e-3
                 and abs(m1["loss"] - m2["loss"]) <= 1e-6
                 # the norm sums every gradient in another order at TP2 x EP2 than at DP2: fp32-relative, not absolute
                 and abs(m1["grad_norm"] - m2["grad_norm"]) <= 1e-6 * max(1.0, abs(m1["grad_norm"]))
                 and rec1["ids"] == every and all(h["ids"] == every for h in held1)
                 and rec2["ids"] == rec2["expected"] and rec2["bytes"] == rec2["expected_bytes"] > 0
                 and len(rec2["ids"]) < len(samples)
                 and all(set(h["ids"]) == set(rec2["ids"]) | set(h["trains"]) for h in held2)
                 and any(h["fetched"] for h in held2))
    return out


def _router_statistics_by_hand(routers, top_k):
    """Forward hooks on `routers` ({layer: router}) that compute, from each training forward's router input and
    weight, megatron's switch loss, the z-loss (mean logsumexp^2) and the tokens per expert over every token they
    see. `done()`: (mean switch loss, mean z-loss, mean over layers of max / mean tokens per expert), over every
    call on every rank."""
    seen = {"aux": 0.0, "z": 0.0, "calls": 0, "counts": {}}

    def hook(layer, router):
        def fn(module, args, output):
            if not torch.is_grad_enabled():  # the old-logprob pass
                return
            with torch.no_grad():
                h = args[0].reshape(-1, args[0].shape[-1]).double()
                logits = h @ router.weight.detach().double().t()
                scores = logits.softmax(-1)
                routed = torch.zeros_like(scores).scatter(1, scores.topk(top_k, dim=-1).indices, 1.0)
                experts, tokens = scores.shape[1], scores.shape[0]
                seen["aux"] += float(experts / (top_k * tokens ** 2) * (scores.sum(0) * routed.sum(0)).sum())
                seen["z"] += float(torch.logsumexp(logits, -1).square().mean())
                seen["calls"] += 1
                seen["counts"][layer] = seen["counts"].get(layer, 0) + routed.sum(0)
        return fn

    hooks = [r.register_forward_hook(hook(i, r)) for i, r in routers.items()]

    def done():
        for h in hooks:
            h.remove()
        sums = torch.tensor([seen["aux"], seen["z"], seen["calls"]], dtype=torch.float64)
        counts = torch.stack([seen["counts"][i] for i in sorted(seen["counts"])])
        dist.all_reduce(sums)
        dist.all_reduce(counts)
        imbalance = counts.max(1).values / counts.mean(1)
        return float(sums[0] / sums[2]), float(sums[1] / sums[2]), float(imbalance.mean())
    return done


def case_cp_router_losses(hf_dir, shape):
    """MoE x context and tensor parallelism with padding: the load-balancing and z-loss values logged, the router
    load, the grad norm and every router's gradient at parallel.context=2 (EP1 and EP2), at parallel.tensor=2
    (sequence parallel) and at parallel.pipeline=2 (no padding there: the mask's way to the second stage's routers)
    equal CP1's, and the logged statistics equal the same statistics computed by hand from the real tokens' router
    inputs. Samples of 13, 11, 9 and 8 tokens, two per micro-batch (21 and 20 tokens): CP2 pads
    each to a multiple of 4 (unequally over the CP ranks), SP pads the 21-token micro-batch to 22; CP1 has none. Each
    layout packs the same two micro-batches (CP1: one per DP rank)."""
    import random

    from justrl_megatron.train.batching import Sample

    rng = random.Random(4)
    samples = [Sample([rng.randrange(shape.vocab_size) for _ in range(6)],
                      [rng.randrange(shape.vocab_size) for _ in range(n)], advantage=rng.uniform(-1, 1), group=i // 2)
               for i, n in enumerate((7, 5, 3, 2))]
    keys = ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance", "loss", "grad_norm")
    out, ok, runs, by_hand = {}, True, {}, None
    for name, layout in (("ep1/cp1", {}), ("ep1/cp2", dict(cp=2)), ("ep1/tp2", dict(tp=2)), ("ep1/pp2", dict(pp=2)),
                         ("ep2/cp1", dict(ep=2)), ("ep2/cp2", dict(ep=2, cp=2))):
        policy = build(hf_dir, shape, moe_aux_loss_coef=0.05, moe_z_loss_coef=0.01, **layout)
        old = compute_logprobs(policy, samples, max_tokens_per_micro_batch=22)
        routers = {layer.layer_number - 1: layer.mlp.router for layer in policy.modules[0].decoder.layers}
        grads = {}
        done = _router_statistics_by_hand(routers, shape.moe_top_k) if name == "ep1/cp1" else None
        m = grpo_update(policy, samples, old, mini_batch_size=4, max_tokens_per_micro_batch=22,
                        on_grads=lambda pol, step: grads.update({i: r.weight.main_grad.clone()
                                                                 for i, r in routers.items()}), **STEP_KW)
        if done is not None:  # CP1 at TP1: no padding, every token the router sees is real
            by_hand = dict(zip(keys, done()))
        runs[name] = m, grads
        del policy
    for ep in ("ep1", "ep2"):
        m1, g1 = runs[f"{ep}/cp1"]
        for name in (f"{ep}/cp2", "ep1/tp2", "ep1/pp2") if ep == "ep1" else (f"{ep}/cp2",):
            m2, g2 = runs[name]
            diff = max(float((g1[i] - g2[i]).abs().max()) for i in g2)  # PP2: this stage's routers
            res = {k: (m1[k], m2[k]) for k in keys}
            res["by_hand"] = {k: by_hand[k] for k in keys[:3]}
            res["router_grad_diff"], res["router_grad_max"] = diff, max(float(g.abs().max()) for g in g1.values())
            out[name] = res
            # TP2 x EP1's grad norm differs from TP1's by ~3e-4 with no padding and no router loss either (the
            # experts' gradients, not the routers'): compared at CP only
            same = keys if name != "ep1/tp2" else keys[:-1]
            ok = ok and diff <= 1e-6 and res["router_grad_max"] > 1e-4 and all(
                abs(res[k][0] - res[k][1]) <= 1e-5 * abs(res[k][0]) for k in same) and all(
                abs(res[k][j] - by_hand[k]) <= 1e-5 * by_hand[k] for k in keys[:3] for j in (0, 1))
    out["ok"] = ok
    return out


def case_tp2ep2_replay(hf_dir, shape):
    """One GRPO update with routing_replay=old at TP2 x EP2 (sequence parallelism turned on for MoE: each TP rank
    records and replays its slice of the row) equals TP1 x EP1 (DP4): loss, grad norm and every gradient of this
    rank (TP shards against the same slice of the TP1 gradient). The routers move between the old-logprob pass and
    the update, so only replayed experts can make the two agree. Aux loss off: its value depends on how samples
    are packed into micro-batches, which DP4 and DP2 do differently."""
    samples = random_samples(shape.vocab_size)
    g = torch.Generator().manual_seed(5)
    old, runs = None, {}
    for name, layout in (("tp1ep1", {}), ("tp2ep2", dict(tp=2, ep=2))):
        policy = build(hf_dir, shape, routing_replay="old", moe_aux_loss_coef=0.0, **layout)
        lp = compute_logprobs(policy, samples, max_tokens_per_micro_batch=MAX_TOKENS)
        if old is None:
            old = [x + 0.3 * torch.randn(x.shape, generator=g) for x in lp]
        _move_routers(policy)
        live = live_parameters(policy.chunks)
        grads = {}

        def capture(pol, step, live=live, grads=grads):
            grads.update({n: p.main_grad.detach().clone() for n, p in live.items()})

        m = grpo_update(policy, samples, old, mini_batch_size=len(samples), max_tokens_per_micro_batch=MAX_TOKENS,
                        on_grads=capture, **STEP_KW)
        runs[name] = m, grads, policy.config.sequence_parallel
        del policy
    (m1, g1, _), (m2, g2, sp) = runs["tp1ep1"], runs["tp2ep2"]
    from megatron.core import parallel_state as ps

    tp_rank, diff = ps.get_tensor_model_parallel_rank(), 0.0
    for n, grad in g2.items():  # a TP-split tensor: this rank's contiguous part of the TP1 one (experts: whole)
        ref = g1[n]
        split = [d for d in range(grad.dim()) if grad.shape[d] != ref.shape[d]]
        ref = ref.chunk(2, dim=split[0])[tp_rank] if split else ref
        diff = max(diff, float((grad - ref).abs().max()))
    out = {"loss": (m1["loss"], m2["loss"]), "grad_norm": (m1["grad_norm"], m2["grad_norm"]), "grad_diff": diff,
           "grads_compared": len(g2), "sequence_parallel": sp}
    out["ok"] = (sp and abs(m1["loss"] - m2["loss"]) <= 1e-6
                 and abs(m1["grad_norm"] - m2["grad_norm"]) <= 1e-6 * max(1.0, abs(m1["grad_norm"]))
                 and diff <= 1e-6 and m1["grad_norm"] > 1e-3)
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


def _wanted(key):
    only = os.environ.get("MOE_CHECKS_ONLY")  # substrings of case keys (a local run of some cases); unset: all
    return not only or any(part in key for part in only.split(","))


def run_case(verdict, key, fn, *args):
    if not _wanted(key):
        return
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
            if not (_wanted(f"{family}/{name}/logits") or _wanted(f"{family}/{name}/roundtrip")):
                continue
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
    if world == 2:  # one model is enough for these: routing and router losses do not depend on the family
        run_case(verdict, f"{family}/ep2/replay_dp2", case_replay_dp2, hf_dir, shape)
        run_case(verdict, f"{family}/dp2_vs_dp1/replay_store", case_replay_store_dp2_vs_dp1, hf_dir, shape)
        run_case(verdict, f"{family}/cp2_vs_cp1/router_losses", case_cp_router_losses, hf_dir, shape)
    if world == 4:
        run_case(verdict, f"{family}/tp2ep2_vs_tp1ep1/replay_grpo", case_tp2ep2_replay, hf_dir, shape)
    if world == 2:  # one model is enough: the checkpoint code does not depend on the family
        run_case(verdict, f"{family}/ep2/resume", case_resume, hf_dir, shape, out)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(verdict, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
