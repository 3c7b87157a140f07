"""Where the rollout engine runs relative to the trainer, behind one small object the loop asks three things of:
"generate this batch", "the trainer needs the devices now" and "publish weights version v".

Colocated (rollout.placement=colocated, the default): every rank hosts an engine on the trainer's own device. On GPU
vLLM holds `rollout.gpu_memory_utilization` of it (~47 GiB of an 80 GB H100 at 0.6), which a 16K-token update cannot
spare, so one step's cycle is

    generate -> sleep (level 2: weights and KV cache freed) -> old logprobs + update -> release the allocator's cache
             -> sync (the engine wakes its weights buffers, then loads the new weights) -> wake (KV cache) -> generate

On CPU vLLM's sleep mode does not exist and these calls are no-ops; the order is the same (tests record it).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

from .. import compat
from ..rollout import RolloutEngine, Rollouts, SamplingConfig


class ColocatedRollout:
    """A rollout engine that shares the trainer's devices and sleeps while the policy trains."""

    def __init__(self, engine: RolloutEngine, export_weights, bucket_mb: int):
        """`export_weights(bucket_bytes)` yields the policy's full HF-named tensors (every rank takes part)."""
        self.engine = engine
        self._export_weights = export_weights
        self._bucket_bytes = int(bucket_mb) << 20

    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, *,
                 seed: int | None = None) -> Rollouts:
        """`n` samples per prompt, the whole batch on every rank (each engine samples its share)."""
        return self.engine.generate_all(prompt_ids, n, sampling, seed=seed)

    @contextlib.contextmanager
    def training(self):
        """The trainer's turn: the engine gives its device memory back for the duration (wake-up is `publish`'s)."""
        self.engine.sleep()
        yield

    def publish(self, version: int) -> dict:
        """Sync the policy's current weights into the engine as `version` and make it ready to generate."""
        compat.release_cached_memory()
        stats = self.engine.update_weights(self._export_weights(self._bucket_bytes), version)
        self.engine.wake_up()
        return stats

    def shutdown(self) -> None:
        self.engine.shutdown()
