"""Split placement (rollout.placement=split): the last `rollout.num_rollout_ranks` ranks only roll out.

Trainer side, `SplitPlacement` (the rollout/placement.py seam; `overlaps`: a submitted batch generates on the rollout
ranks while the trainer works). Rollout side, `serve`: the loop a rollout rank runs (inside `join`) instead of the
training loop. The two talk over the control channel (distributed.init_split: trainer rank 0 + every rollout rank),
one conversation at a time:

    trainer rank 0                                   rollout rank e (engine e of R, vLLM in a child process)
    ("init", receiver info); sender.open()     ->    engine.init_receiver (joins the weight-transfer group)
    ("generate", prompts, n, sampling, seed)   ->    prompts e, e+R, ... (seeded by their place in the batch)
    recv part from each engine                 <-    (prompt indices, Rollouts, timings)
    ("weights",); send_weights(...)            ->    engine.receive_weights (gloo on CPU, vLLM's nccl on GPU)
    ("stop",)                                  ->    engine shut down, the rank exits 0

A rollout rank does one thing at a time, so a weight sync sent while it generates lands right after that batch:
generation never stops for longer than the copy.

Streaming (the streaming source, rollout/stream_source.py) turns a rollout rank into an engine loop
(rollout/engine_loop.EngineLoop):

    ("stream", (n, sampling, max seqs))        ->    the loop starts; a result channel per engine opens
    ("admit", [(gid, prompt ids), ...])        ->    engine gid % R queues its prompts, started as slots free up
    recv finished groups (any time)            <-    ("groups", ([(gid, Rollouts, admitted version)], figures))
    ("weights", min_version); send_weights     ->    pause (requests kept), receive, drop groups admitted before
                                                     min_version (counted), resume
    ("harvest",)                               ->    a stop: every group aborted, ("harvest", [(gid, its samples so
                                                     far)]) back; the checkpoint keeps them
    ("resume", [(gid, ids, samples, version)]) ->    a resumed run: those groups go on where they stopped
    ("stop",)                                  ->    in-flight groups aborted; ("end", their gids) back

The rank listens to the control channel on a thread of its own while the main thread steps the engine; finished
groups (and batches asked for beside the stream: held-out accuracy, validation) go back on the result channel, which
trainer rank 0 receives on a thread per engine into a GroupBuffer.

The other trainer ranks take part in the weight export only (its gathers are collectives) and get each batch from
trainer rank 0 over the trainer group.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections import deque
from typing import Sequence

from ..distributed import backend, free_port, init_split, trainer_broadcast
from .base import RolloutInterrupted, Rollouts, SamplingConfig, weight_sync_backend
from .cpu_cores import bind_split_rank


class _Request:
    """One submitted batch; its rollouts are filled in by `SplitRollout.receive` on trainer rank 0."""

    def __init__(self, num_prompts: int):
        self.num_prompts = num_prompts
        self.rollouts: Rollouts | None = None
        self.stats: dict = {}
        self.interrupted = False  # a rollout rank aborted its part (a stop signal there): no rollouts will come


class SplitPlacement:
    """The trainer's handle on the rollout ranks (every trainer rank builds one; rank 0 holds the channel)."""

    overlaps = True  # a submitted batch generates on other ranks while the trainer works

    def __init__(self, cfg, model_dir, *, engine=None):
        if engine is not None:
            raise ValueError("rollout.placement=split builds its engines on the rollout ranks; a ready engine can "
                             "stand in only for a colocated one")
        self.cfg, self.model_dir = cfg, model_dir
        self._bucket_bytes = int(cfg.rollout.weight_sync_bucket_mb) << 20
        self._lock = threading.Lock()  # the channel carries one conversation at a time (a receiver thread, publish)
        self._pending: deque[_Request] = deque()
        self.roles = self.sender = None
        self._buffer = None  # streaming: trainer rank 0's finished groups
        self._receivers: list[threading.Thread] = []

    @staticmethod
    def trainer_world_size(rollout_cfg, world_size: int) -> int:
        return world_size - rollout_cfg.num_rollout_ranks

    @staticmethod
    def problems(cfg, world_size: int) -> list[str]:
        """The rollout ranks: at least one, fewer than the world, one whole engine each; weights cross processes."""
        ro, out = cfg.rollout, []
        if not 1 <= ro.num_rollout_ranks < world_size:
            out.append(f"rollout.placement=split needs 1 <= rollout.num_rollout_ranks < the world size {world_size} "
                       f"(the last N ranks host vLLM engines, the others train), got {ro.num_rollout_ranks}")
        if weight_sync_backend(ro.weight_sync_backend) == "local":
            out.append("rollout.weight_sync_backend=local needs rollout.placement=colocated (the engine in the "
                       "trainer's process); use auto")
        tp = ro.tensor_parallel
        if ro.num_rollout_ranks >= 1 and tp >= 1:
            if ro.num_rollout_ranks % tp:
                out.append(f"rollout.num_rollout_ranks={ro.num_rollout_ranks} is not divisible by "
                           f"rollout.tensor_parallel={tp}: every engine needs {tp} whole ranks")
            elif tp > 1:
                out.append(f"rollout.placement=split runs one engine per rollout rank (vLLM in a child process): "
                           f"rollout.tensor_parallel must be 1 there, got {tp}; add rollout ranks instead")
        return out

    def join(self) -> bool:
        self.roles = init_split(self.cfg.rollout.num_rollout_ranks)
        bind_split_rank(self.roles.global_rank, self.roles.train_world)  # no GPU: this rank's share of the cores
        if not self.roles.is_trainer:
            serve(self.cfg, self.model_dir, self.roles)  # generate and take weights until the trainer says stop
            return False
        return True

    def start(self, export_weights) -> None:
        from ..rollout.weight_transfer import BroadcastSender, checkpoint_tensors, tied_embeddings

        self.leader = self.roles.control is not None
        self._channel = self.roles.control
        self._export_weights = export_weights
        self._tied = tied_embeddings(self.model_dir)
        self._expected = set(checkpoint_tensors(self.model_dir))  # a sync must cover all of them
        if self.leader:
            # the weight-transfer group's store lives on this rank's host: MASTER_ADDR under torchrun and the Slurm
            # scripts (rank 0 runs on the rendezvous node)
            self.sender = BroadcastSender(backend(), os.environ.get("MASTER_ADDR", "127.0.0.1"), free_port(),
                                          world_size=1 + self.roles.num_rollout_ranks, bucket_bytes=self._bucket_bytes)
            self._channel.broadcast_object(("init", self.sender.receiver_init_info(rank_offset=1)), 0)
            self.sender.open()  # rendezvous with every engine's worker

    # -- generation -------------------------------------------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, *,
               seed: int | None = None) -> _Request:
        """Start generating a batch on the rollout ranks and return at once (every trainer rank calls it)."""
        request = _Request(len(prompt_ids))
        if self.leader:
            with self._lock:
                self._channel.broadcast_object(("generate", ([list(map(int, p)) for p in prompt_ids], n, sampling,
                                                             seed)), 0)
                self._pending.append(request)
        return request

    def receive(self, request: _Request) -> tuple[Rollouts, dict] | None:
        """Trainer rank 0: block until `request`'s rollouts are in (batches arrive in submission order); returns
        (rollouts, the rollout ranks' timings). None on the other trainer ranks. Safe from a second thread.
        RolloutInterrupted where a rollout rank aborted its part: a stop signal reached it, so the run stops."""
        if not self.leader:
            return None
        with self._lock:
            while request.rollouts is None and not request.interrupted:
                self._receive_next()
        if request.interrupted:
            raise RolloutInterrupted("a rollout rank aborted the batch (a stop signal reached it)")
        return request.rollouts, request.stats

    def _receive_next(self) -> None:
        head = self._pending.popleft()
        if self._buffer is not None:  # streaming: the parts come back on the result channels
            parts = [self._buffer.take_batch() for _ in range(self.roles.num_rollout_ranks)]
            parts.sort(key=lambda part: part[2]["engine"])
        else:
            parts = [self._channel.recv_object(src=1 + e) for e in range(self.roles.num_rollout_ranks)]
            if any(part is None for _, part, _ in parts):  # every engine answered: the channel stays in step
                head.interrupted = True
                return
        head.rollouts = merge_parts(parts, head.num_prompts)
        # the slowest engine decides when the batch is complete
        head.stats = {k: max(p[2][k] for p in parts) for k in parts[0][2]}

    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, *,
                 seed: int | None = None) -> Rollouts:
        """`n` samples per prompt, the whole batch on every trainer rank."""
        request = self.submit(prompt_ids, n, sampling, seed=seed)
        try:
            got = self.receive(request)
        except RolloutInterrupted:
            got = ("interrupted", None)
        rollouts = trainer_broadcast(None if got is None else got[0])
        if isinstance(rollouts, str):  # "interrupted": every trainer rank raises
            raise RolloutInterrupted("a rollout rank aborted the batch (a stop signal reached it)")
        return rollouts

    # -- streaming ------------------------------------------------------------------------------------------------------

    def stream_open(self, n: int, sampling: SamplingConfig, capacity: int):
        """Turn every engine into a streaming loop; trainer rank 0 collects finished groups (at most `capacity`:
        what the admission lets be outstanding) in the buffer it returns (None elsewhere). Every trainer rank calls
        it."""
        if not self.leader:
            return None
        from .stream_source import GroupBuffer

        engines = self.roles.num_rollout_ranks
        with self._lock:
            # an engine's share of what the admission lets be outstanding: its occupancy is measured against it
            self._channel.broadcast_object(("stream", (n, sampling, -(-capacity // engines) * n)), 0)
        self._buffer = GroupBuffer(capacity, producers=engines)
        for e in range(engines):
            channel = result_channel(self.roles, e)
            thread = threading.Thread(target=_receive_groups, args=(channel, self._buffer), daemon=True,
                                      name=f"stream-results-{e}")
            thread.start()
            self._receivers.append(thread)
        return self._buffer

    def stream_admit(self, prompts: Sequence[tuple[int, Sequence[int]]]) -> None:
        """(trainer rank 0) Prompts the engines may start now, each with its place in the stream (gid)."""
        if self.leader and prompts:
            with self._lock:
                self._channel.broadcast_object(("admit", [(int(g), list(map(int, p))) for g, p in prompts]), 0)

    def stream_resume(self, groups) -> None:
        """(trainer rank 0) Groups a stop cut short, [(gid, prompt ids, samples so far, admitted version)]: their
        engines continue them before any newly admitted prompt."""
        if self.leader and groups:
            with self._lock:
                self._channel.broadcast_object(("resume", [(int(g), list(map(int, p)), r, int(v))
                                                           for g, p, r, v in groups]), 0)

    def stream_harvest(self) -> dict:
        """(trainer rank 0, at a stop) Every engine aborts its groups and hands back what they sampled so far:
        {gid: samples}. A group that finished before is in the buffer already (each engine's results arrive in
        order). {} elsewhere, or before streaming started."""
        if not self.leader or self._buffer is None:
            return {}
        with self._lock:
            self._channel.broadcast_object(("harvest", None), 0)
        kept = {}
        for _ in range(self.roles.num_rollout_ranks):  # bounded: a stop must end even with an engine stuck
            kept.update(self._buffer.take_batch("harvest", timeout=HARVEST_TIMEOUT_S))
        return kept

    # -- the trainer's turn, weights, the end -----------------------------------------------------------------------

    @contextlib.contextmanager
    def training(self):
        """The engines run on their own devices: nothing to free."""
        yield

    def publish(self, version: int, min_version: int | None = None) -> dict:
        """Stream the policy's weights to every engine as `version` (every trainer rank iterates the export). The
        engines take it after the batch they are generating, whose rollouts are received first; streaming engines
        take it mid-generation and drop the groups admitted before `min_version`."""
        from ..rollout.weight_transfer import send_weights

        if self.leader:
            with self._lock:
                while self._pending:
                    self._receive_next()
                self._channel.broadcast_object(("weights", min_version), 0)
                return send_weights(self.sender, self._export_weights(self._bucket_bytes), version, self._channel,
                                    tied=self._tied, bucket_bytes=self._bucket_bytes, expected_names=self._expected)
        return send_weights(None, self._export_weights(self._bucket_bytes), version, None, tied=self._tied,
                            bucket_bytes=self._bucket_bytes, is_sender=False)

    def shutdown(self) -> None:
        if self.leader:
            with self._lock:
                while self._pending:
                    self._receive_next()
                self._channel.broadcast_object(("stop", None), 0)
            for thread in self._receivers:  # each ends with its engine's ("end", ...)
                thread.join(timeout=60)
            self.sender.close()


def merge_parts(parts, num_prompts: int) -> Rollouts:
    """The engines' parts [(prompt indices, Rollouts, timings)] as one batch in prompt order."""
    samples: dict[int, list[tuple[Rollouts, int]]] = {}
    for indices, r, _ in parts:
        for k, local in enumerate(r.prompt_index):
            samples.setdefault(indices[local], []).append((r, k))
    order = [(r, k, g) for g in range(num_prompts) for r, k in samples.get(g, [])]
    return Rollouts.in_order(order, min(r.weight_version for _, r, _ in parts))  # the oldest weights count


def result_channel(roles, engine: int):
    """The channel engine `engine` sends finished groups on (trainer rank 0 is its rank 0); both ends build it."""
    import datetime

    import torch.distributed as dist

    from ..distributed import ObjectChannel

    rank = 0 if roles.is_trainer else 1
    return ObjectChannel(dist.PrefixStore(f"justrl-results-{engine}", roles.store), rank, 2,
                         roles.timeout or datetime.timedelta(minutes=30))


def _receive_groups(channel, buffer) -> None:
    """Trainer rank 0, a thread per engine: finished groups into the buffer until the engine says it has ended."""
    try:
        while True:
            kind, payload = channel.recv_object(src=1)
            if kind == "end":
                buffer.end(payload)
                return
            if kind in ("batch", "harvest"):
                buffer.put_batch(payload, kind)
                continue
            groups, figures = payload
            buffer.put(groups, figures)
    except BaseException as exc:  # noqa: BLE001  (raised to the trainer by buffer.take)
        buffer.fail(RuntimeError(f"the rollout rank's result channel failed: {exc}"))


HARVEST_TIMEOUT_S = 300.0  # at a stop, an engine's samples so far: an abort and one message (seconds, not minutes)


def serve_stream(engine, channel, results, e: int, engines: int, n: int, sampling, max_seqs: int,
                 tools=None) -> None:
    """A rollout rank's streaming loop, until the trainer says stop (see the module doc). `max_seqs`: the most
    sequences the admission lets this engine hold (its occupancy's denominator, with the engine's own maximum).
    `tools`: rollout.tools' multi-turn driver (each sample's turns run in the loop)."""
    import queue

    from .engine_loop import EngineLoop

    loop = EngineLoop(engine, n, sampling, max_running_seqs=min(max_seqs, engine.max_num_seqs), tools=tools)
    batches: list[tuple[int, list[int], float]] = []  # side batches in progress: (batch id, prompt indices, start)
    inbox: queue.Queue = queue.Queue()
    weights_taken = threading.Event()

    def listen():  # the control channel, while the main thread steps the engine
        while True:
            try:
                message = channel.broadcast_object(None, 0)
            except BaseException as exc:  # noqa: BLE001  (the trainer is gone: the main thread raises it)
                inbox.put(("failed", exc))
                return
            inbox.put(message)
            if message[0] == "weights":  # the main thread reads the sync's metadata on this channel: wait for it
                weights_taken.wait()
                weights_taken.clear()
            elif message[0] == "stop":
                return

    threading.Thread(target=listen, daemon=True, name="stream-control").start()
    while True:
        t = time.perf_counter()
        if loop.busy:
            try:
                message = inbox.get_nowait()
            except queue.Empty:
                message = None
        else:  # nothing to generate: waiting for prompts (the admission) or weights
            message = inbox.get()
            loop.stats.idle_s += time.perf_counter() - t
        if message is not None:
            kind, payload = message
            if kind == "admit":
                loop.admit([(g, ids) for g, ids in payload if g % engines == e])
            elif kind == "resume":
                loop.resume([group for group in payload if group[0] % engines == e])
            elif kind == "harvest":
                results.send_object(("harvest", loop.harvest()), dst=0)
            elif kind == "weights":
                try:
                    dropped = loop.update(lambda: engine.receive_weights(channel), min_version=payload)["dropped"]
                finally:
                    weights_taken.set()
                if dropped:  # the trainer counts them and admits fresh prompts in their place
                    results.send_object(("groups", ([(g, None, v) for g, v in dropped], {})), dst=0)
            elif kind == "generate":  # a whole batch beside the stream (held-out accuracy, validation)
                prompts, bn, bsampling, _ = payload
                mine = list(range(e, len(prompts), engines))
                batches.append((loop.add_batch([prompts[i] for i in mine], bn, bsampling), mine,
                                time.perf_counter()))
            elif kind == "stop":
                results.send_object(("end", loop.abort_all()), dst=0)
                return
            elif kind == "failed":
                raise RuntimeError(f"rollout rank: the trainer's control channel failed: {payload}")
            else:
                raise RuntimeError(f"rollout rank: unknown streaming request {kind!r} from the trainer")
            continue  # every message is handled before the next step
        groups = loop.step()
        if groups:
            results.send_object(("groups", ([(g.gid, g.rollouts, g.admitted_version) for g in groups],
                                            loop.take_stats().sums())), dst=0)
        for batch in list(batches):
            part = loop.batch_done(batch[0])
            if part is not None:
                batches.remove(batch)
                results.send_object(("batch", (batch[1], part, {"engine": e,
                                                               "generate_s": time.perf_counter() - batch[2]})), dst=0)


def serve(cfg, model_dir, roles) -> None:
    """A rollout rank's whole life: build the engine, then answer the trainer until it says stop."""
    from ..interrupt import Interruptible
    from ..slurm import stop_requested
    from .multi_turn import ToolRollout
    from .vllm_engine import make_engine

    # SIGUSR1 / SIGTERM / a first Ctrl-C: the trainer checkpoints and sends stop; this rank must not die first (a
    # second Ctrl-C aborts it with the rest, as it does the trainer)
    Interruptible().install()
    engine = make_engine(cfg, model_dir, seed=cfg.trainer.seed, in_process=False)
    # rollout.tools: this rank runs each sample's turns and tool calls (in its sandbox) beside its engine, as a
    # colocated engine's rank does; the trainer receives the samples with their masks like any others
    tools = ToolRollout.from_config(cfg, model_dir)
    generate = engine.generate if tools is None else functools.partial(tools.generate, engine)
    channel, e, engines = roles.control, roles.engine_index, roles.num_rollout_ranks
    # idle time since this engine's previous batch: waiting for weights, and for the next prompts
    waits = {"wait_weights_s": 0.0, "wait_prompts_s": 0.0, "sync_s": 0.0}
    try:
        while True:
            t = time.perf_counter()
            kind, payload = channel.broadcast_object(None, 0)
            idle = time.perf_counter() - t
            if kind == "init":
                engine.init_receiver({**payload, "rank_offset": payload["rank_offset"] + e})
            elif kind == "weights":
                waits["wait_weights_s"] += idle
                waits["sync_s"] += engine.receive_weights(channel)["seconds"]
            elif kind == "generate":
                waits["wait_prompts_s"] += idle
                prompts, n, sampling, seed = payload
                mine = list(range(e, len(prompts), engines))  # as generate_all: seeds follow the place in the batch
                t = time.perf_counter()
                try:  # a stop signal to this rank aborts the batch; the answer says so (None), the trainer stops
                    part = generate([prompts[i] for i in mine], n, sampling, seed=seed, request_indices=mine,
                                    stop=stop_requested)
                except RolloutInterrupted:
                    part = None
                channel.send_object((mine, part, {**waits, "generate_s": time.perf_counter() - t}), dst=0)
                waits = dict.fromkeys(waits, 0.0)
            elif kind == "stream":  # from here on the engine streams until stop
                serve_stream(engine, channel, result_channel(roles, e), e, engines, *payload, tools=tools)
                return
            elif kind == "stop":
                return
            else:
                raise RuntimeError(f"rollout rank: unknown request {kind!r} from the trainer")
    finally:
        if tools is not None:
            tools.close()
        engine.shutdown()
