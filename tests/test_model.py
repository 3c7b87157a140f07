"""model/: HF config -> shape -> TransformerConfig, the impl switch, chunked logprobs/entropy, SDPA (packed) attention,
and the train benchmark's FLOP count. Single process; the multi-rank model checks live in tests/test_step.py."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import justrl_megatron.compat  # noqa: F401
from justrl_megatron.dtypes import resolve_dtype
from justrl_megatron.model.attention import packed_causal_attention
from justrl_megatron.model.hf_config import model_shape, num_parameters, padded_vocab_size, transformer_config
from justrl_megatron.model.logprobs import logprobs_from_hidden, logprobs_from_logits
from justrl_megatron.model.spec import resolve_impl


# --- HF config -> shape -> TransformerConfig ----------------------------------------------------------------------

def _deepseek_hf_config():
    from transformers import Qwen2Config

    return Qwen2Config(architectures=["Qwen2ForCausalLM"], hidden_size=1536, intermediate_size=8960,
                       num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                       max_position_embeddings=131072, rope_theta=10000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False)


def test_deepseek_shape_and_parameter_count():
    shape = model_shape(_deepseek_hf_config())
    assert (shape.family, shape.num_layers, shape.hidden_size, shape.head_dim) == ("qwen2", 28, 1536, 128)
    assert (shape.num_attention_heads, shape.num_query_groups, shape.qkv_bias) == (12, 2, True)
    assert not shape.tie_word_embeddings and shape.rope_theta == 10000.0
    assert num_parameters(shape) == 1_777_088_000  # DeepSeek-R1-Distill-Qwen-1.5B as HF reports it
    assert padded_vocab_size(shape.vocab_size, 1) == 151936 and padded_vocab_size(shape.vocab_size, 2) == 152064


def test_llama_smollm2_shape():
    from transformers import LlamaConfig

    cfg = LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                      tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0)
    shape = model_shape(cfg)
    assert (shape.family, shape.head_dim, shape.qkv_bias, shape.tie_word_embeddings) == ("llama", 64, False, True)
    assert num_parameters(shape) == 134_515_008  # SmolLM2-135M


def test_unsupported_architecture_is_named():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="unsupported model architecture"):
        model_shape(GPT2Config(architectures=["GPT2LMHeadModel"]))


def test_transformer_config_and_recompute_options():
    shape = model_shape(_deepseek_hf_config())
    cfg = transformer_config(shape, tp=2, sequence_parallel=True, dtype=torch.bfloat16)
    assert cfg.num_query_groups == 2 and cfg.kv_channels == 128 and cfg.add_qkv_bias and not cfg.add_bias_linear
    assert cfg.bf16 and cfg.params_dtype == torch.bfloat16 and cfg.sequence_parallel and cfg.gated_linear_unit
    assert cfg.variable_seq_lengths
    full = transformer_config(shape, recompute="full")
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "uniform", 1)
    assert transformer_config(shape, recompute="selective").recompute_granularity == "selective"
    assert not transformer_config(shape, tp=1, sequence_parallel=True).sequence_parallel  # SP needs TP > 1


def test_one_switch_picks_the_layer_spec():
    from justrl_megatron import compat
    from justrl_megatron.model.spec import te_available

    # the defaults follow the device: TE spec and bf16 where TE and CUDA are, local spec and fp32 on a CPU
    te, cuda = te_available(), compat.cuda_available()
    assert resolve_impl("auto") == ("te" if te else "local")
    assert resolve_impl("local") == "local"
    if not te:
        with pytest.raises(RuntimeError, match="use auto or local"):
            resolve_impl("te")
    with pytest.raises(ValueError, match="auto, te or local"):
        resolve_impl("fast")
    assert resolve_dtype("auto") == (torch.bfloat16 if cuda else torch.float32)
    assert resolve_dtype("bf16") == torch.bfloat16 and resolve_dtype("fp32") == torch.float32
    with pytest.raises(ValueError, match="model.dtype"):
        resolve_dtype("int8")


def test_auto_dtype_is_bf16_on_cpus_with_native_bf16(monkeypatch):
    from justrl_megatron import compat, dtypes

    monkeypatch.setattr(compat, "cuda_available", lambda: False)
    monkeypatch.delenv("JUSTRL_CPU_BF16", raising=False)
    for flags, expected in [("fpu avx2 avx512f avx512_bf16", torch.bfloat16), ("fpu avx2 amx_bf16 amx_tile",
                            torch.bfloat16), ("fpu avx2 avx512f avx512bw", torch.float32), ("", torch.float32)]:
        monkeypatch.setattr(dtypes, "_cpuinfo_flags", lambda flags=flags: frozenset(flags.split()))
        assert dtypes.resolve_dtype("auto") == expected, flags
        assert dtypes.resolve_dtype("fp32") == torch.float32
    monkeypatch.setenv("JUSTRL_CPU_BF16", "1")  # the override, both ways
    assert dtypes.resolve_dtype("auto") == torch.bfloat16
    monkeypatch.setenv("JUSTRL_CPU_BF16", "0")
    monkeypatch.setattr(dtypes, "_cpuinfo_flags", lambda: frozenset({"avx512_bf16"}))
    assert dtypes.resolve_dtype("auto") == torch.float32
    assert dtypes.cpu_has_native_bf16() is False


# --- chunked logprobs / entropy -----------------------------------------------------------------------------------

def _naive(logits, targets, vocab):
    ls = torch.log_softmax(logits[:, :vocab].double(), dim=-1)
    return ls.gather(-1, targets[:, None]).squeeze(-1), -(ls.exp() * ls).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 7, 300, None])
def test_chunked_logprobs_equal_naive_in_fp32(chunk_size):
    g = torch.Generator().manual_seed(0)
    n, h, vocab, padded = 300, 64, 1000, 1024
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(padded, h, generator=g) * 0.3
    weight[vocab:] = 50.0  # padded rows with huge logits: they must not count
    targets = torch.randint(0, vocab, (n,), generator=g)
    ref_lp, ref_ent = _naive(hidden.double() @ weight.double().t(), targets, vocab)
    lp, ent = logprobs_from_hidden(hidden, weight, targets, vocab_size=vocab, with_entropy=True, chunk_size=chunk_size)
    assert lp.dtype == torch.float32 and ent.shape == (n,)
    assert (lp.double() - ref_lp).abs().max() < 1e-5
    assert (ent.double() - ref_ent).abs().max() < 1e-5
    lp2, ent2 = logprobs_from_logits(hidden @ weight.t(), targets, vocab_size=vocab, with_entropy=True,
                                     chunk_size=chunk_size)
    assert (lp2.double() - ref_lp).abs().max() < 1e-5 and (ent2.double() - ref_ent).abs().max() < 1e-5
    assert logprobs_from_hidden(hidden, weight, targets, vocab_size=vocab)[1] is None


@pytest.mark.parametrize("grads", ["logprob", "entropy", "both"])
def test_chunked_logprob_gradients_equal_autograd(grads):
    g = torch.Generator().manual_seed(1)
    n, h, vocab, padded = 41, 16, 60, 64
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(padded, h, generator=g, dtype=torch.float64)
    targets = torch.randint(0, vocab, (n,), generator=g)
    g_lp, g_ent = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)

    def objective(lp, ent):
        return (lp * g_lp * (grads != "entropy") + ent * g_ent * (grads != "logprob")).sum()

    hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    objective(*_naive(hr @ wr.t(), targets, vocab)).backward()

    hf, wf = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = logprobs_from_hidden(hf, wf, targets, vocab_size=vocab, with_entropy=True, chunk_size=6)
    if grads == "logprob":
        (lp * g_lp).sum().backward()  # entropy unused: its gradient is never formed
    elif grads == "entropy":
        (ent * g_ent).sum().backward()
    else:
        objective(lp, ent).backward()
    assert (hf.grad - hr.grad).abs().max() < 1e-10
    assert (wf.grad - wr.grad).abs().max() < 1e-10
    assert wf.grad[vocab:].abs().max() == 0  # padded vocab rows get no gradient

    z = (hidden @ weight.t()).requires_grad_()
    zr = z.detach().clone().requires_grad_()
    objective(*_naive(zr, targets, vocab)).backward()
    lp, ent = logprobs_from_logits(z, targets, vocab_size=vocab, with_entropy=True, chunk_size=9)
    objective(lp, ent).backward()
    assert (z.grad - zr.grad).abs().max() < 1e-10


def test_bf16_inputs_accumulate_in_fp32():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(64, 32, generator=g).bfloat16()
    weight = (torch.randn(128, 32, generator=g) * 0.2).bfloat16()
    targets = torch.randint(0, 128, (64,), generator=g)
    lp, ent = logprobs_from_hidden(hidden.requires_grad_(), weight.requires_grad_(), targets, with_entropy=True)
    assert lp.dtype == torch.float32
    ref_lp, ref_ent = _naive((hidden.float() @ weight.float().t()), targets, 128)
    assert (lp.double() - ref_lp).abs().max() < 0.05  # bf16 logits, fp32 softmax
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    assert torch.isfinite(weight.grad.float()).all()


def test_logprobs_reject_bad_targets():
    with pytest.raises(ValueError, match="one id per row"):
        logprobs_from_logits(torch.randn(4, 8), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="integer token ids"):
        logprobs_from_logits(torch.randn(4, 8), torch.zeros(4))
    with pytest.raises(ValueError, match="hidden size"):
        logprobs_from_hidden(torch.randn(4, 8), torch.randn(16, 6), torch.zeros(4, dtype=torch.long))


# --- attention ----------------------------------------------------------------------------------------------------

def _naive_causal(q, k, v, scale):
    """q [L, np, d], k/v [L, ng, d] -> [L, np, d] with an explicit masked softmax (GQA by repetition)."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    L = q.size(0)
    scores = scores.masked_fill(torch.triu(torch.ones(L, L, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("batched", [False, True], ids=["one-call-per-sequence", "right-padded-batch"])
def test_packed_attention_stays_inside_each_sequence(batched, monkeypatch):
    from justrl_megatron.model import attention

    monkeypatch.setattr(attention, "PAD_BATCH_MAX_WASTE", 100.0 if batched else 0.0)
    g = torch.Generator().manual_seed(3)
    lens = [5, 1, 17, 9]
    t, heads, groups, d = sum(lens), 4, 2, 8
    q, k, v = (torch.randn(t, n, d, generator=g, dtype=torch.float64, requires_grad=True)
               for n in (heads, groups, groups))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    out = packed_causal_attention(q, k, v, cu, max(lens), 1 / math.sqrt(d))
    ref = torch.cat([_naive_causal(q[a:b], k[a:b], v[a:b], 1 / math.sqrt(d)) for a, b in zip(cu[:-1], cu[1:])])
    assert out.shape == (t, heads, d)
    assert (out - ref).abs().max() < 1e-12
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    assert max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads)) < 1e-12
    q, k, v = q.detach(), k.detach(), v.detach()
    # a token of the second sequence sees nothing of the first: changing the first changes nothing after it
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    k2[:5] += 1.0
    v2[:5] += 1.0
    out2 = packed_causal_attention(q2, k2, v2, cu, max(lens), 1 / math.sqrt(d))
    assert torch.equal(out2[5:], out[5:].detach())
    with pytest.raises(ValueError, match="cu_seqlens ends"):
        packed_causal_attention(q, k, v, cu[:-1], max(lens), 1.0)


# --- benchmark arithmetic -----------------------------------------------------------------------------------------

def test_forward_flops_match_the_parameter_count():
    from justrl_megatron.bench.train import BUILTIN_SHAPES, forward_flops, parse_args

    s = BUILTIN_SHAPES["deepseek-r1-distill-qwen-1.5b"]
    assert num_parameters(s) == 1_777_088_000
    # one token, no logits: 2 FLOPs per decoder matmul weight + attention to itself
    biases = s.num_layers * s.head_dim * (s.num_attention_heads + 2 * s.num_query_groups)
    norms = (2 * s.num_layers + 1) * s.hidden_size
    matmul_weights = num_parameters(s) - 2 * s.vocab_size * s.hidden_size - biases - norms
    attention_one = 4 * s.num_attention_heads * s.head_dim * s.num_layers
    assert forward_flops(s, [1], 0) == 2 * matmul_weights + attention_one
    # causal attention grows as L(L+1)/2; the head as 2 h V per computed logprob
    sixteen_k = forward_flops(s, [16384], 15360)
    assert sixteen_k == pytest.approx(2 * matmul_weights * 16384 + attention_one * 16384 * 16385 / 2
                                      + 2 * 1536 * 151936 * 15360)
    # at 16K tokens causal attention is ~30% of the model FLOPs: the 6 N D rule would undercount by ~20%
    assert attention_one * 16384 * 16385 / 2 / sixteen_k == pytest.approx(0.32, abs=0.02)
    assert 2 * 16384 * num_parameters(s) / sixteen_k == pytest.approx(0.80, abs=0.02)
    assert parse_args(["model=tiny", "--tokens", "256", "sp=true", "peak=1.5", "vpp=none"]) == \
        dict(model="tiny", tokens=256, sp=True, peak=1.5, vpp=None)
    with pytest.raises(ValueError, match="unknown option"):
        parse_args(["tokenz=3"])


def test_train_benchmark_runs_on_cpu():
    cmd = [sys.executable, "-m", "justrl_megatron.bench.train", "tokens=512", "seq_len=256", "steps=1", "warmup=0"]
    # CUDA hidden: this checks the CPU path even inside a GPU image (tools/gpu_check.sh runs the GPU bench)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert result["phase"] == "train" and result["device"] == "cpu" and result["transformer_impl"] == "local"
    assert result["tokens_per_step"] == 512 and result["num_sequences"] == 2
    for phase in ("update", "logprob"):
        assert result[phase]["tokens_per_s"] > 0 and result[phase]["tflops_per_device"] > 0
        assert result[phase]["mfu"] is None  # no known peak for a CPU
    assert result["cpu_peak_rss_gib"] > 0 and math.isfinite(result["loss"]) and result["grad_norm"] > 0
    assert "TFLOP/s/device" in proc.stdout


_FROM_CONFIG = """
import json
import justrl_megatron.compat
from justrl_megatron.config import compose
from justrl_megatron.model.hf_config import ModelShape
from justrl_megatron.model.policy import Policy
shape = ModelShape(family="llama", num_layers=2, hidden_size=8, ffn_hidden_size=12, num_attention_heads=2,
                   num_query_groups=1, head_dim=4, vocab_size=10, max_position_embeddings=64, rope_theta=1e4,
                   rms_norm_eps=1e-6, qkv_bias=False, tie_word_embeddings=True, init_std=0.02)
cfg = compose(["trainer.lr=3e-6", "trainer.warmup_steps=2", "trainer.weight_decay=0.05", "trainer.seed=7"])
policy = Policy.from_config(cfg, shape)
print(json.dumps({"hyper": policy.hyper, "dtype": str(policy.dtype), "impl": policy.transformer_impl,
                  "lr": policy.current_lr()}))
"""


def test_policy_from_config_maps_the_config_knobs():
    """Policy.from_config(cfg, shape) == Policy.build(shape, <cfg.model / parallel / trainer knobs>), in its own
    process (it initialises torch.distributed)."""
    proc = subprocess.run([sys.executable, "-c", _FROM_CONFIG], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["hyper"] == dict(lr=3e-6, warmup_steps=2, weight_decay=0.05, grad_clip=1.0, tp=1, pp=1, vpp=None,
                                sequence_parallel=False, recompute="none", distributed_optimizer=True, seed=7,
                                make_vocab_size_divisible_by=128, max_sequence_length=None, cp=1, ep=1)
    assert out["dtype"] == "torch.float32" and out["impl"] == "local" and out["lr"] == 0.0  # warming up from 0
