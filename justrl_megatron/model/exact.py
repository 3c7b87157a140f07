"""`rollout.exact`: the trainer's log-prob forward computes what the vLLM engine computes, op for op.

The decomposition (tools/logprob_parity.py, docs/numerics.md) shows where the two part on the CPU in fp32: embedding,
norms, the QKV GEMM with its bias and RoPE are already bitwise equal; the first difference is core attention (vLLM's
CPU kernel against torch SDPA: another blocking of the softmax reduction), and everything after it inherits it. So on
the CPU the exact mode attends with vLLM's own kernel (`torch.ops._C.cpu_attention_with_kv_cache` over a paged K/V
cache built for the packed micro-batch), with the KV split turned off on both sides: split over threads, a decode
step's reduction order depends on the number of running requests; unsplit, a token's attention is the same whether
it is computed in a prefill of the whole sequence (the trainer) or in a decode step (the engine).

`model.engine_numerics` (auto: on for a half-precision policy on the CPU) takes the same pieces into every pass of
the trainer, the update's own forward included: each piece's forward is the engine's kernel and its backward the
gradient of the trainer's own op (attention: torch SDPA in fp32 recomputed; RoPE: the inverse rotation; a linear:
its matmuls; the head: log-softmax's gradient through its matmuls; the residual add and SiLU are differentiable as
they are). In bf16 a single rounding that differs early grows to the whole gap by the last layer (docs/numerics.md),
so the default path is only close where every piece is the engine's; in fp32 the gap is already at rounding level and
the default stays megatron's kernels.

On GPU the engine is put into vLLM's batch-invariant mode (VLLM_BATCH_INVARIANT=1: Triton kernels with a fixed
reduction order) and megatron into its deterministic settings (`engine_env`, `exact_config`); that pairing is wired
but not verified here (no vLLM on the lent GPU). rollout.exact's paged-cache attention has no backward, which is why
that mode covers the log-prob passes (old log-probs, the rollout check), not the update's own forward.
"""

from __future__ import annotations

import os

import torch

from .logprobs import _LogprobsFromHidden, chunk_rows

# The pieces of the exact mode; JUSTRL_EXACT_OFF=attention,rope,... leaves those to the trainer's own kernels, which
# is how tools/logprob_parity.py measures what each one contributes (docs/numerics.md).
PIECES = ("attention", "linear", "rope", "residual", "silu", "head")
OFF_ENV = "JUSTRL_EXACT_OFF"


def _off() -> set[str]:
    return {n.strip() for n in os.environ.get(OFF_ENV, "").split(",") if n.strip()}


def piece_on(name: str) -> bool:
    return name not in _off()


# K/V cache block size of the engine in exact mode (vllm_engine passes it; the kernel's tiling follows it)
BLOCK_SIZE = 128

ENGINE_NUMERICS = ("auto", "on", "off")  # model.engine_numerics


def _layout_refusals(cfg, shape=None) -> list[str]:
    """What the engine's pieces cannot mirror: they run on one rank's whole layers of a dense local-spec model."""
    return [name for name, on in (
        ("parallel.tensor > 1", cfg.parallel.tensor > 1), ("parallel.pipeline > 1", cfg.parallel.pipeline > 1),
        ("parallel.context > 1", cfg.parallel.context > 1), ("parallel.expert > 1", cfg.parallel.expert > 1),
        ("rollout.tensor_parallel > 1", cfg.rollout.tensor_parallel > 1),
        ("model.lora", cfg.model.lora.enabled), ("model.fp8", cfg.model.fp8),
        ("model.transformer_impl=te", cfg.model.transformer_impl == "te"),
        ("an MoE model", bool(shape is not None and shape.num_experts))) if on]


def resolve_engine_numerics(cfg, shape=None) -> bool:
    """`model.engine_numerics`: on | off | auto (on where the trainer runs on the CPU in half precision, the layout
    is one the pieces cover and vLLM's CPU ops are installed; fp32's default gap is at rounding level already).
    Never on a GPU: the pieces are vLLM's CPU kernels."""
    from .. import compat
    from ..dtypes import resolve_dtype

    choice = cfg.model.engine_numerics
    if choice == "off" or compat.cuda_available():
        return False
    if choice == "on":
        return True
    import importlib.util

    return (resolve_dtype(cfg.model.dtype) != torch.float32 and not _layout_refusals(cfg, shape)
            and importlib.util.find_spec("vllm") is not None)


