"""transformers references and a random GRPO batch, shared by the tests/mp worker scripts.

The scripts run as files (`python tests/mp/x.py`, or `torchrun tests/mp/x.py`), so Python puts tests/mp on sys.path
and they import this module as `from _common import ...`.
"""

import random

import torch


def hf_greedy(model, prompt, steps):
    """Argmax decoding with transformers' KV cache; EOS does not stop it (the engine samples with ignore_eos)."""
    tokens, past, ids = [], None, torch.tensor([list(prompt)])
    with torch.no_grad():
        for _ in range(steps):
            out = model(ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return tokens


def hf_logprobs(model, prompt, tokens):
    """transformers' logprobs of `tokens` following `prompt` (one full forward, fp32 log-softmax)."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    return logp[pos, torch.tensor(tokens)].tolist()


def random_samples(vocab: int, n: int = 8, seed: int = 3) -> list:
    """n GRPO samples of random tokens (prompts of 2-10, responses of 1-16), advantages in [-1.5, 1.5], groups of 4."""
    from justrl_megatron.train.batching import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(2, 10))]
        response = [rng.randrange(vocab) for _ in range(rng.randint(1, 16))]
        out.append(Sample(prompt, response, advantage=rng.uniform(-1.5, 1.5), group=i // 4))
    return out


def rollout_samples(prompts, rollouts, advantages=None) -> list:
    """A Rollouts batch as GRPO samples (prompt i's responses form group i), with their rollout logprobs."""
    from justrl_megatron.train.batching import Sample

    return [Sample(prompt_ids=prompts[i], response_ids=toks, rollout_logprobs=lps,
                   advantage=0.0 if advantages is None else float(advantages[k]), group=i)
            for k, (i, toks, lps) in enumerate(zip(rollouts.prompt_index, rollouts.token_ids, rollouts.logprobs))]
