"""The rounds admission policy (rollout/admission.RoundSource: synchronous, dynamic-sampling and one-step-off rounds)
against scripted engines: what a step admits, with which seeds, what it takes, and what a stop keeps. The streaming
policy's own tests are in tests/test_streaming.py (same scripted engines)."""

from __future__ import annotations

import json

import pytest

from justrl_megatron.algo.dynamic_sampling import round_seed
from justrl_megatron.rollout import SamplingConfig
from test_streaming import Scorer, ScriptedEngines, Timer, Tokenizer, _sampler


class SeededEngines(ScriptedEngines):
    """The scripted engines, recording each admitted group's request seed; `overlaps` as the placement's."""

    def __init__(self, lengths, eta, overlaps=True):
        super().__init__(lengths, eta)
        self.overlaps, self.seeds = overlaps, {}

    def admit(self, batch):
        self.seeds.update({gid: seed for gid, _, seed in batch})
        super().admit(batch)


def _rounds(engines, eta=0, groups=2, **kwargs):
    from justrl_megatron.rollout.admission import RoundSource

    return RoundSource(engines, _sampler(), kwargs.pop("scorer", Scorer()), Tokenizer(), n=2,
                       sampling=SamplingConfig(max_tokens=4), leader=True, seed=7, max_staleness=eta,
                       num_groups=groups, **kwargs)


@pytest.fixture(autouse=True)
def single_trainer(monkeypatch):
    import justrl_megatron.rollout.stream_source as core

    monkeypatch.setattr(core, "trainer_broadcast", lambda obj: obj)  # one trainer rank


def test_a_synchronous_round_is_seeded_by_step_and_place_and_trained_whole_in_prompt_order():
    """A round samples what one seeded batch call would: group i's request seed is the round's seed + i x n (as
    VLLMEngine.generate seeds a batch); the step trains exactly the round's groups, in the order they were drawn,
    and nothing is admitted ahead (min_version None: the update waits for nothing)."""
    engines = SeededEngines({1: 1}, 0)  # group 1 finishes only after the next update: the step waits for it
    source = _rounds(engines)
    engines.publish(0)
    scored = source.next_batch(1, 0, Timer())
    assert [p.id for p in scored.batch.prompts] == ["0", "1"] and scored.staleness == 0
    assert engines.seeds == {0: round_seed(7, 1, 0), 1: round_seed(7, 1, 0) + 2}
    assert not source._admitted and source.min_version(1) is None
    assert engines.waits == [1]  # taken only once it had finished


def test_dynamic_sampling_rounds_are_seeded_per_round_and_keep_only_groups_with_reward_variance():
    class EvenGroupsAllWrong(Scorer):
        def evaluate(self, texts, answers):  # a group's texts are "[gid, k]": even groups get no reward variance
            rewards = [0.0 if int(t.strip("[]").split(",")[0]) % 2 == 0 else float(i % 2) for i, t in enumerate(texts)]
            return rewards, [r > 0 for r in rewards]

    engines = SeededEngines({}, 0)
    source = _rounds(engines, scorer=EvenGroupsAllWrong(), dynamic_sampling=True, max_rounds=3)
    engines.publish(0)
    scored = source.next_batch(1, 0, Timer())
    figures = scored.sampling_stats.metrics()
    assert figures["batch/sampling_rounds"] == 2 and figures["batch/kept_groups"] == 2
    assert [p.id for p in scored.batch.prompts] == ["1", "3"]  # the odd groups of rounds 0 and 1
    assert engines.seeds[2] == round_seed(7, 1, 1)  # round 1's first group
    assert not source._admitted  # the rejected groups are not kept either


def test_one_step_off_admits_the_next_round_before_the_update_and_trains_it_one_version_behind():
    engines = SeededEngines({}, 1)
    source = _rounds(engines, eta=1, last_step=3)
    engines.publish(0)
    first = source.next_batch(1, 0, Timer())
    assert first.staleness == 0 and sorted(source._admitted) == [2, 3]  # step 2's round, generating with weights 0
    assert engines.seeds[2] == round_seed(7, 2, 0)
    engines.publish(1)
    second = source.next_batch(2, 1, Timer())
    assert second.staleness == 1 and [p.id for p in second.batch.prompts] == ["2", "3"]
    engines.publish(2)
    source.next_batch(3, 2, Timer())
    assert not source._admitted  # the last step admits nothing ahead


def test_a_colocated_placement_never_rounds_ahead():
    source = _rounds(SeededEngines({}, 1, overlaps=False), eta=1)
    assert not source.ahead


def test_a_stop_mid_round_keeps_every_group_and_the_resume_continues_the_round(monkeypatch):
    """A stop while the round waits for a long group: the step ends (None), stop_state keeps the finished group
    whole and the running one with its samples so far; a resumed source continues both first (counted: resumed
    groups and tokens, nothing discarded) and trains exactly that round's prompts."""
    import justrl_megatron.rollout.admission as admission

    engines = SeededEngines({1: 3}, 0)
    engines.frozen = True
    source = _rounds(engines)
    engines.publish(0)
    monkeypatch.setattr(admission, "stop_requested", lambda: True)
    assert source.next_batch(1, 0, Timer()) is None
    state = json.loads(json.dumps(source.stop_state()))
    groups = state["groups"]
    assert [g["prompt"]["id"] for g in groups] == ["0", "1"] and not any(g["lost"] for g in groups)
    assert groups[0]["samples"]["finish_reasons"] == ["stop", "stop"]
    assert groups[1]["samples"]["finish_reasons"] == ["abort", "abort"]
    monkeypatch.setattr(admission, "stop_requested", lambda: False)
    resumed_engines = SeededEngines({}, 0)
    resumed = _rounds(resumed_engines)
    resumed.restore(state)
    resumed_engines.publish(0)
    again = resumed.next_batch(1, 0, Timer())
    assert [p.id for p in again.batch.prompts] == ["0", "1"] and [g for g, *_ in resumed_engines.resumed] == [0, 1]
    figures = again.sampling_stats.metrics()
    assert figures["rollout/resumed_groups"] == 2 and figures["rollout/discarded_at_resume"] == 0
    assert figures["rollout/resumed_tokens"] == 2 * 2 + 2 * 1


def test_kept_groups_of_another_group_size_are_generated_anew_with_one_line(capsys):
    """A resume with another rollout.n (or a shorter cap) cannot train the groups a stop kept as they are: their
    prompts are generated anew, first, counted as discarded, and one line says so."""
    engines = SeededEngines({}, 0)
    source = _rounds(engines)
    engines.publish(0)
    state = {"groups": [{"prompt": {"ids": [1], "answer": 0, "data_source": "t", "id": "0"}, "version": 0,
                         "step": 1, "seed": None, "lost": False,
                         "samples": {"prompt_index": [0] * 3, "token_ids": [[5]] * 3, "logprobs": [[-1.0]] * 3,
                                     "finish_reasons": ["abort"] * 3, "weight_version": 0}}], "prompts": []}
    source.restore(state)
    scored = source.next_batch(1, 0, Timer())
    assert [p.id for p in scored.batch.prompts][0] == "0" and not engines.resumed  # admitted anew, not continued
    assert scored.sampling_stats.metrics()["rollout/discarded_at_resume"] == 1
    assert capsys.readouterr().out.count("generated anew") == 1
