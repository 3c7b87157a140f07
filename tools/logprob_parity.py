"""Where the trainer's and the engine's log-probs part: the same prompt + response through the trainer's Megatron
model and the vLLM engine holding the same weights, compared layer by layer.

    PYTHONPATH=. python tools/logprob_parity.py --out docs/data/numerics/parity.json [--dtypes fp32,bf16] [--exact]

One child process per dtype (a process hosts one in-process vLLM engine). In each: a tiny random Qwen2 (or --model),
a local-spec Megatron policy that loads it and streams its weights into the engine (the engine runs exactly the
trainer's bits), then
  * the headline gap: the engine samples 5 prompts x 4 (temperature 1), the trainer recomputes those tokens'
    log-probs (train/step.compute_logprobs, the rollout's own check);
  * per layer, per path: forward hooks on both models record embedding, each norm, attention out, residual after
    attention, MLP out, layer out (residual), final norm; logits and log-softmax at the end.
    prefill = the engine scores prompt+response in one forward (prompt_logprobs); decode = the engine generates the
    response token by token (what a rollout does: the prompt is prefilled, then one row per step through the paged
    KV cache), the rows of all its steps put together. The trainer runs the packed forward of compute_logprobs.
Each row of the table: max and mean |trainer - engine| over the sequence's positions, and the scale (max |engine|).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPTS = [[11, 12, 13, 14, 15], [201, 7, 42], [5, 6, 7, 8, 9, 10, 11], [300, 301], [17, 18, 19]]
N, STEPS = 4, 24
TINY = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=200)  # tests' VLLM_TINY


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def _stat(a, b) -> dict:
    import torch

    a, b = a.double().reshape(b.shape), b.double()
    d = (a - b).abs()
    return {"max": d.max().item(), "mean": d.mean().item(), "scale": b.abs().max().item()}


class Recorder:
    """Forward hooks that keep a copy of each named point's rows ([tokens, features], fp32 as computed)."""

    def __init__(self):
        self.rows: dict[str, list] = {}
        self.handles = []

    def keep(self, name, t):
        t = t.detach().reshape(t.shape[0], -1).clone()  # [tokens, ...] on both sides (megatron: [t, 1, ...])
        self.rows.setdefault(name, []).append(t)

    def out(self, module, name, pick=_first):
        self.handles.append(module.register_forward_hook(lambda m, a, o: self.keep(name, pick(o))))

    def inp(self, module, name, index=0):
        self.handles.append(module.register_forward_pre_hook(lambda m, a: self.keep(name, a[index])))

    def cat(self, name, rows=None):
        import torch

        t = torch.cat(self.rows[name])
        return t if rows is None else t[:rows]

    def clear(self):
        self.rows = {}

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


def _megatron_qkv(out, attn):
    """megatron's fused QKV rows ([q heads of group g, k_g, v_g] per query group) in vLLM's order [q | k | v]."""
    import torch

    groups = attn.num_query_groups_per_partition
    d = attn.hidden_size_per_attention_head
    per = attn.num_attention_heads_per_partition // groups
    x = out.reshape(-1, groups, (per + 2) * d)
    q, k, v = torch.split(x, [per * d, d, d], dim=-1)
    return torch.cat([q.reshape(x.size(0), -1), k.reshape(x.size(0), -1), v.reshape(x.size(0), -1)], dim=-1)


