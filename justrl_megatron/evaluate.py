"""justrl-eval: avg@N accuracy of a model on a local dataset through vLLM.

    justrl-eval --model DIR --data JustRL/data/AIME24/test.parquet --out runs/eval_aime24     # N=32, 31,744 tokens
    justrl-eval --model runs/x/checkpoints/step_000100 --data math500.jsonl --format math
    justrl-eval --model builtin:smollm2-135m-instruct --data builtin:champ-numeric --protocol ours --n 4

--protocol justrl (default) is JustRL's eval (evals/gen_vllm.py): N samples per problem by benchmark (32 for AIME24/25,
AMC23, HMMT, BRUMO, CMIMC; 4 for MATH-500, Minerva, OlympiadBench: --benchmark, else read off the data's file and
folder names; --n wins), max_tokens 31,744 (capped to the model's context), temperature 0.7, top_p 0.9, prompt
"{problem} Please reason step by step, ..." (a space before the instruction). --protocol ours: N=4, 15,360 tokens, the
training prompt ("{problem}\n\nPlease reason ...").
--data reads JustRL's eval parquets (verl layout: chat-list `prompt`, `reward_model.ground_truth`, some stored as
\\boxed{X}) and plain problem/answer files alike; the [data] line says which columns it used.
--model is an HF folder, or a training/megatron checkpoint dir (converted to HF on the fly, into --out).
Writes samples.jsonl (one line per sample: id, sample index, response, reward, correct) and summary.json.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

# JustRL's evals/gen_vllm.py: samples per problem, keyed by what the benchmark's name starts with.
BENCHMARK_N = {"aime": 32, "amc": 32, "hmmt": 32, "brumo": 32, "cmimc": 32, "math500": 4, "minerva": 4, "olympiad": 4}
PROTOCOLS = {
    # protocol: (default N, max new tokens, prompt template)
    "justrl": (4, 31744, "justrl_eval"),
    "ours": (4, 15360, "justrl_stripped"),  # the training prompt on a bare problem
}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="justrl-eval", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="HF folder or megatron checkpoint dir")
    p.add_argument("--data", required=True, help="parquet/jsonl/json file, or generated:<task>")
    p.add_argument("--format", default="generic", help="dapo | gsm8k | math | aime | countdown | mbpp | generic")
    p.add_argument("--protocol", default="justrl", choices=sorted(PROTOCOLS),
                   help="justrl: JustRL's eval (N by benchmark, 31,744 tokens, space-joined prompt); ours: N=4, 15,360")
    p.add_argument("--benchmark", default=None,
                   help=f"picks N under --protocol justrl ({', '.join(BENCHMARK_N)}...); default: from the file name")
    p.add_argument("--n", type=int, default=None, help="samples per problem (avg@N); default: the protocol's")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first LIMIT problems")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per sample; default: the protocol's")
    p.add_argument("--template", default=None, help="prompt template (data/prompts.py); default: the protocol's")
    p.add_argument("--reward", default="dapo_then_math_verify", help="verifier name (see justrl_megatron.rewards)")
    p.add_argument("--workers", type=int, default=2, help="reward worker processes")
    p.add_argument("--tensor-parallel", type=int, default=1, help="vLLM tensor parallel size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/eval", help="output dir")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import justrl_megatron.compat  # noqa: F401

    from omegaconf import OmegaConf
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoTokenizer

    from .rewards import BatchScorer, get_reward_fn
    from .rollout import SamplingConfig, VLLMEngine
    from .data.sampler import load_training_rows, tokenize_prompts
    from .train.validation import avg_pass_at_n

    args = parse_args(sys.argv[1:] if argv is None else argv)
    plan = eval_plan(args)
    print(f"justrl-eval: {plan.describe()}", file=sys.stderr)  # one unwrapped line (rich wraps at 80 off a tty)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data_cfg = OmegaConf.create({"train": args.data, "eval": None, "format": args.format,
                                 "num_generated": args.limit or 100, "task_options": {}, "dedup": True,
                                 "template": plan.template, "system_prompt": None, "max_prompt_length": 1 << 30})
    try:  # a wrong path, column or template is the user's to fix: say so without a traceback
        model_dir = _hf_folder(args.model, out)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        rows = load_training_rows(data_cfg, seed=args.seed, limit=args.limit)
        prompts, _ = tokenize_prompts(rows, tokenizer, data_cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"justrl-eval: {e}", file=sys.stderr)
        return 2
    longest = max(len(p.ids) for p in prompts)
    max_tokens, note = cap_max_tokens(plan.max_tokens, longest, model_context(model_dir))
    if note:
        print(f"justrl-eval: {note}", file=sys.stderr)
    if max_tokens < 1:
        return 2
    n = plan.n
    engine = VLLMEngine(str(model_dir), dtype="auto", tensor_parallel=args.tensor_parallel, seed=args.seed,
                        max_model_len=longest + max_tokens, enforce_eager=True)
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=-1, max_tokens=max_tokens)
    rollouts = engine.generate([p.ids for p in prompts], n, sampling, seed=args.seed)
    texts = tokenizer.batch_decode(rollouts.token_ids, skip_special_tokens=True)
    answers = [prompts[i // n].answer for i in range(len(texts))]
    verifier = get_reward_fn(args.reward)
    with BatchScorer(verifier, num_workers=args.workers) as scorer:
        rewards, correct = scorer.evaluate(texts, answers)
    engine.shutdown()

    with (out / "samples.jsonl").open("w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": prompts[i // n].id, "sample": i % n, "response": text,
                                "answer": str(answers[i]), "reward": rewards[i], "correct": correct[i],
                                "truncated": bool(rollouts.truncated[i])}) + "\n")
    avg, passed = avg_pass_at_n(correct, n)  # the in-training validation's own computation
    summary = {"model": str(args.model), "data": args.data, "problems": len(prompts), "n": n,
               f"avg@{n}": avg, f"pass@{n}": passed,
               "mean_response_tokens": sum(len(t) for t in rollouts.token_ids) / len(texts),
               "truncated_ratio": sum(rollouts.truncated) / len(texts),
               "protocol": args.protocol, "benchmark": plan.benchmark, "max_tokens": max_tokens,
               "template": plan.template, "temperature": args.temperature, "top_p": args.top_p, "reward": args.reward}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    table = Table(title=f"justrl-eval: {args.data}", show_header=False)
    for key, value in summary.items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console().print(table)
    return 0


@dataclass
class EvalPlan:
    protocol: str
    benchmark: str | None  # the BENCHMARK_N key that matched, or None
    benchmark_from: str  # "--benchmark", "the file name", or "" (no match)
    n: int
    n_from: str  # "--n", "the benchmark", or "the protocol default"
    max_tokens: int
    template: str

    def describe(self) -> str:
        bench = (f"benchmark {self.benchmark} ({self.benchmark_from})" if self.benchmark
                 else "benchmark not recognised (give --benchmark or --n)" if self.protocol == "justrl" else "")
        parts = [f"protocol {self.protocol}", bench, f"n={self.n} ({self.n_from})", f"max_tokens={self.max_tokens}",
                 f"template {self.template}"]
        return ", ".join(p for p in parts if p)


def benchmark_of(name: str) -> str | None:
    """The BENCHMARK_N key that ``name`` (a benchmark, file or folder name) starts with: "AIME24" -> "aime",
    "Olympiad-Bench" -> "olympiad", "MATH-500" -> "math500"."""
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    return next((b for b in BENCHMARK_N if key.startswith(b)), None)


def eval_plan(args) -> EvalPlan:
    """N, max_tokens and the prompt template of this run: explicit options win, then the protocol's (and, under
    --protocol justrl, the benchmark's N)."""
    default_n, max_tokens, template = PROTOCOLS[args.protocol]
    benchmark, source = None, ""
    if args.benchmark:
        benchmark, source = benchmark_of(args.benchmark), "--benchmark"
        if benchmark is None:
            raise SystemExit(f"justrl-eval: unknown --benchmark {args.benchmark!r}; known: {', '.join(BENCHMARK_N)} "
                             "(or leave it out and give --n)")
    elif ":" not in args.data:  # generated:/builtin: data has no benchmark name
        path = Path(args.data)
        # JustRL's files are <BENCHMARK>/test.parquet: the file name first, then its folder
        benchmark = benchmark_of(path.stem) or benchmark_of(path.parent.name)
        source = "the file name" if benchmark else ""
    if args.n is not None:
        n, n_from = args.n, "--n"
    elif args.protocol == "justrl" and benchmark:
        n, n_from = BENCHMARK_N[benchmark], "the benchmark"
    else:
        n, n_from = default_n, "the protocol default"
    if n < 1:
        raise SystemExit(f"justrl-eval: --n must be >= 1, got {n}")
    return EvalPlan(args.protocol, benchmark, source, n, n_from,
                    args.max_tokens if args.max_tokens is not None else max_tokens, args.template or template)


