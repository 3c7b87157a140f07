"""MoE training glue: the weights of megatron's router losses (load-balancing aux loss, z-loss) in a GRPO update and
their logged values; the router load per layer; routing replay (old | rollout).

megatron's router adds the aux loss's gradient in backward (`MoEAuxLossAutoScaler`), per micro-batch. With
`calculate_per_token_loss` (policy.py) it multiplies that loss by the micro-batch's token count, expecting
finalize_model_grads to divide every gradient by the global token count; here the GRPO loss is normalised before
(finalize does not rescale), so that count would reach the gradient as is (x thousands). Instead the routers are
told their loss is not per-token (`prepare_routers`) and, for each mini-batch, the coefficient is divided by the
number of micro-batches over all DP ranks (`loss_scale`): the update then adds
`model.moe_aux_loss_coef x mean over micro-batches of megatron's switch loss`, summed over layers as megatron does,
and the same for the z-loss (`model.moe_z_loss_coef x mean over micro-batches of mean_t logsumexp(logits_t)^2`).
(megatron's switch loss is per layer and equals transformers' Mixtral/Qwen3-MoE `load_balancing_loss_func` / top-k;
transformers pools all layers' tokens into one loss. Same coefficient, megatron's definition.)
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .. import compat
from .build import unwrap

# megatron's router losses: its tracker name (router.py; the loss divided by its coefficient) -> (the
# TransformerConfig coefficient, our metric)
TRACKED = {"load_balancing_loss": ("moe_aux_loss_coeff", "moe_aux_loss"), "z_loss": ("moe_z_loss_coeff", "moe_z_loss")}
_COEFFICIENTS = tuple(coef for coef, _ in TRACKED.values())


def prepare_routers(chunks) -> None:
    """The routers' aux and z losses are not per-token here (see the module doc)."""
    for chunk in chunks:
        for module in chunk.modules():
            if hasattr(module, "calculate_per_token_loss") and hasattr(module, "get_aux_loss_coeff"):
                module.calculate_per_token_loss = False


@contextlib.contextmanager
def loss_scale(config, micro_batches_all_ranks: int):
    """Within: the routers' aux and z-loss coefficients are the model's / micro-batches of the mini-batch over all
    DP ranks."""
    coefs = {name: getattr(config, name, None) for name in _COEFFICIENTS if getattr(config, "num_moe_experts", None)}
    coefs = {name: c for name, c in coefs.items() if c}
    if not coefs:
        yield
        return
    _clear_tracker()
    for name, c in coefs.items():
        setattr(config, name, c / micro_batches_all_ranks)
    try:
        yield
    finally:
        for name, c in coefs.items():
            setattr(config, name, c)


def tracked_losses(config, micro_batches_per_rank: int) -> dict[str, float]:
    """{moe_aux_loss, moe_z_loss}: the mean, over layers and micro-batches, of each router loss that is on (without
    its coefficient) since `loss_scale` began; the same on every rank. Collective over all training ranks."""
    on = {name: metric for name, (coef, metric) in TRACKED.items() if getattr(config, coef, None)}
    if not getattr(config, "num_moe_experts", None) or not on:
        return {}
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    values = torch.stack([torch.zeros(config.num_layers, device=compat.default_device()) if name not in tracker
                          else tracker[name]["values"].detach().float().clone() for name in on])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values)  # each layer lives on one stage, on world / PP replicas
    replicas = (dist.get_world_size() if dist.is_initialized() else 1) // ps.get_pipeline_model_parallel_world_size()
    _clear_tracker()
    scale = replicas * max(micro_batches_per_rank, 1) * config.num_layers
    return {metric: float(v.sum()) / scale for metric, v in zip(on.values(), values)}


