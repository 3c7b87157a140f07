"""rollout.exact's pieces (model/exact.py) against independent references, in process; the end-to-end gate (trainer
vs a real engine after a GRPO step and sync) is test_rollout.py::test_exact_mode_gap_is_zero_after_a_grpo_step_and_sync."""

import math

import pytest
import torch

from justrl_megatron.config import ConfigError, compose, validate


def test_exact_is_off_by_default_and_refuses_what_it_does_not_mirror_in_one_line():
    assert compose().rollout.exact is False
    exact = ["rollout.exact=true", "trainer.old_logprobs=recompute"]
    validate(compose(exact), world_size=1)  # one rank, dense local model, an old-logprob pass: accepted
    with pytest.raises(ConfigError) as err:
        validate(compose([*exact, "parallel.tensor=2", "model.lora.enabled=true"]), world_size=2)
    lines = [line for line in str(err.value).splitlines() if "rollout.exact" in line]
    assert len(lines) == 1 and "parallel.tensor > 1" in lines[0] and "model.lora" in lines[0], str(err.value)


def _packed(lengths, hq=4, hkv=2, d=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


@pytest.mark.vllm
def test_a_typo_in_the_exact_switches_from_the_environment_is_refused_by_the_preflight(monkeypatch):
    """JUSTRL_EXACT_OFF=atention measured nothing and said nothing; the pre-flight names it (as JUSTRL_FAST_PATHS_OFF)."""
    from justrl_megatron.model import exact

    cfg = compose([])
    monkeypatch.setenv(exact.OFF_ENV, "rope, atention")
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=1)
    lines = [line for line in str(err.value).splitlines() if exact.OFF_ENV in line]
    assert lines == [f"  - {exact.OFF_ENV}='rope, atention': unknown piece(s) ['atention']; known: attention, linear, "
                     f"rope, residual, silu, head"], lines
    monkeypatch.setenv(exact.OFF_ENV, "rope, attention")
    validate(cfg, world_size=1)
    assert not exact.piece_on("attention") and not exact.piece_on("rope") and exact.piece_on("head")


def test_engine_attention_is_causal_attention_and_batch_invariant():
    from justrl_megatron.model.exact import engine_attention

    lengths = [12, 130, 9, 40]  # one sequence spans two cache blocks
    q, k, v, cu = _packed(lengths)
    scale = 1 / math.sqrt(q.size(-1))
    out = engine_attention(q, k, v, cu, scale)
    for i, n in enumerate(lengths):
        a, b = int(cu[i]), int(cu[i + 1])
        # reference: fp64 softmax attention of this sequence alone, K/V heads repeated for their query groups
        qi, ki, vi = (x[a:b].double().transpose(0, 1) for x in (q, k, v))
        ki, vi = ki.repeat_interleave(2, 0), vi.repeat_interleave(2, 0)
        scores = (qi @ ki.transpose(1, 2)) * scale + torch.full((n, n), -math.inf).triu(1).double()
        ref = (scores.softmax(-1) @ vi).transpose(0, 1)
        assert (out[a:b].double() - ref).abs().max() < 1e-5
        alone = engine_attention(q[a:b], k[a:b], v[a:b], torch.tensor([0, n], dtype=torch.int32), scale)
        assert torch.equal(alone, out[a:b])  # a sequence's rows do not depend on what else is packed


