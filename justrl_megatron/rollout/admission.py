"""Admission policies: what the batch source (rollout/stream_source.GroupSource) admits when, which groups a step
takes, and how stale they may be. A new rollout mode is one policy here and one line in rollout/source.SOURCES.

rounds (rollout.source=rounds, the default)
    A step admits a round of trainer.prompts_per_step prompts (seeded by step and round: a round samples what one
    seeded batch call would) and trains exactly those groups once every one has finished. With
    algo.dynamic_sampling, groups whose rewards are all equal are dropped and more rounds are admitted until the
    batch is full (algo/dynamic_sampling.collect_groups). Weight updates wait for the admitted groups (min_version
    None): every round is sampled by one version.
    One-step-off (rollout.max_staleness >= 1 on a placement whose engines overlap training): the next step's round is
    admitted before this step's batch is handed to the update, so the engines generate batch k + 1 with weights
    k - 1 while the trainer updates on batch k; a step costs about max(rollout, update) plus the copy.

streaming (rollout.streaming=true)
    Staleness bound eta = rollout.max_staleness, by admission: at most (eta + 1) * prompts_per_step groups are
    admitted and not yet taken; finished groups' slots are refilled at once and weights land mid-generation. A step
    takes the groups that could not wait another step first (waiting for them if they still run), then any others in
    the order they finished (`_pick`): a prompt admitted while the policy was at version w is trained by the step
    that trains version w + eta, however long its responses. Only when more such groups are outstanding than a step
    takes (after dynamic sampling's rejections) are the rest too old: the engines abort them at the weight update
    that makes them so (`min_version`), the trainer drops any that finished meanwhile, both counted
    (rollout/dropped_*), and fresh prompts take their places. No trained token is ever more than eta versions behind.
"""

from __future__ import annotations

from ..algo.dynamic_sampling import ScoredBatch, collect_groups, round_seed
from ..slurm import stop_requested
from .base import RolloutInterrupted, Rollouts, check_staleness
from .placement import overlaps
from .stream_source import GroupSource


