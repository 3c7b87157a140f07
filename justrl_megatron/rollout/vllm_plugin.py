"""A vLLM general plugin (the `vllm.general_plugins` entry point in setup.py): vLLM runs `register` in each of its own
processes (the engine core, its workers) before they build their message queues, which our code cannot reach
otherwise.

What it changes, on CPU only: a reader of vLLM's shared-memory message queue (the engine core waiting for its worker's
output, the worker waiting for the next step) spins with sched_yield for a second after every message before it sleeps
on a socket. On a GPU host that buys latency with an idle core; on a CPU host the cores are the ones computing the
model, and the engine core's spinning took as much CPU as half of its worker's (docs/testing.md). Readers there wait
on the socket at once. A waiting reader depends on the writer's notification, and vLLM's notifications can be lost (a
PUB socket with a send high-water mark of 1 drops one when the loaded machine has not yet moved the previous one
along); vLLM then finds the message only at its periodic re-check of the queue, every 5 s. Spinning hid that; without
it an engine in a child process started 10 s late (two start-up messages found by the re-check). So readers here
re-check every 20 ms: a lost notification costs at most that, and an idle reader's 50 flag checks a second cost
nothing measurable. And vLLM's CPU worker freezes its heap after warm-up, as its GPU worker does
(`freeze_gc_heap`): the garbage collector then leaves the model and the start-up's objects alone, while the engine
generates and when the worker exits (its final collection took 4-4.6 s, long enough for vLLM to kill the engine core
at its 5 s shutdown limit). Nothing else changes; on GPU, or a vLLM without that queue, the plugin does nothing.
"""

from __future__ import annotations

from justrl_megatron.import_hooks import after_import


RECHECK_MS = 20  # how often a waiting reader looks at the queue without a notification (vLLM: 5,000)
_DONE: list[bool] = []  # vLLM may load its plugins more than once in a process


def register() -> None:
    if _DONE:
        return
    try:
        from vllm.distributed.device_communicators import shm_broadcast
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
        from vllm.platforms import current_platform
    except ImportError:
        return
    _DONE.append(True)
    if not current_platform.is_cpu():
        return
    init = SpinCondition.__init__

    def init_without_busy_loop(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.busy_loop_s = 0  # a reader waits on its socket right away (a writer's is 0 already)

    SpinCondition.__init__ = init_without_busy_loop
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = RECHECK_MS
    after_import("vllm.v1.worker.cpu_worker", _freeze_the_heap_after_warm_up)  # imported by the worker process only


def _freeze_the_heap_after_warm_up(cpu_worker) -> None:
    from vllm.utils.gc_utils import freeze_gc_heap

    warm_up = cpu_worker.CPUWorker.compile_or_warm_up_model

    def warm_up_then_freeze(self, *args, **kwargs):
        result = warm_up(self, *args, **kwargs)
        freeze_gc_heap()
        return result

    cpu_worker.CPUWorker.compile_or_warm_up_model = warm_up_then_freeze
