"""Time one GRPO update of our Megatron policy against the same forward + backward + AdamW in plain transformers.

The yardstick behind docs/benchmarks.md ("the update is at the CPU's matmul limit"): the same SmolLM2-135M shape, the
same batch of random tokens (default 32 sequences of 50 prompt + 34 response tokens, the demo's step), logprobs of the
response tokens only on both sides. Each side runs in its own process (ours loads the CPU redirections of
justrl_megatron.compat; transformers must not see them), warm-up step first, then `--repeats` timed steps.

    .venv/bin/python tools/update_vs_transformers.py [--dtype fp32|bf16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time


def batch(args):
    rng = random.Random(0)
    return [([rng.randrange(49152) for _ in range(args.prompt)], [rng.randrange(49152) for _ in range(args.response)])
            for _ in range(args.sequences)]


def time_ours(args) -> list[float]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    from justrl_megatron.bench.train import resolve_shape
    from justrl_megatron.distributed import init_distributed
    from justrl_megatron.model.policy import Policy
    from justrl_megatron.train.batching import Sample
    from justrl_megatron.train.step import grpo_update_on_policy

    init_distributed()
    policy = Policy.build(resolve_shape("smollm2-135m"), dtype=args.dtype, transformer_impl="auto", lr=1e-6,
                          warmup_steps=0, weight_decay=0.1, grad_clip=1.0, seed=0, max_sequence_length=2048)
    samples = [Sample(prompt_ids=p, response_ids=r, advantage=(-1.0) ** i, group=i // 4)
               for i, (p, r) in enumerate(batch(args))]
    times = []
    for _ in range(args.repeats + 1):
        t0 = time.perf_counter()
        grpo_update_on_policy(policy, samples, max_tokens_per_micro_batch=1 << 16)
        times.append(time.perf_counter() - t0)
    return times[1:]


def time_transformers(args) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from justrl_megatron.assets import smollm2_135m_instruct

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(smollm2_135m_instruct()),
                                             dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.1)
    rows = batch(args)
    ids = torch.tensor([p + r for p, r in rows])
    targets = ids[:, args.prompt:]
    adv = torch.tensor([(-1.0) ** i for i in range(len(rows))])[:, None]

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            logits = model(input_ids=ids, logits_to_keep=args.response + 1).logits[:, :-1]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)
            loss = -(logp * adv).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()

    times = []
    for _ in range(args.repeats + 1):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times[1:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=50)
    ap.add_argument("--response", type=int, default=34)
    ap.add_argument("--side", choices=["ours", "transformers"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:  # child: one side, JSON on the last line
        times = time_ours(args) if args.side == "ours" else time_transformers(args)
        print(json.dumps(times))
        return 0
    print(f"{args.sequences} x ({args.prompt} + {args.response}) tokens, {args.dtype}, {args.repeats} timed steps")
    for side in ("ours", "transformers"):
        cmd = [sys.executable, __file__, "--side", side, *sys.argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(out.stdout[-2000:] + out.stderr[-4000:], file=sys.stderr)
            return out.returncode
        times = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{side:>13}: median {statistics.median(times):.2f} s (min {min(times):.2f}, max {max(times):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
