"""Split placement (rollout.placement=split): the last `rollout.num_rollout_ranks` ranks only roll out.

Trainer side, `SplitPlacement` (the rollout/placement.py seam) and its `RemoteEngines` client (rollout/engines.py):
trainer rank 0 drives every engine. Rollout side, `serve`: a rollout rank's whole life, one `EngineLoop`
(rollout/engine_loop.py) stepped on the main thread while a listener thread reads the control channel
(distributed.init_split: trainer rank 0 + every rollout rank), the same in every rollout mode:

    trainer rank 0                                   rollout rank e (engine e of R, vLLM in a child process)
    ("init", receiver info); sender.open()     ->    engine.init_receiver (joins the weight-transfer group)
    ("stream", (n, sampling, max seqs))        ->    the loop's group size, sampling and share of the admission
    ("admit", [(gid, ids, seed, engine)])      ->    engine e queues its groups, started as slots free up
    recv finished groups (any time)            <-    ("groups", ([(gid, Rollouts, admitted version)], figures,
                                                     {running gid: tokens so far}))
    ("weights", min_version); send_weights     ->    pause (requests kept), receive, drop groups admitted before
                                                     min_version (counted), resume
    ("generate", (prompts, n, sampling, seed)) ->    its share as a side batch; ("batch", (indices, Rollouts)) back
    ("harvest",)                               ->    a stop: every group aborted, ("harvest", [(gid, its samples so
                                                     far)]) back; the checkpoint keeps them
    ("resume", [(gid, ids, samples, v, e)])    ->    a resumed run: those groups go on where they stopped
    ("stop",)                                  ->    in-flight groups aborted; ("end", their gids) back; exit 0

Finished groups, side batches' parts and harvests go back on a result channel per engine, which trainer rank 0
receives on a thread per engine into a GroupBuffer. Groups go to engines by load (engines.EngineLoads). A weight
update with min_version None ("nothing generates across it": synchronous and one-step-off rounds) is sent once every
admitted group has come back, so a round is sampled by one version, as a one-call batch would be.

The other trainer ranks take part in the weight export only (its gathers are collectives).

Trainer rank 0 and every rollout rank watch each other (`watch_each_other`, liveness.py, rollout.liveness): each
beats from a thread of its own, and a rollout rank stops beating while an engine step or a weight sync is past its
deadline (engine_step_s; transfer_s + the sync's bytes at transfer_mb_per_s). A rollout rank silent for missed_beats
beats ends every wait of the trainer on it: the buffer's waits fail, the sends (made on a thread of their own,
`Liveness.call`: a gloo send waits for its receiver) give up, a publish lets the export run out on every trainer rank;
every trainer rank raises PeerLost at the same point, the save in progress is committed and the run ends in one line
naming the rank (train_entry). A stop signal meanwhile still saves as a stop does: the harvest of the engines' work
gives up on the lost rank, the save is committed, then the run ends in that line. A silent trainer rank 0 ends each
rollout rank at once, in one line (it has nothing to save). The weight-transfer group's port is held from the moment
it is announced (weight_transfer.BroadcastSender).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import threading
import time

from ..distributed import backend, init_split, store_client, trainer_broadcast
from ..liveness import Deadlines, Liveness, PeerLost, exit_process
from ..slurm import stop_requested
from .base import RolloutInterrupted, Rollouts, SamplingConfig, weight_sync_backend
from .cpu_cores import bind_split_rank
from .engines import EngineLoads, GroupBuffer, merge_parts


class SplitPlacement:
    """The trainer's handle on the rollout ranks (every trainer rank builds one; rank 0 holds the channel)."""

    overlaps = True  # the engines generate on their own ranks while the trainer works

    def __init__(self, cfg, model_dir, *, engine=None):
        if engine is not None:
            raise ValueError("rollout.placement=split builds its engines on the rollout ranks; a ready engine can "
                             "stand in only for a colocated one")
        self.cfg, self.model_dir = cfg, model_dir
        self._bucket_bytes = int(cfg.rollout.weight_sync_bucket_mb) << 20
        self.roles = self.sender = self.engines = self.liveness = None

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
        self.liveness = watch_each_other(self.cfg, self.roles)
        if not self.roles.is_trainer:
            # generate and take weights until the trainer says stop
            serve(self.cfg, self.model_dir, self.roles, self.liveness)
            return False
        return True

    def start(self, export_weights) -> "RemoteEngines":
        from ..rollout.weight_transfer import BroadcastSender, checkpoint_tensors, tied_embeddings

        self.leader = self.roles.control is not None
        self._export_weights = export_weights
        self._tied = tied_embeddings(self.model_dir)
        numels = checkpoint_tensors(self.model_dir)
        self._expected = set(numels)  # a sync must cover all of them
        if self.leader:
            # each broadcast carries a bucket, or one tensor larger than a bucket (4 bytes a parameter at most)
            bucket_s = self.liveness.deadlines.transfer(max(self._bucket_bytes, 4 * max(numels.values())))
            # the weight-transfer group's store lives on this rank's host: MASTER_ADDR under torchrun and the Slurm
            # scripts (rank 0 runs on the rendezvous node)
            self.sender = BroadcastSender(backend(), os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                          world_size=1 + self.roles.num_rollout_ranks, bucket_bytes=self._bucket_bytes,
                                          timeout_s=bucket_s)
            self.liveness.call(self.roles.control.broadcast_object,
                               ("init", self.sender.receiver_init_info(rank_offset=1)), 0)
            self.liveness.call(self.sender.open)  # rendezvous with every engine's worker
        self.engines = RemoteEngines(self.cfg, self.roles, self.leader, self.liveness)
        return self.engines

    @contextlib.contextmanager
    def training(self):
        """The engines run on their own devices: nothing to free."""
        yield

    def publish(self, version: int, min_version: int | None = None) -> dict:
        """Stream the policy's weights to every engine as `version` (every trainer rank iterates the export). The
        engines take them mid-generation and drop the groups admitted before `min_version`; with min_version None
        the admitted groups finish first (a round is sampled by one version). A rollout rank lost meanwhile raises
        PeerLost on every trainer rank, after the export has run to its end on all of them (its gathers are
        collectives)."""
        from ..rollout.weight_transfer import send_weights

        stream = self._export_weights(self._bucket_bytes)
        figures, lost = None, None
        if self.leader:
            try:
                if min_version is None:
                    self.engines.wait_idle()
                with self.engines.lock:
                    self.liveness.call(self.roles.control.broadcast_object, ("weights", min_version), 0)
                    figures = send_weights(self.sender, stream, version, self.roles.control, tied=self._tied,
                                           bucket_bytes=self._bucket_bytes, expected_names=self._expected,
                                           call=self.liveness.call)
            except PeerLost as exc:
                lost = str(exc)
            except RuntimeError as exc:  # a broadcast past its deadline (the transfer group's timeout)
                if self.liveness.lost is None and "Timed out" not in str(exc):
                    raise
                lost = self.liveness.lost or f"the weight transfer to the rollout ranks stalled ({exc})"
            if lost is not None:
                for _ in stream:  # the other trainer ranks' export goes on: its collectives need this rank
                    pass
        else:
            figures = send_weights(None, stream, version, None, tied=self._tied, bucket_bytes=self._bucket_bytes,
                                   is_sender=False)
        lost = trainer_broadcast(lost)
        if lost is not None:
            raise PeerLost(lost)
        return figures

    def shutdown(self) -> None:
        """The engines stop (trainer rank 0 tells them). A rollout rank found lost is said here, after the rest is
        closed: PeerLost."""
        if self.leader:
            if self.liveness.lost is None:
                self.engines.stop()
            self.liveness.stop()
            self.sender.close()
            self.liveness.check()


