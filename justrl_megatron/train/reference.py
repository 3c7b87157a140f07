"""The reference policy of the KL penalty (algo.kl_coef > 0): logprobs of the responses under the initial weights.

  with LoRA     the policy itself with its adapters switched off (model/lora.py): the base weights are frozen, so
                that is the initial model, at no memory cost and through the same forward path.
  without LoRA  a frozen copy of the initial weights: a second GPTModel of the same parallel layout, loaded from the
                same HF folder (also after a resume: the reference is the start of training, not of this launch).
                On a GPU it waits in CPU memory between uses and comes to the device only for its forward pass.

Both run forward-only through the same megatron schedule as the old-logprob pass (step.compute_logprobs).
`frozen_copy` also builds the distillation teacher, a model of another shape (train/teacher.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ..convert.load import load_hf_weights
from ..model.build import build_model_chunks
from ..model.lora import adapters_disabled, has_lora
from .step import compute_logprobs


@dataclass
class _FrozenModel:
    """What compute_logprobs reads of a policy, for the frozen copy."""
    chunks: list
    config: object
    shape: object
    device: torch.device
    shared_prompt: bool = False  # the policy's packing (train/batching.py: shared-prompt units)
    fast_paths: object = None  # the policy's (model/fast_paths.FastPaths): the frozen copy runs the same kernels

    @contextlib.contextmanager
    def on_device(self):
        """On a GPU the frozen weights wait in host memory and come to the device only for their forward pass."""
        offload = self.device.type != "cpu"
        if offload:
            for c in self.chunks:
                c.to(self.device, non_blocking=True)
        try:
            yield
        finally:
            if offload:  # back to host memory: the policy's training and the rollout engine need the device
                for c in self.chunks:
                    c.to("cpu")
                torch.cuda.empty_cache()


class Reference:
    """`logprobs(samples, max_tokens_per_micro_batch=...)`: one fp32 CPU tensor per sample, the same on every rank."""

    def __init__(self, policy, frozen: _FrozenModel | None = None):
        self.policy, self.frozen = policy, frozen

    @property
    def mode(self) -> str:
        return "frozen-copy" if self.frozen is not None else "adapters-off"

    @classmethod
    def for_policy(cls, policy, model_dir: str | Path, *, progress: bool = False) -> "Reference":
        """Adapters off with LoRA; else a frozen copy of the HF weights in `model_dir` (call on every rank)."""
        if has_lora(policy.chunks):
            return cls(policy)
        return cls(policy, frozen_copy(policy, model_dir, progress=progress))

    def logprobs(self, samples, *, max_tokens_per_micro_batch: int) -> list[torch.Tensor]:
        if self.frozen is None:
            with adapters_disabled(self.policy.chunks):
                return compute_logprobs(self.policy, samples, max_tokens_per_micro_batch=max_tokens_per_micro_batch)
        with self.frozen.on_device():
            return compute_logprobs(self.frozen, samples, max_tokens_per_micro_batch=max_tokens_per_micro_batch)


def frozen_copy(policy, model_dir, *, shape=None, progress: bool = False) -> _FrozenModel:
    """A frozen GPTModel of the HF weights in `model_dir` at the policy's layout, precision and kernels: the
    policy's own shape (the KL reference), or `shape` (another model of the same tokenizer: a distillation teacher,
    train/teacher.py). Call on every rank."""
    shape = shape or policy.shape
    config = policy.config_for(shape)
    init, config.perform_initialization = config.perform_initialization, False  # every weight is loaded below
    try:
        chunks = build_model_chunks(shape, config, transformer_impl=policy.transformer_impl,
                                    max_sequence_length=policy.hyper.get("max_sequence_length"),
                                    make_vocab_size_divisible_by=policy.hyper.get("make_vocab_size_divisible_by", 128),
                                    attention_backend=policy.fast_paths.attention_backend)
    finally:
        config.perform_initialization = init
    device = policy.device
    chunks = [c.to(device) for c in chunks]
    for c in chunks:
        c.requires_grad_(False)
    load_hf_weights(chunks, model_dir, progress=progress)
    if device.type != "cpu":
        chunks = [c.to("cpu") for c in chunks]
    return _FrozenModel(chunks=chunks, config=config, shape=shape, device=device,
                        shared_prompt=policy.shared_prompt, fast_paths=policy.fast_paths)
