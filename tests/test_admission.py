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

    return RoundSource(engines, _sampler(), kwargs.pop("scorer", Scorer()), Tokenizer(), n=kwargs.pop("n", 2),
                       sampling=kwargs.pop("sampling", SamplingConfig(max_tokens=4)), leader=True, seed=7,
                       max_staleness=eta, num_groups=groups, **kwargs)


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
    resumed.restore(state, 0)
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
    source.restore(state, 0)
    scored = source.next_batch(1, 0, Timer())
    assert [p.id for p in scored.batch.prompts][0] == "0" and not engines.resumed  # admitted anew, not continued
    assert scored.sampling_stats.metrics()["rollout/discarded_at_resume"] == 1
    assert capsys.readouterr().out.count("generated anew") == 1



# --- a resume that changes what a kept group is (rollout/stream_source.py: the rule above _ANEW) ---------------------

SAMPLING = {"rollout.temperature": "temperature", "rollout.top_p": "top_p", "rollout.top_k": "top_k",
            "rollout.max_response_length": "max_tokens"}
PYTHON_TOOL = {"rollout.tools": ["python"], "rollout.tool.max_turns": 4, "rollout.tool.timeout_s": 5.0,
               "rollout.tool.memory_mb": 512, "rollout.tool.max_output_chars": 1024, "rollout.tool.sandbox": "auto",
               "rollout.tool.packages": ["sympy", "numpy"]}


def _settings(n=2, tools=None, **sampling):
    """(n, SamplingConfig, tools) of a run: _rounds' (n 2, max_tokens 4) with `sampling` given by config key."""
    values = {SAMPLING[k]: v for k, v in {"rollout.max_response_length": 4, **sampling}.items()}
    return n, SamplingConfig(**values), tools


def _kept_state(settings, lengths=(1, 1), reasons=None, mask=None):
    """What a stop keeps of one group of len(lengths) samples drawn under `settings` (_settings)."""
    from justrl_megatron.rollout.stream_source import drawn_with

    samples = {"prompt_index": [0] * len(lengths), "token_ids": [[5] * k for k in lengths],
               "logprobs": [[-1.0] * k for k in lengths], "finish_reasons": list(reasons or ["abort"] * len(lengths)),
               "weight_version": 0, "sampled_mask": mask}
    state = {"groups": [{"prompt": {"ids": [1], "answer": 0, "data_source": "t", "id": "0"}, "version": 0, "step": 1,
                         "seed": None, "lost": False, "samples": samples}],
             "prompts": [], "drawn_with": drawn_with(*settings)}
    return json.loads(json.dumps(state))  # as the checkpoint stores it


def _resume(state, settings, capsys, eta=0, version=0):
    """(a source of a run under `settings` with staleness bound `eta` that restored `state` at weights `version`, the
    one line it said)."""
    n, sampling, tools = settings
    source = _rounds(SeededEngines({}, eta), eta=eta, n=n, sampling=sampling, tools=tools)
    source.restore(state, version)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    return source, lines[0]


@pytest.mark.parametrize("key, then, now", [
    ("rollout.n", 2, 4),
    ("rollout.temperature", 1.0, 0.7),
    ("rollout.top_p", 0.9, 1.0),
    ("rollout.top_k", 50, -1),
    ("rollout.tools", None, PYTHON_TOOL),  # a plain group into a tool run
    ("rollout.tools", PYTHON_TOOL, None),  # a tool group into a plain run
    ("rollout.tool.timeout_s", PYTHON_TOOL, {**PYTHON_TOOL, "rollout.tool.timeout_s": 30.0}),
    ("rollout.tool.packages", PYTHON_TOOL, {**PYTHON_TOOL, "rollout.tool.packages": ["sympy"]}),
])
def test_a_kept_group_sampled_otherwise_is_generated_anew_counted_in_one_line(key, then, now, capsys):
    """The probe's case first: groups of 2 kept at a stop and resumed with rollout.n=4 were continued into a batch of
    4-sample groups (logprob_diff 0.124, ratio_max 2.05). A kept group sampled under another group size, another
    distribution or another tool environment goes back to its prompt, first, counted, and the line names why."""
    def run(value):
        if key == "rollout.n":
            return _settings(n=value)
        return _settings(tools=value) if key.startswith("rollout.tool") else _settings(**{key: value})

    source, line = _resume(_kept_state(run(then)), run(now), capsys)
    assert not source._resumed and [p.id for p in source._queue] == ["0"]  # its prompt, before any new one
    assert source._counts.discarded_at_resume == 1 and source._counts.resumed_groups == 0
    assert line.startswith("justrl-train: work in flight: 1 kept group(s) are generated anew, their 2 sampled "
                           "token(s) dropped (") and key in line, line


