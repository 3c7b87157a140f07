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
    from justrl_megatron.model.exact import engine_rope, rope_cache

    d = 32
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    cache = rope_cache(inv, 256)
    q, _, _, cu = _packed([7, 20], dtype=torch.bfloat16)
    out = engine_rope(q, cu, cache)
    pos = torch.cat([torch.arange(7), torch.arange(20)]).double()
    ang = pos[:, None] * inv.double()[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x = q.double()
    ref = x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin
    assert (out.double() - ref).abs().max() <= 2 ** -7 * ref.abs().max()  # within one bf16 rounding


@pytest.mark.vllm
def test_exact_silu_and_logprobs_do_not_depend_on_the_rows_beside_them():
    import torch.nn.functional as F

    from justrl_megatron.model.exact import GRAIN, engine_logprobs, silu

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
