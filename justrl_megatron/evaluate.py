"""justrl-eval: avg@N accuracy of a model on a local dataset through vLLM (JustRL's eval: temperature 0.7, top_p 0.9).

    justrl-eval --model DIR --data aime24.parquet --format aime --n 32 --out runs/eval_aime24
    justrl-eval --model runs/x/checkpoints/step_000100 --data math500.jsonl --format math --n 4

--model is an HF folder, or a training/megatron checkpoint dir (converted to HF on the fly, into --out).
Writes samples.jsonl (one line per sample: id, sample index, response, reward, correct) and summary.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def parse_args(argv):
    p = argparse.ArgumentParser(prog="justrl-eval", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="HF folder or megatron checkpoint dir")
    p.add_argument("--data", required=True, help="parquet/jsonl/json file, or generated:<task>")
    p.add_argument("--format", default="generic", help="dapo | gsm8k | math | aime | countdown | mbpp | generic")
    p.add_argument("--n", type=int, default=4, help="samples per problem (avg@N)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first LIMIT problems")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--max-tokens", type=int, default=15360)
    p.add_argument("--template", default="justrl")
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
    from .train.sampler import load_training_rows, tokenize_prompts

    args = parse_args(sys.argv[1:] if argv is None else argv)
    console = Console(stderr=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = _hf_folder(args.model, out)
    data_cfg = OmegaConf.create({"train": args.data, "eval": None, "format": args.format, "num_generated": args.limit or 100,
                                 "task_options": {}, "dedup": True, "template": args.template, "system_prompt": None,
                                 "max_prompt_length": 1 << 30})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = load_training_rows(data_cfg, seed=args.seed, limit=args.limit)
    if not rows:
        console.print(f"justrl-eval: no usable rows in {args.data}")
        return 2
    prompts, _ = tokenize_prompts(rows, tokenizer, data_cfg)
    engine = VLLMEngine(str(model_dir), dtype="auto", tensor_parallel=args.tensor_parallel, seed=args.seed,
                        max_model_len=max(len(p.ids) for p in prompts) + args.max_tokens, enforce_eager=True)
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=-1, max_tokens=args.max_tokens)
    rollouts = engine.generate([p.ids for p in prompts], args.n, sampling, seed=args.seed)
    texts = tokenizer.batch_decode(rollouts.token_ids, skip_special_tokens=True)
    answers = [prompts[i // args.n].answer for i in range(len(texts))]
    verifier = get_reward_fn(args.reward)
    with BatchScorer(verifier, num_workers=args.workers) as scorer:
        rewards, correct = scorer.evaluate(texts, answers)
    engine.shutdown()

    with (out / "samples.jsonl").open("w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": prompts[i // args.n].id, "sample": i % args.n, "response": text,
                                "answer": str(answers[i]), "reward": rewards[i], "correct": correct[i],
                                "truncated": bool(rollouts.truncated[i])}) + "\n")
    per_problem = [sum(correct[i * args.n:(i + 1) * args.n]) / args.n for i in range(len(prompts))]
    summary = {"model": str(args.model), "data": args.data, "problems": len(prompts), "n": args.n,
               f"avg@{args.n}": sum(per_problem) / len(per_problem),
               f"pass@{args.n}": sum(1 for a in per_problem if a > 0) / len(per_problem),
               "mean_response_tokens": sum(len(t) for t in rollouts.token_ids) / len(texts),
               "truncated_ratio": sum(rollouts.truncated) / len(texts),
               "temperature": args.temperature, "top_p": args.top_p, "reward": args.reward}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    table = Table(title=f"justrl-eval: {args.data}", show_header=False)
    for key, value in summary.items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console().print(table)
    return 0


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