def test_a_smaller_staleness_bound_regenerates_the_kept_groups_it_makes_too_old_and_says_so(capsys):
    """Kept groups admitted at weights 0 and 1, resumed at weights 1: with rollout.max_staleness=0 the older one
    cannot be trained any more and is generated anew, named in the line (it used to say "2 kept group(s) continue"
    and then drop one at admission); with max_staleness=1 both go on."""
    state = _kept_state(_settings())
    later = json.loads(json.dumps(state["groups"][0]))
    later["version"], later["prompt"]["id"] = 1, "1"
    state["groups"].append(later)
    source, line = _resume(json.loads(json.dumps(state)), _settings(), capsys, eta=0, version=1)
    assert [kept.prompt.id for kept, _ in source._resumed] == ["1"] and [p.id for p in source._queue] == ["0"]
    assert source._counts.discarded_at_resume == 1 and source._counts.resumed_groups == 1
    assert line == ("justrl-train: work in flight: 1 kept group(s) continue where they stopped; 1 kept group(s) are "
                    "generated anew, their 2 sampled token(s) dropped (rollout.max_staleness=0: admitted more than 0 "
                    "update(s) before the resumed weights 1)")
    source, line = _resume(json.loads(json.dumps(state)), _settings(), capsys, eta=1, version=1)
    assert len(source._resumed) == 2 and source._counts.discarded_at_resume == 0


def test_a_kept_group_goes_on_where_only_the_number_of_tool_workers_changed(capsys):
    """rollout.tool.workers sets how many calls run at once, not what a call answers: the group is carried."""
    from justrl_megatron.config import compose
    from justrl_megatron.rollout.tools import environment

    before = environment(compose(["rollout.tools=[python]", "rollout.tool.workers=4"]).rollout)
    after = environment(compose(["rollout.tools=[python]", "rollout.tool.workers=1"]).rollout)
    assert before == after and before["rollout.tools"] == ["python"]
    source, line = _resume(_kept_state(_settings(tools=before)), _settings(tools=after), capsys)
    assert len(source._resumed) == 1 and source._counts.discarded_at_resume == 0
    assert line == "justrl-train: work in flight: 1 kept group(s) continue where they stopped"


def test_a_shorter_cap_carries_the_groups_that_fit_and_regenerates_the_others(capsys):
    """rollout.max_response_length 4 -> 2: a group whose samples fit is what the shorter cap would have drawn; one
    with a longer sample is generated anew."""
    fits = _kept_state(_settings(), lengths=(2, 1), reasons=["stop", "abort"])
    source, line = _resume(fits, _settings(**{"rollout.max_response_length": 2}), capsys)
    assert len(source._resumed) == 1 and source._counts.discarded_at_resume == 0
    longer = _kept_state(_settings(), lengths=(3, 1))
    source, line = _resume(longer, _settings(**{"rollout.max_response_length": 2}), capsys)
    assert not source._resumed and source._counts.discarded_at_resume == 1
    assert "rollout.max_response_length 4 -> 2: a sample is longer (3 tokens)" in line, line


