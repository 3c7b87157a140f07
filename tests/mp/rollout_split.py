"""Split placement: rank 0 trains (here: holds the weights and sends them), rank 1 only rolls out.

    python -m torch.distributed.run --standalone --nproc-per-node 2 rollout_split.py HF_DIR OUT

The rollout rank's engine runs in a child process (vLLM's own engine-core process, outside torch.distributed's
WORLD); every sync travels as packed buckets broadcast by trainer rank 0 over the `gloo` weight-transfer group into
the engine's worker, with the per-bucket metadata on a torch.distributed control group — the control flow of split
placement on GPU, where vLLM's `nccl` backend carries the tensors. The weights come from a transformers model that
rank 0 perturbs before each sync (an independent reference for what the engine must compute). Then a SIGTERM to the
rollout rank aborts a big batch in its child-process engine. Verdict: OUT/verdict.json (rank 0).
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import json
import os
import sys

import torch
import torch.distributed as dist

from _common import hf_greedy, hf_logprobs

PROMPTS = [[11, 12, 13, 14, 15], [201, 7, 42], [5, 6, 7, 8, 9, 10, 11]]
STEPS = 8


def share(obj, src, group):
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def main(hf_dir, out):
    from justrl_megatron.distributed import init_distributed
    from justrl_megatron.rollout import SamplingConfig, logprob_gap
    from justrl_megatron.rollout.vllm_engine import VLLMEngine, send_weights
    from justrl_megatron.rollout.weight_transfer import BroadcastSender

    rank, world = init_distributed()
    assert world == 2
    control = dist.new_group([0, 1], backend="gloo")
    trainer = rank == 0
    greedy = SamplingConfig(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    sample = SamplingConfig(max_tokens=STEPS, seed=3)

    if trainer:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        sender = BroadcastSender("gloo", "127.0.0.1", world_size=2, bucket_bytes=256 << 10)
        share(sender.receiver_init_info(rank_offset=1), 0, control)
        sender.open()  # rendezvous with the engine worker, which joins from its own process
        verdict = {"syncs": []}
    else:
        engine = VLLMEngine(hf_dir, dtype="fp32", seed=0, max_model_len=128, enforce_eager=True, in_process=False)
        info = share(None, 0, control)
        engine.init_receiver(info)
        v_backend = engine.backend

    for version in (1, 2):
        if trainer:
            g = torch.Generator().manual_seed(version)
            with torch.no_grad():
                for p in hf.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.05 * p.std())
            stats = send_weights(sender, hf.state_dict().items(), version, control, tied=hf.config.tie_word_embeddings,
                                 bucket_bytes=256 << 10)
            got = share(None, 1, control)
            verdict["syncs"].append({
                "version": version, "sender": stats, "receiver": got["stats"],
                "greedy_equal": got["greedy"] == [hf_greedy(hf, p, STEPS) for p in PROMPTS],
                "versions": got["versions"],
                "gap": logprob_gap(got["logprobs"], [hf_logprobs(hf, PROMPTS[i], t)
                                                     for i, t in zip(got["prompt_index"], got["tokens"])])})
        else:
            stats = engine.receive_weights(control)
            g = engine.generate(PROMPTS, 1, greedy)
            s = engine.generate(PROMPTS, 2, sample)
            share({"stats": stats, "greedy": g.token_ids, "tokens": s.token_ids, "logprobs": s.logprobs,
                   "prompt_index": s.prompt_index, "versions": [g.weight_version, s.weight_version]}, 1, control)

    # issue 42: a SIGTERM to the rollout rank during a big batch; its engine (a child process) aborts it, keeps no
    # request, and then samples the last seeded batch again (what serve does: rollout/split.py)
    if not trainer:
        import signal
        import threading
        import time

        from justrl_megatron.rollout import RolloutInterrupted
        from justrl_megatron.slurm import StopSignal, stop_requested

        stop_signal = StopSignal().install()
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        start, raised = time.monotonic(), None
        try:
            engine.generate(PROMPTS * 8, 32, SamplingConfig(max_tokens=100, seed=5, ignore_eos=True),
                            stop=stop_requested)
        except RolloutInterrupted:
            raised = "RolloutInterrupted"
        stop_signal.restore()
        again = engine.generate(PROMPTS, 2, sample)
        stopped = {"raised": raised, "seconds": time.monotonic() - start, "left": engine.num_unfinished(),
                   "again_equal": [again.token_ids, again.logprobs] == [s.token_ids, s.logprobs]}
    if trainer:
        verdict["stop"] = share(None, 1, control)
        verdict["backend"] = share(None, 1, control)
        sender.close()
        with open(os.path.join(out, "verdict.json"), "w") as f:
            json.dump(verdict, f, indent=1)
    else:
        share(stopped, 1, control)
        share(v_backend, 1, control)
        engine.shutdown()
    dist.barrier(group=control)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
