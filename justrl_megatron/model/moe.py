"""MoE training glue: the weight of megatron's load-balancing (aux) loss in a GRPO update, and its logged value.

megatron's router adds the aux loss's gradient in backward (`MoEAuxLossAutoScaler`), per micro-batch. With
`calculate_per_token_loss` (policy.py) it multiplies that loss by the micro-batch's token count, expecting
finalize_model_grads to divide every gradient by the global token count; here the GRPO loss is normalised before
(finalize does not rescale), so that count would reach the gradient as is (x thousands). Instead the routers are
told their loss is not per-token (`prepare_routers`) and, for each mini-batch, the coefficient is divided by the
number of micro-batches over all DP ranks (`aux_loss_scale`): the update then adds
`model.moe_aux_loss_coef x mean over micro-batches of megatron's switch loss`, summed over layers as megatron does.
(megatron's switch loss is per layer and equals transformers' Mixtral/Qwen3-MoE `load_balancing_loss_func` / top-k;
transformers pools all layers' tokens into one loss. Same coefficient, megatron's definition.)
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .. import compat
from .build import unwrap

TRACKED = "load_balancing_loss"  # megatron's tracker name (router.py), the loss divided by its coefficient


def prepare_routers(chunks) -> None:
    """The routers' aux loss is not per-token here (see the module doc)."""
    for chunk in chunks:
        for module in chunk.modules():
            if hasattr(module, "calculate_per_token_loss") and hasattr(module, "get_aux_loss_coeff"):
                module.calculate_per_token_loss = False


@contextlib.contextmanager
def aux_loss_scale(config, micro_batches_all_ranks: int):
    """Within: the routers' coefficient is the model's / micro-batches of the mini-batch over all DP ranks."""
    coef = getattr(config, "moe_aux_loss_coeff", 0.0) if getattr(config, "num_moe_experts", None) else 0.0
    if not coef:
        yield
        return
    _clear_tracker()
    config.moe_aux_loss_coeff = coef / micro_batches_all_ranks
    try:
        yield
    finally:
        config.moe_aux_loss_coeff = coef


def tracked_aux_loss(config, micro_batches_per_rank: int) -> float | None:
    """The mean, over layers and micro-batches, of the switch loss (without its coefficient) since `aux_loss_scale`
    began; the same on every rank (None without an aux loss). Collective over all training ranks."""
    if not getattr(config, "num_moe_experts", None) or not getattr(config, "moe_aux_loss_coeff", 0.0):
        return None
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get(TRACKED)
    values = (torch.zeros(config.num_layers, device=compat.default_device()) if entry is None
              else entry["values"].detach().float().clone())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values)  # each layer lives on one stage, on world / PP replicas
    replicas = (dist.get_world_size() if dist.is_initialized() else 1) // ps.get_pipeline_model_parallel_world_size()
    _clear_tracker()
    return float(values.sum()) / (replicas * max(micro_batches_per_rank, 1) * config.num_layers)


def _clear_tracker() -> None:
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


# --- routing replay (algo.routing_replay=old) --------------------------------------------------------------------------

ROUTING_REPLAY = ("off", "old")  # "rollout" (vLLM's routed experts) is a GPU path not written yet


class RoutingReplay:
    """Record each token's experts in the old-logprob pass and replay them in the update, per sample, through
    megatron's own `RouterReplay` (`moe_enable_routing_replay`: the router takes the given top-k indices and gathers
    its scores there, so the gradient still flows through the router's probabilities).

    Routes are kept per sample (`key`: any hashable the caller gives each sample) and per global layer, so the
    update may pack the samples into other micro-batches than the old-logprob pass did. A micro-batch is described
    by its samples' keys, their starts in the packed row and their lengths; its padding tokens take experts 0..k-1
    (they are a segment of their own: nothing real attends to them). Every router of the chunk sees the whole row:
    sequence parallelism (a slice of the row per TP rank) and shared-prompt packing are refused by the caller."""

    def __init__(self, chunks):
        self.routers = {}  # id(chunk module) -> [(global layer index, RouterReplay)]
        for chunk in chunks:
            model = unwrap(chunk)
            self.routers[id(model)] = [(layer.layer_number - 1, layer.mlp.router.router_replay)
                                       for layer in model.decoder.layers
                                       if getattr(getattr(layer.mlp, "router", None), "router_replay", None)]
        self.routes: dict = {}  # key -> {layer: LongTensor [length, k]} (CPU)

    def clear(self) -> None:
        self.routes = {}

    @contextlib.contextmanager
    def recording(self, model, keys, starts, lengths):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routers = self.routers.get(id(unwrap(model)), [])
        for _, replay in routers:
            replay.set_router_replay_action(RouterReplayAction.RECORD)
        try:
            yield
        finally:
            for layer, replay in routers:
                chosen = replay.get_recorded_indices()
                replay.clear_indices()
                replay.clear_router_replay_action()
                for key, start, length in zip(keys, starts, lengths):
                    self.routes.setdefault(key, {})[layer] = chosen[start:start + length].detach().to("cpu")

    @contextlib.contextmanager
    def replaying(self, model, keys, starts, lengths, row_length: int):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routers = self.routers.get(id(unwrap(model)), [])
        missing = [k for k in keys if k not in self.routes]
        if routers and missing:
            raise RuntimeError(f"routing replay: no recorded experts for {len(missing)} of the micro-batch's samples "
                               f"(the old-logprob pass must run on the same samples first)")
        for layer, replay in routers:
            k = next(iter(self.routes[keys[0]].values())).shape[1]
            target = torch.arange(k).repeat(row_length, 1)  # padding: experts 0..k-1
            for key, start, length in zip(keys, starts, lengths):
                target[start:start + length] = self.routes[key][layer]
            replay.set_target_indices(target)
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            yield
        finally:
            for _, replay in routers:
                replay.clear_indices()
                replay.clear_router_replay_action()