def watch_each_other(cfg, roles) -> Liveness | None:
    """Trainer rank 0 and every rollout rank beat and watch each other (liveness.py, rollout.liveness); the other
    trainer ranks wait on trainer rank 0 only (None there). A lost rollout rank reaches the trainer through its
    engines' client (`RemoteEngines`); a lost trainer rank 0 ends a rollout rank at once (it has nothing to save)."""
    if roles.control is None:
        return None
    deadlines = Deadlines.from_config(cfg.rollout.liveness)
    store = store_client("justrl-liveness", datetime.timedelta(seconds=deadlines.silence_s))
    if roles.is_trainer:
        peers = {r: f"rollout rank {r}" for r in range(roles.train_world, roles.world)}
        return Liveness(store, 0, peers, deadlines, on_lost=lambda line: None).start()
    me = roles.global_rank
    return Liveness(store, me, {0: "trainer rank 0"}, deadlines,
                    on_lost=lambda line: exit_process(f"{line}; rollout rank {me} stops")).start()


class RemoteEngines:
    """The `Engines` client (rollout/engines.py) of the rollout ranks: trainer rank 0 sends on the control channel and
    receives on a result channel per engine; the other trainer ranks only take part in `generate`'s broadcast."""

    overlaps = True

    def __init__(self, cfg, roles, leader: bool, liveness: Liveness | None = None):
        ro = cfg.rollout
        self.roles, self.leader, self.count, self.liveness = roles, leader, roles.num_rollout_ranks, liveness
        self.lock = threading.Lock()  # the channel carries one conversation at a time
        self.loads = EngineLoads(self.count, ro.n, ro.max_response_length / 2)
        self.buffer: GroupBuffer | None = None
        self._receivers: list[threading.Thread] = []
        if leader:
            self.buffer = GroupBuffer(capacity=0, producers=self.count)
            # a rollout rank that stops answering ends every wait on the buffer (groups, side batches, a harvest)
            liveness.on_lost = lambda line: self.buffer.fail(PeerLost(line))
            if liveness.lost is not None:
                self.buffer.fail(PeerLost(liveness.lost))
            for e in range(self.count):
                thread = threading.Thread(target=_receive_groups, args=(result_channel(roles, e), self.buffer,
                                                                         self.loads, e),
                                          daemon=True, name=f"engine-results-{e}")
                thread.start()
                self._receivers.append(thread)

    def _send(self, message) -> None:
        with self.lock:
            self.liveness.call(self.roles.control.broadcast_object, message, 0)

    def open(self, n: int, sampling: SamplingConfig, capacity: int) -> GroupBuffer | None:
        if not self.leader:
            return None
        # an engine's share of what the admission lets be outstanding: its occupancy is measured against it
        self._send(("stream", (n, sampling, -(-capacity // self.count) * n)))
        self.buffer.capacity = capacity
        return self.buffer

    def admit(self, groups) -> None:
        if self.leader and groups:
            engines = self.loads.assign_all([g for g, *_ in groups])
            self._send(("admit", [(int(g), list(map(int, ids)), seed, e)
                                  for (g, ids, seed), e in zip(groups, engines)]))

    def resume(self, groups) -> None:
        if self.leader and groups:
            engines = self.loads.assign_all([g for g, *_ in groups])
            self._send(("resume", [(int(g), list(map(int, p)), r, int(v), e)
                                   for (g, p, r, v), e in zip(groups, engines)]))

    def harvest(self) -> dict:
        """(trainer rank 0, at a stop) Every engine aborts its groups and hands back what they sampled so far:
        {gid: samples}. A group that finished before is in the buffer already (each engine's results arrive in
        order)."""
        if not self.leader:
            return {}
        self._send(("harvest", None))
        kept = {}
        for _ in range(self.count):  # bounded: a stop must end even with an engine stuck
            kept.update(self.buffer.take_batch("harvest", timeout=HARVEST_TIMEOUT_S))
        self.loads.forget()
        return kept

    def generate(self, prompt_ids, n: int, sampling: SamplingConfig, *, seed: int | None = None) -> Rollouts:
        """A whole batch beside the stream (engine e: prompts e, e + R, ..., seeded by their place in the batch), on
        every trainer rank. A stop on a rollout rank aborts its part: RolloutInterrupted on every trainer rank."""
        got = None
        if self.leader:
            try:
                self._send(("generate", ([list(map(int, p)) for p in prompt_ids], n, sampling, seed)))
                parts = [self.buffer.take_batch() for _ in range(self.count)]
                got = "interrupted" if any(r is None for _, r in parts) else merge_parts(parts, len(prompt_ids))
            except PeerLost as exc:
                got = exc
        got = trainer_broadcast(got)  # (every trainer rank waits for it)
        if isinstance(got, PeerLost):
            raise got
        if isinstance(got, str):
            raise RolloutInterrupted("a rollout rank aborted the batch (a stop signal reached it)")
        return got

    def follow(self) -> None:
        """The engines are the rollout ranks': nothing for the other trainer ranks to do."""

    def release(self) -> None:
        pass

    def wait_idle(self) -> None:
        """Until every admitted group has come back (finished or dropped): a weight update that nothing may
        generate across waits for them."""
        while self.loads.outstanding:
            self.buffer.wait_change()

    def stop(self) -> None:
        self._send(("stop", None))
        for thread in self._receivers:  # each ends with its engine's ("end", ...), or its engine is lost
            while thread.is_alive() and self.liveness.lost is None:
                thread.join(timeout=1.0)


def result_channel(roles, engine: int):
    """The channel engine `engine` sends finished groups on (trainer rank 0 is its rank 0); both ends build it."""
    import datetime

    import torch.distributed as dist

    from ..distributed import ObjectChannel

    rank = 0 if roles.is_trainer else 1
    return ObjectChannel(dist.PrefixStore(f"justrl-results-{engine}", roles.store), rank, 2,
                         roles.timeout or datetime.timedelta(minutes=30))


def _receive_groups(channel, buffer, loads, engine: int) -> None:
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
            groups, figures, progress = payload
            for gid, r, _ in groups:
                loads.finished(gid, [] if r is None else r.sampled_lengths())
            loads.progress(progress)
            buffer.put(groups, figures, engine=engine)
    except BaseException as exc:  # noqa: BLE001  (raised to the trainer by buffer.take)
        buffer.fail(RuntimeError(f"the rollout rank's result channel failed: {exc}"))


HARVEST_TIMEOUT_S = 300.0  # at a stop, an engine's samples so far: an abort and one message (seconds, not minutes)


def serve(cfg, model_dir, roles, liveness: Liveness) -> None:
    """A rollout rank's whole life: build the engine, then step its loop and answer the trainer until it says stop
    (see the module doc). Each engine step and each weight sync runs under its deadline (`liveness.doing`): past it,
    this rank falls silent and the trainer names it."""
    import queue

    from ..interrupt import Interruptible
    from .engine_loop import EngineLoop
    from .multi_turn import ToolRollout
    from .vllm_engine import make_engine
    from .weight_transfer import checkpoint_tensors, sync_bytes_bound, tied_embeddings

    # SIGUSR1 / SIGTERM / a first Ctrl-C: the trainer checkpoints and sends stop; this rank must not die first (a
    # second Ctrl-C aborts it with the rest, as it does the trainer)
    Interruptible().install()
    engine = make_engine(cfg, model_dir, seed=cfg.trainer.seed, in_process=False)
    # rollout.tools: this rank runs each sample's turns and tool calls (in its sandbox) in its loop, as a colocated
    # rank does; the trainer receives the samples with their masks like any others
    tools = ToolRollout.from_config(cfg, model_dir)
    channel, e = roles.control, roles.engine_index
    kind, payload = channel.broadcast_object(None, 0)  # first the weight-transfer group, as the trainer opens it
    if kind != "init":
        raise RuntimeError(f"rollout rank: the trainer's first request was {kind!r}, not init")
    engine.init_receiver({**payload, "rank_offset": payload["rank_offset"] + e})
    results = result_channel(roles, e)  # then the result channel (the trainer builds its end next)
    loop = EngineLoop(engine, cfg.rollout.n, SamplingConfig.from_rollout_config(cfg.rollout), tools=tools)
    step_s = liveness.deadlines.engine_step_s
    sync_s = liveness.deadlines.transfer(sync_bytes_bound(checkpoint_tensors(model_dir), tied_embeddings(model_dir)))
    batches: list[tuple[int, list[int]]] = []  # side batches in progress: (batch id, prompt indices)
    inbox: queue.Queue = queue.Queue()
    channel_free = threading.Event()  # the main thread reads on the channel itself (a sync's metadata, init)

    def listen():  # the control channel, while the main thread steps the engine
        while True:
            try:
                message = channel.broadcast_object(None, 0)
            except BaseException as exc:  # noqa: BLE001  (the trainer is gone: the main thread raises it)
                inbox.put(("failed", exc))
                return
            inbox.put(message)
            if message[0] == "weights":  # the main thread reads the sync's metadata on this channel: wait for it
                channel_free.wait()
                channel_free.clear()
            elif message[0] == "stop":
                return

    threading.Thread(target=listen, daemon=True, name="engine-control").start()
    try:
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
                if kind == "stream":
                    n, sampling, max_seqs = payload
                    loop.configure(n, sampling, max_running_seqs=min(max_seqs, engine.max_num_seqs))
                elif kind == "admit":
                    loop.admit([(g, ids, seed) for g, ids, seed, engine_ in payload if engine_ == e])
                elif kind == "resume":
                    loop.resume([(g, ids, r, v) for g, ids, r, v, engine_ in payload if engine_ == e])
                elif kind == "harvest":
                    with liveness.doing("an engine step", step_s):
                        kept = loop.harvest()
                    results.send_object(("harvest", kept), dst=0)
                elif kind == "weights":
                    try:
                        with liveness.doing("a weight sync", sync_s):
                            dropped = loop.update(lambda: engine.receive_weights(channel),
                                                  min_version=payload)["dropped"]
                    finally:
                        channel_free.set()
                    if dropped:  # the trainer counts them and admits fresh prompts in their place
                        results.send_object(("groups", ([(g, None, v) for g, v in dropped], {}, loop.progress())),
                                            dst=0)
                elif kind == "generate":  # a whole batch beside the stream: this engine's share, seeded by place
                    prompts, bn, bsampling, seed = payload
                    if seed is not None:
                        bsampling = dataclasses.replace(bsampling, seed=seed)
                    mine = list(range(e, len(prompts), roles.num_rollout_ranks))
                    batches.append((loop.add_batch([prompts[i] for i in mine], bn, bsampling, request_indices=mine),
                                    mine))
                elif kind == "stop":
                    liveness.stop()  # the trainer ends too: its silence from now on is no news
                    results.send_object(("end", loop.abort_all()), dst=0)
                    return
                elif kind == "failed":
                    raise RuntimeError(f"rollout rank: the trainer's control channel failed: {payload}")
                else:
                    raise RuntimeError(f"rollout rank: unknown request {kind!r} from the trainer")
                continue  # every message is handled before the next step
            if stop_requested() and batches:  # a stop signal here: the side batches' answer says so (None)
                for _, mine in batches:
                    results.send_object(("batch", (mine, None)), dst=0)
                batches.clear()
                loop.abort_side()
            with liveness.doing("an engine step", step_s):
                groups = loop.step()
            if groups:  # with the running groups' progress: the trainer's load-fed assignment
                results.send_object(("groups", ([(g.gid, g.rollouts, g.admitted_version) for g in groups],
                                                loop.take_stats().sums(), loop.progress())), dst=0)
            for batch in list(batches):
                part = loop.batch_done(batch[0])
                if part is not None:
                    batches.remove(batch)
                    results.send_object(("batch", (batch[1], part)), dst=0)
    finally:
        if tools is not None:
            tools.close()
        engine.shutdown()