@pytest.mark.vllm
def test_engine_rope_is_neox_rotation_in_one_rounding():
    from justrl_megatron.model.exact import engine_rope, packed_positions, rope_cache

    d = 32
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    cache = rope_cache(inv, 256)
    q, _, _, cu = _packed([7, 20], dtype=torch.bfloat16)
    out = engine_rope(q, packed_positions(cu, 27), cache)
    pos = torch.cat([torch.arange(7), torch.arange(20)]).double()
    ang = pos[:, None] * inv.double()[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x = q.double()
    ref = x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin
    assert (out.double() - ref).abs().max() <= 2 ** -7 * ref.abs().max()  # within one bf16 rounding


@pytest.mark.vllm
def test_exact_silu_and_logprobs_do_not_depend_on_the_rows_beside_them():
    import torch.nn.functional as F

    from types import SimpleNamespace

    from justrl_megatron.model.exact import GRAIN, engine_logprobs, row_invariant_silu

    silu = row_invariant_silu(SimpleNamespace(justrl_exact=True))
    g = torch.Generator().manual_seed(1)
    # the gate half of megatron's fc1 output (its glu's chunk: a strided view), more elements than one thread's grain
    gate = torch.randn(2 * GRAIN // 200 + 7, 1, 400, generator=g)[..., :200]
    with torch.no_grad():
        many = silu(gate)
        for i in (0, many.size(0) // 2, many.size(0) - 1):  # each row as the engine's SiLU gets it in a decode step
            assert torch.equal(many[i], F.silu(gate[i:i + 1])[0]), i
        assert torch.allclose(many, F.silu(gate), atol=1e-6)
        hidden, weight = torch.randn(300, 64, generator=g), torch.randn(1024, 64, generator=g) * 0.1
        targets = torch.randint(0, 1000, (300,), generator=g)
        logp, ent = engine_logprobs(hidden, weight, targets, 1000, True)
        one, _ = engine_logprobs(hidden[-1:], weight, targets[-1:], 1000, False)
    assert torch.equal(logp[-1:], one)
    ref = torch.log_softmax((hidden.double() @ weight.double().t())[:, :1000], -1)
    assert (logp.double() - ref.gather(-1, targets[:, None]).squeeze(-1)).abs().max() < 1e-4
    assert (ent.double() + (ref.exp() * ref).sum(-1)).abs().max() < 1e-4


# --- model.engine_numerics: the engine's pieces in every pass, with the trainer's own backward ------------------------

def test_engine_numerics_is_on_for_half_precision_on_the_cpu_and_refuses_what_it_cannot_mirror():
    from justrl_megatron.model.exact import resolve_engine_numerics

    assert compose().model.engine_numerics == "auto"
    assert resolve_engine_numerics(compose(["model.dtype=bf16"])) is True  # the engine's kernels: half precision
    assert resolve_engine_numerics(compose(["model.dtype=fp32"])) is False  # fp32's gap is at rounding level
    assert resolve_engine_numerics(compose(["model.dtype=bf16", "model.engine_numerics=off"])) is False
    assert resolve_engine_numerics(compose(["model.dtype=bf16", "model.lora.enabled=true"])) is False  # auto: off
    assert resolve_engine_numerics(compose(["model.dtype=fp32", "model.engine_numerics=on"])) is True
    with pytest.raises(ConfigError) as err:
        validate(compose(["model.engine_numerics=on", "parallel.tensor=2"]), world_size=2)
    lines = [line for line in str(err.value).splitlines() if "engine_numerics" in line]
    assert len(lines) == 1 and "parallel.tensor > 1" in lines[0] and "set auto or off" in lines[0], str(err.value)
    with pytest.raises(ConfigError, match="model.engine_numerics must be one of auto, on, off, got 'yes'"):
        validate(compose(["model.engine_numerics=yes"]), world_size=1)


@pytest.mark.vllm
def test_engine_pieces_have_the_trainers_gradients():
    """Each piece's forward is the engine's kernel (checked above against references); its backward is the
    gradient of the trainer's own op: a linear's matmuls, the inverse rotation, fp32 SDPA recomputed."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from justrl_megatron.model.attention import _EngineAttention, packed_attention
    from justrl_megatron.model.exact import _EngineLinear, engine_rope, packed_positions, rope_cache

    g = torch.Generator().manual_seed(2)
    x, w, b = (torch.randn(*s, generator=g, requires_grad=True) for s in ((2, 9, 64), (48, 64), (48,)))
    up = torch.randn(2, 9, 48, generator=g)
    mine = torch.autograd.grad((_EngineLinear.apply(x, w, b) * up).sum(), (x, w, b))
    ref = torch.autograd.grad((F.linear(x, w, b) * up).sum(), (x, w, b))
    assert all(torch.allclose(a, r, atol=1e-4, rtol=1e-5) for a, r in zip(mine, ref))

    d = 32
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    q, k, v, cu = _packed([7, 20], dtype=torch.float32)
    positions = packed_positions(cu, 27)
    q.requires_grad_()
    up = torch.randn(q.shape, generator=g)
    (grad_q,) = torch.autograd.grad((engine_rope(q, positions, rope_cache(inv, 64)) * up).sum(), q)
    ang = positions.double()[:, None] * inv.double()[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    q64 = q.detach().double().requires_grad_()
    rotated = q64 * cos + torch.cat([-q64[..., d // 2:], q64[..., :d // 2]], -1) * sin
    (ref_q,) = torch.autograd.grad((rotated * up.double()).sum(), q64)
    assert (grad_q.double() - ref_q).abs().max() < 1e-5

    params = SimpleNamespace(cu_seqlens_q=cu, cu_seqlens_q_padded=None, max_seqlen_q=20, qkv_format="thd")
    inputs = [t.detach().to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    scale = 1 / math.sqrt(d)
    out = _EngineAttention.apply(*inputs, params, scale, "flash")
    up = torch.randn(out.shape, generator=g).to(torch.bfloat16).float()  # the gradient reaches a bf16 output as bf16
    mine = torch.autograd.grad((out.float() * up).sum(), inputs)
    ref_in = [t.detach().float().requires_grad_() for t in inputs]
    ref = torch.autograd.grad((packed_attention(*ref_in, params, scale) * up).sum(), ref_in)
    assert all(a.dtype == torch.bfloat16 and torch.equal(a, r.to(torch.bfloat16)) for a, r in zip(mine, ref))

    # the head (the vocabulary padded past its 120 real tokens): model/logprobs.py's gradient, row chunks invisible
    from justrl_megatron.model.exact import engine_logprobs
    from justrl_megatron.model.logprobs import logprobs_from_hidden

    h = torch.randn(30, 64, generator=g, requires_grad=True)
    w = (torch.randn(136, 64, generator=g) * 0.3).requires_grad_()
    t, up_lp, up_ent = torch.randint(0, 120, (30,), generator=g), torch.randn(30, generator=g), torch.randn(30)
    lp, ent = engine_logprobs(h, w, t, 120, True, chunk_size=7)
    mine = torch.autograd.grad((lp * up_lp + ent * up_ent).sum(), (h, w))
    ref_lp, ref_ent = logprobs_from_hidden(h, w, t, vocab_size=120, with_entropy=True)
    ref = torch.autograd.grad((ref_lp * up_lp + ref_ent * up_ent).sum(), (h, w))
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    assert all(torch.allclose(a, r, atol=1e-5, rtol=1e-4) for a, r in zip(mine, ref))
    assert torch.equal(mine[1][120:], torch.zeros(16, 64))  # padding is no token
    with torch.no_grad():
        assert torch.equal(engine_logprobs(h, w, t, 120, False)[0], lp.detach())  # one chunk: the same bits


ENGINE_TINY = dict(family="qwen2", num_layers=2, hidden_size=128, ffn_hidden_size=200, num_attention_heads=4,
                   num_query_groups=2, head_dim=32, vocab_size=120, max_position_embeddings=64, rope_theta=10000.0,
                   rms_norm_eps=1e-6, qkv_bias=True, tie_word_embeddings=False, init_std=0.02)


@pytest.mark.vllm
def test_engine_numerics_update_forward_is_the_log_prob_pass_and_its_gradient_the_defaults():
    """A bf16 policy with model.engine_numerics: the update's forward (autograd) gives bitwise the hidden states of
    the log-prob pass (no autograd), so the log-probs the update starts from are the ones the rollout check sees;
    its parameter gradient is the default path's within bf16's rounding."""
    from justrl_megatron.model.build import unwrap
    from justrl_megatron.model.hf_config import ModelShape
    from justrl_megatron.model.policy import Policy
    from justrl_megatron.train.batching import Sample, make_micro_batch

    policy = Policy.build(ModelShape(**ENGINE_TINY), dtype="bf16", transformer_impl="local", lr=1e-3, seed=3,
                          engine_numerics=True)
    model = unwrap(policy.chunks[0])
    g = torch.Generator().manual_seed(0)
    samples = [Sample(prompt_ids=torch.randint(1, 120, (4,), generator=g).tolist(),
                      response_ids=torch.randint(1, 120, (n,), generator=g).tolist(), advantage=1.0)
               for n in (6, 11, 3)]
    mb = make_micro_batch(samples, [0, 1, 2], pad_to_multiple_of=8)
    seen = []
    model.decoder.final_layernorm.register_forward_hook(lambda m, a, o: seen.append(o))

    def forward(grad: bool):
        seen.clear()
        with torch.set_grad_enabled(grad):
            model(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params())
        return seen[0]

    hidden = forward(True)
    assert torch.equal(hidden.detach(), forward(False))
    up = torch.randn(hidden.shape, generator=g)
    params = [p for p in model.parameters() if p.requires_grad]
    on = torch.autograd.grad((hidden.float() * up).sum(), params, allow_unused=True)  # (the head: not used)
    policy.config.justrl_engine_numerics = False  # the same weights on the trainer's own kernels
    off = torch.autograd.grad((forward(True).float() * up).sum(), params, allow_unused=True)
    assert not torch.equal(forward(False), hidden.detach())  # the two paths do differ in bf16
    compared = [(a, b) for a, b in zip(on, off) if b is not None]
    assert len(compared) == len(params) - 1
    for a, b in compared:
        assert torch.isfinite(a).all() and (a.float() - b.float()).norm() <= 0.05 * b.float().norm() + 1e-6


@pytest.mark.vllm
def test_engine_numerics_shared_prompt_forward_is_each_samples_own():
    """trainer.shared_prompt (a group's prompt computed once, its responses' RoPE rows per token) under the engine's
    pieces: the log-probs are bitwise those of each sample packed alone, as the engine computes each request."""
    from justrl_megatron.model.hf_config import ModelShape
    from justrl_megatron.model.policy import Policy
    from justrl_megatron.train.batching import Sample
    from justrl_megatron.train.step import compute_logprobs

    g = torch.Generator().manual_seed(4)
    samples = []
    for group, prompt_len in enumerate((5, 3)):
        prompt = torch.randint(1, 120, (prompt_len,), generator=g).tolist()
        samples += [Sample(prompt_ids=prompt, response_ids=torch.randint(1, 120, (n,), generator=g).tolist(),
                           advantage=1.0, group=group) for n in (4, 9, 2)]
    out = {}
    for shared in ("on", "off"):
        policy = Policy.build(ModelShape(**ENGINE_TINY), dtype="bf16", transformer_impl="local", lr=1e-3, seed=3,
                              engine_numerics=True, shared_prompt=shared)
        out[shared] = compute_logprobs(policy, samples, max_tokens_per_micro_batch=256)
    for a, b in zip(out["on"], out["off"]):
        assert torch.equal(a, b)
