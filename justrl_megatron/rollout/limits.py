"""What vLLM's SamplingParams would refuse at the first rollout (or at the first validation), said before any model
loads: `problems(cfg)`, collected by config.validate. Checked against vLLM 0.32's `SamplingParams._verify_args`.

- temperature below vLLM's _SAMPLING_EPS (1e-5) is greedy, and greedy sampling takes n = 1 only ("0: greedy" in the
  docs means one answer per prompt; a GRPO group of identical greedy answers would have no variance anyway);
- temperature above 2 is refused;
- n above VLLM_MAX_N_SEQUENCES (16384 by default) is refused; a group that large is never a GRPO group size.
"""

from __future__ import annotations

import math

GREEDY_BELOW = 1e-5  # vllm.sampling_params._SAMPLING_EPS
MAX_TEMPERATURE = 2.0
MAX_N = 16384  # vllm.envs.VLLM_MAX_N_SEQUENCES' default


def sampling_problems(where: str, *, n: int, temperature: float) -> list[str]:
    """One line per refused combination of one sampling setting (`where` names its keys' prefix)."""
    problems = []
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature):
        return problems  # a type, NaN or inf: said by the config's own checks
    if 0 <= temperature < GREEDY_BELOW and n > 1:
        problems.append(f"{where}temperature={temperature} is greedy sampling, which gives one answer per prompt, "
                        f"but {where}n={n}; use a temperature > 0 (JustRL: 1.0 for training, 0.7 for validation) "
                        f"or n=1")
    if temperature > MAX_TEMPERATURE:
        problems.append(f"{where}temperature={temperature}: vLLM samples with temperatures in [0, {MAX_TEMPERATURE:g}]")
    if n > MAX_N:
        problems.append(f"{where}n={n}: vLLM samples at most {MAX_N} answers per prompt (and a GRPO group that large "
                        f"is a mistake: JustRL uses 8); put the samples into more prompts per step instead")
    return problems


def problems(cfg) -> list[str]:
    """rollout.* (training samples) and every data.val set's own sampling."""
    ro = cfg.rollout
    found = sampling_problems("rollout.", n=ro.n, temperature=ro.temperature)
    for i, entry in enumerate(cfg.data.val):
        found += sampling_problems(f"data.val[{i}].", n=entry.n, temperature=entry.temperature)
    return found
