"""Packed (THD) attention on CUDA: the varlen flash path the probe picks equals per-sequence attention (values and
gradients, bf16 and fp16, GQA and MHA), it is really picked on torch >= 2.10, and it never syncs with the host."""

import itertools
import math

import pytest
import torch

from justrl_megatron.model import attention
from justrl_megatron.model.attention import packed_attention, packed_causal_attention, probe_varlen, varlen_choice
from justrl_megatron.model.norm import rms_norm_fused, rms_norm_reference
from test_model import _naive_causal  # the CPU tests' reference (explicit masked softmax)

LENS = [37, 1, 130, 64, 255, 9]  # includes a 1-token sequence; 496 tokens
HEAD_DIM = 128  # DeepSeek-R1-Distill-Qwen-1.5B's
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
LAYOUTS = [(12, 2), (8, 8)]  # GQA as in the 1.5B model; MHA


def _torch_at_least(major, minor):
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (major, minor)


def _inputs(heads, groups, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(LENS)
    q, k, v = (torch.randn(t, n, HEAD_DIM, generator=g, dtype=torch.float64) for n in (heads, groups, groups))
    w = torch.randn(t, heads, HEAD_DIM, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, *itertools.accumulate(LENS)], dtype=torch.int32)
    return q, k, v, w, cu


def _run(q, k, v, w, cu, scale, device, dtype):
    ins = [x.to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v)]
    out = packed_causal_attention(*ins, cu.to(device), max(LENS), scale)
    grads = torch.autograd.grad((out.double() * w.to(device)).sum(), ins)
    return out.detach().double().cpu(), [g.double().cpu() for g in grads]


def _truth(q, k, v, w, cu, scale, dtype):
    """fp64 on the CPU from the same (rounded) inputs."""
    q, k, v = (x.to(dtype).double().requires_grad_() for x in (q, k, v))
    b = cu.tolist()
    out = torch.cat([_naive_causal(q[s:e], k[s:e], v[s:e], scale) for s, e in zip(b[:-1], b[1:])])
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    return out.detach(), list(grads)


def _rel(a, b):
    return float((a - b).abs().max() / (1.0 + b.abs().max()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads,groups", LAYOUTS, ids=["gqa", "mha"])
def test_probe_picks_varlen_on_this_torch(dtype, heads, groups):
    if not _torch_at_least(2, 10):
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen (>= 2.10)")
    name, fn, errors = probe_varlen(attention.varlen_candidates(), torch.device("cuda"), dtype, heads, groups,
                                    HEAD_DIM)
    # a failure here means the GPU path silently lost varlen flash: fix the candidate forms in model/attention.py
    assert name is not None, f"no varlen_attn form works on torch {torch.__version__}: {errors}"
    assert varlen_choice("cuda", dtype, heads, groups, HEAD_DIM)[0] == name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads,groups", LAYOUTS, ids=["gqa", "mha"])
def test_varlen_equals_per_sequence_attention(dtype, heads, groups, monkeypatch):
    q, k, v, w, cu = _inputs(heads, groups)
    scale = 1 / math.sqrt(HEAD_DIM)
    truth, truth_grads = _truth(q, k, v, w, cu, scale, dtype)
    varlen, varlen_grads = _run(q, k, v, w, cu, scale, "cuda", dtype)  # whichever path the probe chose
    # the exact fallback on the same device: one SDPA call per sequence
    monkeypatch.setattr(attention, "PAD_BATCH_MAX_WASTE", 0.0)
    monkeypatch.setitem(attention._VARLEN, (torch.device("cuda", torch.cuda.current_device()), dtype, heads, groups,
                                            HEAD_DIM), (None, None))
    per_seq, per_seq_grads = _run(q, k, v, w, cu, scale, "cuda", dtype)
    tol = TOL[dtype]
    assert _rel(varlen, truth) <= tol and _rel(per_seq, truth) <= tol
    assert _rel(varlen, per_seq) <= tol
    for a, b, t in zip(varlen_grads, per_seq_grads, truth_grads):
        assert _rel(a, t) <= 2 * tol and _rel(b, t) <= 2 * tol and _rel(a, b) <= 2 * tol
    # attention stays inside each sequence: the 1-token sequence attends only to itself
    one = LENS[0]
    rep = heads // groups
    assert _rel(varlen[one], v[one].to(dtype).double().repeat_interleave(rep, 0)) <= tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_varlen_path_has_no_host_sync(dtype):
    if not _torch_at_least(2, 10):
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen (>= 2.10)")
    from megatron.core.packed_seq_params import PackedSeqParams

    q, k, v, w, cu = _inputs(12, 2)
    dev = torch.device("cuda")
    ins = [x.to(device=dev, dtype=dtype).requires_grad_() for x in (q, k, v)]
    cu, w = cu.to(dev), w.to(device=dev, dtype=dtype)
    # as batching.MicroBatch.packed_seq_params builds it: max_seqlen a host int
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(LENS),
                          max_seqlen_kv=max(LENS))
    assert varlen_choice(dev, dtype, 12, 2, HEAD_DIM)[0] is not None  # the probe (which syncs) runs before
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device->host sync in the layer's attention now raises
    try:
        for _layer in range(2):  # exactly what SDPAttention.forward runs for a packed row, layer after layer
            out = packed_attention(*ins, psp, 1 / math.sqrt(HEAD_DIM))
            torch.autograd.grad((out * w).sum(), ins)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_fused_rms_norm_on_cuda_matches_the_reference():
    g = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(300, 1536, generator=g)).cuda()
    weight = (1 + 0.1 * torch.randn(1536, generator=g)).cuda()
    # bf16: the reference rounds twice (normalised x, then x * weight), the fused kernel once
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -6)):
        xd, wd = x.to(dtype), weight.to(dtype)
        ref, fused = rms_norm_reference(xd, wd, 1e-6), rms_norm_fused(xd, wd, 1e-6)
        assert fused.dtype == dtype
        assert ((fused.float() - ref.float()).abs() <= tol * ref.float().abs() + 1e-5).all(), dtype
