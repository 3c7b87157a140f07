"""`trainer.profile_steps=[a,b]`: a torch profiler trace of steps a..b (inclusive), one Chrome trace per rank.

Open `run_dir/profile/steps_a-b_rank{r}.json` in chrome://tracing or https://ui.perfetto.dev. The loop's phases
(rollout, reward, old_logprob, update, sync) appear as named ranges (`PhaseTimer` marks them with record_function).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from .. import compat


class PhaseTimer:
    """Seconds per phase of one step (`with timer("update"): ...`); each phase is also a named profiler range."""

    def __init__(self):
        self.seconds, self._t0 = {}, time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, phase):
        t = time.perf_counter()
        with torch.profiler.record_function(phase):
            yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0


class StepProfiler:
    def __init__(self, steps, run_dir, rank: int = 0):
        self.first, self.last = (int(steps[0]), int(steps[1])) if steps else (None, None)
        self.path = Path(run_dir) / "profile" / f"steps_{self.first}-{self.last}_rank{rank}.json"
        self._prof = None

    def step_started(self, step: int) -> None:
        if step != self.first:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if compat.cuda_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
        self._prof.__enter__()

    def step_finished(self, step: int, stopping: bool = False) -> Path | None:
        """Write the trace after the last profiled step (or earlier if the run stops); returns its path."""
        if self._prof is None or (step < self.last and not stopping):
            return None
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        return self.path