def test_a_longer_cap_reopens_the_samples_the_old_cap_cut(capsys):
    """rollout.max_response_length 4 -> 8: a sample the old cap ended ("length") goes on to the new cap (its tokens
    are what the longer cap would have drawn so far); a tool group with such a sample is generated anew."""
    state = _kept_state(_settings(), lengths=(4, 2), reasons=["length", "stop"])
    source, line = _resume(state, _settings(**{"rollout.max_response_length": 8}), capsys)
    ((_, samples),) = source._resumed
    assert samples.finish_reasons == ["abort", "stop"] and samples.truncated == [False, False]
    assert source._counts.discarded_at_resume == 0 and "1 kept group(s) continue" in line
    tool = _kept_state(_settings(tools=PYTHON_TOOL), lengths=(4, 2), reasons=["length", "stop"],
                       mask=[[1, 1, 0, 1], [1, 1]])
    source, line = _resume(tool, _settings(tools=PYTHON_TOOL, **{"rollout.max_response_length": 8}), capsys)
    assert not source._resumed and source._counts.discarded_at_resume == 1
    assert "the old cap cut a tool sample" in line, line


def _streaming_stop(monkeypatch, steps_before):
    """What a streaming run (eta 1, 2 groups a step) keeps at a stop in step `steps_before` + 1, after training
    `steps_before` steps: its 4 admitted groups, each with its samples so far."""
    import justrl_megatron.rollout.admission as admission
    from test_streaming import ScriptedEngines, _pipeline

    engines = ScriptedEngines({g: 3 for g in range(1, 8)}, 1)  # group 0 finishes at once, the others run on
    streaming = _pipeline(engines, _sampler(), 1)
    engines.publish(0)
    for step in range(1, steps_before + 1):
        streaming.next_batch(step, step - 1, Timer())
        engines.publish(step)
    engines.frozen = True
    monkeypatch.setattr(admission, "stop_requested", lambda: True)
    assert streaming.next_batch(steps_before + 1, steps_before, Timer()) is None
    monkeypatch.setattr(admission, "stop_requested", lambda: False)
    return json.loads(json.dumps(streaming.stop_state()))


def test_a_colocated_resume_of_a_streaming_stop_continues_one_round_and_says_what_is_generated_anew(
        monkeypatch, capsys):
    """A streaming run keeps up to (eta + 1) rounds of groups; synchronous rounds (colocated) train one round at a
    time. The resume said "4 kept group(s) continue" and then overfilled the round's buffer: the line counts what the
    restore does (a round's worth continues, the rest is generated anew, first) and the steps train exactly that."""
    state = _streaming_stop(monkeypatch, 0)
    assert [(g["prompt"]["id"], g["version"]) for g in state["groups"]] == [(str(i), 0) for i in range(4)]
    capsys.readouterr()
    engines = SeededEngines({}, 0, overlaps=False)
    rounds = _rounds(engines)
    rounds.restore(state, 0)
    assert capsys.readouterr().out.splitlines() == [
        "justrl-train: work in flight: 2 kept group(s) continue where they stopped; 2 kept group(s) are generated "
        "anew, their 4 sampled token(s) dropped (more than the 2 group(s) this run admits at once)"]
    engines.publish(0)
    first = rounds.next_batch(1, 0, Timer())
    assert [p.id for p in first.batch.prompts] == ["0", "1"] and [g for g, *_ in engines.resumed] == [0, 1]
    figures = first.sampling_stats.metrics()
    assert figures["rollout/resumed_groups"] == 2 and figures["rollout/discarded_at_resume"] == 2
    engines.publish(1)
    assert [p.id for p in rounds.next_batch(2, 1, Timer()).batch.prompts] == ["2", "3"]  # their prompts, next


