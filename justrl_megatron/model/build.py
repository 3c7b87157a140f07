"""Build the policy: one megatron-core GPTModel per (virtual) pipeline stage owned by this rank."""

from __future__ import annotations

from .hf_config import ModelShape, padded_vocab_size
from .spec import block_spec


def build_model_chunks(
    shape: ModelShape,
    config,
    *,
    transformer_impl: str = "auto",
    max_sequence_length: int | None = None,
    make_vocab_size_divisible_by: int = 128,
    parallel_output: bool = True,
):
    """Return the list of GPTModel chunks of this rank (length = virtual pipeline size, 1 without VPP)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    vpp = config.virtual_pipeline_model_parallel_size
    vocab = padded_vocab_size(shape.vocab_size, config.tensor_model_parallel_size, make_vocab_size_divisible_by)
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=block_spec(config, transformer_impl, vp_stage=stage),
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
        )
    return chunks
