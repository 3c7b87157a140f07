"""Single process: the real SmolLM2-135M-Instruct (Llama, 30 layers, GQA 9/3, tied embeddings) through the converter.

Loads the HF weights into a Megatron GPTModel (TP1, fp32), compares its logits with transformers (fp32 eager and
fp32 sdpa) against an fp64 transformers reference, and exports the live model back in the HF dtype (bf16) to compare
with the original safetensors bitwise. Writes OUT/smollm2.json.
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import json
import os
import sys

import torch


def main(out):
    from transformers import AutoConfig, AutoModelForCausalLM

    from justrl_megatron.assets import smollm2_135m_instruct
    from justrl_megatron.convert import export_hf_stream, load_hf_weights
    from justrl_megatron.convert.load import SafetensorsFolder
    from justrl_megatron.convert.verify import megatron_logits, random_tokens
    from justrl_megatron.distributed import init_distributed, init_model_parallel
    from justrl_megatron.model.build import build_model_chunks
    from justrl_megatron.model.hf_config import model_shape, transformer_config

    hf_dir = smollm2_135m_instruct()
    init_distributed()
    init_model_parallel(1, 1)
    shape = model_shape(AutoConfig.from_pretrained(hf_dir))
    chunks = build_model_chunks(shape, transformer_config(shape), transformer_impl="local")
    load_hf_weights(chunks, hf_dir, progress=False)
    tokens = random_tokens(shape.vocab_size, batch=2, seq_len=32, seed=0)
    ours = megatron_logits(chunks, tokens, shape.vocab_size)

    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64, attn_implementation="eager").eval()
        ref64 = hf(tokens).logits
        hf = hf.float()
        eager32 = hf(tokens).logits.double()
        hf.config._attn_implementation = "sdpa"
        sdpa32 = hf(tokens).logits.double()

    files = SafetensorsFolder(hf_dir)
    mismatched, n = [], 0
    for bucket in export_hf_stream(chunks, shape, bucket_bytes=64 << 20, dtype=torch.bfloat16):
        for name, t in bucket:
            n += 1
            if not torch.equal(t, files.read(name, None, 0, 0)):
                mismatched.append(name)
    verdict = {
        "megatron_vs_fp64": (ours.double() - ref64).abs().max().item(),
        "hf_eager_fp32_vs_fp64": (eager32 - ref64).abs().max().item(),
        "hf_sdpa_fp32_vs_fp64": (sdpa32 - ref64).abs().max().item(),
        "megatron_vs_hf_eager_fp32": (ours.double() - eager32).abs().max().item(),
        "logit_scale": ref64.abs().max().item(),
        "exported": n,
        "in_hf_file": len(files.names()),
        "mismatched": mismatched,
    }
    with open(os.path.join(out, "smollm2.json"), "w") as f:
        json.dump(verdict, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