def megatron_hooks(model, rec: Recorder) -> None:
    """Points on the local-spec GPTModel ([t, 1, h] rows of the packed forward)."""
    rec.out(model.embedding, "embedding")
    layers = model.decoder.layers
    for i, layer in enumerate(layers):
        rec.out(layer.input_layernorm, f"L{i}.input_norm")
        attn = layer.self_attention
        rec.out(attn.linear_qkv, f"L{i}.qkv", pick=lambda o, a=attn: _megatron_qkv(_first(o), a))
        rec.inp(attn.core_attention, f"L{i}.q_roped", 0)
        rec.inp(attn.core_attention, f"L{i}.k_roped", 1)
        rec.out(attn.core_attention, f"L{i}.core_attn")
        rec.out(layer.self_attention, f"L{i}.attn_out")
        rec.inp(layer.pre_mlp_layernorm, f"L{i}.residual_mid")
        rec.out(layer.pre_mlp_layernorm, f"L{i}.pre_mlp_norm")
        rec.out(layer.mlp.linear_fc1, f"L{i}.gate_up")
        rec.inp(layer.mlp.linear_fc2, f"L{i}.swiglu")
        rec.out(layer.mlp, f"L{i}.mlp_out")
        rec.out(layer, f"L{i}.layer_out")
    rec.out(model.decoder.final_layernorm, "final_norm")


def vllm_hooks(model, rec: Recorder, num_layers: int) -> None:
    """The same points on vLLM's Qwen2/Llama (its norms add the residual: `(x, residual) -> (normed, x + residual)`,
    so a layer's output is the residual the next norm returns)."""
    inner = model.model
    rec.out(inner.embed_tokens, "embedding")
    for i, layer in enumerate(inner.layers):
        rec.out(layer.input_layernorm, f"L{i}.input_norm")
        if i > 0:
            rec.out(layer.input_layernorm, f"L{i - 1}.layer_out", pick=lambda o: o[1])
        attn = layer.self_attn
        rec.out(attn.qkv_proj, f"L{i}.qkv")
        rec.inp(attn.attn, f"L{i}.q_roped", 0)
        rec.inp(attn.attn, f"L{i}.k_roped", 1)
        rec.out(attn.attn, f"L{i}.core_attn")
        rec.out(layer.self_attn, f"L{i}.attn_out")
        rec.out(layer.post_attention_layernorm, f"L{i}.residual_mid", pick=lambda o: o[1])
        rec.out(layer.post_attention_layernorm, f"L{i}.pre_mlp_norm")
        rec.out(layer.mlp.gate_up_proj, f"L{i}.gate_up")
        rec.inp(layer.mlp.down_proj, f"L{i}.swiglu")
        rec.out(layer.mlp, f"L{i}.mlp_out")
    rec.out(inner.norm, f"L{num_layers - 1}.layer_out", pick=lambda o: o[1])
    rec.out(inner.norm, "final_norm")


