"""model/memory.py: the activation formula against what autograd really saves in a live megatron GPTModel (local spec,
CPU; also with megatron's fused SwiGLU switched on), the CUDA norm's term against torch's own autograd node, fixed bytes
by hand and against a built model's parameters, and the plan's choices for the JustRL recipes."""

import re
from pathlib import Path

import pytest
import torch

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)
from justrl_megatron.bench.train import BUILTIN_SHAPES
from justrl_megatron.model.hf_config import ModelShape, num_parameters
from justrl_megatron.model.memory import (
    CPU_KERNELS,
    CUDA_KERNELS,
    GIB,
    Kernels,
    MemoryPlanError,
    activation_bytes_per_token,
    backward_working_bytes_per_token,
    estimate_peak_bytes,
    fixed_bytes,
    layer_saved_bytes_per_token,
    layer_terms,
    logprob_head_bytes,
    params_per_gpu,
    plan_memory,
    resolve_recompute,
)

DEEPSEEK = BUILTIN_SHAPES["deepseek-r1-distill-qwen-1.5b"]
H100_80GB = 81559 * 2**20  # what nvidia-smi reports for an H100 80GB HBM3
TOLERANCE = 0.10  # formula vs measurement; today they agree to the byte, a missing SwiGLU tensor is ~13% of a layer


def _shape(layers, hidden, ffn, heads, groups, head_dim, vocab=1000, tied=False):
    return ModelShape(family="qwen2", num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn,
                      num_attention_heads=heads, num_query_groups=groups, head_dim=head_dim, vocab_size=vocab,
                      max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=True,
                      tie_word_embeddings=tied, init_std=0.02)


def _build(shape, dtype, recompute, fused_swiglu=False):
    from justrl_megatron.distributed import init_distributed, init_model_parallel
    from justrl_megatron.model.build import build_model_chunks
    from justrl_megatron.model.hf_config import transformer_config

    init_distributed()
    init_model_parallel(tp=1, pp=1)
    config = transformer_config(shape, dtype=dtype, recompute=None if recompute == "none" else recompute,
                                bias_activation_fusion=fused_swiglu)
    return build_model_chunks(shape, config, transformer_impl="local")[0]


def measure_saved_bytes(shape, *, tokens, dtype, recompute, head=False, fused_swiglu=False) -> int:
    """Bytes of the unique non-parameter storages autograd saves for backward in one training forward pass over one
    packed row of ``tokens`` tokens (the trainer's THD path); with ``head`` the chunked logprob head too."""
    from justrl_megatron.model.build import output_weight, returning_hidden_states
    from justrl_megatron.model.logprobs import logprobs_from_hidden
    from justrl_megatron.train.batching import Sample, make_micro_batch

    model = _build(shape, dtype, recompute, fused_swiglu)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    mb = make_micro_batch([Sample(prompt_ids=[1] * 16, response_ids=[2] * (tokens - 16), advantage=1.0)], [0])
    storages: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), returning_hidden_states([model]):
        out = model(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params())
        if head:
            hidden = out[0].index_select(0, mb.logit_positions)
            logprobs_from_hidden(hidden, output_weight(model), mb.targets, vocab_size=shape.vocab_size,
                                 with_entropy=True)
    return sum(storages.values())


CONFIGS = [
    # (hidden, ffn, heads, groups, head_dim): Qwen-like ffn/hidden ratios, GQA
    (128, 352, 4, 2, 32),
    (192, 1120, 6, 2, 32),  # the 1.5B model's ffn/hidden (5.8) and heads/groups (6)
]


@pytest.mark.parametrize("dims", CONFIGS, ids=lambda d: f"h{d[0]}")
@pytest.mark.parametrize("dtype,recompute", [(torch.float32, "none"), (torch.bfloat16, "none"),
                                             (torch.bfloat16, "selective"), (torch.bfloat16, "full"),
                                             (torch.float32, "full")],
                         ids=["fp32-none", "bf16-none", "bf16-selective", "bf16-full", "fp32-full"])
def test_layer_formula_matches_saved_tensors(dims, dtype, recompute):
    tokens = 256
    # per layer: the difference between a 3-layer and a 1-layer model cancels the embedding and the final norm
    three = measure_saved_bytes(_shape(3, *dims), tokens=tokens, dtype=dtype, recompute=recompute)
    one = measure_saved_bytes(_shape(1, *dims), tokens=tokens, dtype=dtype, recompute=recompute)
    measured = (three - one) / 2 / tokens
    predicted = layer_saved_bytes_per_token(_shape(1, *dims), recompute=recompute, dtype=dtype, kernels=CPU_KERNELS)
    assert measured == pytest.approx(predicted, rel=TOLERANCE), (measured, predicted)
    if recompute == "full":
        assert measured == pytest.approx(torch.empty((), dtype=dtype).element_size() * dims[0], rel=0.01)


