"""Offline assets: Qwen2 tokenizer, SmolLM2-135M-Instruct folder, tiny random models; model.path resolution."""

import json

import pytest
import torch

from justrl_megatron import assets


def test_qwen2_tokenizer_matches_qwen25_vocabulary():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets.qwen2_tokenizer())
    assert len(tok) == 151665
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    assert tok.eos_token_id == 151645
    assert tok.encode("12345") == [16, 17, 18, 19, 20]  # Qwen2 splits digits one by one
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(tok.encode("\\boxed{\\frac{1}{2}} ü")) == "\\boxed{\\frac{1}{2}} ü"


@pytest.mark.parametrize("family,tied", [("qwen2", False), ("llama", True)])
def test_tiny_model_loads_in_transformers(tmp_path, family, tied):
    from transformers import AutoModelForCausalLM

    path = assets.tiny_model(tmp_path / family, family, vocab_size=1000)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is tied and cfg["vocab_size"] == 1000
    model = AutoModelForCausalLM.from_pretrained(path)
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 1000) and torch.isfinite(logits).all()
    if family == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0  # biases randomised, so tests see them


def test_smollm2_builds_offline_and_generates():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = assets.smollm2_135m_instruct()
    cfg = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "5" in tok.decode(out[0, ids["input_ids"].shape[1]:])
    assert assets.resolve_model_path("builtin:smollm2-135m-instruct") == path


def test_model_path_errors_say_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        assets.resolve_model_path(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="Give a local Hugging Face folder"):
        assets.resolve_model_path(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="available"):
        assets.resolve_model_path("builtin:gpt5")
