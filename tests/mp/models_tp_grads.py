"""2 processes: one GRPO backward on a tiny Qwen3 at TP1 (x DP2), TP2 and TP2 + sequence parallel; writes the reduced
gradients of the q/k norms (one [head_dim] weight shared by all heads, which TP splits: megatron sums their
gradients over TP) and of a plain norm and the fused QKV weight (gathered to HF layout) as a control.

    python -m torch.distributed.run --standalone --nproc-per-node 2 models_tp_grads.py HF_DIR OUT

Writes OUT/rank{r}.json: {layout: {name: flat gradient}}.
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import json
import os
import random
import sys

import torch
import torch.distributed as dist

LAYOUTS = {"tp1": dict(tp=1), "tp2": dict(tp=2), "tp2sp": dict(tp=2, sequence_parallel=True)}
WATCH = ("decoder.layers.1.self_attention.q_layernorm.weight", "decoder.layers.1.self_attention.k_layernorm.weight",
         "decoder.layers.0.input_layernorm.weight", "decoder.layers.0.self_attention.linear_qkv.weight")


def samples(vocab):
    from justrl_megatron.train.batching import Sample

    rng = random.Random(3)
    return [Sample([rng.randrange(vocab) for _ in range(rng.randint(2, 10))],
                   [rng.randrange(vocab) for _ in range(rng.randint(1, 16))], advantage=rng.uniform(-1.5, 1.5),
                   group=i // 4) for i in range(8)]


def main(hf_dir, out):
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig

    from justrl_megatron.convert.load import load_hf_weights
    from justrl_megatron.convert.mapping import live_parameters, model_entries, shards_to_hf
    from justrl_megatron.distributed import init_distributed
    from justrl_megatron.model.hf_config import model_shape
    from justrl_megatron.model.policy import Policy
    from justrl_megatron.train.step import compute_logprobs, grpo_update

    rank, _ = init_distributed()
    shape = model_shape(AutoConfig.from_pretrained(hf_dir))
    batch = samples(shape.vocab_size)
    by_mcore = {e.mcore: e for e in model_entries(shape)}
    verdict = {}
    for name, layout in LAYOUTS.items():
        policy = Policy.build(shape, dtype="fp32", transformer_impl="local", lr=1e-3, grad_clip=0.0,
                              distributed_optimizer=False, seed=1234, **layout)
        load_hf_weights(policy.chunks, hf_dir, progress=False)
        policy.optimizer.reload_model_params()
        old = compute_logprobs(policy, batch, max_tokens_per_micro_batch=64)
        grads = {}

        def capture(pol, step):
            params = live_parameters(pol.chunks)
            tp, group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
            for n in WATCH:
                g = params[n].main_grad.detach().clone()
                if by_mcore[n].kind != "replicated" and tp > 1:  # the HF-layout gradient of a split weight
                    parts = [torch.empty_like(g) for _ in range(tp)]
                    dist.all_gather(parts, g.contiguous(), group=group)
                    g = torch.cat([t.reshape(-1) for t in shards_to_hf(by_mcore[n], parts, shape)])
                elif by_mcore[n].kind != "replicated":
                    g = torch.cat([t.reshape(-1) for t in shards_to_hf(by_mcore[n], [g], shape)])
                grads[n] = g.reshape(-1).tolist()

        grpo_update(policy, batch, old, mini_batch_size=len(batch), max_tokens_per_micro_batch=64, on_grads=capture)
        verdict[name] = grads
        del policy
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(verdict, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
