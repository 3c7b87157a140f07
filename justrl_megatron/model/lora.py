"""LoRA adapters on megatron's tensor-parallel linears: y = W x + scale * B A x, base weights frozen.

Targets (per transformer layer): qkv (self_attention.linear_qkv) and fc1 (mlp.linear_fc1) are ColumnParallelLinear,
proj (self_attention.linear_proj) and fc2 (mlp.linear_fc2) RowParallelLinear. The adapters split like their layer:

  column  W_i [out/tp, in]: A [r, in] replicated, B_i [out/tp, r] sharded. A x is the same on every rank; its
          gradient is a sum over the ranks' output shards, hence copy_to_tensor_model_parallel_region on A x
          (forward identity, backward all-reduce), after which dA and dx are complete on every rank.
  row     W_i [out, in/tp]: A_i [r, in/tp] sharded, B [out, r] replicated. A_i x_i is a partial sum, all-reduced
          (reduce_from_tensor_model_parallel_region) before B, as the base layer all-reduces W_i x_i.

Init as PEFT: A kaiming-uniform (a=sqrt(5)) drawn at full size from a generator seeded by (seed, layer, target) and
then sliced, so every TP layout starts from the same global adapters; B = 0, so the adapted model is the base model
exactly until the first update. scale = alpha / rank.

The adapters live in one module per model chunk (`GPTModel.justrl_lora`), not inside the linears, so the HF <-> Megatron
mapping (convert/mapping.live_parameters) sees only base weights; megatron's DDP and optimizer see every parameter
that requires a gradient, which after `apply_lora` are the adapters alone: no grad buffers, no Adam state for W.
The linear's forward is wrapped per instance. Sequence parallelism and TransformerEngine's fused LayerNorm+Linear
are refused (the adapter would need the gathered / normed input those layers compute inside).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    reduce_from_tensor_model_parallel_region)
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from .build import unwrap

# target -> (submodule of the layer, linear, column parallel?)
TARGETS = {"qkv": ("self_attention", "linear_qkv", True), "proj": ("self_attention", "linear_proj", False),
           "fc1": ("mlp", "linear_fc1", True), "fc2": ("mlp", "linear_fc2", False)}
MODULE = "justrl_lora"  # the GPTModel attribute holding the chunk's adapters
WEIGHT_TAG = "justrl_lora_adapter"  # attribute of an adapted base weight -> its Adapter (for merged export)
# HF module names of each target (PEFT's target_modules), in the order mapping.shards_to_hf returns them
HF_MODULES = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "proj": ("self_attn.o_proj",),
              "fc1": ("mlp.gate_proj", "mlp.up_proj"), "fc2": ("mlp.down_proj",)}


def lora_problems(rank, alpha, dropout, targets, *, sequence_parallel=False, transformer_impl="local",
                  prefix="model.lora.") -> list[str]:
    """What is wrong with these LoRA settings (config validation and `apply_lora` share it)."""
    problems = []
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        problems.append(f"{prefix}rank must be an integer >= 1, got {rank!r}")
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        problems.append(f"{prefix}alpha must be > 0, got {alpha!r}")
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        problems.append(f"{prefix}dropout must be in [0, 1), got {dropout!r}")
    targets = list(targets or [])
    unknown = [t for t in targets if t not in TARGETS]
    if not targets or unknown or len(set(targets)) != len(targets):
        problems.append(f"{prefix}targets must be a non-empty list of distinct names from {', '.join(TARGETS)}; "
                        f"got {targets}")
    if sequence_parallel:
        problems.append("LoRA does not support parallel.sequence_parallel (the column layers gather their input "
                        "inside, the adapter would need that gathered input): set parallel.sequence_parallel=false")
    if transformer_impl == "te":
        problems.append("LoRA needs model.transformer_impl=local (or auto): TransformerEngine fuses the norm into the "
                        "qkv / fc1 linears and the adapter needs the normed input")
    return problems


def problems(cfg, shape=None) -> list[str]:
    """model.lora's settings in the config (`lora_problems`); nothing when LoRA is off."""
    lora = cfg.model.lora
    if not lora.enabled:
        return []
    return lora_problems(lora.rank, lora.alpha, lora.dropout, list(lora.targets),
                         sequence_parallel=cfg.parallel.sequence_parallel, transformer_impl=cfg.model.transformer_impl)