class RoundSource(GroupSource):
    """Synchronous, dynamic-sampling and one-step-off rounds (module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ahead = self.eta >= 1 and self.engines.overlaps  # start step k + 1's round before step k's update
        self.capacity = self.num_groups * (2 if self.ahead else 1) * max(1, self.max_rounds)

    @staticmethod
    def problems(cfg) -> list[str]:
        """Asynchronous rounds need a placement whose rollout overlaps training; staleness beyond one step needs a
        rollout correction."""
        ro, out = cfg.rollout, []
        if ro.max_staleness >= 1 and not overlaps(ro.placement):
            out.append(f"rollout.max_staleness={ro.max_staleness} (asynchronous rollouts) needs "
                       f"rollout.placement=split with rollout.num_rollout_ranks >= 1: a colocated engine shares the "
                       f"trainer's devices, so nothing overlaps; use max_staleness=0")
        return out + correction_problems(cfg)

    def min_version(self, version: int) -> None:
        return None  # a round generates with one version: the weight update waits for it

    def _take_step(self, step: int, version: int):
        waiting = [g for g, a in self._admitted.items() if a.step in (step, None)]  # ahead, or kept at a stop
        rounds = 0

        def draw_batch():
            nonlocal waiting, rounds
            if waiting:  # round 0 was admitted already: the step before admitted it, or a resume kept it
                gids, waiting = waiting, []
            else:
                count = self.num_groups if rounds else max(self.num_groups, len(self._resumed))  # a stop's, whole
                gids = self._admit(count, version, step=step, seed=round_seed(self.seed, step, rounds))
            rounds += 1
            return gids

        taken: dict[int, Rollouts] = {}
        try:
            batch, stats = collect_groups(draw_batch, lambda gids, _: self._collect(gids, version, taken),
                                          group_size=self.n, num_groups=self.num_groups, max_rounds=self.max_rounds,
                                          enabled=self.dynamic_sampling)
        except BaseException:
            self._put_back(taken)
            raise
        gid_of = {id(self._admitted[g].prompt): g for g in taken}
        for gid in taken:  # trained, or dropped for want of reward variance
            del self._admitted[gid]
        if self.ahead and (self.last_step is None or step < self.last_step):
            self._admit(self.num_groups, version, step=step + 1, seed=round_seed(self.seed, step + 1, 0))
        return batch, [gid_of[id(p)] for p in batch.prompts], stats, {}

    def _collect(self, gids: list[int], version: int, taken: dict) -> ScoredBatch:
        """Every group of a round, finished, in admission order, scored together."""
        wanted = set(gids) - set(taken)
        while wanted:
            gid, rollouts, _ = self._buffer.take(lambda items: next((i for i, (g, *_) in enumerate(items)
                                                                     if g in wanted), None), stop=stop_requested)
            wanted.discard(gid)
            taken[gid] = rollouts
        order = [(taken[g], k, i) for i, g in enumerate(gids) for k in range(len(taken[g]))]
        rollouts = Rollouts.in_order(order, min(taken[g].weight_version for g in gids))
        check_staleness(rollouts.weight_version, version, self.eta)
        prompts = [self._admitted[g].prompt for g in gids]
        rewards, correct, stats = self._score(prompts, rollouts)
        return ScoredBatch(prompts, rollouts, list(rewards), list(correct), stats)


class StreamSource(GroupSource):
    """Streaming: admission by the staleness bound, weights mid-generation (module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.capacity = (self.eta + 1) * self.num_groups  # groups admitted and not yet taken

    @staticmethod
    def problems(cfg) -> list[str]:
        """Streaming needs a placement whose engines run beside the trainer, and eta >= 1."""
        ro, out = cfg.rollout, []
        if not overlaps(ro.placement):
            out.append("rollout.streaming=true needs rollout.placement=split: a colocated engine shares the trainer's "
                       "devices, so generation and training cannot overlap; drop rollout.streaming or use split")
        elif ro.max_staleness < 1:
            out.append(f"rollout.streaming=true needs rollout.max_staleness >= 1 (a response may span weight versions "
                       f"and waits in the buffer while the trainer updates), got {ro.max_staleness}")
        if cfg.algo.routing_replay == "rollout":
            out.append("algo.routing_replay=rollout does not work with rollout.streaming=true (the engine loop returns "
                       "no routed experts, and a response may span weight versions); use algo.routing_replay=old")
        return out + correction_problems(cfg)

    def min_version(self, version: int) -> int:
        """Groups started before version - eta could not be trained any more: the engines drop them."""
        return version - self.eta

    def _top_up(self, step: int, version: int) -> None:
        """Top the outstanding groups up to the bound (no more than the remaining steps can take)."""
        room = self.capacity - len(self._admitted)
        if self.last_step is not None:
            room = min(room, (self.last_step - step + 1) * self.num_groups - len(self._admitted))
        if room > 0:
            self._admit(room, version)

    def _pick(self, version: int, needed):
        """Which finished group the step takes next (GroupBuffer.take's `pick`): an engine's drop notice first (it
        frees admission room), then the groups that cannot wait another step (admitted eta or more versions ago:
        trained now or never), then any, in the order they finished. While an expiring group still runs and the step
        has no other room for it, the step waits for it: a long response is trained, not thrown away for a shorter
        one that overtook it (which would bias training against long answers and waste its tokens)."""
        def expiring(gid: int) -> bool:
            return version + 1 - self._admitted[gid].version > self.eta

        def pick(items: list) -> int | None:
            for i, (gid, rollouts, _) in enumerate(items):
                if rollouts is None or expiring(gid):
                    return i
            running = sum(expiring(gid) for gid in self._admitted)  # none is in the buffer (the loop above)
            return 0 if needed() > running else None

        return pick

    def _take_step(self, step: int, version: int):
        self._top_up(step, version)
        kept, zero_variance, taken = [], 0, 0
        pick = self._pick(version, lambda: self.num_groups - len(kept))
        took: dict[int, Rollouts] = {}  # what a stop puts back: the groups this step took to train
        admitted = {}
        while len(kept) < self.num_groups:
            try:
                gid, rollouts, _ = self._buffer.take(pick, stop=stop_requested)
            except RolloutInterrupted:
                self._admitted.update({g: admitted[g] for g in took})  # (dropped ones stay dropped)
                self._put_back(took)
                raise
            admitted[gid] = self._admitted.pop(gid)
            if rollouts is None:  # aborted by its engine: too old to train
                self._counts.dropped_in_engine += 1
                self._top_up(step, version)
                continue
            if version - rollouts.weight_version > self.eta:  # finished, but too old by now
                self._counts.dropped_stale += 1
                self._counts.untrained[gid] = rollouts.sampled_lengths()
                self._top_up(step, version)
                continue
            prompt = admitted[gid].prompt
            rewards, correct, reward_stats = self._score([prompt], rollouts)
            taken += 1
            # dynamic sampling: a group without reward variance teaches nothing; after max_rounds batches' worth of
            # groups the step takes what comes (as the rounds do when they run out)
            if self.dynamic_sampling and len(set(rewards)) == 1 and taken < self.max_rounds * self.num_groups:
                zero_variance += 1
                self._counts.untrained[gid] = rollouts.sampled_lengths()
                self._top_up(step, version)
                continue
            took[gid] = rollouts
            kept.append((prompt, rollouts, rewards, correct, reward_stats, gid))
        figures = {}
        if self.dynamic_sampling:
            figures = {"batch/kept_groups": float(len(kept)), "batch/zero_variance_groups": float(zero_variance)}
        order = [(r, k, g) for g, (_, r, *_) in enumerate(kept) for k in range(len(r))]
        rollouts = Rollouts.in_order(order, min(r.weight_version for _, r, *_ in kept))
        batch = ScoredBatch([p for p, *_ in kept], rollouts, [x for _, _, rw, *_ in kept for x in rw],
                            [x for _, _, _, c, *_ in kept for x in c], kept[-1][4])
        return batch, [gid for *_, gid in kept], None, figures


def correction_problems(cfg) -> list[str]:
    """Samples more than one update old need a rollout correction (every source that trains stale samples)."""
    ro = cfg.rollout
    if ro.max_staleness > 1 and cfg.algo.rollout_correction == "none":
        return [f"rollout.max_staleness={ro.max_staleness} trains on samples up to {ro.max_staleness} updates old; "
                f"set algo.rollout_correction (tis, mis, seq-tis or seq-mis) to correct for it, or use "
                f"max_staleness=1 (one-step-off)"]
    return []