def test_whole_model_with_head_is_covered_by_the_per_token_terms():
    dims, tokens = CONFIGS[1], 512
    shape = _shape(2, *dims, vocab=3000)
    measured = measure_saved_bytes(shape, tokens=tokens, dtype=torch.bfloat16, recompute="none", head=True)
    kw = dict(dtype=torch.bfloat16, kernels=CPU_KERNELS)
    layers = 2 * layer_saved_bytes_per_token(shape, **kw)
    # activation_bytes_per_token = layers + backward working set (not a saved tensor) + the per-token extras
    extras = activation_bytes_per_token(shape, **kw) - layers - backward_working_bytes_per_token(shape, **kw)
    predicted = tokens * (layers + extras)
    assert measured <= predicted  # the extras include the loss's per-token values, not run here
    assert measured == pytest.approx(predicted, rel=TOLERANCE)


FUSED_ON_CPU = Kernels(attention="cpu", norm="reference", swiglu="fused")  # CPU path, megatron's fused SwiGLU on


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_swiglu_formula_matches_saved_tensors(dtype):
    """bias_activation_fusion=True (what the local spec turns on on CUDA): megatron's BiasSwiGLUFunction is a plain
    autograd function that keeps only fc1's output. Run eagerly here: the same function, without inductor's compile."""
    dims, tokens = CONFIGS[1], 256
    with torch.compiler.set_stance("force_eager"):
        three = measure_saved_bytes(_shape(3, *dims), tokens=tokens, dtype=dtype, recompute="none", fused_swiglu=True)
        one = measure_saved_bytes(_shape(1, *dims), tokens=tokens, dtype=dtype, recompute="none", fused_swiglu=True)
    measured = (three - one) / 2 / tokens
    predicted = layer_saved_bytes_per_token(_shape(1, *dims), dtype=dtype, kernels=FUSED_ON_CPU)
    assert measured == pytest.approx(predicted, rel=TOLERANCE), (measured, predicted)
    # the fused module really ran: the plain SwiGLU's two extra f-sized tensors are gone
    plain = layer_saved_bytes_per_token(_shape(1, *dims), dtype=dtype, kernels=CPU_KERNELS)
    assert plain - measured == pytest.approx(2 * dims[1] * torch.empty((), dtype=dtype).element_size(), rel=0.05)


def test_cuda_norm_term_is_what_torchs_fused_rms_norm_keeps():
    """On CUDA norm.py runs F.rms_norm, whose kernel's autograd node (FusedRmsNormBackward0; the CPU decomposes the op,
    so it cannot be measured here) keeps the input, the weight (a parameter) and result1, the fp32 rstd per row:
    read off the installed torch's generated autograd header, so a torch that keeps more fails here."""
    header = Path(torch.__file__).parent / "include/torch/csrc/autograd/generated/Functions.h"
    node = re.search(r"struct TORCH_API FusedRmsNormBackward0 .*?\n};", header.read_text(), re.S)
    assert node is not None, "torch no longer has FusedRmsNormBackward0: re-derive the fused norm term"
    assert sorted(re.findall(r"SavedVariable (\w+)_;", node.group(0))) == ["input", "result1", "weight"]
    h = DEEPSEEK.hidden_size
    assert layer_terms(DEEPSEEK)["norms"] == 2 * (2 * h + 4)  # bf16 input + fp32 rstd, per norm
    assert layer_terms(DEEPSEEK, kernels=CPU_KERNELS)["norms"] == 2 * (4 * h + 4 + 2 * h)


def test_the_cuda_terms_of_the_1p5b():
    # by hand (see the module docstring): norms 2(2h + 4), linear inputs 4h, RoPE 4 x 2 x 128, attention
    # 2(q + kv) + 2(q + 2kv) + 2q + 4 x heads, fused SwiGLU 3 x 2 x ffn
    h, f, q, kv = 1536, 8960, 1536, 256
    by_hand = 2 * (2 * h + 4) + 4 * h + 1024 + 2 * (q + kv) + 2 * (q + 2 * kv) + 2 * q + 48 + 6 * f
    assert layer_saved_bytes_per_token(DEEPSEEK) == by_hand == 77880  # 50.7 h
    # the CPU path's norms and SwiGLU with the flash attention: the plan's former figure
    assert layer_saved_bytes_per_token(DEEPSEEK, kernels=Kernels(norm="reference", swiglu="plain")) == 126008


