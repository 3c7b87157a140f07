"""Core attention for the local (non-TransformerEngine) layer spec: torch SDPA, packed sequences included.

megatron's local `DotProductAttention` materialises the [b, h, s, s] score matrix (16K tokens: 1 GiB per head in fp32)
and rejects packed sequences. This module takes its place in the spec (same constructor and forward contract) and
calls `torch.nn.functional.scaled_dot_product_attention`, whose flash / memory-efficient kernels (CUDA, and the CPU
flash kernel) never build the score matrix.

What megatron's `Attention` hands the core-attention module (megatron-core 0.16 / 0.19):
  * padded batches ("sbhd"): query [s, b, np, hn], key/value [s, b, ng, hn]; returns [s, b, np * hn];
  * packed rows ("thd", `PackedSeqParams.qkv_format == "thd"`): query [t, np, hn], key/value [t, ng, hn] (the batch dim
    of 1 is squeezed by the caller, RoPE is already applied per sequence from `cu_seqlens`); returns [t, np * hn].
Attention stays inside each packed sequence. A micro-batch of shared-prompt units (train/batching.py) carries a
`SharedPrompt` (on the PackedSeqParams and on its cu_seqlens tensor): its rows, one per response (prompt + response),
are gathered from the unit, attended like packed sequences, and each token's output is picked back from one row. On CUDA with bf16/fp16 one varlen flash call covers the whole row
(`torch.nn.attention.varlen`, torch >= 2.10; the call form is chosen by probing it once per device/dtype/head layout,
see `varlen_choice`), with no host sync; elsewhere the sequences are right-padded into one batched causal SDPA call
when that wastes little (exact), else each sequence is one causal SDPA call (no S x S either). The fallback reads the
sequence boundaries on the host once per micro-batch (`packed_plan`), not once per layer.
With context parallelism (config.context_parallel_size > 1) a packed row holds this rank's chunks of each sequence
and `context_parallel_attention` attends them against the K/V all-gathered over the CP group (below).
"""

from __future__ import annotations

import logging
import math
import statistics

import torch
import torch.nn.functional as F

from .exact import engine_attention, engine_pass, piece_on
from .fast_paths import ATTENTION_BACKENDS

logger = logging.getLogger(__name__)


# --- what trainer.shared_prompt and parallel.context cannot run with (config validation, the policy) ------------

SHARED_PROMPT_CHOICES = ("auto", "on", "off")


def _shared_prompt_choice(choice) -> str:
    return {"true": "on", "false": "off"}.get(str(choice).lower(), str(choice).lower())  # yaml / CLI booleans


def shared_prompt_problems(choice, transformer_impl: str = "auto", cp: int = 1, routing_replay: bool = False
                           ) -> list[str]:
    """What trainer.shared_prompt cannot be (config validation and `resolve_shared_prompt` share it):
    a known choice; `on` only where a unit's rows can be attended (our SDPA attention: not TransformerEngine's), cut
    into context-parallel chunks (not at parallel.context > 1) and replayed per sample (not with MoE routing
    replay). `auto` turns itself off in those cases."""
    choice = _shared_prompt_choice(choice)
    if choice not in SHARED_PROMPT_CHOICES:
        return [f"trainer.shared_prompt must be auto, on or off, got {choice!r}"]
    if choice != "on":
        return []
    problems = []
    if transformer_impl == "te":
        problems.append("trainer.shared_prompt=on needs model.transformer_impl=local or auto (TransformerEngine's "
                        "attention and fused RoPE take only plain packed sequences); set trainer.shared_prompt=auto")
    if cp > 1:
        problems.append("trainer.shared_prompt=on does not work with parallel.context > 1 (a shared prompt's rows "
                        "cannot be split into context-parallel chunks); set trainer.shared_prompt=auto or off")
    if routing_replay:
        problems.append("trainer.shared_prompt=on does not work with algo.routing_replay (experts are kept per "
                        "sample); set trainer.shared_prompt=auto or off")
    return problems


def resolve_shared_prompt(choice, impl: str, cp: int = 1, routing_replay: bool = False) -> bool:
    """trainer.shared_prompt -> on or off. A group's responses can share one prompt copy only through our own core
    attention (the local spec's SDPAttention, below) and megatron's unfused RoPE; TransformerEngine's
    attention and fused RoPE know only plain packed segments. auto: on with the local spec; off with TE, with
    context parallelism (a unit's rows cannot be cut into CP chunks) and with MoE routing replay (experts are kept
    per sample). What `on` cannot run with is refused by `shared_prompt_problems`."""
    problems = shared_prompt_problems(choice, impl, cp, routing_replay)
    if problems:
        raise ValueError(problems[0])
    choice = _shared_prompt_choice(choice)
    return choice == "on" or (choice == "auto" and impl != "te" and cp == 1 and not routing_replay)