def problems(cfg, shape=None) -> list[str]:
    """rollout.exact's refusals, one line, before any model is built: what it does not mirror op for op; a name in
    JUSTRL_EXACT_OFF that is no piece (a typo would measure nothing and say nothing)."""
    unknown = sorted(_off() - set(PIECES))
    if unknown:
        return [f"{OFF_ENV}={os.environ[OFF_ENV]!r}: unknown piece(s) {unknown}; known: {', '.join(PIECES)}"]
    choice = cfg.model.engine_numerics
    if choice not in ENGINE_NUMERICS:
        return [f"model.engine_numerics must be one of {', '.join(ENGINE_NUMERICS)}, got {choice!r}"]
    problems, layout = [], _layout_refusals(cfg, shape)
    if choice == "on" and layout:
        problems.append(f"model.engine_numerics=on runs the engine's kernels on one rank with a dense local-spec "
                        f"model only; not with {', '.join(layout)} (set auto or off)")
    if not cfg.rollout.exact:
        return problems
    refused = layout + [name for name, on in (
        ("rollout.placement=split", cfg.rollout.placement == "split"), ("rollout.streaming", cfg.rollout.streaming),
        ("trainer.shared_prompt=on", cfg.trainer.shared_prompt == "on"),
        # one optimizer step per batch takes the old log-probs from the update's own forward (megatron's kernels)
        ("trainer.old_logprobs=auto on the one-step path (set recompute)",
         cfg.trainer.old_logprobs == "auto" and cfg.trainer.mini_batch_size >= cfg.trainer.prompts_per_step)) if on]
    if refused:
        return problems + [f"rollout.exact=true mirrors the engine on one rank with a dense local-spec model only; "
                           f"not with {', '.join(refused)}"]
    return problems


def engine_env(on_gpu: bool) -> dict[str, str]:
    """Environment the engine needs before it is built, in exact mode."""
    if on_gpu:
        return {"VLLM_BATCH_INVARIANT": "1"}
    return {"VLLM_CPU_ATTN_SPLIT_KV": "0"}


def exact_config(config) -> None:
    """megatron's deterministic settings (GPU): fixed-order reductions where megatron offers them."""
    for name in ("deterministic_mode",):
        if hasattr(config, name):
            setattr(config, name, True)


_VLLM: dict[tuple[str, str], object] = {}


def _vllm(module: str, name: str):
    """`from module import name` of vLLM, imported once and on a thread of its own: vLLM's import keeps an exception
    whose traceback holds every frame below the import alive for good. Imported from a caller's stack, that kept the
    caller's tensors, and the first stand-in linear's oneDNN handle, until the interpreter's exit, whose collection
    then runs the handle's destructor without imports (a traceback printed at every exit)."""
    if (module, name) not in _VLLM:
        import importlib
        import threading

        def load():
            parent = importlib.import_module(module)
            found = getattr(parent, name, None)  # a submodule (vllm._custom_ops) is no attribute until imported
            _VLLM[(module, name)] = importlib.import_module(f"{module}.{name}") if found is None else found

        thread = threading.Thread(target=load, name="justrl-import-vllm")
        thread.start()
        thread.join()
        if (module, name) not in _VLLM:
            raise ImportError(f"could not import {name} from {module}: model.engine_numerics and rollout.exact run "
                              f"vLLM's CPU ops (is vllm installed?)")
    return _VLLM[(module, name)]


def _isa(dtype: torch.dtype, head_dim: int) -> str:
    return _vllm("vllm.v1.attention.backends.cpu_attn", "_get_attn_isa")(dtype, BLOCK_SIZE, head_dim)


