"""Build the policy: one megatron-core GPTModel per (virtual) pipeline stage owned by this rank."""

from __future__ import annotations

import contextlib

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections before megatron loads)

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region)

from .hf_config import ModelShape, padded_vocab_size
from .rope import install_packed_rope, set_rotary
from .spec import block_spec


def build_model_chunks(
    shape: ModelShape,
    config,
    *,
    transformer_impl: str = "auto",
    max_sequence_length: int | None = None,
    make_vocab_size_divisible_by: int = 128,
    parallel_output: bool = True,
    moe_grouped_gemm: bool = False,
    fp8: bool = False,
    attention_backend: str = "auto",
):
    """Return the list of GPTModel chunks of this rank (length = virtual pipeline size, 1 without VPP).
    `moe_grouped_gemm`, `fp8`, `attention_backend`: the local spec's grouped experts, FP8 linears and packed
    attention kernel (spec.block_spec)."""
    vpp = config.virtual_pipeline_model_parallel_size
    vocab = padded_vocab_size(shape.vocab_size, config.tensor_model_parallel_size, make_vocab_size_divisible_by)
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=block_spec(config, transformer_impl, vp_stage=stage,
                                              moe_grouped_gemm=moe_grouped_gemm, fp8=fp8,
                                              attention_backend=attention_backend),
            vocab_size=vocab,
            max_sequence_length=max_sequence_length or shape.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=parallel_output,
            share_embeddings_and_output_weights=shape.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=int(shape.rope_theta),
            vp_stage=stage,
        )
        set_rotary(model, shape)  # the HF config's base and scaling, exactly (rope.py)
        install_packed_rope()
        chunks.append(model)
    return chunks


def unwrap(chunk):
    """The GPTModel inside DDP / Float16Module (or other megatron) wrappers."""
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def output_weight(model):
    """The [vocab/TP, hidden] weight of the output projection on a last-stage GPTModel (tied or not)."""
    model = unwrap(model)
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def _install_hidden_passthrough(layer) -> None:
    """Give a ColumnParallelLinear output layer a switch that returns its (TP-replicated) input instead of logits.

    The switch keeps the layer's parameters and names (checkpoints, converters) untouched. When on, the layer does
    only the communication its matmul would have done: the sequence-parallel all-gather (backward: reduce-scatter),
    or the copy into the TP region (backward: all-reduce of the partial input gradients). The caller then computes
    logprobs from the hidden states and `output_weight(model)` in chunks (model/logprobs.py).
    """
    if getattr(layer, "_justrl_passthrough", False):
        return
    logits_forward = layer.forward

    def forward(input_, weight=None, runtime_gather_output=None, **kwargs):
        if not layer.justrl_return_hidden:
            return logits_forward(input_, weight=weight, runtime_gather_output=runtime_gather_output, **kwargs)
        if layer.sequence_parallel:
            return gather_from_sequence_parallel_region(input_, True, group=layer.tp_group), None
        return copy_to_tensor_model_parallel_region(input_, group=layer.tp_group), None

    layer.forward = forward
    layer.justrl_return_hidden = False
    layer._justrl_passthrough = True


@contextlib.contextmanager
def returning_hidden_states(chunks):
    """Within the block, last-stage chunks return final hidden states [b, s, h] (after the final norm, full sequence
    on every TP rank) instead of logits, so the logits are never materialised."""
    layers = [unwrap(c).output_layer for c in chunks if getattr(unwrap(c), "post_process", False)]
    for layer in layers:
        _install_hidden_passthrough(layer)
        layer.justrl_return_hidden = True
    try:
        yield
    finally:
        for layer in layers:
            layer.justrl_return_hidden = False


def nonfinite_parameters(chunks, *, trainable_only: bool = False) -> list[str]:
    """Names of this rank's parameters holding a NaN or inf: one fused max-|x| pass and one host sync."""
    named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters()
             if p.requires_grad or not trainable_only]
    if not named:
        return []
    worst = torch.stack(torch._foreach_norm([p.detach() for _, p in named], float("inf")))
    bad = (~torch.isfinite(worst)).nonzero().flatten().tolist()
    return [named[i][0] for i in bad]