class RouterLoad:
    """Tokens routed to each expert, per layer, while active (a context manager over forward passes): the load
    imbalance of a layer is max / mean tokens per expert (1: balanced; E / k: every token to the same k experts).
    Counted from the routers' routing maps, over every rank; the ratio is blind to the TP replicas that route the
    same tokens (each count scales alike). Packing pads (a few tokens per micro-batch at TP > 1) are counted too."""

    def __init__(self, chunks, num_layers: int, num_experts: int):
        self.routers = [(layer.layer_number - 1, layer.mlp.router) for chunk in chunks
                        for layer in unwrap(chunk).decoder.layers if hasattr(layer.mlp, "router")]
        # on the model's device: a hook that copied to the host would sync the GPU at every layer of every forward
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=compat.default_device())
        self._hooks = []

    def __enter__(self):
        def count(layer):
            def hook(module, args, output):
                self.counts[layer] += output[1].detach().sum(0)
            return hook
        self._hooks = [router.register_forward_hook(count(layer)) for layer, router in self.routers]
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        return False

    def imbalance(self) -> dict[str, float]:
        """{moe_load_imbalance: mean over layers, moe_load_imbalance/layer_NN: each layer}; the same on every rank.
        Collective over all training ranks."""
        counts = self.counts
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        per_layer = (counts.max(1).values / counts.mean(1).clamp_min(1e-12)).tolist()
        out = {f"actor/moe_load_imbalance/layer_{i:02d}": v for i, v in enumerate(per_layer)}
        return {"moe_load_imbalance": sum(per_layer) / len(per_layer), **out}


def _clear_tracker() -> None:
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


# --- routing replay (algo.routing_replay old | rollout) ----------------------------------------------------------------

ROUTING_REPLAY = ("off", "old", "rollout")


class RoutingReplay:
    """Record each token's experts in the old-logprob pass and replay them in the update, per sample, through
    megatron's own `RouterReplay` (`moe_enable_routing_replay`: the router takes the given top-k indices and gathers
    its scores there, so the gradient still flows through the router's probabilities).

    Routes are kept per sample (`key`: any hashable the caller gives each sample) and per global layer, so the
    update may pack the samples into other micro-batches than the old-logprob pass did. A micro-batch is described
    by its samples' keys, their starts in the packed row and their lengths; its padding tokens take experts 0..k-1
    (they are a segment of their own: nothing real attends to them). Every router of the chunk sees the whole row:
    sequence parallelism (a slice of the row per TP rank) and shared-prompt packing are refused by the caller.

    `source`: old (the old-logprob pass records, the update replays) or rollout (the routes vLLM returned with each
    sample, `use_rollout_routes`, are replayed in both passes)."""

    def __init__(self, chunks, source: str = "old"):
        if source not in ("old", "rollout"):
            raise ValueError(f"routing replay source must be old or rollout, got {source!r}")
        self.source = source
        self.routers = {}  # id(chunk module) -> [(global layer index, RouterReplay)]
        self.num_layers = self.num_experts = 0  # this stage's last MoE layer (vLLM's arrays hold every layer), E
        for chunk in chunks:
            model = unwrap(chunk)
            routers = [(layer.layer_number - 1, layer.mlp.router) for layer in model.decoder.layers
                       if getattr(getattr(layer.mlp, "router", None), "router_replay", None)]
            self.routers[id(model)] = [(i, router.router_replay) for i, router in routers]
            for i, router in routers:
                self.num_layers, self.num_experts = max(self.num_layers, i + 1), router.num_experts
        self.routes: dict = {}  # key -> {layer: LongTensor [length, k]} (CPU)

    def clear(self) -> None:
        self.routes = {}

    def use_rollout_routes(self, samples) -> None:
        """The experts vLLM chose for each sample (`Sample.routed_experts`: [tokens, layers, k], its rows the prompt
        and response tokens but the last, which vLLM never forwards) as the routes to replay, keyed by the
        sample's index. The last token takes its predecessor's experts: nothing attends to it after."""
        self.clear()
        for i, s in enumerate(samples):
            if s.routed_experts is None:
                raise ValueError(f"algo.routing_replay=rollout: sample {i} carries no routed experts from vLLM")
            rows = torch.as_tensor(s.routed_experts).long()
            if rows.dim() != 3 or rows.shape[1] < self.num_layers or not s.length - 1 <= rows.shape[0] <= s.length:
                raise ValueError(f"algo.routing_replay=rollout: sample {i} has {s.length} tokens and "
                                 f"{self.num_layers}+ MoE layers, but vLLM's routed experts are {list(rows.shape)} "
                                 "([tokens - 1, layers, top-k] expected)")
            if rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < self.num_experts:
                raise ValueError(f"algo.routing_replay=rollout: sample {i} routes to experts outside "
                                 f"0..{self.num_experts - 1} (another model's routes?)")
            if rows.shape[0] < s.length:
                rows = torch.cat([rows, rows[-1:]])
            self.routes[i] = {layer: rows[:, layer].contiguous() for layer in range(rows.shape[1])}

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

