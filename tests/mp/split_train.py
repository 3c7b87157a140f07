"""Split placement's groups and control channel, without vLLM or megatron (seconds):

    python -m torch.distributed.run --standalone --nproc-per-node 3 split_train.py OUT

3 ranks, 1 rollout rank: ranks 0-1 must see a default group of 2 (the trainers'), rank 2 one of its own; the
control channel joins trainer rank 0 and the rollout rank only (trainer rank 1 never waits on it); objects
broadcast, sent and received over it arrive intact; a weight sync whose stream misses the checkpoint's tensors is
refused on both ends. Verdict: OUT/rank{r}.json.
"""

import json
import os
import sys

import torch
import torch.distributed as dist


def main(out):
    from justrl_megatron.distributed import init_distributed, init_split
    from justrl_megatron.rollout import Rollouts
    from justrl_megatron.rollout.vllm_engine import broadcast_object, send_weights

    roles = init_split(num_rollout_ranks=1)
    rank, world = init_distributed()  # what the policy, checkpoints and metrics see afterwards
    verdict = {"global_rank": roles.global_rank, "is_trainer": roles.is_trainer, "rank": rank, "world": world,
               "has_channel": roles.control is not None}
    t = torch.tensor([roles.global_rank + 1.0])
    dist.all_reduce(t)  # over this side's default group only
    verdict["side_sum"] = t.item()

    ch = roles.control
    if ch is not None:
        part = Rollouts(prompt_index=[0, 0], token_ids=[[1, 2], [3]], logprobs=[[-0.5, -1.0], [-2.0]],
                        finish_reasons=["length", "stop"], weight_version=7)
        if roles.is_trainer:
            ch.broadcast_object(("generate", [[5, 6, 7]]), 0)
            verdict["received"] = ch.recv_object(src=1)
            try:
                send_weights(None, [], 3, ch, tied=False, expected_names={"model.norm.weight"})
            except RuntimeError as exc:
                verdict["sender_error"] = str(exc)
        else:
            verdict["got"] = ch.broadcast_object(None, 0)
            ch.send_object({"part": part.token_ids, "version": part.weight_version, "big": list(range(5000))}, dst=0)
            verdict["abort"] = broadcast_object(None, 0, ch)
    dist.barrier()
    with open(os.path.join(out, f"rank{roles.global_rank}.json"), "w") as f:
        json.dump(verdict, f)


if __name__ == "__main__":
    main(sys.argv[1])
