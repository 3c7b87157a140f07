"""The GPU fast paths (model/fast_paths.py, model.attention_backend) compute what the default path computes, checked
here on the CPU where they can run; the CPU path itself never takes them. tests/gpu/test_gpu_fast_paths.py checks
them on CUDA (compiled kernels, cuDNN, host syncs)."""

import math

import pytest
import torch

from justrl_megatron.model import fast_paths, logprobs
from justrl_megatron.model.attention import PackedPlan, attention_backend

TINY = dict(family="qwen2", num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
            head_dim=8, vocab_size=120, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6,
            qkv_bias=True, tie_word_embeddings=False, init_std=0.02)


def test_switches_come_from_the_config_and_the_override_turns_them_off(monkeypatch):
    monkeypatch.delenv(fast_paths.ENV, raising=False)
    assert fast_paths.switches() == {n: True for n in fast_paths.SWITCHES}
    assert fast_paths.switches({"rope_once": False}) == {**{n: True for n in fast_paths.SWITCHES}, "rope_once": False}
    monkeypatch.setenv(fast_paths.ENV, "compiled_head, fused_adamw")
    got = fast_paths.switches({"rope_once": False})
    assert got == {"rope_once": False, "foreach_grad_norm": True, "fused_adamw": False, "compiled_head": False}
    assert fast_paths.switches(None, override="all") == {n: False for n in fast_paths.SWITCHES}
    with pytest.raises(ValueError, match="unknown fast path.*rope_twice"):
        fast_paths.switches(None, override="rope_twice")
    resolved = fast_paths.resolve({"rope_once": False}, attention_backend="auto")
    assert resolved.record() == {"model.attention_backend": "flash", "model.fast_paths.rope_once": False,
                                 "model.fast_paths.foreach_grad_norm": True, "model.fast_paths.fused_adamw": False,
                                 "model.fast_paths.compiled_head": False,
                                 f"env.{fast_paths.ENV}": "compiled_head, fused_adamw"}


def test_an_override_typo_is_refused_by_the_config_preflight_in_one_line(monkeypatch):
    from justrl_megatron.config import ConfigError, compose, validate

    cfg = compose([])
    monkeypatch.setenv(fast_paths.ENV, "rope_once,fused_adam")
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=1)
    lines = [line for line in str(err.value).splitlines() if fast_paths.ENV in line]
    assert len(lines) == 1 and "fused_adam'" in lines[0] and "known: rope_once" in lines[0]
    monkeypatch.setenv(fast_paths.ENV, "all")
    validate(cfg, world_size=1)  # a valid override passes


@pytest.mark.parametrize("rank", [0, 1])
def test_auto_is_decided_on_rank_0_and_every_rank_takes_its_answer(rank, monkeypatch):
    """Only trainer rank 0 measures; what it decides is what distributed.trainer_broadcast hands every rank (here
    the broadcast is stood in for: rank 0 sends cudnn, whatever the other ranks' own timing would say)."""
    import torch.distributed as dist

    from justrl_megatron import distributed

    sent = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(distributed, "trainer_broadcast", lambda obj: sent.append(obj) or "cudnn")
    asked = []

    def decide(choice):  # the ranks' own timings disagree
        asked.append(choice)
        return "cudnn" if rank == 0 else "flash"

    got = fast_paths.resolve(None, attention_backend="auto", decide_attention=decide)
    assert got.attention_backend == "cudnn"
    assert asked == (["auto"] if rank == 0 else [])  # rank 1 never measured
    assert sent == (["cudnn"] if rank == 0 else [None])
    asked.clear()
    assert fast_paths.resolve(None, attention_backend="flash", decide_attention=lambda c: asked.append(c) or c) \
        .attention_backend == "flash" and asked == ["flash"]  # a fixed choice: no broadcast, each rank checks it


def _history(run_dir, n):
    folder = run_dir / "config_history"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{n:04d}.yaml").write_text("trainer:\n  lr: 1.0e-06\n")