def run_dtype(dtype: str, model_dir: str | None, workdir: str, exact: bool, layers: bool = True,
              engine_numerics: bool = False) -> dict:
    import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

    import torch
    from transformers import AutoConfig

    from justrl_megatron.assets import tiny_model
    from justrl_megatron.convert.export import export_hf_stream
    from justrl_megatron.convert.load import load_hf_weights
    from justrl_megatron.model.build import output_weight, unwrap
    from justrl_megatron.model.hf_config import model_shape
    from justrl_megatron.model.policy import Policy
    from justrl_megatron.rollout import SamplingConfig, logprob_gap
    from justrl_megatron.rollout.vllm_engine import VLLMEngine
    from justrl_megatron.train.batching import Sample
    from justrl_megatron.train.step import compute_logprobs

    torch.manual_seed(0)
    hf_dir = model_dir or str(tiny_model(os.path.join(workdir, "tiny_qwen2"), "qwen2", **TINY))
    shape = model_shape(AutoConfig.from_pretrained(hf_dir))
    engine = VLLMEngine(hf_dir, dtype=dtype, seed=0, max_model_len=128, cpu_kvcache_gib=1, enforce_eager=True,
                         exact=exact or engine_numerics)
    policy = Policy.build(shape, tp=1, dtype=dtype, transformer_impl="local", lr=1e-3, grad_clip=0.0,
                          distributed_optimizer=False, seed=1234, exact=exact, engine_numerics=engine_numerics)
    load_hf_weights(policy.chunks, hf_dir, progress=False)
    policy.optimizer.reload_model_params()
    engine.update_weights(export_hf_stream(policy.chunks, shape, include_tied_lm_head=True), version=0)
    llm = engine.llm
    out = {"dtype": dtype, "exact": exact, "engine_numerics": engine_numerics,
           "exact_off": os.environ.get("JUSTRL_EXACT_OFF", ""), "model": model_dir or f"tiny qwen2 {TINY}",
           "layers": shape.num_layers,
           "torch_threads": torch.get_num_threads()}

    # headline: the rollout's own check over a batch of 20 samples
    t = time.perf_counter()
    r = engine.generate_all(PROMPTS, N, SamplingConfig(max_tokens=STEPS), seed=7)
    samples = [Sample(prompt_ids=PROMPTS[i], response_ids=toks, rollout_logprobs=lps, advantage=0.0, group=i)
               for i, toks, lps in zip(r.prompt_index, r.token_ids, r.logprobs)]
    t_pass = time.perf_counter()
    trainer = compute_logprobs(policy, samples, max_tokens_per_micro_batch=256)
    out["trainer_pass_s"] = time.perf_counter() - t_pass  # the log-prob pass alone (exact vs default cost)
    out["batch_gap"] = logprob_gap(r.logprobs, trainer)
    out["batch_gap_s"] = time.perf_counter() - t
    # batch invariance of each side: the trainer's log-probs of a sample alone vs in the batch's micro-batch
    alone = [compute_logprobs(policy, [smp], max_tokens_per_micro_batch=256)[0] for smp in samples]
    out["trainer_alone_vs_batch"] = logprob_gap([a.tolist() for a in alone], trainer)

    if not layers:
        return out
    # per layer, one sample at a time (so that every hook call is this sequence's rows)
    model = unwrap(policy.chunks[0])
    mrec, vrec = Recorder(), Recorder()
    megatron_hooks(model, mrec)
    llm.apply_model(lambda m: vllm_hooks(m, vrec, shape.num_layers))
    from vllm import SamplingParams

    per_sample = []
    for k in range(len(PROMPTS)):
        prompt, resp, lps = samples[k * N].prompt_ids, samples[k * N].response_ids, samples[k * N].rollout_logprobs
        full = prompt + resp
        T = len(full) - 1  # rows that predict a response token end at T - 1; the last token is never an input
        mrec.clear()
        logp_t = compute_logprobs(policy, [samples[k * N]], max_tokens_per_micro_batch=256)[0]
        m_rows = {name: mrec.cat(name, len(full)) for name in mrec.rows}
        w = output_weight(model).detach()
        m_logits = (m_rows["final_norm"] @ w.t()).float()[:, :shape.vocab_size]
        entry = {"prompt": prompt, "response_len": len(resp)}
        for path in ("prefill", "decode"):
            vrec.clear()
            llm.reset_prefix_cache()
            if path == "prefill":
                res = llm.generate([{"prompt_token_ids": full}],
                                   SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False),
                                   use_tqdm=False)[0]
                # prompt_logprobs[j] = {token j: logprob}, the first None
                v_logp = torch.tensor([res.prompt_logprobs[j][full[j]].logprob for j in range(len(prompt), len(full))])
                rows = len(full)
            else:
                # the rollout's own decode, replayed: the same seed resamples the same tokens (checked below)
                res = llm.generate([{"prompt_token_ids": prompt}], _replay_params(engine, k), use_tqdm=False)[0]
                got = list(res.outputs[0].token_ids)
                entry["decode_replayed"] = got == resp
                # the engine's batch invariance: this sample decoded alone vs in the batch of 20
                entry["engine_alone_vs_batch_max"] = max(
                    abs(lp[t].logprob - b) for lp, t, b in zip(res.outputs[0].logprobs, got, lps))
                v_logp = torch.tensor([lp[t].logprob for lp, t in zip(res.outputs[0].logprobs, got)])
                rows = T
            v_rows = {name: vrec.cat(name, rows) for name in vrec.rows}
            layers = {}
            for name in v_rows:
                if name in m_rows:
                    layers[name] = _stat(m_rows[name][:rows], v_rows[name][:rows])
            # logits at the rows that predict response tokens, from each side's final norm (vLLM's own head)
            pred = slice(len(prompt) - 1, T)
            v_logits = llm.apply_model(lambda m: m.compute_logits(v_rows["final_norm"][pred]).float().cpu())[0]
            layers["logits"] = _stat(m_logits[pred], v_logits[:, :shape.vocab_size])
            layers["log_softmax"] = _stat(logp_t, v_logp)
            entry[path] = layers
        per_sample.append(entry)
    out["per_sample"] = per_sample
    out["engine_alone_vs_batch_max"] = max(s["engine_alone_vs_batch_max"] for s in per_sample)
    out["table"] = {path: _summarise([s[path] for s in per_sample]) for path in ("prefill", "decode")}
    return out


