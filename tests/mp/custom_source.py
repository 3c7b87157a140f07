"""A batch source of the test's own, registered in rollout/source.SOURCES and picked by rollout.source: the loop
trains with it unchanged (docs/architecture.md, "A rollout mode").

usage: python custom_source.py OUT.json [hydra overrides...] (with rollout.source=alternating)
"""

import sys

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections for megatron-core)

from loop_recording import record

from justrl_megatron.algo.dynamic_sampling import ScoredBatch
from justrl_megatron.rollout import SamplingConfig, source


class AlternatingSource:
    """Each step: the sampler's next prompts, sampled by the engines (a batch beside any stream); within each group the odd samples score 1."""

    def __init__(self, engines, sampler, n, sampling):
        self.engines, self.sampler, self.n, self.sampling, self.steps = engines, sampler, n, sampling, []

    @classmethod
    def from_config(cls, cfg, engines, sampler, scorer, tokenizer, *, leader):
        return cls(engines, sampler, cfg.rollout.n, SamplingConfig.from_rollout_config(cfg.rollout))

    @staticmethod
    def problems(cfg):
        return [] if cfg.rollout.n >= 2 else ["rollout.source=alternating needs rollout.n >= 2"]

    def next_batch(self, step, version, timer):
        prompts = self.sampler.next_batch()
        rollouts = self.engines.generate([p.ids for p in prompts], self.n, self.sampling, seed=step)
        rewards = [float(i % 2) for i in range(len(rollouts))]
        self.steps.append(step)
        return source.ScoredStep(ScoredBatch(prompts, rollouts, rewards, [r > 0 for r in rewards], {}), None,
                                 version - rollouts.weight_version)

    def min_version(self, version):
        return None

    def state(self):
        return {"alternating_steps": list(self.steps)}

    def stop_state(self):
        return None

    def restore(self, state, version):
        self.steps = list((state or {}).get("alternating_steps", []))


if __name__ == "__main__":
    source.SOURCES["alternating"] = f"{__name__}:AlternatingSource"  # the one registry line a new mode needs
    record(sys.argv[1], sys.argv[2:])
