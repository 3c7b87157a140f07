"""Checkpoint saves vs training (issue 39): step time and per-rank peak memory with a save every step, vs none.

    python tools/bench_checkpoint.py OUT [--layers N] [--steps K]                           # the demo (1 rank)
    torchrun --nproc-per-node 2 tools/bench_checkpoint.py OUT --moe --ep 2 [--layers N]   # the MoE demo (EP2)

The demo policies' shapes (SmolLM2-135M-Instruct: hidden 576, 9 heads / 3 KV groups, SwiGLU 1536, vocabulary 49,152,
tied; the MoE demo: 4 experts top-2 per layer), random weights (a step costs what it costs with trained ones), fp32,
the distributed optimizer, one GRPO update of 8 random samples per step. Modes in one process, in turn: `none`, `sync`
(trainer.async_save=false), `async` (the default). Memory: the PSS of the rank and its checkpoint-writer children,
sampled every 20 ms (PSS splits copy-on-write pages between the trainer and its forked writer: their sum is what
the machine holds). Each rank writes OUT/bench_rank{r}.json; rank 0 prints a table.
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import argparse
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from justrl_megatron.checkpoint import Checkpointer
from justrl_megatron.distributed import init_distributed
from justrl_megatron.model.hf_config import ModelShape
from justrl_megatron.model.memory import checkpoint_save_bytes
from justrl_megatron.model.policy import Policy
from justrl_megatron.train.batching import Sample
from justrl_megatron.train.step import compute_logprobs, grpo_update


def shape(layers: int, moe: bool) -> ModelShape:
    extra = dict(num_experts=4, moe_top_k=2, moe_ffn_hidden_size=1536, family="mixtral") if moe else {}
    return ModelShape(**{"family": "llama", "num_layers": layers, "hidden_size": 576, "ffn_hidden_size": 1536,
                         "num_attention_heads": 9, "num_query_groups": 3, "head_dim": 64, "vocab_size": 49152,
                         "max_position_embeddings": 2048, "rope_theta": 1e5, "rms_norm_eps": 1e-5, "qkv_bias": False,
                         "tie_word_embeddings": True, "init_std": 0.02, **extra})


def pss_tree(pid: int, spawned: list | None = None) -> int:
    """PSS bytes of `pid` and its descendants (`spawned` collects those of spawned helpers: megatron's result-queue
    Manager, started once per process and kept, not per save)."""
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(entry.name))
            except (OSError, ValueError, IndexError):
                pass
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += kids.get(p, [])
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                pss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
            total += pss
            if spawned is not None and p != pid:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    if b"spawn_main" in f.read():
                        spawned.append(pss)
        except (OSError, StopIteration):
            pass
    return total


class PeakSampler:
    def __init__(self):
        self.peak, self.helpers, self._stop = 0, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            spawned = []
            self.peak = max(self.peak, pss_tree(os.getpid(), spawned))
            self.helpers = max(self.helpers, sum(spawned))
            time.sleep(0.02)

    def reset(self):
        self.peak, self.helpers = pss_tree(os.getpid()), 0

    def stop(self):
        self._stop.set()
        self._thread.join()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    rank, world = init_distributed()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    s = shape(args.layers, args.moe)
    policy = Policy.build(s, ep=args.ep, dtype="fp32", transformer_impl="local", lr=1e-5,
                          distributed_optimizer=True, seed=1234)
    rng = random.Random(3)
    samples = [Sample([rng.randrange(s.vocab_size) for _ in range(32)],
                      [rng.randrange(s.vocab_size) for _ in range(96)], advantage=rng.uniform(-1, 1), group=i // 4)
               for i in range(8)]
    old = compute_logprobs(policy, samples, max_tokens_per_micro_batch=512)

    def step():
        grpo_update(policy, samples, old, mini_batch_size=len(samples), max_tokens_per_micro_batch=512,
                    clip_low=0.2, clip_high=0.28, dual_clip_c=10.0, loss_agg="token-mean")

    step()  # warm-up: Adam state allocated
    sampler, result = PeakSampler(), {}
    for mode in ("none", "sync", "async", "none"):  # `none` again last: the machine's drift over the run
        saver = Checkpointer(Path(args.out) / f"run_{mode}", async_save=mode == "async", keep_last=1)
        if mode != "none":  # the first save of a process pays one-time costs (imports, plans): not a step's
            saver.save(0, policy.chunks, policy.optimizer, policy.scheduler, {})
            saver.wait()
        dist.barrier()
        sampler.reset()
        times = []
        for i in range(1, args.steps + 1):
            t = time.perf_counter()
            step()
            if mode != "none":
                saver.poll()
                saver.save(i, policy.chunks, policy.optimizer, policy.scheduler, {})
            times.append(time.perf_counter() - t)
        saver.wait()
        key = mode if mode not in result else "none_again"
        result[key] = {"step_s": statistics.median(times), "steps_s": times, "peak_pss_bytes": sampler.peak,
                       "spawned_helpers_pss_bytes": sampler.helpers}
    sampler.stop()
    result["predicted_save_bytes"] = checkpoint_save_bytes(s, dp=world, ep=args.ep,
                                                           dtype=torch.float32, distributed_optimizer=True)
    result["params_here"] = sum(p.numel() for c in policy.chunks for p in c.parameters())
    with open(Path(args.out) / f"bench_rank{rank}.json", "w") as f:
        json.dump(result, f, indent=1)
    dist.barrier()
    if rank == 0:
        for r in range(world):
            v = json.loads((Path(args.out) / f"bench_rank{r}.json").read_text())
            base = min(v["none"]["step_s"], v["none_again"]["step_s"])
            peak = max(v["none"]["peak_pss_bytes"], v["none_again"]["peak_pss_bytes"])
            print(f"rank {r}: params {v['params_here'] / 1e6:.1f}M; step {base:.2f} s, peak {peak / 2**30:.2f} GiB | "
                  f"sync save: {v['sync']['step_s']:.2f} s ({v['sync']['step_s'] / base:.2f}x), "
                  f"{v['sync']['peak_pss_bytes'] / 2**30:.2f} GiB ({v['sync']['peak_pss_bytes'] / peak:.2f}x) | "
                  f"async save: {v['async']['step_s']:.2f} s ({v['async']['step_s'] / base:.2f}x), "
                  f"{v['async']['peak_pss_bytes'] / 2**30:.2f} GiB ({v['async']['peak_pss_bytes'] / peak:.2f}x) | "
                  f"of which megatron's spawned result-queue Manager {v['async']['spawned_helpers_pss_bytes'] / 2**30:.2f}"
                  f" GiB; predicted save bytes {v['predicted_save_bytes'] / 2**30:.2f} GiB", flush=True)


if __name__ == "__main__":  # dist_checkpointing forks / spawns its writers
    main()