def test_kept_groups_older_than_the_resumed_runs_bound_are_generated_anew_in_the_resume_line(monkeypatch, capsys):
    """Groups a streaming run admitted at weights 0 and kept at a stop in step 2 are one update old when the run
    resumes at weights 1: synchronous rounds (max_staleness 0) cannot train them, so the line says they are
    generated anew (it said they continue), and the groups admitted at weights 1 go on."""
    state = _streaming_stop(monkeypatch, 1)
    assert [(g["prompt"]["id"], g["version"]) for g in state["groups"]] == [("2", 0), ("3", 0), ("4", 1), ("5", 1)]
    capsys.readouterr()
    engines = SeededEngines({}, 0, overlaps=False)
    rounds = _rounds(engines)
    rounds.restore(state, 1)
    assert capsys.readouterr().out.splitlines() == [
        "justrl-train: work in flight: 2 kept group(s) continue where they stopped; 2 kept group(s) are generated "
        "anew, their 4 sampled token(s) dropped (rollout.max_staleness=0: admitted more than 0 update(s) before the "
        "resumed weights 1)"]
    engines.publish(1)
    first = rounds.next_batch(2, 1, Timer())
    assert [p.id for p in first.batch.prompts] == ["4", "5"] and [v for *_, v in engines.resumed] == [1, 1]
    figures = first.sampling_stats.metrics()
    assert figures["rollout/resumed_groups"] == 2 and figures["rollout/discarded_at_resume"] == 2
    engines.publish(2)
    assert [p.id for p in rounds.next_batch(3, 2, Timer()).batch.prompts] == ["2", "3"]


def _mode(mode, engines, n):
    """A source of `mode` (synchronous and one-step-off rounds, streaming) over `engines`, with groups of n."""
    from justrl_megatron.rollout.admission import StreamSource

    if mode == "streaming":
        return StreamSource(engines, _sampler(), Scorer(), Tokenizer(), n=n, sampling=SamplingConfig(max_tokens=4),
                            leader=True, max_staleness=1, num_groups=2)
    return _rounds(engines, eta={"synchronous": 0, "one_step_off": 1}[mode], n=n)


@pytest.mark.parametrize("mode", ["synchronous", "one_step_off", "streaming"])
def test_every_mode_regenerates_what_a_stop_kept_when_the_resume_changes_the_group_size(mode, monkeypatch, capsys):
    """The probe's case through a real stop and the resumed run's first step, in every mode that keeps in-flight
    work: groups of 2 kept at a stop and resumed with rollout.n=3 reach no engine as continuations; their prompts are
    sampled anew first, the step trains groups of 3 only, and the one line counts the groups and tokens dropped."""
    import justrl_megatron.rollout.admission as admission

    eta = 0 if mode == "synchronous" else 1
    engines = SeededEngines({1: 3, 2: 3, 3: 3}, eta)  # group 0 finishes at once, the others are cut short
    engines.frozen = True
    stopped = _mode(mode, engines, n=2)
    engines.publish(0)
    monkeypatch.setattr(admission, "stop_requested", lambda: True)
    assert stopped.next_batch(1, 0, Timer()) is None
    state = json.loads(json.dumps(stopped.stop_state()))  # as at_stop.pt keeps it
    kept = [g for g in state["groups"] if g["samples"] is not None]
    tokens = sum(len(t) for g in kept for t in g["samples"]["token_ids"])
    assert len(kept) == len(state["groups"]) >= 2 and state["drawn_with"]["rollout.n"] == 2
    monkeypatch.setattr(admission, "stop_requested", lambda: False)
    capsys.readouterr()
    engines = SeededEngines({}, eta)
    resumed = _mode(mode, engines, n=3)
    resumed.restore(state, 0)
    assert capsys.readouterr().out.splitlines() == [
        f"justrl-train: work in flight: {len(kept)} kept group(s) are generated anew, their {tokens} sampled token(s) "
        f"dropped (rollout.n 2 -> 3: a group's advantages compare exactly n samples of one prompt)"]
    engines.publish(0)
    scored = resumed.next_batch(1, 0, Timer())
    assert not engines.resumed and engines.admitted[:len(kept)] == list(range(len(kept)))  # anew, first
    assert [p.id for p in scored.batch.prompts] == [g["prompt"]["id"] for g in kept[:2]]
    assert len(scored.batch.rollouts) == 2 * 3  # every trained group has this run's 3 samples
    figures = scored.sampling_stats.metrics()
    assert figures["rollout/discarded_at_resume"] == len(kept) and figures["rollout/resumed_groups"] == 0

