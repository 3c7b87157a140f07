"""Log-probabilities and entropy of target tokens from vocab-parallel logits, in chunks of tokens.

Each tensor-parallel rank holds a contiguous slice of the (padded) vocabulary. Per chunk of tokens:
  z = logits of the chunk in fp32 (columns past the real vocabulary set to -1e30: padding is not a token)
  m = max_v z (all-reduce MAX);  s = sum_v exp(z - m);  z_t = logit of the target;  e = sum_v exp(z - m) z
  (one all-reduce SUM of the stacked [s, z_t, e])
  logp = z_t - (m + log s);   entropy = lse - e / s
The backward pass recomputes the chunk's logits instead of saving fp32 softmax for the whole sequence: with 16K
tokens and a 152K vocabulary the full fp32 logits alone are ~10 GB; here at most one chunk (~512 MB) is alive.

Two entry points share that math:
  * `logprobs_from_logits(logits, ...)`: logits already computed (e.g. megatron's vocab-parallel output);
  * `logprobs_from_hidden(hidden, weight, ...)`: the output projection is fused in, so the logits never exist at all
    (the policy's training path: saves the bf16 logits and their gradient, ~10 GB more at 16K x 152K on one GPU).
Gradients: d logp / dz = onehot(t) - p;  d entropy / dz = -p (log p + entropy). The gradient w.r.t. the hidden states is
partial per TP rank (its vocab slice); the caller's `copy_to_tensor_model_parallel_region` (or the sequence-parallel
gather) all-reduces it in backward, as megatron's output layer does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MASKED_LOGIT = -1e30  # finite: exp() underflows to exactly 0 and 0 * MASKED_LOGIT stays 0 (no NaN in backward)
CHUNK_ELEMENTS = 1 << 27  # fp32 elements per chunk of logits (512 MB)


def chunk_rows(vocab_local: int, chunk_size: int | None = None) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return chunk_size
    return max(1, CHUNK_ELEMENTS // max(vocab_local, 1))


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _vocab_slice(vocab_local: int, group, vocab_size: int | None) -> tuple[int, int]:
    """(first vocab id of this rank's slice, number of its columns that are real tokens)."""
    rank = 0 if group is None else dist.get_rank(group)
    start = rank * vocab_local
    real = vocab_local if vocab_size is None else min(max(vocab_size - start, 0), vocab_local)
    return start, real


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if _group_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # bf16/fp16 -> fp32; fp64 stays (tests)


def _prepare(chunk: torch.Tensor, real_cols: int) -> torch.Tensor:
    """The chunk in fp32 with padded-vocab columns masked (never writes into the caller's tensor)."""
    z = chunk.to(_acc_dtype(chunk.dtype))
    if real_cols < z.size(-1):
        if z is chunk:
            z = z.clone()
        z[:, real_cols:] = MASKED_LOGIT
    return z


def _chunk_forward(z, targets, start, group, with_entropy):
    """z: fp32 [n, V_local] (padding masked). Returns logp [n], entropy [n] | None, lse [n]."""
    local = targets - start
    in_slice = (local >= 0) & (local < z.size(-1))
    m = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
    e = torch.exp(z - m.unsqueeze(-1))
    z_t = z.gather(-1, local.clamp(0, z.size(-1) - 1).unsqueeze(-1)).squeeze(-1) * in_slice
    parts = [e.sum(-1), z_t]
    if with_entropy:
        parts.append((e * z).sum(-1))
    stacked = _all_reduce(torch.stack(parts), dist.ReduceOp.SUM, group)
    lse = m + torch.log(stacked[0])
    logp = stacked[1] - lse
    entropy = lse - stacked[2] / stacked[0] if with_entropy else None
    return logp, entropy, lse


def _chunk_grad_logits(z, targets, start, lse, entropy, g_logp, g_ent):
    """d(sum g_logp * logp + g_ent * entropy) / dz for one chunk, fp32 [n, V_local]."""
    p = torch.exp(z - lse.unsqueeze(-1))
    coeff = g_logp.unsqueeze(-1) if g_logp is not None else torch.zeros_like(lse).unsqueeze(-1)
    if g_ent is not None:
        # -p (log p + H) with log p = z - lse
        coeff = coeff + g_ent.unsqueeze(-1) * (z - lse.unsqueeze(-1) + entropy.unsqueeze(-1))
    grad = -p * coeff
    if g_logp is not None:  # + g_logp at the target column, on the rank whose slice holds it (no host sync)
        local = targets - start
        in_slice = (local >= 0) & (local < z.size(-1))
        grad.scatter_add_(-1, local.clamp(0, z.size(-1) - 1).unsqueeze(-1),
                          (g_logp * in_slice).to(grad.dtype).unsqueeze(-1))
    return grad


# --- the same chunk math as single kernels (fast path `compiled_head`, CUDA) -------------------------------------------
# The eager path above makes an fp32 copy of each bf16 chunk of logits and then a dozen elementwise passes over it
# (mask, max, exp, gather, sums; in backward exp, products, scatter, cast): at 16K x 152K that is ~7% of an update
# in small memory-bound kernels. Written without in-place writes or gathers, each function below compiles to one or
# two kernels that read the raw chunk once; the target's logit is picked with a comparison against its column
# (exact: every other term is 0). The all-reduces over the TP group stay between the kernels.

def _masked(raw, real):
    z = raw.to(_acc_dtype(raw.dtype))
    col = torch.arange(z.size(-1), device=z.device)
    return torch.where(col < real, z, MASKED_LOGIT), col


def _fused_max(raw, real):
    return _masked(raw, real)[0].max(dim=-1).values


def _fused_sums(raw, real, local, m, with_entropy: bool):
    z, col = _masked(raw, real)
    e = torch.exp(z - m.unsqueeze(-1))
    parts = [e.sum(-1), torch.where(col == local.unsqueeze(-1), z, 0.0).sum(-1)]
    if with_entropy:
        parts.append((e * z).sum(-1))
    return torch.stack(parts)


def _fused_grad(raw, real, local, lse, entropy, g_logp, g_ent, out_dtype):
    z, col = _masked(raw, real)
    p = torch.exp(z - lse.unsqueeze(-1))
    coeff = g_logp.unsqueeze(-1) if g_logp is not None else torch.zeros_like(lse).unsqueeze(-1)
    if g_ent is not None:
        coeff = coeff + g_ent.unsqueeze(-1) * (z - lse.unsqueeze(-1) + entropy.unsqueeze(-1))
    grad = -p * coeff
    if g_logp is not None:
        grad = grad + torch.where(col == local.unsqueeze(-1), g_logp.unsqueeze(-1), 0.0)
    return grad.to(out_dtype)


_COMPILED: dict = {}


def _fused_kernels_eager():
    """The fused forms uncompiled (tests compare them with the eager chunk functions on the CPU)."""
    return _fused_max, _fused_sums, _fused_grad


def _kernels(device, compiled: bool = False):
    """(max, sums, grad) as compiled kernels with `compiled` (the fast path `compiled_head`, which the step passes
    on CUDA); None: the eager chunk functions above."""
    if not compiled:
        return None
    if not _COMPILED:
        # dynamic: the row count changes with every chunk and micro-batch; the vocabulary width does not
        _COMPILED.update(max=torch.compile(_fused_max, dynamic=True), sums=torch.compile(_fused_sums, dynamic=True),
                         grad=torch.compile(_fused_grad, dynamic=True))
    return _COMPILED["max"], _COMPILED["sums"], _COMPILED["grad"]


def _forward_stats(raw, targets, start, real, group, with_entropy, kernels):
    """logp, entropy | None, lse of one raw chunk of logits [n, V_local] (either path)."""
    if kernels is None:
        return _chunk_forward(_prepare(raw, real), targets, start, group, with_entropy)
    fmax, fsums, _ = kernels
    m = _all_reduce(fmax(raw, real), dist.ReduceOp.MAX, group)
    stacked = _all_reduce(fsums(raw, real, targets - start, m, with_entropy), dist.ReduceOp.SUM, group)
    lse = m + torch.log(stacked[0])
    return stacked[1] - lse, (lse - stacked[2] / stacked[0] if with_entropy else None), lse


def _grad_of_chunk(raw, targets, start, real, lse, ent, g_logp, g_ent, out_dtype, kernels):
    if kernels is None:
        return _chunk_grad_logits(_prepare(raw, real), targets, start, lse, ent, g_logp, g_ent).to(out_dtype)
    return kernels[2](raw, real, targets - start, lse, ent, g_logp, g_ent, out_dtype)


class _LogprobsFromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_size, rows, with_entropy, compiled):
        start, real = _vocab_slice(logits.size(-1), group, vocab_size)
        n, acc = logits.size(0), _acc_dtype(logits.dtype)
        logp = torch.empty(n, dtype=acc, device=logits.device)
        ent = torch.empty(n if with_entropy else 0, dtype=acc, device=logits.device)
        lse = torch.empty(n, dtype=acc, device=logits.device)
        kernels = _kernels(logits.device, compiled)
        for a in range(0, n, rows):
            b = min(a + rows, n)
            lp, en, ls = _forward_stats(logits[a:b], targets[a:b], start, real, group, with_entropy, kernels)
            logp[a:b], lse[a:b] = lp, ls
            if with_entropy:
                ent[a:b] = en
        ctx.save_for_backward(logits, targets, lse, ent)
        ctx.meta = (group, start, real, rows, with_entropy, compiled)
        ctx.set_materialize_grads(False)  # an unused output (e.g. entropy without a bonus) costs nothing in backward
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, targets, lse, ent = ctx.saved_tensors
        group, start, real, rows, with_entropy, compiled = ctx.meta
        g_ent = g_ent if with_entropy else None
        if g_logp is None and g_ent is None:
            return None, None, None, None, None, None, None
        grad = torch.empty_like(logits)
        kernels = _kernels(logits.device, compiled)
        for a in range(0, logits.size(0), rows):
            b = min(a + rows, logits.size(0))
            grad[a:b] = _grad_of_chunk(
                logits[a:b], targets[a:b], start, real, lse[a:b], ent[a:b] if g_ent is not None else None,
                None if g_logp is None else g_logp[a:b], None if g_ent is None else g_ent[a:b], grad.dtype, kernels)
        return grad, None, None, None, None, None, None