def model_context(model_dir) -> int | None:
    """The model's context length (config.json max_position_embeddings), or None where the config does not say."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


def cap_max_tokens(max_tokens: int, longest_prompt: int, context: int | None) -> tuple[int, str | None]:
    """max_tokens fitted to the model's context after the longest prompt, and what to tell the user about it."""
    if context is None or longest_prompt + max_tokens <= context:
        return max_tokens, None
    room = context - longest_prompt
    if room < 1:
        return 0, (f"the longest prompt ({longest_prompt} tokens) leaves no room in the model's context ({context} "
                   "tokens, max_position_embeddings) for a response: use shorter prompts or a longer-context model")
    return room, (f"max_tokens {max_tokens:,} + the longest prompt ({longest_prompt} tokens) exceed the model's "
                  f"context ({context:,} tokens, max_position_embeddings): capped to {room:,} new tokens, so responses "
                  "that need more are cut (scores below JustRL's protocol)")


def _hf_folder(model: str, out: Path) -> Path:
    """An HF folder as is; a megatron checkpoint converted to HF into out/hf first."""
    from .assets import resolve_model_path

    path = Path(model)
    if path.is_dir() and not (path / "config.json").exists():
        from .convert.cli import main as convert

        target = out / "hf"
        if convert(["mcore-to-hf", "--ckpt", str(path), "--out", str(target)]) not in (0, None):
            raise SystemExit(f"justrl-eval: could not convert checkpoint {model} to HF")
        return target
    return resolve_model_path(model)
