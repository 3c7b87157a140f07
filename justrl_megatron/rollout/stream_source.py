"""The batch source: groups admitted to the engines, taken back finished, scored, handed to the update. Every rollout
mode is this source with an admission policy (rollout/admission.py: what is admitted when, which groups a step
takes, how stale they may be); the engines are driven one way in all of them (rollout/engines.py, engine_loop.py).

    source.restore(saved, version)               # groups a checkpoint or a stop kept: continued first
    scored = source.next_batch(step, version, timer)   # the step's groups; None: a stop cut the step short
    source.state()                               # the checkpoint's: every admitted group, with its samples if done
    source.stop_state()                          # at a stop: every admitted group with its samples so far

Trainer rank 0 decides and scores; a colocated job's other trainer ranks step their engines meanwhile
(`Engines.follow`), a split job's wait. The step's batch stays on trainer rank 0 (the ScoredStep's `batch` is None
elsewhere): the loop sends each DP replica its samples (train/shard.py); every rank gets the staleness, the step's
figures and the sampler's position.

Nothing is lost at a stop, in any mode: the engines abort every group and hand back what it sampled so far (tokens,
behaviour logprobs, per-token versions); the resumed run continues each group where it stopped, under the weight
version it was admitted at, so the staleness bound still counts from its first token (`rollout/resumed_groups`,
`rollout/resumed_tokens`). After a crash a checkpoint has the finished groups' samples and the prompts of the others,
which are generated anew (`rollout/discarded_at_resume` counts the groups whose work was lost; 0 otherwise). Nothing
is trained twice and no prompt is skipped.

A resume may change the settings a kept group was sampled under: `restore` carries the group or generates it anew,
per setting (the rule is written above `_ANEW`), and says what it did in one line, with the groups and sampled
tokens it threw away. Settings that change the prompt or its tokens are pinned by the checkpoint and refused before
any model loads (run_config.PINNED).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ..algo.dynamic_sampling import ScoredBatch
from ..data.sampler import Prompt
from ..distributed import trainer_broadcast
from ..liveness import PeerLost
from .base import RolloutInterrupted, Rollouts, SamplingConfig, check_staleness
from .engines import engine_figures
from .scoring import score
from .source import ScoredStep


# The rule for a kept group (a stop's or a checkpoint's) when a resume changes a setting it was sampled under: the
# settings are saved with the groups (`drawn_with`, as config keys) and compared in `restore`. A group that cannot go
# on as this run would have sampled it is generated anew from its prompt, first, counted (rollout/discarded_at_resume)
# and named in the resume's one line; nothing is refused here, as regenerating is always right. What the prompt is
# (model.path, model.tokenizer, data.train, data.template, data.system_prompt, data.max_prompt_length, trainer.seed)
# is pinned by the checkpoint (run_config.PINNED): a resume that changes it is refused in one line before any model
# loads. Per setting (key -> why a changed value sends the kept groups to be generated anew):
_ANEW = {
    "rollout.n": "a group's advantages compare exactly n samples of one prompt",
    "rollout.temperature": "its tokens were drawn from another distribution",
    "rollout.top_p": "its tokens were drawn from another distribution",
    "rollout.top_k": "its tokens were drawn from another distribution",
    # and every tool setting that shapes a call's output (rollout/tools.environment: all of them but the number of
    # calls run at once)
    "rollout.tools": "its tool outputs came from another tool environment",
}
# rollout.max_response_length is carried: shorter, a group whose samples all fit goes on (its tokens are what the new
# cap would have drawn), one with a longer sample is generated anew; longer, a sample the old cap cut goes on to the
# new cap (a tool group with such a sample is generated anew: its turns cannot be reopened).
KEPT_LENGTH = "rollout.max_response_length"
# rollout.max_staleness is not a sampling setting but bounds how old a kept group may be when it is trained: a smaller
# one at the resume makes the groups admitted more than eta updates before the resumed weights too old to train, so
# they are generated anew like the above, in the same line (a larger one keeps them all).
_TOO_OLD = "rollout.max_staleness={eta}: admitted more than {eta} update(s) before the resumed weights {version}"


def _why_anew(key: str) -> str:
    if key in _ANEW:
        return _ANEW[key]
    return _ANEW["rollout.tools"] if key.startswith("rollout.tool") else "it was sampled otherwise"


def drawn_with(n: int, sampling: SamplingConfig, tools: dict | None = None) -> dict:
    """The settings a group's samples are drawn under, as config keys (the rule above `_ANEW`); `tools`: the tool
    environment (rollout/tools.environment), None or {} without tools."""
    return {"rollout.n": n, "rollout.temperature": sampling.temperature, "rollout.top_p": sampling.top_p,
            "rollout.top_k": sampling.top_k, "rollout.max_response_length": sampling.max_tokens, **(tools or {})}


@dataclass
class Admitted:
    """A group in the engines' hands: its prompt, the weights it was admitted with, the step it is meant for
    (rounds; None: any), and its request seed."""

    prompt: Prompt
    version: int
    step: int | None = None
    seed: int | None = None


@dataclass
class StepStats:
    """A step's figures, where the loop reads dynamic sampling's (`metrics`, `shortfall`)."""

    figures: dict
    sampling: object = None  # dynamic sampling's rounds (algo/dynamic_sampling.SamplingStats), or None

    def metrics(self) -> dict[str, float]:
        return {**(self.sampling.metrics() if self.sampling is not None else {}), **self.figures}

    def shortfall(self) -> str | None:
        return self.sampling.shortfall() if self.sampling is not None else None


@dataclass
class _Counts:
    dropped_stale: int = 0
    dropped_in_engine: int = 0
    discarded_at_resume: int = 0
    resumed_groups: int = 0
    resumed_tokens: int = 0
    untrained: dict = field(default_factory=dict)  # finished groups a step dropped: gid -> lengths (the planner's)


class GroupSource:
    """The core every admission policy shares (rollout/admission.py subclasses it): admitted groups, the engines'
    buffer, taking, scoring, checkpoints and stops. A policy implements `_take_step(step, version)` on trainer
    rank 0, returning (the step's ScoredBatch, its groups' gids, dynamic sampling's stats or None, figures)."""

    def __init__(self, engines, sampler, scorer, tokenizer, *, n: int, sampling: SamplingConfig, leader: bool,
                 seed: int = 0, max_staleness: int, num_groups: int, dynamic_sampling: bool = False,
                 max_rounds: int = 1, last_step: int | None = None, tools: dict | None = None):
        self.engines, self.sampler, self.scorer, self.tokenizer = engines, sampler, scorer, tokenizer
        self.n, self.sampling, self.seed, self.leader, self.eta = n, sampling, seed, leader, max_staleness
        self.num_groups, self.dynamic_sampling, self.max_rounds = num_groups, dynamic_sampling, max_rounds
        self.last_step = last_step
        self.drawn_with = drawn_with(n, sampling, tools)  # what this run's groups are sampled under
        self._queue: deque[Prompt] = deque()  # drawn (or restored), not admitted yet
        self._admitted: dict[int, Admitted] = {}  # gid -> the group, until a step trains or drops it
        self._next_gid = 0
        self._buffer = None  # trainer rank 0: finished groups (the engines fill it)
        self._finished: dict[int, Rollouts] = {}  # groups a stopped step had taken, not trained
        self._resumed: deque[tuple[Admitted, Rollouts]] = deque()  # groups a stop or a checkpoint kept
        self._counts = _Counts()

    @classmethod
    def from_config(cls, cfg, engines, sampler, scorer, tokenizer, *, leader: bool) -> "GroupSource":
        """rollout.n, sampling, max_staleness and tools; algo's dynamic sampling; trainer's seed and batch size."""
        from .tools import environment

        ro, tr, algo = cfg.rollout, cfg.trainer, cfg.algo
        return cls(engines, sampler, scorer, tokenizer, n=ro.n, sampling=SamplingConfig.from_rollout_config(ro),
                   seed=tr.seed, leader=leader, max_staleness=ro.max_staleness, num_groups=tr.prompts_per_step,
                   dynamic_sampling=algo.dynamic_sampling, max_rounds=algo.max_sampling_rounds,
                   last_step=tr.total_steps, tools=environment(ro))

    capacity: int  # the policy's: groups admitted and not yet taken, at most

    def min_version(self, version: int) -> int | None:
        """The policy's: the oldest weights whose in-flight work the engines keep at an update (None: in-flight
        work finishes before the update)."""
        raise NotImplementedError

    def next_batch(self, step: int, version: int, timer):
        """The step's groups (a ScoredStep, rollout/source.py; its batch on trainer rank 0 only). None: a stop
        (SIGTERM / SIGUSR1 / Ctrl-C) came while the step waited for them: every trainer rank returns None, and what
        the step had taken goes back among the admitted groups. A rollout rank that stopped answering raises
        PeerLost on every trainer rank."""
        full = None
        if self.leader:
            try:
                full = self._leader_step(step, version)
            except RolloutInterrupted:
                full = "interrupted"
            except PeerLost as exc:
                full = exc
            finally:
                self.engines.release()
        else:
            self.engines.follow()
        # the other trainer ranks get what every rank needs, not the batch: rank 0 sends each its samples
        # (train/shard.py)
        light = trainer_broadcast(full[1:] if isinstance(full, tuple) else full)
        if isinstance(light, PeerLost):
            raise light
        if light == "interrupted":
            return None
        stats, seconds, sampler_state = light[1:]
        self.sampler.load_state_dict(sampler_state)  # only trainer rank 0 draws: every rank keeps its position
        timer.seconds |= seconds
        staleness = int(light[0])
        check_staleness(version - staleness, version, self.eta)  # the bound, once more, on every trainer rank
        return ScoredStep(full[0] if self.leader else None, stats, staleness)

    # -- trainer rank 0 ------------------------------------------------------------------------------------------------

    def _open(self):
        if self._buffer is None:
            self._buffer = self.engines.open(self.n, self.sampling, self.capacity)
        return self._buffer

    def _leader_step(self, step: int, version: int):
        buffer = self._open()
        t = time.perf_counter()
        self._timing = {"wait_rollout": 0.0, "reward": 0.0}
        try:
            with torch.profiler.record_function("rollout"):  # named ranges in a profiler trace
                batch, gids, sampling_stats, figures = self._take_step(step, version)
        finally:
            self._timing["wait_rollout"] = max(0.0, time.perf_counter() - t - self._timing["reward"])
        rollouts = batch.rollouts
        versions = [rollouts.versions_of(i) for i in range(len(rollouts))]
        lags = [version - min(v, default=version) for v in versions]
        engine, depth, peak, per_engine = buffer.take_stats()
        engine_s = engine.get("busy_s", 0.0) + engine.get("idle_s", 0.0) + engine.get("paused_s", 0.0)
        counts, self._counts = self._counts, _Counts()
        figures = {
            "rollout/staleness_mean": sum(lags) / len(lags), "rollout/staleness_max": float(max(lags)),
            "rollout/multi_version_frac": sum(len(set(v)) > 1 for v in versions) / len(versions),
            "rollout/engine_occupancy": engine["occupancy_sum"] / engine["steps"] if engine.get("steps") else 0.0,
            "rollout/engine_idle_frac": engine.get("idle_s", 0.0) / engine_s if engine_s else 0.0,
            "rollout/buffer_depth": float(depth), "rollout/buffer_peak": float(peak),
            "rollout/admitted_outstanding": float(len(self._admitted)),
            # each trained group's admission number since this process started (beside response/lengths), and
            # those of the finished groups the step dropped with their lengths: the trace bench/plan.py replays
            "rollout/group_admission": gids,
            "rollout/untrained_admission": list(counts.untrained),
            "rollout/untrained_lengths": [x for lengths in counts.untrained.values() for x in lengths],
            **{f"rollout/{k}": float(v) for k, v in dataclasses.asdict(counts).items() if k != "untrained"},
            **engine_figures(per_engine), **figures,
        }
        seconds = {**self._timing, "rollout": self._timing["wait_rollout"], "rollout_idle": engine.get("idle_s", 0.0),
                   "rollout_paused": engine.get("paused_s", 0.0), "rollout_busy": engine.get("busy_s", 0.0)}
        batch.rewards, batch.correct = list(batch.rewards), list(batch.correct)
        return batch, int(figures["rollout/staleness_max"]), StepStats(figures, sampling_stats), seconds, \
            self.sampler.state_dict()

    def _draw(self) -> Prompt:
        if not self._queue:
            self._queue.extend(self.sampler.next_batch())
        return self._queue.popleft()

    def _too_old(self, kept: Admitted, version: int) -> bool:
        """A kept group admitted more than eta updates before weights `version` may not be trained with them (at the
        resume, and again when it waited for admission room)."""
        return kept.version < version - self.eta

    def _admit(self, count: int, version: int, *, step: int | None = None, seed: int | None = None) -> list[int]:
        """`count` groups: the kept ones first (continued under their own admission's version, unless one waited
        for admission room past the bound, as more kept groups than the policy admits at once may: then generated
        anew and counted; `restore` decided the others), then drawn prompts. `seed`: the round's (each group's
        request seed: seed + its place in the round x n). Returns their gids."""
        resumed, fresh, gids = [], [], []
        for i in range(count):
            gid = self._next_gid
            self._next_gid += 1
            gids.append(gid)
            group_seed = None if seed is None else seed + i * self.n
            if self._resumed:
                kept, samples = self._resumed.popleft()
                if not self._too_old(kept, version):
                    self._admitted[gid] = dataclasses.replace(kept, step=step)
                    resumed.append((gid, kept.prompt.ids, samples, kept.version))
                    continue
                self._counts.discarded_at_resume += 1
                prompt = kept.prompt
            else:
                prompt = self._draw()
            self._admitted[gid] = Admitted(prompt, version, step, group_seed)
            fresh.append((gid, prompt.ids, group_seed))
        self.engines.resume(resumed)
        self.engines.admit(fresh)
        return gids

    def _score(self, prompts, rollouts) -> tuple:
        t = time.perf_counter()
        with torch.profiler.record_function("reward"):
            got = score(self.scorer, self.tokenizer, prompts, rollouts, self.n)
        self._timing["reward"] += time.perf_counter() - t
        return got

    def _put_back(self, taken: dict[int, Rollouts]) -> None:
        """A stop cut the step short: the groups it had taken stay admitted, their samples kept for `stop_state`."""
        self._finished.update(taken)

    # -- checkpoints ---------------------------------------------------------------------------------------------------

    def _saved(self, samples: dict[int, Rollouts], *, lost: bool) -> dict:
        """Every admitted group as plain data, with its samples where known, then the groups restored and not
        admitted again yet (a stop right after a resume keeps them as they were), and the drawn prompts. `lost`:
        whether an admitted group without samples had work that a resume from this state cannot continue (a
        checkpoint's in-flight groups)."""
        def record(a: Admitted, r: Rollouts | None, lost: bool) -> dict:
            return {"prompt": dataclasses.asdict(a.prompt), "version": a.version, "step": a.step, "seed": a.seed,
                    "samples": None if r is None else dataclasses.asdict(r), "lost": lost}

        groups = [record(a, samples.get(gid), lost and gid not in samples) for gid, a in sorted(self._admitted.items())]
        return {"groups": groups + [record(a, r, False) for a, r in self._resumed],
                "prompts": [dataclasses.asdict(p) for p in self._queue], "drawn_with": dict(self.drawn_with)}

    def _buffered(self) -> dict[int, Rollouts]:
        """Finished groups in the buffer, not taken (left in it)."""
        return {} if self._buffer is None else self._buffer.peek()

    def state(self) -> dict:
        """For the checkpoint (every trainer rank calls it, before reading the sampler's position): every admitted
        group (finished ones with their samples), the groups kept for continuing, and the drawn prompts."""
        out = None
        if self.leader:
            out = {**self._saved({**self._finished, **self._buffered()}, lost=True),
                   "sampler": self.sampler.state_dict()}
        out = trainer_broadcast(out)
        self.sampler.load_state_dict(out.pop("sampler"))
        return out

    def stop_state(self) -> dict | None:
        """At a stop, once its checkpoint is saved or queued (trainer rank 0; None elsewhere): every admitted group
        with what it sampled so far (the engines abort them and hand it back; finished ones come from the buffer),
        then the drawn prompts. The engines generate nothing more in this run."""
        if not self.leader:
            return None
        samples = dict(self._finished)
        try:
            samples.update(self.engines.harvest())  # each engine's finished groups arrive before its answer
        except PeerLost:  # a rollout rank stopped answering: the run ends naming it (placement.shutdown)
            return None
        except Exception as exc:  # noqa: BLE001 - an engine gone: the checkpoint's prompts still resume the run
            print(f"justrl-train: warning: the rollout ranks did not hand back their groups at the stop ({exc}); "
                  f"the resumed run generates them anew", flush=True)
            return None
        samples.update(self._buffered())
        return self._saved(samples, lost=False)

    def restore(self, state: dict | None, version: int) -> None:
        """Take back what `state` or `stop_state` saved, for a run that resumes with weights `version`: groups with
        samples are continued first (under their admission's version), the others generated anew before any newly
        drawn prompt. Groups sampled under other settings than this run's, or too old for its staleness bound, are
        carried or generated anew as the rule above `_ANEW` says; so are those beyond what its policy admits at once
        (`capacity`: synchronous rounds after a streaming run), which would wait and age. One line (trainer rank 0)
        says what was continued and what was not, why, and how many sampled tokens that threw away."""
        if not state:
            return
        then = state.get("drawn_with")  # None: saved before the settings were kept (only n and lengths can be told)
        now = self.drawn_with
        changed = [] if then is None else [
            f"{key} {then.get(key)} -> {now.get(key)}: {_why_anew(key)}" for key in sorted(then.keys() | now.keys())
            if key != KEPT_LENGTH and then.get(key) != now.get(key)]
        fresh, anew, lost, unstarted = [], {}, 0, 0
        resumed_before = self._counts.resumed_groups
        for g in state.get("groups", []):
            kept = Admitted(Prompt(**g["prompt"]), int(g["version"]), g.get("step"), g.get("seed"))
            if g["samples"] is None:
                fresh.append(kept.prompt)
                lost += bool(g.get("lost"))
                unstarted += not g.get("lost")
                continue
            samples = Rollouts(**g["samples"])
            why = "; ".join(changed) or self._unfit(samples, then) or (
                _TOO_OLD.format(eta=self.eta, version=version) if self._too_old(kept, version) else None)
            if not why and self._counts.resumed_groups - resumed_before >= self.capacity:
                why = f"more than the {self.capacity} group(s) this run admits at once"
            if why:
                fresh.append(kept.prompt)
                groups, tokens = anew.get(why, (0, 0))
                anew[why] = (groups + 1, tokens + samples.num_tokens)
                continue
            self._resumed.append((kept, samples))
            self._counts.resumed_groups += 1
            self._counts.resumed_tokens += samples.num_tokens
        if "groups" not in state:  # saved by an older version of this source: its prompts are generated anew
            lost += int(state.get("outstanding", 0))
        self._counts.discarded_at_resume += lost + sum(groups for groups, _ in anew.values())
        self._queue.extendleft(reversed(fresh + [Prompt(**p) for p in state.get("prompts", [])]))
        if self.leader:
            line = _restore_line(self._counts.resumed_groups - resumed_before, unstarted, lost, anew)
            if line:
                print(f"justrl-train: {line}", flush=True)

    def _unfit(self, samples: Rollouts, then: dict | None) -> str | None:
        """Why a kept group sampled under `then` (its drawn_with; None: not saved) cannot go on in this run, or None;
        a sample that the old, shorter rollout.max_response_length cut is reopened to go on to this run's."""
        cap, old_cap = self.sampling.max_tokens, (then or {}).get(KEPT_LENGTH)
        if len(samples) != self.n:
            return f"rollout.n {len(samples)} -> {self.n}: {_why_anew('rollout.n')}"
        longest = max(map(len, samples.token_ids), default=0)
        if longest > cap:
            return f"{KEPT_LENGTH} {old_cap or 'longer'} -> {cap}: a sample is longer ({longest} tokens)"
        cut = [k for k, (reason, tokens) in enumerate(zip(samples.finish_reasons, samples.token_ids))
               if reason == "length" and len(tokens) < cap]
        if cut and old_cap is not None and old_cap < cap:
            if samples.sampled_mask is not None:
                return f"{KEPT_LENGTH} {old_cap} -> {cap}: the old cap cut a tool sample, whose turns cannot reopen"
            for k in cut:  # its tokens are what the longer cap would have drawn so far: it goes on from there
                samples.finish_reasons[k], samples.truncated[k] = "abort", False
        return None


def _restore_line(continued: int, fresh: int, lost: int, anew: dict[str, tuple[int, int]]) -> str | None:
    """The resume's one line about the saved work in flight (None: there was none); `anew`: why -> (kept groups,
    their sampled tokens) generated anew for that reason."""
    parts = [f"{continued} kept group(s) continue where they stopped"] if continued else []
    if anew:
        groups, tokens = (sum(counts) for counts in zip(*anew.values()))
        whys = "; ".join(why + (f" ({count})" if len(anew) > 1 else "") for why, (count, _) in anew.items())
        parts.append(f"{groups} kept group(s) are generated anew, their {tokens} sampled token(s) dropped ({whys})")
    if lost:
        parts.append(f"{lost} group(s) whose samples were lost (the run ended without a stop) are generated anew")
    if fresh:
        parts.append(f"{fresh} admitted prompt(s) had sampled nothing yet and start now")
    return ("work in flight: " + "; ".join(parts)) if parts else None