class Adapter(torch.nn.Module):
    """The A, B pair of one TP-parallel linear (this rank's shards)."""

    def __init__(self, linear, column: bool, rank: int, alpha: float, dropout: float, seed: int):
        super().__init__()
        tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        weight = linear.weight
        out_local, in_local = weight.shape
        in_full = in_local if column else in_local * tp
        a = torch.empty(rank, in_full, dtype=torch.float32)
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed))
        if not column:
            a = a[:, tp_rank * in_local:(tp_rank + 1) * in_local]
        b = torch.zeros(out_local, rank)
        kw = dict(dtype=weight.dtype, device=weight.device)
        self.lora_A = torch.nn.Parameter(a.to(**kw).contiguous())
        self.lora_B = torch.nn.Parameter(b.to(**kw))
        # the sharded one of the pair, for megatron's grad norm (replicated params count once) and checkpoints
        set_tensor_model_parallel_attributes(self.lora_B if column else self.lora_A, True, 0 if column else 1, 1)
        self.column, self.scale, self.rank, self.alpha, self.dropout_p = column, alpha / rank, rank, alpha, dropout
        self.dropout = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
        self.tp_group = linear.tp_group if tp > 1 else None
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """scale * B A x; the scale multiplies the rank-wide A x, not the output (3072 wide at fc1)."""
        h = F.linear(self.dropout(x), self.lora_A)
        if self.tp_group is not None:
            h = (copy_to_tensor_model_parallel_region(h, group=self.tp_group) if self.column
                 else reduce_from_tensor_model_parallel_region(h, group=self.tp_group))
        return F.linear(h * self.scale, self.lora_B)

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of W + scale * B A (a new tensor; W is untouched), in W's dtype."""
        delta = (self.lora_B.detach().float() @ self.lora_A.detach().float()) * self.scale
        return (weight.detach().float() + delta).to(weight.dtype)


def _standard_strides(t: torch.Tensor) -> torch.Tensor:
    """`t` with row-major strides: a view when its memory is already in order, else a copy. `.contiguous()` is not
    enough: a [s, 1, h] tensor with an odd stride on the size-1 dim counts as contiguous and comes back unchanged."""
    return t.reshape(-1).view(t.shape)


class _StandardStridesGrad(torch.autograd.Function):
    """Identity whose backward hands on the gradient with row-major strides. The frozen base linear runs megatron's
    LinearWithFrozenWeight, whose backward is grad_output.matmul(W) on the 3-D [s, b, h] gradient; at the row-parallel
    linears (proj, fc2) that gradient arrives as [s, 1, h] with the stride of the batch dim of a transpose, and
    torch.matmul then does not fold it into one GEMM but runs a batched product per token: 3.6x slower on CPU, 2.2 s
    of a 10 s update of SmolLM2-135M (60 calls)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _standard_strides(grad)


def _wrap_forward(linear, adapter: Adapter) -> None:
    base_forward = linear.forward

    def forward(input_, *args, **kwargs):
        input_ = _standard_strides(input_)
        out, bias = base_forward(input_, *args, **kwargs)
        if adapter.enabled:
            out = out + adapter(input_)
        if torch.is_grad_enabled():
            out = _StandardStridesGrad.apply(out)  # the gradient both the frozen GEMM and the adapter see
        return out, bias

    linear.forward = forward


def apply_lora(modules, *, rank: int, alpha: float, dropout: float = 0.0, targets=tuple(TARGETS), seed: int = 1234
               ) -> None:
    """Freeze every parameter of the GPTModel `modules` (one per chunk) and add adapters to `targets` of each layer.
    Call before megatron's DDP and optimizer are built."""
    sp = bool(unwrap(modules[0]).config.sequence_parallel)
    problems = lora_problems(rank, alpha, dropout, targets, sequence_parallel=sp, prefix="lora ")
    if problems:
        raise ValueError("; ".join(problems))
    for module in modules:
        model = unwrap(module)
        if hasattr(model, MODULE):
            raise ValueError("LoRA adapters are already applied to this model")
        for p in model.parameters():
            p.requires_grad_(False)
        adapters = torch.nn.ModuleDict()
        for layer in model.decoder.layers:
            index = layer.layer_number - 1  # global layer index: the same names at every PP / VPP layout
            per_layer = torch.nn.ModuleDict()
            for t, (sub, name, column) in TARGETS.items():
                if t not in targets:
                    continue
                linear = getattr(getattr(layer, sub), name)
                if not hasattr(linear, "tp_group") or type(linear).__name__.startswith("TE"):
                    raise ValueError(f"LoRA needs megatron's local ColumnParallelLinear / RowParallelLinear, got "
                                     f"{type(linear).__name__}: set model.transformer_impl=local")
                adapter = Adapter(linear, column, rank, alpha, dropout,
                                  seed=(seed * 1_000_003 + index * 16 + list(TARGETS).index(t)) % (2 ** 63))
                setattr(linear.weight, WEIGHT_TAG, adapter)
                _wrap_forward(linear, adapter)
                per_layer[t] = adapter
            adapters[str(index)] = per_layer
        setattr(model, MODULE, adapters)


def adapters(chunks) -> dict[tuple[int, str], Adapter]:
    """{(global layer index, target): Adapter} of this rank's chunks (empty without LoRA)."""
    out = {}
    for chunk in chunks:
        for index, per_layer in getattr(unwrap(chunk), MODULE, {}).items():
            for target, adapter in per_layer.items():
                out[(int(index), target)] = adapter
    return out