def shared_prompt_config_problems(cfg, shape=None) -> list[str]:
    """`shared_prompt_problems` of the config (routing replay counts only on an MoE model, or an unknown one)."""
    return shared_prompt_problems(cfg.trainer.shared_prompt, cfg.model.transformer_impl, cfg.parallel.context,
                                  cfg.algo.routing_replay != "off" and (shape is None or bool(shape.num_experts)))


def context_parallel_problems(cfg, shape=None) -> list[str]:
    """What parallel.context > 1 cannot run with (one message each, before any model is built); trainer.shared_prompt
    is `shared_prompt_problems`' and the TE spec's fp32 attention spec.transformer_engine_problems'."""
    if cfg.parallel.context <= 1:
        return []
    from ..algo.grpo import CP_LOSS_AGGS

    problems = []
    if cfg.algo.loss_agg not in CP_LOSS_AGGS:
        problems.append(f"algo.loss_agg={cfg.algo.loss_agg} does not work with parallel.context > 1 (it divides by "
                        f"a per-sequence or per-micro-batch token count that no context-parallel rank holds); use "
                        f"{' or '.join(CP_LOSS_AGGS)}")
    if cfg.algo.policy_loss == "gspo":
        problems.append("algo.policy_loss=gspo does not work with parallel.context > 1 (its sequence ratio is a mean "
                        "over every token of a response, spread over the context-parallel ranks); use ppo or cispo")
    if cfg.model.lora.enabled:
        problems.append("model.lora does not work with parallel.context > 1 yet; set parallel.context=1")
    return problems


# --- varlen flash attention: chosen by probing the call, never by reading its signature ---------------------------
# torch's `varlen_attn` changed form between releases (read from the wheels' torch/nn/attention/varlen.py):
#   2.10: varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None)   (no scale, no GQA flag)
#   2.11: varlen_attn(..., *, return_aux=None, scale=None, window_size=(-1, -1))             (causal = (-1, 0))
#   2.13: varlen_attn(..., *, ..., scale=None, window_size=(-1, -1), enable_gqa=False, ...)
# 2.10/2.11 have no GQA flag: aten's flash kernel may still take fewer KV heads than query heads (flash-attn 2 does),
# so that is tried before expanding K/V to the query heads (repeat_interleave: exact, more memory). A signature says
# nothing about whether a kernel exists for this device/dtype/head count or whether KV groups are understood; one
# tiny causal forward+backward with a known answer does.