def _replay_params(engine, k):
    """Sampling params that reproduce the batch's first sample of prompt k alone (vLLM seeds sample j of a request
    seed + j; generate_all spaces requests a group apart)."""
    from justrl_megatron.rollout import SamplingConfig

    return engine.sampling_params(1, SamplingConfig(max_tokens=STEPS, seed=7), k, group=N)


def _summarise(entries: list[dict]) -> dict:
    names = list(entries[0])
    return {n: {"max": max(e[n]["max"] for e in entries),
                "mean": sum(e[n]["mean"] for e in entries) / len(entries),
                "scale": max(e[n]["scale"] for e in entries)} for n in names}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--model", default=None, help="an HF folder (default: a tiny random Qwen2)")
    ap.add_argument("--exact", action="store_true", help="the trainer in rollout.exact mode")
    ap.add_argument("--engine-numerics", action="store_true", help="the trainer with model.engine_numerics=on")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--headline-only", action="store_true", help="the batch gaps only, no per-layer table")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one dtype, JSON to --out
    args = ap.parse_args(argv)
    import tempfile

    workdir = args.workdir or tempfile.mkdtemp(prefix="parity_")
    if args.one:
        res = run_dtype(args.one, args.model, workdir, args.exact, layers=not args.headline_only,
                        engine_numerics=args.engine_numerics)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        return 0
    results = {"command": " ".join(["python", "tools/logprob_parity.py", *(argv or sys.argv[1:])]), "runs": []}
    for dtype in args.dtypes.split(","):
        part = os.path.join(workdir, f"{dtype}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--one", dtype, "--out", part, "--workdir", workdir]
        cmd += (["--model", args.model] if args.model else []) + (["--exact"] if args.exact else []) \
            + (["--engine-numerics"] if args.engine_numerics else [])
        cmd += ["--headline-only"] if args.headline_only else []
        subprocess.run(cmd, check=True)
        with open(part) as f:
            results["runs"].append(json.load(f))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    for run in results["runs"]:
        g = run["batch_gap"]
        print(f"{run['dtype']}{' exact' if run['exact'] else ''}{' off=' + run['exact_off'] if run['exact_off'] else ''}: batch gap mean {g['logprob_diff_mean']:.3g} "
              f"max {g['logprob_diff_max']:.3g} over {g['logprob_diff_tokens']} tokens")
        if "table" not in run:
            continue
        print(f"  trainer alone vs in the batch: {run['trainer_alone_vs_batch']}; engine alone vs in the batch: "
              f"max {run['engine_alone_vs_batch_max']:.3g}")
        for path, table in run["table"].items():
            print(f"  {path}")
            for name, s in table.items():
                print(f"    {name:18s} max {s['max']:.3g}  mean {s['mean']:.3g}  (scale {s['scale']:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
