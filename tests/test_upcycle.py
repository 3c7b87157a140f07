"""`justrl-convert upcycle` (issue 31): a dense Llama/Mistral folder -> a Mixtral folder that computes the same function.

The upcycled model's logits equal the dense model's: in float64 to rounding (~1e-15: the same function), in fp32
within fp32 noise, in transformers and in our Megatron MoE policy. Every expert is a bitwise copy of its layer's MLP,
routers are zero, the tokenizer travels; refusals (Qwen2's qkv bias, Qwen3's q/k norm, E < 2, k > E, --out over the
input) are one line, exit 2, before anything is written.
"""

import json

import pytest
import torch

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)
from justrl_megatron.assets import tiny_model
from justrl_megatron.convert.cli import main as convert_main
from justrl_megatron.convert.load import SafetensorsFolder

VOCAB = 1009


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("upcycle")
    return {"llama": tiny_model(root / "llama", "llama", num_layers=2, vocab_size=VOCAB, with_tokenizer=False),
            "mistral": tiny_model(root / "mistral", "mistral", num_layers=2, vocab_size=VOCAB),
            "llama3_rope": tiny_model(root / "llama3", "llama", num_layers=2, vocab_size=VOCAB,
                                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 128})}


def _upcycle(src, out, experts=4, top_k=2, *extra):
    return convert_main(["upcycle", "--hf", str(src), "--out", str(out), "--experts", str(experts),
                         "--top-k", str(top_k), *map(str, extra)])


def _logits(folder, tokens, dtype):
    from transformers import AutoModelForCausalLM

    extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}  # grouped_mm has no fp64
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **extra).eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("family,experts,top_k", [("llama", 4, 2), ("mistral", 3, 1), ("llama3_rope", 8, 4)])
def test_upcycled_model_computes_what_the_dense_one_does(dense, tmp_path, family, experts, top_k):
    out = tmp_path / "moe"
    assert _upcycle(dense[family], out, experts, top_k) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == experts
    assert config["num_experts_per_tok"] == top_k
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    exact = (_logits(dense[family], tokens, torch.float64) - _logits(out, tokens, torch.float64)).abs().max()
    # the same function: only rounding differs (Mixtral's routing weights are fp32 whatever the model's dtype: 1/k is
    # exact for these k; k = 3 would add 1/3's fp32 rounding, ~3e-8 relative)
    assert exact <= 1e-12, float(exact)
    fp32 = (_logits(dense[family], tokens, torch.float32) - _logits(out, tokens, torch.float32)).abs().max()
    assert fp32 <= 1e-5, float(fp32)

    before, after = SafetensorsFolder(dense[family]), SafetensorsFolder(out)
    for i in range(2):
        for hf, mixtral in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            mlp = before.read(f"model.layers.{i}.mlp.{hf}.weight", None, 0, 0)
            for e in range(experts):
                assert torch.equal(after.read(f"model.layers.{i}.block_sparse_moe.experts.{e}.{mixtral}.weight",
                                              None, 0, 0), mlp)
        router = after.read(f"model.layers.{i}.block_sparse_moe.gate.weight", None, 0, 0)
        assert router.shape == (experts, 64) and not router.any()
    kept = {n for n in before.names() if ".mlp." not in n}
    assert kept <= after.names() and len(after.names()) == len(kept) + 2 * (3 * experts + 1)
    for n in kept:
        assert torch.equal(after.read(n, None, 0, 0), before.read(n, None, 0, 0))


def test_megatron_runs_the_upcycled_model_as_the_dense_one(dense, tmp_path):
    """Our Megatron MoE policy (EP1, in this process) on the upcycled folder: the dense HF model's logits."""
    from transformers import AutoConfig

    from justrl_megatron.convert.load import load_hf_weights
    from justrl_megatron.convert.verify import megatron_logits, random_tokens
    from justrl_megatron.model.hf_config import model_shape
    from justrl_megatron.model.policy import Policy

    out = tmp_path / "moe"
    assert _upcycle(dense["llama"], out, 4, 2) == 0
    shape = model_shape(AutoConfig.from_pretrained(out))
    assert shape.num_experts == 4 and shape.moe_top_k == 2 and shape.tie_word_embeddings
    policy = Policy.build(shape, dtype="fp32", transformer_impl="local", lr=1e-3, distributed_optimizer=False)
    load_hf_weights(policy.chunks, out, progress=False)
    tokens = random_tokens(VOCAB, batch=2, seq_len=40, seed=3)
    ours = megatron_logits(policy.chunks, tokens, VOCAB)
    diff = (ours - _logits(dense["llama"], tokens, torch.float32)).abs().max()
    assert diff <= 1e-5, float(diff)


def test_upcycle_writes_shards_with_an_index_and_keeps_the_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from justrl_megatron.convert.upcycle import upcycle

    src = tiny_model(tmp_path / "llama", "llama", num_layers=2, with_tokenizer=True, vocab_size=151_665)
    out = tmp_path / "moe"
    out.mkdir()
    upcycle(src, out, experts=2, top_k=2, shard_bytes=4 << 20)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).exists() for s in shards)
    assert len(index["weight_map"]) == len(SafetensorsFolder(out).names())
    assert AutoTokenizer.from_pretrained(out)("1 + 2").input_ids == AutoTokenizer.from_pretrained(src)("1 + 2").input_ids


@pytest.mark.parametrize("family,args,message", [
    ("qwen2", (4, 2), "Qwen2ForCausalLM cannot be upcycled to Mixtral (its q/k/v projections have biases"),
    ("qwen3", (4, 2), "Qwen3ForCausalLM cannot be upcycled to Mixtral (its attention has q/k norms"),
    ("llama", (1, 1), "--experts must be >= 2, got 1"),
    ("llama", (4, 5), "--top-k must be in 1..--experts (4), got 5"),
])
def test_upcycle_refuses_in_one_line_before_writing(tmp_path, capsys, family, args, message):
    src = tiny_model(tmp_path / family, family, num_layers=1, vocab_size=VOCAB)
    capsys.readouterr()  # transformers' progress bar
    assert _upcycle(src, tmp_path / "out", *args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_upcycle_never_writes_over_its_input(dense, tmp_path, capsys):
    assert _upcycle(dense["llama"], dense["llama"], 4, 2, "--force") == 2
    assert "is the --hf input itself" in capsys.readouterr().err
    assert (dense["llama"] / "config.json").exists()