def _expand_kv(q, k, v):
    rep = q.size(1) // k.size(1)
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def varlen_candidates() -> list:
    """[(name, fn(q, k, v, cu, max_seqlen, scale) -> out, expands_kv)] in order of preference (an expanding form is
    skipped for MHA, where it equals the form before it); empty where torch has no varlen_attn."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return []

    def window_gqa(q, k, v, cu, mx, scale):
        return varlen_attn(q, k, v, cu, cu, mx, mx, scale=scale, window_size=(-1, 0), enable_gqa=q.size(1) != k.size(1))

    def window(q, k, v, cu, mx, scale):
        return varlen_attn(q, k, v, cu, cu, mx, mx, scale=scale, window_size=(-1, 0))

    def window_expanded(q, k, v, cu, mx, scale):
        return window(q, *_expand_kv(q, k, v), cu, mx, scale)

    def is_causal(q, k, v, cu, mx, scale):
        # 2.10 takes no scale (it uses 1/sqrt(d)): fold any other scale into q (one extra rounding of q)
        rescale = scale * math.sqrt(q.size(-1))
        return varlen_attn(q * rescale if abs(rescale - 1.0) > 1e-12 else q, k, v, cu, cu, mx, mx, is_causal=True)

    def is_causal_expanded(q, k, v, cu, mx, scale):
        return is_causal(q, *_expand_kv(q, k, v), cu, mx, scale)

    return [("window_size+enable_gqa", window_gqa, False), ("window_size", window, False),
            ("window_size+expanded_kv", window_expanded, True), ("is_causal", is_causal, False),
            ("is_causal+expanded_kv", is_causal_expanded, True)]


def _reference_attention(q, k, v, bounds: list[int], scale: float) -> torch.Tensor:
    """Per-sequence causal attention with an explicit masked softmax in fp32 (the probe's known answer)."""
    q, k, v = q.float(), *_expand_kv(q, k.float(), v.float())
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        s = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * scale
        mask = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu(1)
        outs.append(torch.einsum("hqk,khd->qhd", s.masked_fill(mask, float("-inf")).softmax(-1), v[a:b]))
    return torch.cat(outs)


# probe input: sequences of 7, 1 and 12 tokens (one of length 1), a non-default scale so that a form ignoring it fails
_PROBE_LENGTHS = (7, 1, 12)
_PROBE_TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def probe_varlen(candidates, device, dtype, num_heads: int, num_groups: int, head_dim: int):
    """The first candidate whose output AND input gradients match the reference on this device/dtype/heads.
    Returns (name, fn, errors) with name/fn None when none does; errors maps tried names to what went wrong."""
    bounds = [0]
    for n in _PROBE_LENGTHS:
        bounds.append(bounds[-1] + n)
    g = torch.Generator().manual_seed(0)  # CPU generator: the probe touches no device RNG state
    t, scale = bounds[-1], 0.7 / math.sqrt(head_dim)
    base = [torch.randn(t, h, head_dim, generator=g).to(device=device, dtype=dtype)
            for h in (num_heads, num_groups, num_groups)]
    w = torch.randn(t, num_heads, head_dim, generator=g).to(device)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    tol = _PROBE_TOL.get(dtype, 1e-4)
    errors = {}
    # the first call may come from a no-grad forward (old logprobs) or a recompute: the probe needs autograd
    with torch.inference_mode(False), torch.enable_grad():
        ref_in = [x.detach().float().requires_grad_() for x in base]
        ref = _reference_attention(*ref_in, bounds, scale)
        ref_grads = torch.autograd.grad((ref * w).sum(), ref_in)
        for name, fn, expands in candidates:
            if expands and num_heads == num_groups:
                continue  # identical to the form before it
            try:
                inputs = [x.detach().clone().requires_grad_() for x in base]
                out = fn(*inputs, cu, max(_PROBE_LENGTHS), scale)
                grads = torch.autograd.grad((out.float() * w).sum(), inputs)
                err = float((out.detach().float() - ref.detach()).abs().max())
                gerr = max(float((a.float() - b).abs().max() / (1.0 + b.abs().max())) for a, b in zip(grads, ref_grads))
            except Exception as exc:  # noqa: BLE001  (any failure just rules this form out)
                errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                continue
            if tuple(out.shape) == tuple(ref.shape) and err <= tol and gerr <= 4 * tol:
                return name, fn, errors
            errors[name] = f"wrong answer (max |out - ref| {err:.3g}, grads {gerr:.3g}; tolerance {tol:g})"
    return None, None, errors


_VARLEN: dict = {}  # (device, dtype, heads, groups, head_dim) -> (name, fn) or (None, None)
_WARNED: set = set()


def _device(device) -> torch.device:
    """The device as the probes' caches key it: "cuda" and "cuda:0" are one kernel choice."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def varlen_choice(device, dtype, num_heads: int, num_groups: int, head_dim: int):
    """(name, fn) of the varlen form this device/dtype/head layout uses, probed once; (None, None) = fallback."""
    key = (_device(device), dtype, num_heads, num_groups, head_dim)
    if key not in _VARLEN:
        name, fn, errors = probe_varlen(varlen_candidates(), key[0], dtype, num_heads, num_groups, head_dim)
        _VARLEN[key] = (name, fn)
        what = f"{key[0]}/{str(dtype).replace('torch.', '')}, {num_heads} heads, {num_groups} KV groups, d={head_dim}"
        if name is not None:
            logger.info("packed attention on %s: torch varlen_attn [%s]%s", what, name,
                        f" (rejected: {errors})" if errors else "")
        elif "varlen" not in _WARNED:  # once per process, not per layer or per key
            _WARNED.add("varlen")
            logger.warning("torch varlen flash attention is not usable on %s (tried: %s); packed rows fall back to "
                           "exact SDPA calls (slower)", what, errors or "torch has no torch.nn.attention.varlen")
    return _VARLEN[key]


# --- cuDNN attention for packed rows (model.attention_backend) ------------------------------------------------------
# torch's varlen kernel is FlashAttention-2; cuDNN's fused attention (SDPBackend.CUDNN_ATTENTION) runs 1.5-1.6x
# faster on Hopper at head dim 128 (FlashAttention-3 paper: forward 595 vs 370 TFLOP/s, backward 516 vs 322). torch
# exposes it through SDPA on a [b, h, s, d] batch, so a packed row is attended one sequence at a time (one call for
# a 16K-token sample) from bounds known on the host (`PackedPlan`, no sync: the micro-batch carries them).


def cudnn_candidates() -> list:
    """[(name, fn(q, k, v, bounds, scale) -> out, expands_kv)] of the cuDNN forms, GQA first."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception:
        return []

    def per_sequence(q, k, v, bounds, scale, gqa):
        outs = []
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            for a, b in zip(bounds[:-1], bounds[1:]):
                if b == a + 1:  # cuDNN takes no 1-token sequence; its softmax over one key is 1: the output is v
                    rep = q.size(1) // v.size(1)
                    outs.append(v[a:b].repeat_interleave(rep, dim=1) + q[a:b] * 0)  # (q stays in the graph)
                elif b > a:
                    qi, ki, vi = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, h, L, d]
                    out = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale,
                                                         enable_gqa=gqa and q.size(1) != k.size(1))
                    outs.append(out.squeeze(0).transpose(0, 1))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    def gqa(q, k, v, bounds, scale):
        return per_sequence(q, k, v, bounds, scale, True)

    def expanded(q, k, v, bounds, scale):
        return per_sequence(q, *_expand_kv(q, k, v), bounds, scale, False)

    return [("cudnn+enable_gqa", gqa, False), ("cudnn+expanded_kv", expanded, True)]