def has_lora(chunks) -> bool:
    return any(hasattr(unwrap(c), MODULE) for c in chunks)


def settings(chunks) -> dict | None:
    """rank, alpha, dropout, targets of the adapters (None without LoRA); the same on every rank."""
    found = adapters(chunks)
    if not found:
        return None
    first = next(iter(found.values()))
    return {"rank": first.rank, "alpha": first.alpha, "dropout": first.dropout_p,
            "targets": [t for t in TARGETS if any(k[1] == t for k in found)]}


@contextlib.contextmanager
def adapters_disabled(chunks):
    """Within the block the model is its base weights alone (the LoRA reference policy)."""
    found = list(adapters(chunks).values())
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a in found:
            a.enabled = True


def merged_weight(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the weight the engines get: W + scale * B A where `param` is adapted, else W."""
    adapter = getattr(param, WEIGHT_TAG, None)
    if adapter is None or not adapter.enabled:
        return param.detach()
    return adapter.merged(param)


# --- global (TP-gathered) views: tests, checkpoints' shapes and the PEFT export -----------------------------------

def _key(index: int, target: str, which: str) -> str:
    return f"lora.layers.{index}.{target}.{which}"


def _sharded_dim(adapter: Adapter, which: str) -> int | None:
    if which == "lora_B" and adapter.column:
        return 0
    if which == "lora_A" and not adapter.column:
        return 1
    return None


def tp_shards(adapter: Adapter, which: str) -> list[torch.Tensor]:
    """Every TP rank's shard of A or B (one replicated tensor when it is not split); a collective over TP."""
    t = getattr(adapter, which).detach()
    if _sharded_dim(adapter, which) is None or adapter.tp_group is None:
        return [t]
    shards = [torch.empty_like(t) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(shards, t.contiguous(), group=adapter.tp_group)
    return shards


def _is_swiglu(target: str, which: str) -> bool:
    """fc1's B: each TP rank holds [gate slice; up slice], so the full tensor is [gate; up], not the shards' concat."""
    return target == "fc1" and which == "lora_B"


def global_state(chunks) -> dict[str, torch.Tensor]:
    """{lora.layers.<i>.<target>.lora_A / lora_B: the full tensor, as at TP=1} of this rank's layers."""
    out = {}
    for (index, target), adapter in sorted(adapters(chunks).items()):
        for which in ("lora_A", "lora_B"):
            dim = _sharded_dim(adapter, which)
            shards = tp_shards(adapter, which)
            if _is_swiglu(target, which):
                halves = [s.chunk(2, dim=0) for s in shards]
                full = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
            else:
                full = torch.cat(shards, dim=dim) if dim is not None else shards[0]
            out[_key(index, target, which)] = full
    return out


def load_global_state(chunks, state: dict[str, torch.Tensor]) -> None:
    """Set this rank's shards from full tensors (as `global_state` returns them)."""
    tp_rank = ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for (index, target), adapter in adapters(chunks).items():
            for which in ("lora_A", "lora_B"):
                param, full = getattr(adapter, which), state[_key(index, target, which)]
                dim = _sharded_dim(adapter, which)
                if _is_swiglu(target, which):
                    n = param.shape[0] // 2
                    gate, up = full.chunk(2, dim=0)
                    full = torch.cat([gate[tp_rank * n:(tp_rank + 1) * n], up[tp_rank * n:(tp_rank + 1) * n]])
                elif dim is not None:
                    n = param.shape[dim]
                    full = full.narrow(dim, tp_rank * n, n)
                param.copy_(full)


def sharded_state_dict(chunk) -> dict:
    """megatron dist-checkpoint entries of one chunk's adapters (global keys: loads at any TP / PP layout; fc1's B
    through megatron's own SwiGLU factory, as its weight)."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

    out = {}
    for (index, target), adapter in sorted(adapters([chunk]).items()):
        for which in ("lora_A", "lora_B"):
            key, param, dim = _key(index, target, which), getattr(adapter, which), _sharded_dim(adapter, which)
            out[key] = (make_sharded_tensor_for_checkpoint(param, key) if dim is None
                        else make_tp_sharded_tensor_for_checkpoint(param, key, tp_axis=dim))
            if _is_swiglu(target, which):
                out[key] = apply_swiglu_sharded_factory(out[key], ())
    return out


def load_state(chunk, loaded: dict) -> None:
    """Copy a loaded `sharded_state_dict` (plain tensors, this rank's shards) into the chunk's adapters."""
    for (index, target), adapter in adapters([chunk]).items():
        for which in ("lora_A", "lora_B"):
            getattr(adapter, which).data.copy_(loaded[_key(index, target, which)])
