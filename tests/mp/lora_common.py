"""Shared by the LoRA worker scripts (tests/mp/lora_*.py): a policy built from a tiny HF folder, and samples."""

from _common import random_samples
from justrl_megatron.convert.load import load_hf_weights
from justrl_megatron.model.hf_config import model_shape
from justrl_megatron.model.policy import Policy

LORA = dict(rank=4, alpha=8.0, dropout=0.0, targets=["qkv", "proj", "fc1", "fc2"])


def build(hf, lora, tp=1, distopt=True, lr=1e-2):
    from transformers import AutoConfig

    shape = model_shape(AutoConfig.from_pretrained(hf))
    policy = Policy.build(shape, tp=tp, dtype="fp32", transformer_impl="local", lr=lr, warmup_steps=0,
                          weight_decay=0.0, grad_clip=1.0, distributed_optimizer=distopt, seed=1234, lora=lora)
    load_hf_weights(policy.chunks, hf, progress=False)
    policy.optimizer.reload_model_params()
    return policy


def samples_for(hf, n=8, seed=3):
    from transformers import AutoConfig

    return random_samples(AutoConfig.from_pretrained(hf).vocab_size, n, seed)


def set_random_adapters(chunks, seed=7, std=0.05):
    """Give A and B full-size random values (the same global tensors at every TP layout): from B = 0, A would get no
    gradient at the first step and the checks would compare zeros."""
    import torch

    from justrl_megatron.model import lora

    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(v.shape, generator=g) * std for k, v in lora.global_state(chunks).items()}
    lora.load_global_state(chunks, state)


def global_grads(chunks):
    """{lora.layers.<i>.<target>.lora_A / lora_B: the full main_grad}, gathered over TP like the parameters."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from justrl_megatron.model import lora

    out = {}
    tp = ps.get_tensor_model_parallel_world_size()
    for (index, target), adapter in sorted(lora.adapters(chunks).items()):
        for which in ("lora_A", "lora_B"):
            grad = getattr(adapter, which).main_grad.detach().clone()
            dim = lora._sharded_dim(adapter, which)
            if dim is not None and tp > 1:
                shards = [torch.empty_like(grad) for _ in range(tp)]
                dist.all_gather(shards, grad.contiguous(), group=ps.get_tensor_model_parallel_group())
                if lora._is_swiglu(target, which):  # [gate; up] per rank, as the parameter
                    halves = [s.chunk(2) for s in shards]
                    grad = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
                else:
                    grad = torch.cat(shards, dim=dim)
            out[f"lora.layers.{index}.{target}.{which}"] = grad
    return out