_CUDNN: dict = {}  # (device, dtype, heads, groups, head_dim) -> (name, fn) or (None, None)


def cudnn_choice(device, dtype, num_heads: int, num_groups: int, head_dim: int):
    """(name, fn) of the cuDNN form that computes the reference answer here, probed once; (None, None): none does."""
    key = (_device(device), dtype, num_heads, num_groups, head_dim)
    if key not in _CUDNN:
        forms = {name: fn for name, fn, _ in cudnn_candidates()}
        # the probe calls forms as varlen does (cu_seqlens on the device): read its bounds once per probe call
        adapted = [(name, (lambda fn: lambda q, k, v, cu, mx, scale: fn(q, k, v, cu.tolist(), scale))(fn), exp)
                   for name, fn, exp in cudnn_candidates()]
        name, _, errors = probe_varlen(adapted, key[0], dtype, num_heads, num_groups, head_dim)
        _CUDNN[key] = (name, forms.get(name))
        if name is None and "cudnn" not in _WARNED:
            _WARNED.add("cudnn")
            logger.warning("cuDNN attention is not usable here (tried: %s); packed rows use flash attention",
                           errors or "torch has no sdpa_kernel")
    return _CUDNN[key]


def cuda_seconds(fn, repeats: int = 3, warmup: int = 1) -> float:
    """Median seconds of fn() on the current CUDA stream, by CUDA events, after `warmup` calls (the `auto` backend's
    choice here; bench/kernels.py's microbenchmarks)."""
    times = []
    for i in range(warmup + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def _forward_backward(fn, q, k, v, *rest):
    def run():
        fn(*(x.detach().requires_grad_() for x in (q, k, v)), *rest).sum().backward()
    return run


_AUTO: dict = {}


def attention_backend(choice: str, device, dtype, num_heads: int, num_groups: int, head_dim: int) -> str:
    """model.attention_backend -> "flash" or "cudnn" for packed rows on this device/dtype/heads. auto: cuDNN when
    it computes the probe's answer and one forward+backward of an 8,192-token sequence is at least 5% faster than
    flash (measured once per process and head layout); "cudnn" where cuDNN fails falls back to flash (a warning)."""
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"model.attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {choice!r}")
    if choice == "flash" or torch.device(device).type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return "flash"
    if cudnn_choice(device, dtype, num_heads, num_groups, head_dim)[1] is None:
        return "flash"
    if choice == "cudnn":
        return "cudnn"
    key = (str(device), dtype, num_heads, num_groups, head_dim)
    if key not in _AUTO:
        _AUTO[key] = _auto_pick(device, dtype, num_heads, num_groups, head_dim)
    return _AUTO[key]