def test_selective_recompute_saves_only_the_logsumexp_on_the_flash_path():
    none = layer_saved_bytes_per_token(DEEPSEEK, recompute="none")
    selective = layer_saved_bytes_per_token(DEEPSEEK, recompute="selective")
    assert none == 77880  # 50.7 h bytes per token and layer in bf16 on CUDA (see the module docstring)
    assert none - selective == 4 * DEEPSEEK.num_attention_heads
    assert layer_saved_bytes_per_token(DEEPSEEK, recompute="full") == 2 * DEEPSEEK.hidden_size


def test_fixed_bytes_by_hand():
    shape = _shape(2, 64, 128, 4, 2, 16, vocab=1000)
    layer = 64 * 16 * (2 * 4 + 2 * 2) + 16 * (4 + 2 * 2) + 3 * 64 * 128 + 2 * 64  # attn + qkv bias + mlp + norms
    total = 2 * layer + 2 * 1024 * 64 + 64  # vocab padded to 1024; untied embedding + output layer; final norm
    assert params_per_gpu(shape) == total == 205376
    assert fixed_bytes(shape, dtype=torch.bfloat16) == 18 * total
    assert fixed_bytes(shape, dtype=torch.bfloat16, dp=4) == (2 + 4 + 12 // 4) * total  # master + Adam sharded
    assert fixed_bytes(shape, dtype=torch.bfloat16, dp=4, distributed_optimizer=False) == 18 * total
    assert fixed_bytes(shape, dtype=torch.float32) == 16 * total
    # the count agrees with a real GPTModel's parameters
    assert sum(p.numel() for p in _build(shape, torch.float32, "none").parameters()) == total
    # tensor parallel splits everything but the norms; DeepSeek's vocabulary needs no padding
    assert params_per_gpu(DEEPSEEK) == num_parameters(DEEPSEEK) == 1_777_088_000
    assert fixed_bytes(DEEPSEEK) == 18 * 1_777_088_000  # ~29.8 GiB
    split = 1536 * 128 * (2 * 12 + 2 * 2) + 128 * (12 + 2 * 2) + 3 * 1536 * 8960
    vocab_tp2 = 152064  # 151,936 padded to a multiple of 128 x TP
    assert params_per_gpu(DEEPSEEK, tp=2) == 28 * (split // 2 + 2 * 1536) + 2 * vocab_tp2 * 1536 // 2 + 1536


def test_logprob_head_peak():
    # 5 fp32 chunks of ~2^27 elements (2.5 GiB) + the output weight's gradient in fp32 and bf16 (1.3 GiB)
    head = logprob_head_bytes(DEEPSEEK)
    assert 3.7 * GIB < head < 3.9 * GIB
    assert logprob_head_bytes(DEEPSEEK, tp=2) < head


def test_plan_for_the_deepseek_1p5b_update_on_an_h100():
    # with the CUDA kernels one 16K sample fits without recompute at TP=1 on one GPU (67.9 of 71.7 GiB usable)
    plan = plan_memory(DEEPSEEK, device_bytes=H100_80GB, max_tokens_per_micro_batch=16384, min_tokens=16384)
    assert plan.fits and plan.recompute == "none" and plan.max_tokens_per_micro_batch == 16384
    assert "recompute=none" in plan.describe() and "16384 tokens/micro-batch" in plan.describe()
    assert "\n" not in plan.describe()
    assert plan.peak_bytes == estimate_peak_bytes(DEEPSEEK, tokens=16384, recompute="none")
    assert 67 * GIB < plan.peak_bytes < 0.9 * H100_80GB
    # the CPU path's kernels (unfused SwiGLU, fp32 norm copies) would not fit it: the plan follows the kernels
    assert estimate_peak_bytes(DEEPSEEK, tokens=16384, kernels=Kernels(norm="reference", swiglu="plain")) > \
        0.9 * H100_80GB
    # a 32K sample does not fit without recompute: the manual setting is refused with the fixes
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(DEEPSEEK, device_bytes=H100_80GB, recompute="none", max_tokens_per_micro_batch=32768,
                    min_tokens=32768)
    assert "model.recompute=full" in str(err.value) and "parallel.tensor=2" in str(err.value)
    # the recipe's 32K micro-batch under full recompute
    recipe = plan_memory(DEEPSEEK, device_bytes=H100_80GB, recompute="full", max_tokens_per_micro_batch=32768,
                         min_tokens=16384)
    assert recipe.recompute == "full" and recipe.max_tokens_per_micro_batch == 32768 and recipe.fits


def test_plan_clamps_the_budget_and_prefers_no_recompute_when_it_fits():
    plan = plan_memory(DEEPSEEK, device_bytes=H100_80GB, max_tokens_per_micro_batch=65536, min_tokens=4096)
    assert plan.recompute == "none" and plan.fits
    assert 4096 <= plan.max_tokens_per_micro_batch < 65536 and plan.max_tokens_per_micro_batch % 128 == 0
    assert "clamped from 65536" in plan.describe()
    more = estimate_peak_bytes(DEEPSEEK, tokens=plan.max_tokens_per_micro_batch + 128)
    assert more > 0.9 * H100_80GB  # the clamp is tight: 128 tokens more would not fit


def test_a_small_device_is_refused_with_what_to_change():
    with pytest.raises(MemoryPlanError, match=r"parallel\.tensor=2"):
        plan_memory(DEEPSEEK, device_bytes=24 * GIB, max_tokens_per_micro_batch=16384, min_tokens=16384)
    with pytest.raises(MemoryPlanError, match="more memory"):
        plan_memory(DEEPSEEK, device_bytes=8 * GIB, max_tokens_per_micro_batch=16384, min_tokens=16384)


def _recipe(name, *overrides):
    from justrl_megatron.config import compose

    return compose([f"recipe={name}", *overrides])


@pytest.mark.parametrize("recipe", ["justrl_deepseek_1p5b", "justrl_nemotron_1p5b"])
def test_the_justrl_recipes_fit_80gb_at_tp1(recipe):
    # one node of 8 GPUs: the distributed optimizer shards 12 of the 18 B/param over DP=8, so one 16K sample fits
    # without recompute; the recipe's 32K budget is clamped to what fits
    cfg = _recipe(recipe)
    assert cfg.model.recompute == "auto"
    plan = resolve_recompute(cfg, DEEPSEEK, world_size=8, device_bytes=H100_80GB)
    assert plan.fits and cfg.model.recompute == "none" == plan.recompute
    assert 16384 <= cfg.trainer.max_tokens_per_micro_batch == plan.max_tokens_per_micro_batch < 32768
    # one GPU (DP=1, 30 GiB of fixed memory): still no recompute, with a smaller budget (one 16K sample fits)
    cfg = _recipe(recipe)
    one = resolve_recompute(cfg, DEEPSEEK, world_size=1, device_bytes=H100_80GB)
    assert one.fits and cfg.model.recompute == "none"
    assert 16384 <= cfg.trainer.max_tokens_per_micro_batch < plan.max_tokens_per_micro_batch


def test_resolve_recompute_on_cpu_and_manual_settings():
    cfg = _recipe("justrl_deepseek_1p5b")
    if not torch.cuda.is_available():  # CPU: auto -> none, the budget as configured, no plan
        assert resolve_recompute(cfg, DEEPSEEK, world_size=1) is None
        assert cfg.model.recompute == "none" and cfg.trainer.max_tokens_per_micro_batch == 32768
    cfg = _recipe("justrl_deepseek_1p5b", "model.recompute=none", "rollout.max_response_length=31744")
    with pytest.raises(MemoryPlanError, match="model.recompute=full"):
        resolve_recompute(cfg, DEEPSEEK, world_size=1, device_bytes=H100_80GB)  # one GPU: 30 GiB fixed


def test_validate_accepts_auto_and_names_the_choices():
    from justrl_megatron.config import ConfigError, validate

    validate(_recipe("justrl_deepseek_1p5b"), world_size=8)
    with pytest.raises(ConfigError, match="auto, none, selective or full"):
        validate(_recipe("justrl_deepseek_1p5b", "model.recompute=some"), world_size=8)


def test_justrl_train_resolves_auto_before_the_loop(capsys):
    from justrl_megatron.train_entry import apply_memory_plan

    cfg = _recipe("justrl_deepseek_1p5b")
    plan = apply_memory_plan(cfg, DEEPSEEK)
    if torch.cuda.is_available():
        assert plan is not None and cfg.model.recompute == plan.recompute
        assert capsys.readouterr().out.startswith("justrl-train: memory plan: ")
    else:  # the CPU keeps its behaviour: no recompute, the configured budget, nothing printed
        assert plan is None and cfg.model.recompute == "none"
        assert cfg.trainer.max_tokens_per_micro_batch == 32768 and capsys.readouterr().out == ""