def engine_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Causal attention of packed sequences with vLLM's CPU kernel: q [t, hq, d], k/v [t, hkv, d] -> [t, hq, d].

    Each sequence gets its own blocks of a private paged cache, written by the engine's own reshape_and_cache."""
    ops = _vllm("vllm", "_custom_ops")

    t, hq, d = q.shape
    hkv = k.size(1)
    cu = cu_seqlens.to(torch.int64).cpu()
    lengths = (cu[1:] - cu[:-1])
    n = lengths.numel()
    blocks = (lengths + BLOCK_SIZE - 1) // BLOCK_SIZE
    first = torch.zeros(n, dtype=torch.int64)
    first[1:] = torch.cumsum(blocks, 0)[:-1]
    width = int(blocks.max().item()) if n else 1
    block_table = (first.unsqueeze(1) + torch.arange(width).unsqueeze(0)).to(torch.int32)
    seq_of = torch.repeat_interleave(torch.arange(n), lengths)
    pos = torch.arange(t) - cu[:-1][seq_of]
    slots = (first[seq_of] + pos // BLOCK_SIZE) * BLOCK_SIZE + pos % BLOCK_SIZE
    total = int(blocks.sum().item())
    cache = torch.zeros(total, hkv, BLOCK_SIZE * 2, d, dtype=q.dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    isa = _isa(q.dtype, d)
    k, v, q = k.contiguous(), v.contiguous(), q.contiguous()
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
    query_start = cu.to(torch.int32)
    seq_lens = lengths.to(torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=n, num_heads=hq, num_kv_heads=hkv, head_dim=d, seq_lens=seq_lens, dtype=q.dtype,
        query_start_loc=query_start, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)
    out = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=query_start,
        seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=block_table, softcap=0.0, scheduler_metadata=meta, s_aux=None)
    return out


def engine_pass(config, x: torch.Tensor, autograd: bool | None = None) -> bool:
    """Whether this pass over `x` computes with the engine's pieces: every pass under model.engine_numerics, the
    log-prob passes (no autograd: `autograd`, else the grad mode) under rollout.exact; on the CPU only."""
    if x.is_cuda:
        return False
    autograd = torch.is_grad_enabled() if autograd is None else autograd
    return bool(getattr(config, "justrl_engine_numerics", False)) or (
        bool(getattr(config, "justrl_exact", False)) and not autograd)


class _EngineLinear(torch.autograd.Function):
    """`engine_linear` forward; the backward of x @ w^T + b (the matmuls any linear's backward computes)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return engine_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.size(-1))
        grad_x = (rows @ weight).reshape(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = rows.t() @ x.reshape(-1, x.size(-1)) if ctx.needs_input_grad[1] else None
        grad_b = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def engine_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T (+ bias) as vLLM's CPU linear computes it: vLLM's own dispatch (`dispatch_cpu_unquantized_gemm`:
    oneDNN's matmul with the bias fused where this CPU has it for the dtype, SGL's AMX kernel, zentorch, else
    F.linear) run on a stand-in layer. Made per call: the optimizer changes the weight in place between passes."""
    return _engine_layer(weight, bias)(x)


def _engine_layer(weight: torch.Tensor, bias: torch.Tensor | None):
    """vLLM's CPU linear for `weight` (and `bias`) as a function of x [..., in] (one stand-in layer: its GEMM handle
    serves every call, e.g. every row chunk of the head)."""
    dispatch = _vllm("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm")
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
    layer.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
    dispatch(layer, remove_weight=False)

    def linear(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.size(-1)).contiguous()
        return layer.cpu_linear(rows, layer.weight, layer.bias).reshape(*x.shape[:-1], weight.size(0))

    return linear


def _exact_forward(layer, original):
    """A megatron Column/RowParallelLinear's forward that computes with `engine_linear` in log-prob passes (TP1: the
    exact mode refuses TP > 1, so there is nothing to gather or reduce)."""

    def forward(input_, *args, **kwargs):
        if not engine_pass(layer.config, input_) or args or kwargs.get("weight") is not None \
                or not piece_on("linear"):
            return original(input_, *args, **kwargs)
        bias = getattr(layer, "bias", None)
        fused = None if layer.skip_bias_add else bias
        if torch.is_grad_enabled():
            out = _EngineLinear.apply(input_, layer.weight, fused)
        else:
            out = engine_linear(input_, layer.weight, fused)
        return out, (bias if layer.skip_bias_add else None)

    return forward


# torch splits an elementwise op over threads once it has more elements than this (at::internal::GRAIN_SIZE); the
# split lands mid-row, where a vectorised run restarts and transcendental functions (exp in SiLU) take the scalar
# path for a few elements, so a token's SiLU depends on how many rows share the call. The engine's decode steps
# stay below it; the trainer's packed micro-batches do not.
GRAIN = 32768


def row_invariant_silu(config):
    """F.silu, row-invariant in the engine's passes (`engine_pass`): rows in calls of at most GRAIN elements (one
    thread each). Its input is the gate half of the fc1 output (a strided view: torch runs each row as its own
    vector loop, as for the engine's `x[..., :d]`). Differentiable as it is."""
    import torch.nn.functional as F

    def silu(x: torch.Tensor) -> torch.Tensor:
        if not engine_pass(config, x) or x.numel() <= GRAIN or not piece_on("silu"):
            return F.silu(x)
        rows = x.reshape(-1, x.size(-1))
        step = max(1, GRAIN // x.size(-1))
        return torch.cat([F.silu(rows[i:i + step]) for i in range(0, rows.size(0), step)]).reshape(x.shape)

    return silu


def rope_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """vLLM's cos/sin cache ([positions, rotary_dim], cos | sin, fp32; the kernel takes it in the activations'
    dtype), from the trainer's inverse frequencies (model/rope.py computes them as transformers and vLLM do)."""
    t = torch.arange(max_positions, dtype=torch.float)
    freqs = torch.einsum("i,j -> ij", t, inv_freq.float().cpu())
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def packed_positions(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """Each of n packed tokens' position within its cu_seqlens segment."""
    cu = cu_seqlens.to(torch.int64).cpu()
    seq_of = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1])
    return torch.arange(n) - cu[:-1][seq_of]


def engine_rope(t: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """RoPE of packed rows t [T, heads, d] at `positions` with vLLM's CPU kernel (NeoX style, in place on a copy): in
    bf16 it rotates in fp32 and rounds once, where megatron's `t * cos + rotate(t) * sin` rounds each product.
    Differentiable: the gradient of a rotation is the rotation back (the same kernel, sin negated)."""
    if torch.is_grad_enabled() and t.requires_grad:
        return _EngineRope.apply(t, positions, cache)
    return _rotate(t, positions, cache)


def _rotate(t: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    ops = _vllm("vllm", "_custom_ops")

    n, heads, d = t.shape
    rows = t.detach().reshape(n, heads * d).clone()
    ops.rotary_embedding(positions.to(torch.int64).cpu(), rows, None, d, cache.to(t.dtype), True)
    return rows.view(n, heads, d)


class _EngineRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, positions, cache):
        ctx.save_for_backward(positions, cache)
        return _rotate(t, positions, cache)

    @staticmethod
    def backward(ctx, grad):
        positions, cache = ctx.saved_tensors
        half = cache.size(-1) // 2
        back = torch.cat((cache[:, :half], -cache[:, half:]), dim=-1)  # cos | -sin: the rotation by -angle
        return _rotate(grad.contiguous(), positions, back), None, None


FP32_SUM = "_justrl_fp32_sum"  # on a residual-stream tensor made by `_exact_bda`: the sum before it was rounded


def _exact_bda(make, config):
    """A TransformerLayer's bias-dropout-add as vLLM's fused add + RMSNorm does it in the engine's passes: the sum in
    fp32, rounded once for the residual stream, and the fp32 sum kept on the result for the next norm (vLLM
    normalises the unrounded sum; megatron's norm would see the rounded one, which differs in bf16)."""

    def builder(training, fused):
        add = make(training, fused)

        def bda(x_with_bias, residual, prob):
            out, bias = x_with_bias
            # megatron runs the add under enable_grad(): rollout.exact's log-prob pass shows as activations without
            # autograd; under model.engine_numerics every pass takes it (the fp32 sum is differentiable)
            autograd = residual.requires_grad or out.requires_grad
            if not engine_pass(config, residual, autograd) or bias is not None or (training and prob) \
                    or not piece_on("residual"):
                return add(x_with_bias, residual, prob)
            total = out.float() + residual.float()
            result = total.to(residual.dtype)
            if result is total:
                result = total.clone()
            setattr(result, FP32_SUM, total)
            return result

        return bda

    return builder


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's native RMSNorm (`vllm.ir.ops.rms_norm` / `fused_add_rms_norm`, the CPU's implementation) of x, or of
    the fp32 sum `_exact_bda` kept on it. A sum made without autograd on a tensor that has it (the output of a
    recomputed block: its forward ran without) is not used: the gradient would not reach the block."""
    x32 = getattr(x, FP32_SUM, None)
    x32 = x.float() if x32 is None or (x.requires_grad and not x32.requires_grad) else x32
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x32.to(weight.dtype) * weight).to(x.dtype)


def install(modules) -> None:
    """Route the decoder's linears through `engine_linear` in the engine's passes (`engine_pass`; the output layer
    is the log-prob head's: `engine_logprobs`), its gated MLPs' SiLU through `row_invariant_silu`, its residual
    adds through `_exact_bda`."""
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for model in modules:
        rotary = getattr(model, "rotary_pos_emb", None)
        if rotary is not None:  # read by model/rope.py's packed RoPE in log-prob passes
            model.config.justrl_rope_cache = rope_cache(rotary.inv_freq, model.max_position_embeddings)
        for name, m in model.named_modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and not name.endswith("output_layer"):
                m.forward = _exact_forward(m, m.forward)
            if isinstance(m, TransformerLayer):
                m.self_attn_bda = _exact_bda(m.self_attn_bda, m.config)
                m.mlp_bda = _exact_bda(m.mlp_bda, m.config)
            if isinstance(m, MLP) and m.config.activation_func is F.silu:
                # the glu reads it per call (megatron 0.16 / 0.19, unfused path)
                m.config.activation_func = row_invariant_silu(m.config)


def engine_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                    with_entropy: bool, chunk_size: int | None = None):
    """Target log-probs (and entropy) as the engine's sampler gets them: logits by the engine's linear in the model's
    dtype, the padded vocabulary cut off, then `log_softmax(dtype=float32)` (not the chunked max + log-sum-exp of
    model/logprobs.py, which sums the vocabulary in another order). Row chunks bound the fp32 logits alive (a row's
    values do not depend on its chunk); differentiable (`_EngineHead`), so the update's forward takes it too."""
    rows = chunk_rows(vocab_size, chunk_size)
    logp, ent = _EngineHead.apply(hidden, weight, targets, None, vocab_size, rows, with_entropy, False)
    return logp, (ent if with_entropy else None)


class _EngineHead(_LogprobsFromHidden):
    """model/logprobs.py's fused head with the engine's forward. Its backward is the fused head's: the gradient of the
    target's log-prob and the entropy from each chunk's logits recomputed by a plain matmul (a gradient need not be
    the engine's bits), through the head's matmuls."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, group, vocab_size, rows, with_entropy, compiled):
        linear = _engine_layer(weight, None)
        n = hidden.size(0)
        logp, lse = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)
        ent = torch.empty(n if with_entropy else 0, dtype=torch.float32)
        for a in range(0, n, rows):
            logits = linear(hidden[a:a + rows])[:, :vocab_size]
            logp_all = logits.log_softmax(dim=-1, dtype=torch.float32)
            target = targets[a:a + rows].long().unsqueeze(-1)
            logp[a:a + rows] = logp_all.gather(-1, target).squeeze(-1)
            lse[a:a + rows] = logits.gather(-1, target).squeeze(-1).float() - logp[a:a + rows]
            if with_entropy:
                ent[a:a + rows] = -(logp_all.exp() * logp_all).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.meta = (None, 0, vocab_size, rows, with_entropy, False)  # one rank: the whole vocabulary, eager kernels
        ctx.set_materialize_grads(False)
        return logp, ent