def _auto_pick(device, dtype, num_heads, num_groups, head_dim, tokens: int = 8192) -> str:
    _, flash = varlen_choice(device, dtype, num_heads, num_groups, head_dim)
    _, cudnn = cudnn_choice(device, dtype, num_heads, num_groups, head_dim)
    if flash is None:
        return "cudnn"
    with torch.inference_mode(False), torch.enable_grad():
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(tokens, h, head_dim, device=device, dtype=dtype, generator=g)
                   for h in (num_heads, num_groups, num_groups))
        cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        scale = 1.0 / math.sqrt(head_dim)
        t_flash = cuda_seconds(_forward_backward(flash, q, k, v, cu, tokens, scale))
        t_cudnn = cuda_seconds(_forward_backward(cudnn, q, k, v, [0, tokens], scale))
    pick = "cudnn" if t_cudnn <= 0.95 * t_flash else "flash"
    logger.info("model.attention_backend=auto: %s (forward+backward of %d tokens: cudnn %.2f ms, flash %.2f ms)",
                pick, tokens, t_cudnn * 1e3, t_flash * 1e3)
    return pick


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of q [b, np, s, hn] over k, v [b, ng, s, hn] (GQA when ng < np) -> [b, np, s, hn]."""
    if not q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        # the CPU flash kernel's half-precision backward is ~3x slower than its fp32 one: attention (a few % of the
        # FLOPs here) runs in fp32, the matmuls around it stay bf16
        return causal_sdpa(q.float(), k.float(), v.float(), scale).to(q.dtype)
    gqa = q.size(1) != k.size(1)
    if gqa and q.is_cuda and q.dtype == torch.float32:
        # fp32 on CUDA has no flash kernel and the efficient one lacks GQA: expand KV rather than fall back to math.
        rep = q.size(1) // k.size(1)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        gqa = False
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)


class PackedPlan:
    """What the exact fallback needs to know about one packed row, computed once per micro-batch (one host sync),
    not once per layer, and only when the fallback runs (the varlen path never reads it): the boundaries as Python
    ints and, for the right-padded batch, the token -> slot index."""

    def __init__(self, cu_seqlens: torch.Tensor):
        self.cu_seqlens = cu_seqlens
        self._bounds = None
        self._slot = None

    @property
    def bounds(self) -> list[int]:
        if self._bounds is None:
            # a micro-batch moved to the device carries its host copy (train/batching.MicroBatch.to): no sync
            host = getattr(self.cu_seqlens, "justrl_host_bounds", None)
            self._bounds = list(host) if host is not None else self.cu_seqlens.tolist()  # else the host sync
        return self._bounds

    @property
    def lengths(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds[:-1], self.bounds[1:]) if b > a]

    def slot(self, device) -> torch.Tensor:
        if self._slot is None:
            lengths = self.lengths
            n, longest = len(lengths), max(lengths)
            lens = torch.tensor(lengths, device=device)
            seq = torch.repeat_interleave(torch.arange(n, device=device), lens)
            starts = torch.cumsum(lens, 0) - lens
            self._slot = seq * longest + (torch.arange(self.bounds[-1], device=device) - starts[seq])
        return self._slot


def packed_plan(packed_seq_params, cu_seqlens: torch.Tensor) -> PackedPlan:
    """The plan of this micro-batch, cached on its PackedSeqParams (every layer and a recompute see the same
    object); keyed by the cu_seqlens tensor itself so that a reused params object cannot serve stale bounds."""
    plan = getattr(packed_seq_params, "_justrl_packed_plan", None)
    if plan is None or plan.cu_seqlens is not cu_seqlens:
        plan = PackedPlan(cu_seqlens)
        try:
            packed_seq_params._justrl_packed_plan = plan
        except AttributeError:  # a frozen/slotted params object: no cache, still correct
            pass
    return plan


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, scale: float, plan: PackedPlan | None = None,
                            backend: str = "flash") -> torch.Tensor:
    """Causal attention within each packed sequence. q [t, np, hn], k/v [t, ng, hn], cu_seqlens [n+1] -> [t, np, hn].

    `max_seqlen` must be a Python int (PackedSeqParams.max_seqlen_q is one): the varlen path then never syncs with
    the host. `plan` (see `packed_plan`) carries the host-side bounds for cuDNN and the fallback, once per
    micro-batch. `backend`: model.attention_backend (auto, flash or cudnn; see `attention_backend`)."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        if attention_backend(backend, q.device, q.dtype, q.size(1), k.size(1), q.size(2)) == "cudnn":
            if plan is None or plan.cu_seqlens is not cu_seqlens:
                plan = PackedPlan(cu_seqlens)
            return cudnn_choice(q.device, q.dtype, q.size(1), k.size(1), q.size(2))[1](q, k, v, plan.bounds, scale)
        _, fn = varlen_choice(q.device, q.dtype, q.size(1), k.size(1), q.size(2))
        if fn is not None:
            return fn(q, k, v, cu_seqlens.to(torch.int32), int(max_seqlen), scale)
    if plan is None or plan.cu_seqlens is not cu_seqlens:
        plan = PackedPlan(cu_seqlens)
    bounds, lengths = plan.bounds, plan.lengths
    if bounds[-1] != q.size(0):
        raise ValueError(f"cu_seqlens ends at {bounds[-1]} but the packed row holds {q.size(0)} tokens")
    if len(lengths) > 1 and len(lengths) * max(lengths) <= PAD_BATCH_MAX_WASTE * q.size(0):
        return _right_padded_batch(q, k, v, lengths, scale, plan.slot(q.device))
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        # [L, h, d] -> [1, h, L, d]
        qi, ki, vi = (x[start:end].permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))
        outs.append(causal_sdpa(qi, ki, vi, scale).squeeze(0).permute(1, 0, 2))
    return torch.cat(outs, dim=0)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed_seq_params, scale: float,
                     backend: str = "flash"):
    """What SDPAttention does with a packed (THD) row: q [t, np, hn], k/v [t, ng, hn] -> [t, np, hn]."""
    cu = packed_seq_params.cu_seqlens_q_padded
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    shared = getattr(packed_seq_params, "justrl_shared_prompt", None) or getattr(cu, "justrl_shared_prompt", None)
    if shared is not None:
        return shared_prompt_attention(q, k, v, shared, scale, backend=backend)
    return packed_causal_attention(q, k, v, cu, packed_seq_params.max_seqlen_q, scale,
                                   plan=packed_plan(packed_seq_params, cu), backend=backend)