def test_resolved_choices_are_recorded_and_a_resume_that_differs_says_so(tmp_path):
    from justrl_megatron.run_history import ResolvedChoiceChanged, record_resolved

    first = fast_paths.FastPaths(attention_backend="cudnn").record()
    assert record_resolved(tmp_path, first) is None  # no history: a policy built outside justrl-train
    assert not (tmp_path / "config_history").exists()
    _history(tmp_path, 1)
    assert record_resolved(tmp_path, first) is None  # the first launch: nothing to compare with
    saved = (tmp_path / "config_history" / "0001.resolved.yaml").read_text()
    assert "model.attention_backend: cudnn" in saved and "model.fast_paths.rope_once: true" in saved
    _history(tmp_path, 2)
    assert record_resolved(tmp_path, first) is None  # resolved alike: silent
    _history(tmp_path, 3)
    second = fast_paths.FastPaths(attention_backend="flash", rope_once=False, override="rope_once").record()
    note = record_resolved(tmp_path, second)
    assert "\n" not in note and "model.attention_backend 'cudnn' -> 'flash'" in note
    assert "model.fast_paths.rope_once True -> False" in note and "(0002.yaml)" in note
    _history(tmp_path, 4)
    with pytest.raises(ResolvedChoiceChanged, match="strict_resume"):
        record_resolved(tmp_path, first, strict=True)
    from justrl_megatron.run_config import history

    assert [p.name for p in history(tmp_path)] == [f"{n:04d}.yaml" for n in (1, 2, 3, 4)]  # records are no entries


def test_the_policy_resolves_its_fast_paths_once_and_its_modules_read_them(monkeypatch):
    from justrl_megatron.model.attention import SDPAttention
    from justrl_megatron.model.hf_config import ModelShape
    from justrl_megatron.model.policy import Policy

    monkeypatch.setenv(fast_paths.ENV, "fused_adamw")
    policy = Policy.build(ModelShape(**TINY), dtype="fp32", transformer_impl="local", lr=1e-3, seed=3,
                          fast_paths={"compiled_head": False})
    monkeypatch.delenv(fast_paths.ENV)  # decided at build: a later change of the environment changes nothing
    assert policy.fast_paths == fast_paths.FastPaths(fused_adamw=False, compiled_head=False, override="fused_adamw")
    assert not hasattr(policy.config, "justrl_fast_paths")  # the backend reaches the attention through its spec
    cores = [m for m in policy.modules[0].modules() if isinstance(m, SDPAttention)]
    assert cores and all(c.backend == "flash" for c in cores)  # the CPU's answer, decided once


def test_attention_backend_is_validated_and_flash_off_cuda():
    assert attention_backend("cudnn", "cpu", torch.bfloat16, 4, 2, 8) == "flash"
    assert attention_backend("auto", "cpu", torch.float32, 4, 2, 8) == "flash"
    with pytest.raises(ValueError, match="auto, flash, cudnn"):
        attention_backend("xformers", "cpu", torch.float32, 4, 2, 8)
    from justrl_megatron.config import ConfigError, compose, validate

    cfg = compose(["model.attention_backend=xformers"])
    with pytest.raises(ConfigError, match="model.attention_backend must be auto, flash or cudnn"):
        validate(cfg, world_size=1)


def test_a_micro_batch_on_a_device_carries_its_bounds_on_the_host():
    from justrl_megatron.train.batching import Sample, make_micro_batch

    samples = [Sample(prompt_ids=[1, 2], response_ids=[3] * n, advantage=1.0) for n in (3, 5)]
    mb = make_micro_batch(samples, [0, 1], pad_to_multiple_of=4)
    moved = mb.to("meta")  # a device whose tensors cannot be read back: the bounds must not come from it
    plan = PackedPlan(moved.cu_seqlens)
    assert plan.bounds == mb.cu_seqlens.tolist() and plan.lengths == [5, 7]


