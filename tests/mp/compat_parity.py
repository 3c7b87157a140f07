"""2-process gloo job: real megatron-core on CPU through justrl_megatron.compat, TP2 / TP2+SP / PP2 vs TP1.

Run by tests/test_compat.py under torchrun. Weights cross layouts through megatron's own dist_checkpointing (an
independent resharding path), and so do the gradients (copied into the parameters before saving), so no code of ours
decides how shards line up. Each rank writes its verdict to OUT/rank{r}.json.
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import json
import os
import sys

import torch
import torch.distributed as dist

from justrl_megatron.distributed import init_distributed, init_model_parallel
from justrl_megatron.model.build import build_model_chunks
from justrl_megatron.model.hf_config import ModelShape, transformer_config

SHAPE = ModelShape(family="qwen2", num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                   num_query_groups=2, head_dim=16, vocab_size=256, max_position_embeddings=64, rope_theta=10000.0,
                   rms_norm_eps=1e-6, qkv_bias=True, tie_word_embeddings=False, init_std=0.02)
MB, SEQ, NUM_MB = 2, 16, 2


def batches():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, SHAPE.vocab_size, (NUM_MB, MB, SEQ + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def build(tp, pp, sp=False, distributed_optimizer=False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    init_model_parallel(tp=tp, pp=pp, seed=1234)
    torch.manual_seed(1234)
    config = transformer_config(SHAPE, tp=tp, pp=pp, sequence_parallel=sp)
    config.finalize_model_grads_func = finalize_model_grads
    chunks = build_model_chunks(SHAPE, config, transformer_impl="local")
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer,
                                               grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    chunks = [DistributedDataParallel(config, ddp_config, c) for c in chunks]
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, clip_grad=1.0,
                        use_distributed_optimizer=distributed_optimizer, params_dtype=torch.float32),
        chunks,
    )
    return chunks, opt


def run_step(chunks, opt, forward_only=False):
    """One pass through megatron's schedule (1F1B under PP). Returns (full logits per micro-batch | None, loss, gnorm)."""
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    logits_out, losses = [], []

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        pos = torch.arange(SEQ).unsqueeze(0).expand(MB, SEQ)
        if forward_only:
            out = model(tokens, pos, attention_mask=None)

            def keep_logits(output):
                logits_out.append(tensor_parallel.gather_from_tensor_model_parallel_region(output).detach().clone())
                return output.sum() * 0.0, {}
            return out, keep_logits
        out = model(tokens, pos, attention_mask=None, labels=labels)

        def ce(output):
            loss = output.float().mean()
            losses.append(loss.detach().clone())
            return loss, {"loss": loss.detach().clone()}
        return out, ce

    for c in chunks:
        c.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches()), model=chunks, num_microbatches=NUM_MB,
        seq_length=SEQ, micro_batch_size=MB, forward_only=forward_only,
    )
    if forward_only:
        return logits_out, None, None
    grads = {n: p.main_grad.clone() for c in chunks for n, p in c.module.named_parameters()}
    # the optimizer step reports the grad norm as megatron computes it (over TP, PP and DP, before clipping)
    ok, gnorm, _ = opt.step()
    assert ok
    return grads, torch.stack(losses).mean() if losses else None, gnorm


def save_ckpt(chunks, path):
    from megatron.core import dist_checkpointing
    os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(chunks[0].module.sharded_state_dict(), path)


def load_ckpt(chunks, path):
    from megatron.core import dist_checkpointing
    sd = dist_checkpointing.load(chunks[0].module.sharded_state_dict(), path)
    chunks[0].module.load_state_dict(sd)


def grads_into_params(chunks, grads):
    for c in chunks:
        for n, p in c.module.named_parameters():
            p.data.copy_(grads[n])


def main(out):
    rank, _ = init_distributed()
    ckpt = lambda name: os.path.join(out, name)  # noqa: E731
    verdict = {}

    # A. reference at TP1 (DP2: both ranks see the same batch, so averaged grads equal one rank's)
    chunks, opt = build(1, 1)
    save_ckpt(chunks, ckpt("weights"))
    ref_logits, _, _ = run_step(chunks, opt, forward_only=True)
    ref_grads, ref_loss, ref_gnorm = run_step(chunks, opt)
    ref_after_step = {n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}

    # A2. same at TP1 with the distributed optimizer (exercises the Tensor.type() redirection)
    chunks, opt = build(1, 1, distributed_optimizer=True)
    load_ckpt(chunks, ckpt("weights"))
    _, _, gnorm = run_step(chunks, opt)
    diff = max((p.detach() - ref_after_step[n]).abs().max().item() for n, p in chunks[0].module.named_parameters())
    verdict["distopt"] = {"gnorm": float(gnorm), "ref_gnorm": float(ref_gnorm), "param_diff_after_step": diff}

    layouts = {"tp2": dict(tp=2, pp=1), "tp2_sp": dict(tp=2, pp=1, sp=True), "pp2": dict(tp=1, pp=2)}
    for name, layout in layouts.items():
        chunks, opt = build(**layout)
        load_ckpt(chunks, ckpt("weights"))
        logits, _, _ = run_step(chunks, opt, forward_only=True)
        grads, loss, gnorm = run_step(chunks, opt)
        from megatron.core import parallel_state as ps
        entry = {"gnorm": float(gnorm), "ref_gnorm": float(ref_gnorm),
                 "sequence_parallel": chunks[0].config.sequence_parallel}
        if ps.is_pipeline_last_stage():
            entry["logit_diff"] = max((a - b).abs().max().item() for a, b in zip(logits, ref_logits))
            entry["loss_diff"] = abs(loss.item() - ref_loss.item())
            entry["n_logits"] = len(logits)
        grads_into_params(chunks, grads)
        save_ckpt(chunks, ckpt(f"grads_{name}"))
        verdict[name] = entry

    # B. every layout's gradients, resharded back to TP1 by dist_checkpointing, against the reference
    chunks, opt = build(1, 1)
    for name in layouts:
        load_ckpt(chunks, ckpt(f"grads_{name}"))
        verdict[name]["grad_diff"] = max(
            (p.detach() - ref_grads[n]).abs().max().item() for n, p in chunks[0].module.named_parameters())
        verdict[name]["grad_scale"] = max(g.abs().max().item() for g in ref_grads.values())

    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(verdict, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
