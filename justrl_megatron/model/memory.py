"""The memory plan: predicted peak training memory per GPU for one micro-batch -> recompute mode and token budget.

peak = fixed bytes (weights, fp32 grads, optimizer state)  +  tokens x activation bytes per token  +  the logprob head

Fixed bytes per parameter on this GPU: bf16/fp16 weights 2 + fp32 gradient buffer 4 (megatron DDP, grad_reduce_in_fp32)
+ fp32 master weights 4 + Adam m, v 8 = 18; fp32 weights 4 + 4 + 8 = 16. The distributed optimizer shards the master
weights and Adam state over the data-parallel ranks (the gradient buffer stays whole). Weights are split over TP; over
PP we take the heaviest stage (the first holds the embedding, the last the output layer and final norm).

Activation bytes per token and layer are what autograd keeps for backward, term by term, and they follow the kernels
that run (`Kernels`: CUDA_KERNELS on a GPU, CPU_KERNELS on the CPU; read off megatron-core 0.16.1 / 0.19.2, torch
2.13 and our norm.py / attention.py, and checked against `saved_tensors_hooks` measurements of a real GPTModel on CPU
in tests/test_memory.py). b = bytes of the model dtype, q = heads x head_dim, kv = KV groups x head_dim, f = ffn
size; per layer and token:
  2 RMSNorms               fused (CUDA: F.rms_norm's kernel, whose FusedRmsNormBackward0 keeps the input and the fp32
                           rstd; TE's norm likewise): b.h + 4; reference (norm.py's CPU form): fp32 copy of the input
                           4h + rsqrt 4 + normalised input before the weight b.h
  2 linear inputs          qkv and fc1 save their input: b.h each
  RoPE                     cos and sin, for q and for k: 4 b.head_dim
  core attention (flash)   q, k after RoPE b(q + kv); v is a view of the fused QKV output, which stays: b(q + 2kv);
                           the output b.q (linear_proj's input is a view of it) and the logsumexp 4 x heads (fp32)
  SwiGLU MLP               fused (megatron's bias_swiglu_impl, on with the local spec on CUDA when it compiles, and
                           with TE): its autograd function keeps only fc1's output 2f.b, fc2 its input f.b: 3f.b;
                           plain (CPU): fc1 output 2f.b, silu(gate) f.b, `x_linear + glu_linear_offset` f.b (an extra
                           tensor in megatron's unfused GLU), fc2 input f.b: 5f.b
DeepSeek-R1-Distill-Qwen-1.5B in bf16 on CUDA: 77,880 B = 50.7 h per token and layer (33 GiB at 16K tokens x 28
layers); with the CPU path's norms and SwiGLU it would be 126,008 B = 82 h.
On CPU the attention differs too (attention.py): half dtypes run attention in fp32 (fp32 copies of q, k, v and the
output) and the per-sequence path concatenates its output (one more b.q).

Recompute (megatron's `recompute_granularity`):
  selective  checkpoints the core attention only (`recompute_modules` default ["core_attn"], 0.16 and 0.19). With our
             SDPA/flash attention there is no S x S score matrix to drop, and its output stays alive as linear_proj's
             input, so selective saves only the logsumexp (4 x heads bytes: 48 B of 78 KB per token and layer for the
             1.5B model). It is modelled as such; `auto` in effect goes from none to full.
  full       every layer is checkpointed (uniform, 1 layer per unit): each keeps only its input, b.h; in backward one
             layer at a time is recomputed, so one layer of full activations is added.
Backward also holds gradient temporaries of the layer in flight: the MLP's backward has the gradients of fc2's input
(f.b) and of fc1's output (2f.b) alive at once, plus two h-sized gradients (3f.b + 2b.h); with the plain SwiGLU its
autograd graph holds more, counted as half a layer of activations (BACKWARD_WORKING_LAYERS); the larger of the two.
Not measured on a GPU yet. Per token outside the layers: the final norm, the
hidden states kept by the logprob head and the loss's per-token fp32 values (EXTRA_FP32_PER_TOKEN).
With PP, 1F1B's first stage holds up to PP micro-batches in flight: L/PP layers x PP = L layers' activations.
Context parallelism (CP): a rank holds 1/CP of every sequence, so the activations and the logprob head's rows are
those of tokens/CP; the distributed optimizer shards over DP x CP. The local spec's attention all-gathers K/V
(attention.py) and autograd keeps the gathered K and V per layer (2 b.kv per token of the whole micro-batch; with full
recompute only the layer in flight's); TE's ring attention keeps its chunks only transiently (not counted).
`tokens` and `max_tokens_per_micro_batch` stay those of the whole (global) micro-batch.
Not counted: the CUDA context, NCCL buffers, allocator fragmentation and a sleeping vLLM (level 2 keeps little): the
margin (default 10% of the device) covers them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .hf_config import ModelShape, check_parallel_layout, padded_vocab_size
from .logprobs import CHUNK_ELEMENTS

RECOMPUTE_MODES = ("none", "selective", "full")
GIB = 2**30
TOKEN_MULTIPLE = 128  # a clamped budget is rounded down to this
BACKWARD_WORKING_LAYERS = 0.5  # gradient temporaries of the layer in backward, in layers of full activations
HEAD_CHUNK_TENSORS = 5  # fp32 [rows, vocab] chunk tensors alive at once in the logprob head's backward (logprobs.py)
EXTRA_FP32_PER_TOKEN = 16  # per-token fp32 values of the logprob head and loss (logp, lse, entropy, ratio, ...)


class MemoryPlanError(ValueError):
    """The update cannot fit the device as configured; the message says what to change."""


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# --- fixed bytes ------------------------------------------------------------------------------------------------------

def _layer_params(shape: ModelShape) -> tuple[int, int]:
    """(parameters split over TP, parameters replicated over TP) of one decoder layer."""
    s = shape
    split = s.hidden_size * s.head_dim * (2 * s.num_attention_heads + 2 * s.num_query_groups)
    if s.qkv_bias:
        split += s.head_dim * (s.num_attention_heads + 2 * s.num_query_groups)
    split += 3 * s.hidden_size * s.ffn_hidden_size
    return split, 2 * s.hidden_size  # the two norm weights are replicated


def params_per_gpu(shape: ModelShape, *, tp: int = 1, pp: int = 1) -> int:
    """Parameters held by the heaviest pipeline stage's GPU (vocabulary padded as megatron pads it)."""
    split, replicated = _layer_params(shape)
    layers = math.ceil(shape.num_layers / pp) * (split // tp + replicated)
    vocab = padded_vocab_size(shape.vocab_size, tp) * shape.hidden_size // tp
    first = layers + vocab
    # untied: the last stage has its own output layer; tied with PP > 1: megatron keeps a copy of the embedding there
    last = layers + shape.hidden_size + (vocab if (not shape.tie_word_embeddings or pp > 1) else 0)
    return first + last - layers if pp == 1 else max(first, last)


def fixed_bytes(shape: ModelShape, *, tp: int = 1, pp: int = 1, dp: int = 1, dtype: torch.dtype = torch.bfloat16,
                distributed_optimizer: bool = True) -> int:
    """Weights + fp32 gradient buffer + optimizer state (+ fp32 master weights for half dtypes) on one GPU."""
    shard = dp if distributed_optimizer else 1
    if dtype in (torch.bfloat16, torch.float16):
        per_param = 2 + 4 + (4 + 8) / shard  # weight, fp32 grad | fp32 master, Adam m, v
    else:
        per_param = 4 + 4 + 8 / shard
    return int(params_per_gpu(shape, tp=tp, pp=pp) * per_param)


# --- activations ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Kernels:
    """The kernels whose saved tensors the activation terms follow (see the module docstring)."""
    attention: str = "flash"  # "flash": varlen flash / SDPA in the model dtype; "cpu": attention.py's CPU path
    norm: str = "fused"       # "fused": F.rms_norm's CUDA kernel or TE's norm; "reference": norm.py's CPU form
    swiglu: str = "fused"     # "fused": megatron's bias_swiglu_impl; "plain": megatron's unfused GLU

    def __post_init__(self):
        for field, value, choices in (("attention", self.attention, ("flash", "cpu")),
                                      ("norm", self.norm, ("fused", "reference")),
                                      ("swiglu", self.swiglu, ("fused", "plain"))):
            if value not in choices:
                raise ValueError(f"Kernels.{field} must be one of {choices}, got {value!r}")


CUDA_KERNELS = Kernels()  # the local spec with the fused SwiGLU on, and the TE spec
CPU_KERNELS = Kernels(attention="cpu", norm="reference", swiglu="plain")


def _norm_bytes(h_seq: float, b: int, kernels: Kernels) -> float:
    return b * h_seq + 4 if kernels.norm == "fused" else 4 * h_seq + 4 + b * h_seq


def layer_terms(shape: ModelShape, *, tp: int = 1, sequence_parallel: bool = False,
                dtype: torch.dtype = torch.bfloat16, kernels: Kernels = CUDA_KERNELS) -> dict[str, float]:
    """Bytes per token that autograd keeps for backward in one decoder layer without recompute, term by term, with
    ``kernels`` running (CUDA_KERNELS: the GPU's; CPU_KERNELS: the CPU path's)."""
    s, b = shape, _bytes(dtype)
    h_seq = s.hidden_size / tp if sequence_parallel and tp > 1 else s.hidden_size  # SP splits the h-sized tensors
    q = s.num_attention_heads * s.head_dim / tp
    kv = s.num_query_groups * s.head_dim / tp
    heads, f = s.num_attention_heads / tp, s.ffn_hidden_size / tp
    terms = {
        "norms": 2 * _norm_bytes(h_seq, b, kernels),
        "linear_inputs": 2 * b * h_seq,
        "rope": 4 * b * s.head_dim,
        "mlp": (3 if kernels.swiglu == "fused" else 5) * b * f,
    }
    if kernels.attention == "cpu" and b < 4:  # fp32 copies of q, k, v and of the output, then a cast + concatenated
        terms.update(attn_qkv=4 * (q + 2 * kv), attn_out=4 * q + 4 * heads, attn_proj_input=b * q)
    else:
        terms.update(attn_qkv=b * (q + kv) + b * (q + 2 * kv), attn_out=b * q + 4 * heads,
                     attn_proj_input=b * q if kernels.attention == "cpu" else 0)
    return terms


def layer_saved_bytes_per_token(shape: ModelShape, *, recompute: str = "none", tp: int = 1,
                                sequence_parallel: bool = False, dtype: torch.dtype = torch.bfloat16,
                                kernels: Kernels = CUDA_KERNELS) -> float:
    """What autograd keeps per token for one layer between its forward and its backward (what
    `saved_tensors_hooks` sees), under ``recompute``."""
    _check_mode(recompute)
    terms = layer_terms(shape, tp=tp, sequence_parallel=sequence_parallel, dtype=dtype, kernels=kernels)
    if recompute == "full":
        h_seq = shape.hidden_size / tp if sequence_parallel and tp > 1 else shape.hidden_size
        return float(_bytes(dtype) * h_seq)  # the checkpoint keeps the layer's input only
    total = float(sum(terms.values()))
    if recompute == "selective":
        # the checkpointed core attention keeps only its inputs (q, k after RoPE, v as a view of the QKV output)
        # instead of what the attention saved internally; on the flash path its output stays as linear_proj's input
        b = _bytes(dtype)
        q = shape.num_attention_heads * shape.head_dim / tp
        kv = shape.num_query_groups * shape.head_dim / tp
        total += b * (q + kv) + b * (q + 2 * kv) - terms["attn_qkv"] - terms["attn_out"]
        if kernels.attention == "flash":
            total += b * q
    return total


def backward_working_bytes_per_token(shape: ModelShape, *, tp: int = 1, sequence_parallel: bool = False,
                                     dtype: torch.dtype = torch.bfloat16, kernels: Kernels = CUDA_KERNELS) -> float:
    """Gradient temporaries of the layer in backward, per token (estimated, see the module docstring)."""
    b = _bytes(dtype)
    h_seq = shape.hidden_size / tp if sequence_parallel and tp > 1 else shape.hidden_size
    mlp_grads = 3 * b * shape.ffn_hidden_size / tp + 2 * b * h_seq
    full_layer = layer_saved_bytes_per_token(shape, tp=tp, sequence_parallel=sequence_parallel, dtype=dtype,
                                             kernels=kernels)
    return max(mlp_grads, BACKWARD_WORKING_LAYERS * full_layer)


def _extra_per_token(shape: ModelShape, dtype: torch.dtype, kernels: Kernels) -> float:
    """Per token outside the layers (last stage): embedding ids, final norm, the head's hidden rows, loss values."""
    b, h = _bytes(dtype), shape.hidden_size
    return 8 + _norm_bytes(h, b, kernels) + b * h + 4 * EXTRA_FP32_PER_TOKEN


def activation_bytes_per_token(shape: ModelShape, *, recompute: str = "none", tp: int = 1, pp: int = 1,
                               sequence_parallel: bool = False, dtype: torch.dtype = torch.bfloat16,
                               impl: str = "local", cp: int = 1, kernels: Kernels = CUDA_KERNELS) -> float:
    """Peak activation bytes per token of a micro-batch for the whole model on one GPU (all its layers, PP
    micro-batches in flight), including the layer being recomputed (full) and backward's working set. With context
    parallelism (``cp`` > 1): per token of the whole micro-batch, of which this GPU holds 1/cp."""
    if cp > 1:
        local = activation_bytes_per_token(shape, recompute=recompute, tp=tp, pp=pp,
                                           sequence_parallel=sequence_parallel, dtype=dtype, impl=impl,
                                           kernels=kernels)
        if impl == "te":
            return local / cp
        kv = shape.num_query_groups * shape.head_dim / tp
        layers = 1 if recompute == "full" else math.ceil(shape.num_layers / pp) * pp
        return local / cp + layers * 2 * _bytes(dtype) * kv  # the gathered K and V, kept for backward
    kw = dict(tp=tp, sequence_parallel=sequence_parallel, dtype=dtype, kernels=kernels)
    full_layer = layer_saved_bytes_per_token(shape, recompute="none", **kw)
    saved = layer_saved_bytes_per_token(shape, recompute=recompute, **kw)
    layers_in_flight = math.ceil(shape.num_layers / pp) * pp  # 1F1B: the first stage holds PP micro-batches
    recomputed = full_layer if recompute == "full" else 0.0
    return layers_in_flight * saved + recomputed + backward_working_bytes_per_token(shape, **kw) + \
        _extra_per_token(shape, dtype, kernels)


def logprob_head_bytes(shape: ModelShape, *, tp: int = 1, dtype: torch.dtype = torch.bfloat16,
                       tokens: int | None = None) -> int:
    """Peak of the chunked logprob head (model/logprobs.py) beyond the per-token terms: in backward, a few fp32
    [rows, vocab/TP] chunk tensors (rows x vocab ~ CHUNK_ELEMENTS, fewer rows when the micro-batch has fewer
    ``tokens``) plus the output weight's gradient, accumulated in fp32 and cast to the weight dtype at the end."""
    vocab = padded_vocab_size(shape.vocab_size, tp) // tp
    rows = max(1, CHUNK_ELEMENTS // vocab)
    if tokens is not None:
        rows = min(rows, max(tokens, 0))
    weight = vocab * shape.hidden_size
    return int(HEAD_CHUNK_TENSORS * 4 * rows * vocab + (4 + _bytes(dtype)) * weight)


def estimate_peak_bytes(shape: ModelShape, *, tokens: int, recompute: str = "none", tp: int = 1, pp: int = 1,
                        dp: int = 1, dtype: torch.dtype = torch.bfloat16, sequence_parallel: bool = False,
                        distributed_optimizer: bool = True, impl: str = "local", cp: int = 1,
                        kernels: Kernels = CUDA_KERNELS) -> int:
    """Predicted peak bytes (what torch.cuda.max_memory_allocated would report) of one update micro-batch of
    ``tokens`` tokens (over all ``cp`` context-parallel ranks; the distributed optimizer shards over dp x cp)."""
    return int(fixed_bytes(shape, tp=tp, pp=pp, dp=dp * cp, dtype=dtype, distributed_optimizer=distributed_optimizer)
               + tokens * activation_bytes_per_token(shape, recompute=recompute, tp=tp, pp=pp,
                                                     sequence_parallel=sequence_parallel, dtype=dtype, impl=impl,
                                                     cp=cp, kernels=kernels)
               + logprob_head_bytes(shape, tp=tp, dtype=dtype, tokens=-(-tokens // cp)))


# --- the plan ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryPlan:
    recompute: str                     # "none" | "selective" | "full"
    max_tokens_per_micro_batch: int
    fixed_bytes: int                   # weights + grads + optimizer state (+ master weights) on this GPU
    activation_bytes_per_token: float  # for the whole model on this GPU (all its layers), under `recompute`
    logprob_head_bytes: int            # the chunked logprob head's peak (see model/logprobs.py)
    peak_bytes: int                    # predicted peak for one micro-batch of max_tokens_per_micro_batch tokens
    device_bytes: int
    margin: float
    note: str = ""                     # why this mode / budget (clamped from what, what was skipped)

    @property
    def usable_bytes(self) -> int:
        return int(self.device_bytes * (1 - self.margin))

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.usable_bytes

    @property
    def activation_bytes(self) -> int:
        return int(self.activation_bytes_per_token * self.max_tokens_per_micro_batch)

    def describe(self) -> str:
        g = lambda n: f"{n / GIB:.1f}"  # noqa: E731
        line = (f"memory plan: recompute={self.recompute}, {self.max_tokens_per_micro_batch} tokens/micro-batch, "
                f"peak {g(self.peak_bytes)} GiB of {g(self.device_bytes)} GiB (fixed {g(self.fixed_bytes)}, "
                f"activations {g(self.activation_bytes)}, head {g(self.logprob_head_bytes)})")
        return f"{line}; {self.note}" if self.note else line


def _check_mode(recompute: str) -> None:
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"model.recompute must be auto, none, selective or full, got {recompute!r}")


def max_tokens_that_fit(shape: ModelShape, *, device_bytes: int, margin: float = 0.1, **kw) -> int:
    """The most tokens per micro-batch whose predicted peak stays within device_bytes x (1 - margin) (0 if none)."""
    fixed_kw = {k: kw[k] for k in ("tp", "pp", "dp", "dtype", "distributed_optimizer") if k in kw}
    cp = kw.get("cp", 1)
    fixed_kw["dp"] = fixed_kw.get("dp", 1) * cp  # the distributed optimizer shards over DP x CP
    act_kw = {k: v for k, v in kw.items() if k not in ("dp", "distributed_optimizer")}
    tp, dtype = kw.get("tp", 1), kw.get("dtype", torch.bfloat16)
    per_token = activation_bytes_per_token(shape, **act_kw)
    room = device_bytes * (1 - margin) - fixed_bytes(shape, **fixed_kw)
    vocab = padded_vocab_size(shape.vocab_size, tp) // tp
    rows = max(1, CHUNK_ELEMENTS // vocab)
    full_chunks = room - logprob_head_bytes(shape, tp=tp, dtype=dtype)
    if full_chunks >= rows * cp * per_token:  # at least one full chunk of rows: the head's peak no longer grows
        return int(full_chunks // per_token)
    # fewer tokens than one chunk: the head's chunk tensors grow with the (local) tokens too
    weight_only = room - logprob_head_bytes(shape, tp=tp, dtype=dtype, tokens=0)
    return max(0, int(weight_only // (per_token + HEAD_CHUNK_TENSORS * 4 * vocab / cp)))


def plan_memory(shape: ModelShape, *, device_bytes: int, recompute: str = "auto", max_tokens_per_micro_batch: int,
                min_tokens: int, tp: int = 1, pp: int = 1, dp: int = 1, dtype: torch.dtype = torch.bfloat16,
                sequence_parallel: bool = False, distributed_optimizer: bool = True, impl: str = "local",
                margin: float = 0.1, cp: int = 1, kernels: Kernels = CUDA_KERNELS) -> MemoryPlan:
    """Choose the recompute mode (``auto``: the first of none, selective, full under which one full sample of
    ``min_tokens`` fits) and clamp the token budget to what fits (never below ``min_tokens``; rounded down to a
    multiple of 128). A manual mode that cannot fit ``min_tokens``, or ``auto`` when nothing fits, raises
    MemoryPlanError saying what to change."""
    if min_tokens < 1 or max_tokens_per_micro_batch < min_tokens:
        raise ValueError(f"max_tokens_per_micro_batch ({max_tokens_per_micro_batch}) must be >= min_tokens "
                         f"({min_tokens}), one full sample")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    if recompute != "auto":
        _check_mode(recompute)
    act_kw = dict(tp=tp, pp=pp, sequence_parallel=sequence_parallel, dtype=dtype, impl=impl, cp=cp, kernels=kernels)
    all_kw = dict(act_kw, dp=dp, distributed_optimizer=distributed_optimizer)
    fit = {m: max_tokens_that_fit(shape, device_bytes=device_bytes, margin=margin, recompute=m, **all_kw)
           for m in RECOMPUTE_MODES}
    candidates = RECOMPUTE_MODES if recompute == "auto" else (recompute,)
    mode = next((m for m in candidates if fit[m] >= min_tokens), None)
    if mode is None:
        raise MemoryPlanError(_no_fit_message(shape, recompute, fit, min_tokens, device_bytes, margin, all_kw))
    tokens = max_tokens_per_micro_batch
    notes = []
    if recompute == "auto" and mode != "none":
        notes.append(f"recompute=none would fit only {fit['none']} tokens")
        if mode == "full":
            notes.append("selective saves only the attention logsumexp with the local spec")
    if fit[mode] < tokens:
        tokens = max(min_tokens, fit[mode] // TOKEN_MULTIPLE * TOKEN_MULTIPLE)
        notes.append(f"budget clamped from {max_tokens_per_micro_batch}")
    peak = estimate_peak_bytes(shape, tokens=tokens, recompute=mode, **all_kw)
    return MemoryPlan(recompute=mode, max_tokens_per_micro_batch=tokens,
                      fixed_bytes=fixed_bytes(shape, tp=tp, pp=pp, dp=dp * cp, dtype=dtype,
                                              distributed_optimizer=distributed_optimizer),
                      activation_bytes_per_token=activation_bytes_per_token(shape, recompute=mode, **act_kw),
                      logprob_head_bytes=logprob_head_bytes(shape, tp=tp, dtype=dtype, tokens=-(-tokens // cp)),
                      peak_bytes=peak,
                      device_bytes=int(device_bytes), margin=margin, note="; ".join(notes))


def _no_fit_message(shape, recompute, fit, min_tokens, device_bytes, margin, kw) -> str:
    tp = kw["tp"]
    worst = recompute if recompute != "auto" else "full"
    peak = estimate_peak_bytes(shape, tokens=min_tokens, recompute=worst, **kw)
    fixes = [f"model.recompute={m} (fits {fit[m]} tokens)" for m in RECOMPUTE_MODES
             if m != recompute and fit[m] >= min_tokens]
    for bigger in (2 * tp, 4 * tp):
        if not check_parallel_layout(shape, bigger, kw["pp"], None):  # the layout megatron accepts
            n = max_tokens_that_fit(shape, device_bytes=device_bytes, margin=margin, recompute="full",
                                    **dict(kw, tp=bigger))
            if n >= min_tokens:
                fixes.append(f"parallel.tensor={bigger} (fits {n} tokens with recompute=full)")
                break
    cp = kw.get("cp", 1)
    for bigger in (2 * cp, 4 * cp):  # context parallelism splits every sample's activations
        n = max_tokens_that_fit(shape, device_bytes=device_bytes, margin=margin, recompute="full",
                                **dict(kw, cp=bigger))
        if n >= min_tokens:
            fixes.append(f"parallel.context={bigger} (fits {n} tokens with recompute=full)")
            break
    if max(fit.values()) > 0:
        fixes.append(f"shorter samples (data.max_prompt_length + rollout.max_response_length <= {max(fit.values())})")
    return (f"model.recompute={recompute}: one full sample of {min_tokens} tokens needs about "
            f"{peak / GIB:.1f} GiB per GPU (recompute={worst}) but {device_bytes * (1 - margin) / GIB:.1f} GiB are "
            f"usable ({device_bytes / GIB:.1f} GiB, margin {margin:.0%}); "
            + ("set " + " or ".join(fixes) + ", or use" if fixes else "use") + " GPUs with more memory")


# --- the trainer's entry ----------------------------------------------------------------------------------------------

def memory_plan_for(cfg, shape: ModelShape, world_size: int, *, device_bytes: int | None = None,
                    margin: float = 0.1) -> MemoryPlan | None:
    """The memory plan of a config (reads `cfg`, writes nothing): `world_size` counts the ranks that train (the
    placement's trainer world size). With a device size (``device_bytes``, or the CUDA device's total memory when
    CUDA is there) the plan decides the recompute mode and clamps the token budget; it raises MemoryPlanError when
    the configured mode cannot fit one full sample. Without one (CPU) there is no plan: None."""
    from .. import compat
    from ..dtypes import resolve_dtype
    from .spec import resolve_impl

    configured = cfg.model.recompute
    if configured != "auto":
        _check_mode(configured)
    if device_bytes is None and compat.cuda_available():
        device_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if device_bytes is None:
        return None
    par, ro = cfg.parallel, cfg.rollout
    tp, pp, cp = par.tensor, par.pipeline, par.context
    dtype = torch.bfloat16 if cfg.model.dtype == "auto" else resolve_dtype(cfg.model.dtype)  # auto: bf16 on a GPU
    impl = resolve_impl(cfg.model.transformer_impl) if compat.cuda_available() else (
        "te" if cfg.model.transformer_impl == "te" else "local")
    return plan_memory(shape, device_bytes=device_bytes, recompute=configured,
                       max_tokens_per_micro_batch=cfg.trainer.max_tokens_per_micro_batch,
                       min_tokens=cfg.data.max_prompt_length + ro.max_response_length, tp=tp, pp=pp,
                       dp=max(world_size // (tp * pp * cp), 1), cp=cp, dtype=dtype,
                       sequence_parallel=bool(par.sequence_parallel and tp > 1),
                       distributed_optimizer=par.distributed_optimizer, impl=impl, margin=margin,
                       kernels=gpu_kernels(impl))


def gpu_kernels(impl: str) -> Kernels:
    """The kernels the policy runs on this GPU: CUDA_KERNELS, or the plain SwiGLU when the local spec's fused one
    does not compile here (spec.gpu_fusions decides that for the model too). Without CUDA the plan is for a GPU
    image, which has the fused SwiGLU."""
    from .. import compat

    if impl == "te" or not compat.cuda_available():
        return CUDA_KERNELS
    from .spec import gpu_fusions

    return CUDA_KERNELS if gpu_fusions(impl).get("bias_activation_fusion") else Kernels(swiglu="plain")


def resolve_recompute(cfg, shape: ModelShape, world_size: int, *, device_bytes: int | None = None,
                      margin: float = 0.1) -> MemoryPlan | None:
    """The last step of validating a config (train_entry.check_config), and the only place that writes into it:
    `cfg.model.recompute` becomes concrete and `cfg.trainer.max_tokens_per_micro_batch` is clamped to what fits, as
    `memory_plan_for` decides (returned). On the CPU (no plan) ``auto`` becomes ``none`` and the budget stays."""
    from omegaconf import open_dict

    plan = memory_plan_for(cfg, shape, world_size, device_bytes=device_bytes, margin=margin)
    with open_dict(cfg):
        if plan is None:
            cfg.model.recompute = "none" if cfg.model.recompute == "auto" else cfg.model.recompute
        else:
            cfg.model.recompute = plan.recompute
            cfg.trainer.max_tokens_per_micro_batch = plan.max_tokens_per_micro_batch
    return plan


# --- what a checkpoint save holds -------------------------------------------------------------------------------------

def checkpoint_save_bytes(shape: ModelShape, *, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1,
                          dtype: torch.dtype = torch.bfloat16, distributed_optimizer: bool = True) -> int:
    """Host bytes one rank's checkpoint save holds beside training (checkpoint/save.py), for the heaviest pipeline stage.

    It writes its 1/DP share of the weights and of the optimizer state (replicas over DP are written once, spread over
    the DP ranks; the distributed optimizer's dp_reshardable format writes each rank's own shard: no gather, nothing
    extra on the GPU): Adam's two fp32 moments, and fp32 main weights where they are not the weights themselves
    (half dtypes; the distributed optimizer saves its main-weight shard always). On GPU an async save copies exactly these bytes to
    host memory before the step goes on; on CPU the forked writer shares them copy-on-write, so they are what the
    training can at most duplicate while the write runs. The same count is the rank's share of the checkpoint's size.
    (The former fully_reshardable format also gathered 12 bytes per parameter of the whole model onto DP rank 0.)"""
    params = params_per_gpu(shape, tp=tp, pp=pp)
    master = 4 if distributed_optimizer or dtype in (torch.bfloat16, torch.float16) else 0
    per_param = _bytes(dtype) + 8 + master
    total = params * per_param / dp
    if shape.num_experts:  # MoE layers: a router and this EP rank's experts (expert TP 1) instead of the dense MLP,
        layers = math.ceil(shape.num_layers / pp)  # the experts sharded over the expert-DP ranks (dp / ep)
        dense_mlp = layers * 3 * shape.hidden_size * shape.ffn_hidden_size // tp
        router = layers * shape.hidden_size * shape.num_experts
        experts = layers * (shape.num_experts // ep) * 3 * shape.hidden_size * shape.moe_ffn_hidden_size
        total += (router - dense_mlp) * per_param / dp + experts * per_param / max(1, dp // ep)
    return int(total)
