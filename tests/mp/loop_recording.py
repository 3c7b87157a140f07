"""justrl-train's loop with a rollout engine that records every call instead of vLLM: the colocated cycle's order.

usage: python loop_recording.py OUT.json [hydra overrides...]
Runs `train.loop.run` on the composed config with `RecordingEngine` (what the engine loop drives, random tokens) and
writes its call log to OUT.json. With JUSTRL_RECORDING_STOP_AT=k the k-th batch gets a SIGTERM while it generates:
the engine loop reads it between steps and the stop keeps what each sample has sampled so far.
"""

import hashlib
import json
import os
import signal
import sys
import time

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections for megatron-core)

import torch

from justrl_megatron.config import compose
from justrl_megatron.rollout import RolloutEngine, Rollouts
from justrl_megatron.train.loop import run
from justrl_megatron.train_entry import apply_memory_plan, check_config


class RecordingEngine:
    """What the engine loop asks of an engine (add_request / step / abort_keeping ...), sampling random tokens
    (logprob -1 each, one token per step and sample, seeded by the request's seed), and a record of every batch
    ("generate": the requests added before a step), sleep / update_weights / wake_up / shutdown."""

    max_num_seqs = 64
    step_budget = None

    def __init__(self, vocab_size: int):
        self.calls, self.asleep, self._version = [], False, 0
        self.vocab_size = vocab_size
        self.live, self._new = {}, []

    @property
    def weight_version(self) -> int:
        return self._version

    def add_request(self, rid, prompt_ids, n, sampling, *, request_index=0, stream=False, regex=None):
        if self.asleep:
            raise RuntimeError("add_request() on a sleeping engine")
        gen = torch.Generator().manual_seed(sampling.seed or 0)
        plans = [torch.randint(0, self.vocab_size, (int(torch.randint(1, sampling.max_tokens + 1, (1,), generator=gen)),),
                               generator=gen).tolist() for _ in range(n)]
        self.live[rid] = {"plans": plans, "done": 0, "max": sampling.max_tokens, "version": self._version}
        self._new.append(list(map(int, prompt_ids)))

    def _record_batch(self) -> None:
        prompts = hashlib.sha256(json.dumps(self._new).encode()).hexdigest()
        self.calls.append(["generate", self._version, len(self._new), prompts])
        self._new = []
        if sum(c[0] == "generate" for c in self.calls) == int(os.environ.get("JUSTRL_RECORDING_STOP_AT", 0)):
            os.kill(os.getpid(), signal.SIGTERM)  # read by the engine loop's stop check before its next step
            time.sleep(0.2)

    def _rollouts(self, r, finished: bool) -> Rollouts:
        toks = [p[:r["done"]] for p in r["plans"]]
        reasons = [("length" if len(p) == r["max"] else "stop") if len(p) <= r["done"] else "abort"
                   for p in r["plans"]]
        return Rollouts(prompt_index=[0] * len(toks), token_ids=toks, logprobs=[[-1.0] * len(t) for t in toks],
                        finish_reasons=reasons, weight_version=r["version"],
                        token_versions=[[r["version"]] * len(t) for t in toks])

    def step(self):
        if self._new:
            self._record_batch()
        out = []
        for rid, r in list(self.live.items()):
            r["done"] += 1
            if all(len(p) <= r["done"] for p in r["plans"]):
                out.append((rid, self._rollouts(r, True)))
                del self.live[rid]
        return out

    def num_unfinished(self):
        return len(self.live)

    def abort(self, rids):
        for rid in rids:
            self.live.pop(rid, None)

    def abort_keeping(self, rids):
        return {rid: self._rollouts(self.live.pop(rid), False) for rid in rids if rid in self.live}

    def pause(self):
        pass

    def resume(self):
        pass

    def update_weights(self, stream, version):
        digest, names = hashlib.sha256(), []
        for item in stream:
            for name, tensor in (item if isinstance(item, list) else [item]):
                names.append(name)
                digest.update(tensor.detach().float().contiguous().numpy().tobytes())
        self.calls.append(["update_weights", version, len(names), digest.hexdigest()])
        self._version = version
        return {}

    def sleep(self):
        self.calls.append(["sleep"])
        self.asleep = True

    def wake_up(self):
        self.calls.append(["wake_up"])
        self.asleep = False

    def shutdown(self):
        self.calls.append(["shutdown"])


def record(out: str, overrides: list[str]) -> None:
    """`train.loop.run` on the composed config with a RecordingEngine; its call log and last step into `out`."""
    cfg = compose(overrides)
    model_dir, shape = check_config(cfg)
    apply_memory_plan(cfg, shape)  # as justrl-train does: model.recompute=auto becomes concrete
    engine = RecordingEngine(shape.vocab_size)
    assert isinstance(engine, RolloutEngine)  # what the engine loop drives
    last = run(cfg, model_dir, shape, engine=engine)
    with open(out, "w") as f:
        json.dump({"last_step": last, "calls": engine.calls}, f)


if __name__ == "__main__":
    record(sys.argv[1], sys.argv[2:])