def _policy(dtype):
    from justrl_megatron.model.hf_config import ModelShape
    from justrl_megatron.model.policy import Policy

    return Policy.build(ModelShape(**TINY), dtype=dtype, transformer_impl="local", lr=1e-3, warmup_steps=0, seed=3)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_rope_from_rows_per_token_equals_megatrons_packed_rope(dtype, monkeypatch):
    """Fast path rope_once: the rotation rows picked per token by the position ids (made once per micro-batch) and
    applied as they are give bit-for-bit the logits of megatron's packed RoPE (boundaries read in every layer),
    padding included; megatron's packed function is not called at all."""
    from megatron.core.models.common.embeddings import rope_utils

    from justrl_megatron.model.build import unwrap
    from justrl_megatron.model.rope import rope_at_positions
    from justrl_megatron.train import step
    from justrl_megatron.train.batching import Sample, make_micro_batch

    policy = _policy(dtype)
    g = torch.Generator().manual_seed(0)
    samples = [Sample(prompt_ids=torch.randint(1, 120, (3,), generator=g).tolist(),
                      response_ids=torch.randint(1, 120, (n,), generator=g).tolist(), advantage=1.0)
               for n in (5, 1, 9)]
    mb = make_micro_batch(samples, [0, 1, 2], pad_to_multiple_of=8)  # 21 tokens + 3 of padding
    assert step._rope_positions(mb, True) is None  # the CPU keeps megatron's path (its speed and figures unchanged)
    model = unwrap(policy.chunks[0])
    model.eval()

    def logits(positions):
        with torch.no_grad(), rope_at_positions(model, positions):
            return model(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params())

    reference = logits(None)
    calls = []
    real_thd = rope_utils._apply_rotary_pos_emb_thd
    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd", lambda *a, **k: calls.append(1) or real_thd(*a, **k))
    fast = logits(mb.position_ids[0])
    assert not calls
    n = mb.num_real_tokens
    assert torch.equal(fast[:, :n], reference[:, :n])


def _head_inputs(dtype, rows=37, hidden=16, vocab=50, padded=56, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g).to(dtype)
    w = (torch.randn(padded, hidden, generator=g) * 0.3).to(dtype)
    t = torch.randint(0, vocab, (rows,), generator=g)
    return h, w, t, vocab


def _head(h, w, t, vocab, chunk, fused, monkeypatch):
    monkeypatch.setattr(logprobs, "_kernels", (lambda d, c=False: logprobs._fused_kernels_eager()) if fused else
                        (lambda d, c=False: None))
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = logprobs.logprobs_from_hidden(hh, ww, t, vocab_size=vocab, with_entropy=True, chunk_size=chunk)
    (lp.sum() + 0.3 * ent.sum()).backward()
    z = hh.detach() @ ww.detach().t()
    zz = z.clone().requires_grad_()
    lp2, ent2 = logprobs.logprobs_from_logits(zz, t, vocab_size=vocab, with_entropy=True, chunk_size=chunk)
    (lp2.sum() - 0.7 * ent2.sum()).backward()
    return [lp.detach(), ent.detach(), hh.grad, ww.grad, lp2.detach(), ent2.detach(), zz.grad]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
def test_fused_head_math_equals_the_eager_chunks(dtype, tol, monkeypatch):
    """Fast path compiled_head: the single-kernel forms of the chunk math (mask, max, sums, target by comparison;
    gradient with the target term added by comparison) equal the eager chunk functions, with padded vocabulary
    columns and several chunks. fp32: 1e-6 relative (sums in another order); bf16 inputs: the log-probs and
    entropies are fp32 either way (same 1e-6), the bf16 gradients within one bf16 rounding (1e-2 relative).
    Compiled on CUDA, the same functions are checked in tests/gpu/test_gpu_fast_paths.py."""
    h, w, t, vocab = _head_inputs(dtype)
    eager = _head(h, w, t, vocab, 8, False, monkeypatch)
    fused = _head(h, w, t, vocab, 8, True, monkeypatch)
    for i, (a, b) in enumerate(zip(fused, eager)):
        bound = 1e-6 if a.dtype == torch.float32 else tol
        assert float((a.float() - b.float()).abs().max() / (1 + b.float().abs().max())) <= bound, i
    assert math.isfinite(float(eager[1].sum()))