def packed_engine_attention(q, k, v, packed_seq_params, scale: float) -> torch.Tensor:
    """`packed_attention` with the engine's kernel (rollout.exact, model/exact.py); shared-prompt units are unfolded
    into their rows first, as `shared_prompt_attention` does."""
    cu = packed_seq_params.cu_seqlens_q_padded
    cu = packed_seq_params.cu_seqlens_q if cu is None else cu
    shared = getattr(packed_seq_params, "justrl_shared_prompt", None) or getattr(cu, "justrl_shared_prompt", None)
    if shared is None:
        return engine_attention(q, k, v, cu, scale)
    rows = [x.index_select(0, shared.gather) for x in (q, k, v)]
    return engine_attention(*rows, shared.row_cu, scale).index_select(0, shared.pick)


class _EngineAttention(torch.autograd.Function):
    """`packed_engine_attention` forward (model.engine_numerics: the update's own forward attends as the engine
    does); backward: the gradient of `packed_attention` in fp32, recomputed from the saved q, k, v (the same
    function up to fp32 rounding; the engine's kernel has no backward)."""

    @staticmethod
    def forward(ctx, q, k, v, packed_seq_params, scale, backend):
        ctx.save_for_backward(q, k, v)
        ctx.params, ctx.scale, ctx.backend = packed_seq_params, scale, backend
        return packed_engine_attention(q, k, v, packed_seq_params, scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [x.detach().float().requires_grad_() for x in (q, k, v)]
            out = packed_attention(*inputs, ctx.params, ctx.scale, backend=ctx.backend)
            grads = torch.autograd.grad(out, inputs, grad.float())
        return (*(g.to(x.dtype) for g, x in zip(grads, (q, k, v))), None, None, None)


def shared_prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shared, scale: float,
                            backend: str = "flash") -> torch.Tensor:
    """Attention of a row of shared-prompt units: q [t, np, hn], k/v [t, ng, hn] -> [t, np, hn]. `shared`
    (train/batching.SharedPrompt): the rows are gathered (a prompt's keys and values once per response, its queries
    too: attention FLOPs only), attended as packed causal sequences, and each token's output picked from its row.
    The gather's backward sums the rows' gradients into the one prompt copy."""
    rows = [x.index_select(0, shared.gather) for x in (q, k, v)]
    out = packed_causal_attention(*rows, shared.row_cu, shared.row_max, scale, plan=packed_plan(shared, shared.row_cu),
                                  backend=backend)
    return out.index_select(0, shared.pick)


# One batched SDPA call over right-padded sequences instead of one call per sequence, when the padding costs at most
# this factor in tokens: the per-call overhead dominates for the many short sequences of a GRPO batch on a CPU.
PAD_BATCH_MAX_WASTE = 2.0


def _right_padded_batch(q, k, v, lengths: list[int], scale: float, slot: torch.Tensor) -> torch.Tensor:
    """Causal attention of packed sequences as one [n, h, L, d] SDPA call. Exact: with the padding on the right, a real
    query's causal window holds only real keys of its own sequence; padded queries are computed and dropped.
    `slot` maps each packed token to its padded slot (PackedPlan.slot)."""
    n, longest = len(lengths), max(lengths)

    def pad(x):  # [t, h, d] -> [n, h, L, d]
        flat = x.new_zeros(n * longest, x.size(1), x.size(2)).index_copy(0, slot, x)
        return flat.view(n, longest, x.size(1), x.size(2)).transpose(1, 2)

    out = causal_sdpa(pad(q), pad(k), pad(v), scale)  # [n, h, L, d]
    return out.transpose(1, 2).reshape(n * longest, q.size(1), q.size(2)).index_select(0, slot)


# --- context parallelism: local queries against the K/V of the whole CP group ------------------------------------
# The micro-batch of a CP rank (train/batching.split_for_context_parallel) holds, per sequence, chunks r and
# 2N-1-r of 2N equal chunks; cu_seqlens are those of the padded global row. Each layer all-gathers K and V over the
# CP group (one collective for both), puts the chunks back in global order, and runs exact causal attention of the
# local queries against their sequence's keys up to the query's global position. Backward sums the K/V gradients of
# every rank and keeps this rank's share (Llama 3's all-gather CP: exact with packing and GQA, no ring).

