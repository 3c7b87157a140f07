"""Shared by the LoRA worker scripts (tests/mp/lora_*.py): a policy built from a tiny HF folder, and samples."""

import random

from justrl_megatron.convert.load import load_hf_weights
from justrl_megatron.model.hf_config import model_shape
from justrl_megatron.model.policy import Policy
from justrl_megatron.train.batching import Sample

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

    vocab = AutoConfig.from_pretrained(hf).vocab_size
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(2, 10))]
        response = [rng.randrange(vocab) for _ in range(rng.randint(1, 16))]
        out.append(Sample(prompt, response, advantage=rng.uniform(-1.5, 1.5), group=i // 4))
    return out
