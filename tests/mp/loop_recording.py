"""justrl-train's loop with a rollout engine that records every call instead of vLLM: the colocated cycle's order.

usage: python loop_recording.py OUT.json [hydra overrides...]
Runs `train.loop.run` on the composed config with `RecordingEngine` (the RolloutEngine protocol, random tokens) and
writes its call log to OUT.json. With JUSTRL_RECORDING_STOP_AT=k the k-th batch gets a SIGTERM while it generates:
the engine then does what vLLM's does with the stop predicate (reads it, aborts: RolloutInterrupted).
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
from justrl_megatron.rollout import RolloutEngine, RolloutInterrupted, Rollouts
from justrl_megatron.train.loop import run
from justrl_megatron.train_entry import apply_memory_plan, check_config


class RecordingEngine:
    """Samples random tokens (logprob -1 each) and records generate / sleep / update_weights / wake_up / shutdown."""

    def __init__(self, vocab_size: int):
        self.calls, self.asleep, self._version = [], False, 0
        self.vocab_size = vocab_size

    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, prompt_token_ids, n, sampling, *, seed=None):
        if self.asleep:
            raise RuntimeError("generate() on a sleeping engine")
        gen = torch.Generator().manual_seed(seed or 0)
        token_ids = [torch.randint(0, self.vocab_size, (int(torch.randint(1, sampling.max_tokens + 1, (1,),
                                                                              generator=gen)),), generator=gen).tolist()
                     for _ in prompt_token_ids for _ in range(n)]
        return Rollouts(prompt_index=[i for i in range(len(prompt_token_ids)) for _ in range(n)], token_ids=token_ids,
                        logprobs=[[-1.0] * len(t) for t in token_ids],
                        finish_reasons=["length" if len(t) == sampling.max_tokens else "stop" for t in token_ids],
                        weight_version=self._version)

    def generate_all(self, prompt_token_ids, n, sampling, *, seed=None, stop=None):
        prompts = hashlib.sha256(json.dumps([list(map(int, p)) for p in prompt_token_ids]).encode()).hexdigest()
        self.calls.append(["generate", self._version, len(prompt_token_ids), prompts])
        if sum(c[0] == "generate" for c in self.calls) == int(os.environ.get("JUSTRL_RECORDING_STOP_AT", 0)):
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 10
            while stop is not None and time.monotonic() < deadline:  # as vLLM's engine reads it between its steps
                if stop():
                    raise RolloutInterrupted("stopped while generating")
                time.sleep(0.01)
        return self.generate(prompt_token_ids, n, sampling, seed=seed)

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
    assert isinstance(engine, RolloutEngine)
    last = run(cfg, model_dir, shape, engine=engine)
    with open(out, "w") as f:
        json.dump({"last_step": last, "calls": engine.calls}, f)


if __name__ == "__main__":
    record(sys.argv[1], sys.argv[2:])