class _GatherContextParallel(torch.autograd.Function):
    """x [t, ...] -> [cp, t, ...] (every rank's x); backward: reduce-scatter of the gradient (gloo has no
    reduce-scatter: all-reduce, then this rank's slice)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((group.size(), *x.shape))
        dist.all_gather(list(out.unbind(0)), x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            out = grad.new_empty(grad.shape[1:])
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.group.rank()].clone(), None


class ContextParallelPlan:
    """Host-side layout of one CP micro-batch, computed once per micro-batch (one host sync), not per layer:
    `order` maps the global token order to rows of the flattened all-gathered [cp * t_local] tensor, and `seqs`
    holds (global start, local start, chunk length) per sequence."""

    def __init__(self, cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int):
        self.cu_seqlens, self.cp_size, self.cp_rank = cu_seqlens, cp_size, cp_rank
        bounds = cu_seqlens.tolist()
        local_total = bounds[-1] // cp_size
        order, self.seqs = [], []
        for a, b in zip(bounds[:-1], bounds[1:]):
            if (b - a) % (2 * cp_size):
                raise ValueError(f"a sequence of {b - a} tokens is not padded to a multiple of 2 x context "
                                 f"parallel size {cp_size} (train/batching.split_for_context_parallel pads it)")
            chunk, local_start = (b - a) // (2 * cp_size), a // cp_size
            for j in range(2 * cp_size):
                owner, offset = (j, local_start) if j < cp_size else (2 * cp_size - 1 - j, local_start + chunk)
                start = owner * local_total + offset
                order.extend(range(start, start + chunk))
            self.seqs.append((a, local_start, chunk))
        self.order = torch.tensor(order, dtype=torch.int64, device=cu_seqlens.device)
        self.local_total = local_total


def context_parallel_plan(packed_seq_params, cu_seqlens: torch.Tensor, group) -> ContextParallelPlan:
    """The plan of this micro-batch, cached on its PackedSeqParams (as `packed_plan`)."""
    plan = getattr(packed_seq_params, "_justrl_cp_plan", None)
    if plan is None or plan.cu_seqlens is not cu_seqlens:
        plan = ContextParallelPlan(cu_seqlens, group.size(), group.rank())
        try:
            packed_seq_params._justrl_cp_plan = plan
        except AttributeError:
            pass
    return plan


# queries per masked SDPA call are limited so that the [queries, keys] mask stays below this many elements
_CP_MASK_ELEMENTS = 1 << 24


def _cp_blocks(plan: ContextParallelPlan):
    """(local query rows, the sequence's keys in global order, global position of the first query) per block of
    queries: a query at global position p of its sequence sees the keys at positions 0 .. p."""
    n, r = plan.cp_size, plan.cp_rank
    for start, local_start, chunk in plan.seqs:
        for i, j in enumerate((r, 2 * n - 1 - r)):
            first, q0 = j * chunk, local_start + i * chunk
            block = max(1, _CP_MASK_ELEMENTS // (first + chunk))
            for s in range(0, chunk, block):
                e = min(chunk, s + block)
                yield slice(q0 + s, q0 + e), slice(start, start + first + e), first + s


def _masked_block(q, k, v, first_pos: int, scale: float) -> torch.Tensor:
    """q [b, np, hn] at positions first_pos .. first_pos + b - 1 against k/v [first_pos + b, ng, hn] (its sequence's
    keys from position 0): query i sees keys 0 .. first_pos + i. -> [b, np, hn]."""
    if not q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):  # as causal_sdpa: fp32 attention on the CPU
        return _masked_block(q.float(), k.float(), v.float(), first_pos, scale).to(q.dtype)
    gqa = q.size(1) != k.size(1)
    if gqa and q.is_cuda:  # CUDA's masked kernels lack GQA: expand (CPU's flash kernel takes both)
        k, v = _expand_kv(q, k, v)
        gqa = False
    keep = torch.arange(k.size(0), device=q.device)[None, :] <= \
        torch.arange(first_pos, first_pos + q.size(0), device=q.device)[:, None]
    qi, ki, vi = (x.permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))
    return F.scaled_dot_product_attention(qi, ki, vi, attn_mask=keep, scale=scale, enable_gqa=gqa).squeeze(0) \
        .permute(1, 0, 2)


class _ContextParallelCore(torch.autograd.Function):
    """The local queries' attention over the gathered K/V, block by block, keeping only its inputs for backward:
    backward recomputes one block at a time (as flash kernels do), so a block's [queries, keys] mask and scores exist
    only while that block runs, never for the whole layer until its backward."""

    @staticmethod
    def forward(ctx, q, k_all, v_all, plan, scale):
        ctx.save_for_backward(q, k_all, v_all)
        ctx.plan, ctx.scale = plan, scale
        out = q.new_empty(q.shape)
        for qs, ks, first in _cp_blocks(plan):
            out[qs] = _masked_block(q[qs], k_all[ks], v_all[ks], first, scale)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k_all, v_all = ctx.saved_tensors
        gq, gk, gv = torch.zeros_like(q), torch.zeros_like(k_all), torch.zeros_like(v_all)
        for qs, ks, first in _cp_blocks(ctx.plan):
            with torch.enable_grad():
                inputs = [x.detach().requires_grad_() for x in (q[qs], k_all[ks], v_all[ks])]
                out = _masked_block(*inputs, first, ctx.scale)
                dq, dk, dv = torch.autograd.grad(out, inputs, grad[qs])
            gq[qs] += dq
            gk[ks] += dk
            gv[ks] += dv
        return gq, gk, gv, None, None


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: ContextParallelPlan,
                               group, scale: float) -> torch.Tensor:
    """Exact causal attention of this CP rank's queries q [t, np, hn] against their sequences' keys on all CP ranks
    (k/v [t, ng, hn] local). -> [t, np, hn]."""
    if q.size(0) != plan.local_total:
        raise ValueError(f"the context-parallel rank holds {q.size(0)} tokens but cu_seqlens say "
                         f"{plan.local_total} (= {plan.cu_seqlens[-1].item()} / {plan.cp_size})")
    ng = k.size(1)
    kv = _GatherContextParallel.apply(torch.cat([k, v], dim=1), group)  # [cp, t, 2 ng, hn]
    kv = kv.reshape(-1, *kv.shape[2:]).index_select(0, plan.order)     # global token order
    return _ContextParallelCore.apply(q, kv[:, :ng], kv[:, ng:], plan, scale)


try:
    from megatron.core.transformer.module import MegatronModule as _Base
except Exception:  # pragma: no cover - megatron is a hard dependency; keeps the module importable for docs
    _Base = torch.nn.Module


class SDPAttention(_Base):
    """Drop-in core attention for megatron's local spec (same constructor/forward contract as DotProductAttention).
    `backend`: model.attention_backend for packed rows, from the layer spec's `ModuleSpec.params` (spec.block_spec):
    the one every rank agreed on (model/fast_paths.resolve, Policy.build); "auto" (a model built without a Policy:
    tests, converters) decides per process."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, backend: str = "auto", **_unused):
        super().__init__(config=config)
        from megatron.core import parallel_state as ps

        if pg_collection is not None and hasattr(pg_collection, "tp"):
            tp = pg_collection.tp.size()
        else:
            tp = ps.get_tensor_model_parallel_world_size()
        self.cp_group = None  # context parallel: K/V all-gathered over this group (context_parallel_attention)
        if config.context_parallel_size > 1:
            self.cp_group = pg_collection.cp if pg_collection is not None and hasattr(pg_collection, "cp") \
                else ps.get_context_parallel_group()
        if config.num_attention_heads % tp or config.num_query_groups % tp:
            raise ValueError(f"tensor parallel size {tp} must divide {config.num_attention_heads} attention heads "
                             f"and {config.num_query_groups} query groups")
        self.num_heads = config.num_attention_heads // tp
        self.num_groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.attn_mask_type = attn_mask_type
        self.backend = backend
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError("SDPAttention runs without attention dropout (RL fine-tuning); set attention_dropout=0")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_unused):
        if attention_bias is not None:
            raise ValueError("SDPAttention does not take an attention bias")
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed sequences must use qkv_format='thd', got {packed_seq_params.qkv_format!r}")
            if self.cp_group is not None:
                cu = packed_seq_params.cu_seqlens_q_padded
                cu = packed_seq_params.cu_seqlens_q if cu is None else cu
                plan = context_parallel_plan(packed_seq_params, cu, self.cp_group)
                out = context_parallel_attention(query, key, value, plan, self.cp_group, self.softmax_scale)
            elif engine_pass(self.config, query) and piece_on("attention"):  # the engine's kernel (model/exact.py)
                if torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value)):
                    out = _EngineAttention.apply(query, key, value, packed_seq_params, self.softmax_scale,
                                                 self.backend)
                else:
                    out = packed_engine_attention(query, key, value, packed_seq_params, self.softmax_scale)
            else:
                out = packed_attention(query, key, value, packed_seq_params, self.softmax_scale,
                                       backend=self.backend)
            return out.reshape(out.size(0), -1)
        if self.cp_group is not None:
            raise ValueError("context parallelism on the local spec takes packed (thd) micro-batches only")
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        if attention_mask is None:
            out = causal_sdpa(q, k, v, self.softmax_scale)
        else:
            # megatron's mask marks positions to DROP (True = masked); SDPA's boolean mask marks positions to KEEP.
            keep = ~attention_mask.bool()
            if q.size(1) != k.size(1):
                rep = q.size(1) // k.size(1)
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=self.softmax_scale)
        s, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