class _LogprobsFromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, group, vocab_size, rows, with_entropy, compiled):
        start, real = _vocab_slice(weight.size(0), group, vocab_size)
        n, acc = hidden.size(0), _acc_dtype(hidden.dtype)
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        ent = torch.empty(n if with_entropy else 0, dtype=acc, device=hidden.device)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        kernels = _kernels(hidden.device, compiled)
        for a in range(0, n, rows):
            b = min(a + rows, n)
            lp, en, ls = _forward_stats(hidden[a:b] @ weight.t(), targets[a:b], start, real, group, with_entropy,
                                        kernels)
            logp[a:b], lse[a:b] = lp, ls
            if with_entropy:
                ent[a:b] = en
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.meta = (group, start, real, rows, with_entropy, compiled)
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        group, start, real, rows, with_entropy, compiled = ctx.meta
        g_ent = g_ent if with_entropy else None
        if g_logp is None and g_ent is None:
            return None, None, None, None, None, None, None, None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=_acc_dtype(weight.dtype), device=weight.device) if need_w else None
        kernels = _kernels(hidden.device, compiled)
        for a in range(0, hidden.size(0), rows):
            b = min(a + rows, hidden.size(0))
            h = hidden[a:b]
            gz = _grad_of_chunk(
                h @ weight.t(), targets[a:b], start, real, lse[a:b], ent[a:b] if g_ent is not None else None,
                None if g_logp is None else g_logp[a:b], None if g_ent is None else g_ent[a:b], weight.dtype, kernels)
            if need_h:
                grad_h[a:b] = gz @ weight
            if need_w:
                grad_w += (gz.t() @ h).to(grad_w.dtype)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None, None


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int | None = None,
                         with_entropy: bool = False, chunk_size: int | None = None, group=None, compiled: bool = False):
    """Log-probabilities (and entropy) of ``targets`` [N] under vocab-parallel ``logits`` [N, V_local].

    ``group``: the tensor-parallel group whose ranks hold consecutive vocab slices (None: the whole vocabulary is
    here). ``vocab_size``: the real vocabulary (ids at or past it are padding and excluded from the softmax).
    Returns ``(logp [N], entropy [N] | None)`` in fp32 (fp64 for fp64 input), differentiable w.r.t. ``logits``.
    ``compiled``: the per-chunk math as compiled kernels (fast path `compiled_head`).
    """
    _check(logits.size(0), targets)
    rows = chunk_rows(logits.size(-1), chunk_size)
    logp, ent = _LogprobsFromLogits.apply(logits, targets, group, vocab_size, rows, with_entropy, compiled)
    return logp, (ent if with_entropy else None)


def logprobs_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         vocab_size: int | None = None, with_entropy: bool = False, chunk_size: int | None = None,
                         group=None, compiled: bool = False):
    """As `logprobs_from_logits` for logits = hidden [N, H] @ weight[V_local, H]^T, never materialising them.

    ``hidden`` must be the full sequence on every TP rank (after megatron's copy-to-TP / sequence-parallel gather,
    whose backward sums the partial gradients this returns).
    """
    _check(hidden.size(0), targets)
    if hidden.size(-1) != weight.size(-1):
        raise ValueError(f"hidden size {hidden.size(-1)} does not match the output weight {tuple(weight.shape)}")
    rows = chunk_rows(weight.size(0), chunk_size)
    logp, ent = _LogprobsFromHidden.apply(hidden, weight, targets, group, vocab_size, rows, with_entropy, compiled)
    return logp, (ent if with_entropy else None)


def _check(n: int, targets: torch.Tensor) -> None:
    if targets.dim() != 1 or targets.numel() != n:
        raise ValueError(f"targets must be flat with one id per row ({n}), got shape {tuple(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
