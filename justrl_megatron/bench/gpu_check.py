"""`tools/gpu_check.sh`: one command that tells what this stack does on a bare GPU box, planned to fit one device call.

A device call has a hard 10-minute limit; the kit plans each call at <= 8 minutes (CALL_PLAN_S): about a minute for
installing the carried wheels and starting Python, the rest (TOTAL_CAP_S) for the stages. The stages that do not fit
the first call run in a second one:

    bash tools/gpu_check.sh                    # call 1, the same-card A/B: probe, mfu, moe, fp8 (30+150+90+120 s)
    bash tools/gpu_check.sh --stages pytest    # call 2: the CUDA tests (300 s)
    bash tools/gpu_check.sh --stages train     # call 3: the train phase under the memory plan (170 s)
    bash tools/gpu_check.sh --stages budget    # call 4: the token-budget search (300 s)

Any stage can be redone alone the same way (`--stages pytest`); the last stage of a call (a stage run alone too) may
use the rest of the call's time. Stages, each in a process group of its own with its own time cap (a crash, hang or CUDA OOM in one is recorded and the next still runs; the whole group is killed after
every stage, so nothing a stage left behind holds the GPU into the next; the exit code is non-zero if any failed):
  probe   torch / CUDA / device / megatron-core versions (CUDA as `compat` sees it), and which torch varlen
          flash-attention call works here
  train   the train-phase benchmark (bench/train.py) on the DeepSeek-R1-Distill-Qwen-1.5B shape with random weights:
          one sample of 1,024 prompt + 15,360 response tokens, bf16, TP=1, the recompute mode the memory plan picks;
          tokens/s/GPU and MFU of the forward-only pass (old logprobs) and of the update (fwd + bwd + optimizer), and
          the peak allocated memory against the plan's prediction
  pytest  `python -m pytest -m gpu tests/gpu`: the CUDA-only tests (nothing else is collected: tests/ imports vLLM,
          wandb, ... which the box lacks), streamed to $OUT/pytest.log, a per-test timeout (pytest-timeout, carried
          in .whl/), `-rA --durations=0`
  mfu     the fast paths of model/fast_paths.py and model.attention_backend, on this card in one process: kernel
          microbenchmarks (bench/kernels.py: attention flash vs cuDNN, SwiGLU, AdamW foreach vs fused, the log-prob
          head eager vs compiled, each with its output difference), then the train phase with recompute none for
          the baseline (all off, flash), all on, and each alone; host syncs of one update for baseline and all;
          then a JustRL-shaped batch (bench/packed_shape.py: groups of 8, log-normal lengths, shared 300-token
          prompts, trainer.shared_prompt on) packed to the memory plan's budget, with the attention backend auto
          and flash
  moe     grouped vs sequential MoE experts (model.moe_grouped_gemm) on a Qwen3-30B-A3B slice (2 layers at full
          width, EP1, one 16K sequence): update tokens/s both ways, and their loss and grad norm
  fp8     FP8 linears (model.fp8) vs bf16 at 16K: update time and MFU (bf16-equivalent FLOPs), and the loss and
          grad norm of 20 updates on fixed data both ways against bench/update_ab.TOLERANCES
  budget  the largest token budget per micro-batch that fits: upward from the plan's budget (one update per try,
          catching an out-of-memory error: torch.cuda.OutOfMemoryError or the RuntimeError cuBLAS / cuDNN / NCCL
          raise), then bisection in 1,024-token steps; it stops before a try that would end past its deadline, with
          the best so far
Results: gpu_check.json and gpu_check.md in $OUT when set, else ./gpu_check_out/, rewritten before and after every
stage and after every budget try, so that a call killed at its limit still brings back what was measured.

    python -m justrl_megatron.bench.gpu_check [--dry-run] [--stages LIST] [--out DIR] [--wheels DIR]

`--dry-run` (CPU, CI) checks the wheel bundle (.whl/, see tools/gpu_wheels.txt) and prints the stages, the two calls
and the memory plan computed for an 80 GB H100. Everything here runs through `python -m` (no console scripts on the
box). The driver itself imports no torch and never touches CUDA: only the stages do, each in its own process.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Callable

from ..model.fast_paths import SWITCHES  # (imports nothing but os: the driver stays free of torch)

ROOT = Path(__file__).resolve().parents[2]
WHEELS_TXT = ROOT / "tools" / "gpu_wheels.txt"
BUNDLE_LIMIT_BYTES = 20 * 1000 * 1000
CARRY_HINT = ('.whl/ is git-ignored: it must travel to the GPU box with the checkout (a device call: carry: [".whl"]); '
              'make it with `bash tools/gpu_wheels.sh` on a machine with PyPI')
H100_80GB_BYTES = 81559 * 2**20  # what nvidia-smi reports for an H100 80GB HBM3
MODEL = "deepseek-r1-distill-qwen-1.5b"
PROMPT, RESPONSE = 1024, 15360
CALL_PLAN_S = 480  # one device call, all of it (install + stages): 8 minutes, under the 10-minute hard limit
TOTAL_CAP_S = 420  # the stages of one call; the other minute is pip installing .whl/ and Python/torch start-up
MIN_STAGE_S = 15  # a stage with less time left than this is not started (it is named for a second call)
STAGES = {  # name -> (time cap in seconds, what it does)
    "probe": (30, "torch / CUDA / device / megatron-core versions, varlen flash attention probe"),
    "train": (170, f"train phase, {MODEL} shape, {PROMPT} + {RESPONSE} tokens, bf16, TP=1, under the memory plan"),
    "pytest": (300, "python -m pytest -m gpu tests/gpu (log: pytest.log, per-test timeout, -rA --durations=0)"),
    "budget": (300, "largest tokens per micro-batch that fit (upward from the plan, OOM caught, 1,024-token steps)"),
    "mfu": (150, "kernel microbenchmarks, then the train phase once per fast path (baseline, each alone, all), "
                 "recompute none, same card; host syncs per update; a JustRL-shaped packed batch, auto and flash"),
    "moe": (90, "grouped vs sequential experts, Qwen3-30B-A3B slice (2 layers, full width, EP1), 16K tokens"),
    "fp8": (120, "FP8 vs bf16 update at 16K (time, MFU), loss and grad norm of 20 updates on fixed data"),
}
# each call's stages fit TOTAL_CAP_S; the first is the default
CALLS = (("probe", "mfu", "moe", "fp8"), ("pytest",), ("train",), ("budget",))
PER_TEST_TIMEOUT_S = 120  # pytest-timeout, per test (setup and teardown included)
BUDGET_STEP = 1024  # the budget search's resolution in tokens


def call_command(names) -> str:
    return "bash tools/gpu_check.sh" + ("" if tuple(names) == CALLS[0] else f" --stages {','.join(names)}")


# --- the wheel bundle ------------------------------------------------------------------------------------------------

def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def required_wheels(path: Path = WHEELS_TXT) -> dict[str, str]:
    """{normalised name: version} from tools/gpu_wheels.txt."""
    out = {}
    for line in path.read_text().splitlines():
        spec = line.split("#", 1)[0].strip()
        if spec:
            name, _, version = spec.partition("==")
            out[_norm(name)] = version
    return out


@dataclasses.dataclass
class BundleReport:
    path: str
    present: bool
    wheels: list[dict]
    total_bytes: int
    problems: list[str]

    @property
    def ok(self) -> bool:
        return self.present and not self.problems


def check_bundle(path: str | os.PathLike, required: dict[str, str] | None = None,
                 limit_bytes: int = BUNDLE_LIMIT_BYTES) -> BundleReport:
    """Is ``path`` a bundle gpu_check.sh can install on Python 3.12 x86-64: every listed wheel there once, at its
    pinned version, a readable wheel for cp312 or pure Python, and all of them within ``limit_bytes``?"""
    required = required_wheels() if required is None else required
    path = Path(path)
    if not path.is_dir():
        return BundleReport(str(path), False, [], 0, [f"bundle missing: no {path}/ ({CARRY_HINT})"])
    problems, wheels, seen = [], [], {}
    for whl in sorted(path.glob("*.whl")):
        parts = whl.name[:-4].split("-")
        if len(parts) not in (5, 6):
            problems.append(f"{whl.name}: not a wheel file name")
            continue
        name, version, py, abi, plat = _norm(parts[0]), parts[1], parts[-3], parts[-2], parts[-1]
        wheels.append({"file": whl.name, "name": name, "version": version, "bytes": whl.stat().st_size})
        seen.setdefault(name, []).append(version)
        if not (("cp312" in py.split(".") and abi in ("cp312", "abi3", "none")) or
                (py.startswith("py3") and abi == "none")):
            problems.append(f"{whl.name}: not for CPython 3.12 ({py}-{abi})")
        if plat != "any" and not ("manylinux" in plat and "x86_64" in plat):
            problems.append(f"{whl.name}: not for x86-64 Linux ({plat})")
        if not zipfile.is_zipfile(whl):
            problems.append(f"{whl.name}: not a readable zip (re-run tools/gpu_wheels.sh)")
    for name, versions in seen.items():
        if len(versions) > 1:
            problems.append(f"{name}: {len(versions)} versions {sorted(versions)} (pip refuses the whole install; "
                            f"keep one)")
    for name, version in required.items():
        if name not in seen:
            problems.append(f"{name}=={version} missing (re-run tools/gpu_wheels.sh)")
        elif version and version not in seen[name]:
            problems.append(f"{name}: {seen[name]} present, tools/gpu_wheels.txt pins {version}")
    total = sum(w["bytes"] for w in wheels)
    if total > limit_bytes:
        problems.append(f"bundle is {total / 1e6:.1f} MB, over the {limit_bytes / 1e6:.0f} MB limit")
    return BundleReport(str(path), True, wheels, total, problems)


# --- the token-budget search (pure) -----------------------------------------------------------------------------------

def search_budget(fits: Callable[[int], bool], start: int, *, multiple: int = BUDGET_STEP, grow: float = 1.25,
                  limit: int | None = None, deadline: float | None = None,
                  clock: Callable[[], float] = time.monotonic) -> tuple[int, list[tuple[int, bool]]]:
    """The largest multiple of ``multiple`` for which ``fits`` holds: from ``start`` upward by ``grow`` until the first
    failure (downward if ``start`` fails), then bisection to one ``multiple``. Stops at ``limit``, or before a try
    that would end past ``deadline`` (a try is assumed to take as long as the longest one so far), with the best found
    so far. Returns (best, 0 if none fits; [(tokens, fitted), ...] in trial order)."""
    def down(x: float) -> int:
        return int(x) // multiple * multiple

    best, failed, trials, longest = 0, None, [], 0.0
    n = max(multiple, down(start))
    if limit is not None:
        n = min(n, down(limit))
    while deadline is None or clock() + longest < deadline:
        t0 = clock()
        ok = bool(fits(n))
        longest = max(longest, clock() - t0)
        trials.append((n, ok))
        if ok:
            best = n
        else:
            failed = n
        if failed is None:  # still growing
            if limit is not None and best >= down(limit):
                break
            n = max(down(n * grow), best + multiple)
            if limit is not None:
                n = min(n, down(limit))
        elif best == 0:  # nothing fits yet: shrink
            n = down(n / grow)
            if n < multiple:
                break
        else:  # bisect between the best fit and the smallest failure
            if failed - best <= multiple:
                break
            n = down((best + failed) // 2)
            if n <= best:
                break
    return best, trials


# --- the plan ---------------------------------------------------------------------------------------------------------

def memory_plan(device_bytes: int, *, max_tokens: int | None = None, impl: str = "local"):
    """The memory plan for one sample of PROMPT + RESPONSE tokens of the MODEL shape at TP=1 on one GPU."""
    from ..model.memory import gpu_kernels, plan_memory
    from .train import BUILTIN_SHAPES

    return plan_memory(BUILTIN_SHAPES[MODEL], device_bytes=device_bytes,
                       max_tokens_per_micro_batch=max_tokens or PROMPT + RESPONSE,
                       min_tokens=PROMPT + RESPONSE, tp=1, pp=1, dp=1, impl=impl, kernels=gpu_kernels(impl))


# CUDA's allocator raises torch.cuda.OutOfMemoryError; cuBLAS, cuDNN and NCCL report running out of device memory as
# a plain RuntimeError (a failed workspace or handle allocation), which is the same "does not fit" to the budget search
OOM_MESSAGES = re.compile(r"out of memory|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|"
                          r"CUDNN_STATUS_NOT_ENOUGH_WORKSPACE|Failed to CUDA calloc|cudaErrorMemoryAllocation",
                          re.IGNORECASE)


def is_out_of_memory(exc: BaseException) -> bool:
    return type(exc).__name__ == "OutOfMemoryError" or (isinstance(exc, RuntimeError)
                                                         and bool(OOM_MESSAGES.search(str(exc))))


def runs_in_memory(update: Callable[[], object]) -> bool:
    """True if ``update`` ran, False if it ran out of device memory (any of the ways CUDA libraries say so); any other
    error propagates (the stage fails with it instead of calling a bug "does not fit")."""
    try:
        update()
    except Exception as exc:  # noqa: BLE001  (sorted just below)
        if not is_out_of_memory(exc):
            raise
        return False
    return True


# --- stages (each runs in its own process group: `--stage NAME --result FILE --cap S --out DIR`) ----------------------
# A stage returns its record (a dict; "ok": False and "error" where it failed but still has something to say) and may
# call `progress(partial)` any time: the driver folds the partial record into the report while the stage still runs.

def _write_json(path: Path, data: dict) -> None:
    """Atomically (a reader, or a kill, never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def _cuda_available() -> bool:
    from .. import compat  # imports torch only (and, without CUDA, megatron-core for its CPU redirections)

    return compat.cuda_available()


def stage_probe(progress, cap_s: float, out_dir: Path) -> dict:
    import inspect
    from importlib.metadata import version

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_available": _cuda_available()}
    try:
        out["megatron_core"] = version("megatron-core")
    except Exception as err:  # noqa: BLE001
        out["megatron_core"] = f"missing ({err})"
    try:
        from .cli import machine_info

        out["machine"] = machine_info()
    except Exception as err:  # noqa: BLE001
        out["machine"] = {"error": f"{type(err).__name__}: {err}"}
    try:
        from torch.nn.attention.varlen import varlen_attn

        out["varlen_signature"] = str(inspect.signature(varlen_attn))
    except Exception as err:  # noqa: BLE001
        out["varlen_signature"] = f"unavailable ({type(err).__name__}: {err})"
    if not out["cuda_available"]:
        return {**out, "ok": False, "error": f"no CUDA device visible to torch {torch.__version__} (compat)"}
    props = torch.cuda.get_device_properties(0)
    out.update(device=props.name, device_total_gib=round(props.total_memory / 2**30, 2),
               multiprocessors=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
    progress(out)
    if out["varlen_signature"].startswith("unavailable"):
        return out
    # which call form the model's attention will use (the same probe, attention.varlen_choice), GQA and MHA
    from ..model.attention import probe_varlen, varlen_candidates

    out["varlen_choice"] = {}
    for heads, groups in ((12, 2), (4, 4)):
        name, _, rejected = probe_varlen(varlen_candidates(), torch.device("cuda", 0), torch.bfloat16, heads, groups,
                                         128)
        out["varlen_choice"][f"{heads} heads / {groups} KV groups"] = {"chosen": name, "rejected": rejected}
    return out


_SUMMARY_RE = re.compile(r"\b(passed|failed|errors?|skipped|deselected|xfailed|xpassed|no tests ran)\b")
_OUTCOME_WORDS = ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "XPASS")


def pytest_counts(summary: str) -> dict[str, int]:
    """{'passed': 3, 'skipped': 2, 'errors': 1, ...} from pytest's final line."""
    counts = {}
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)\b", summary):
        counts["errors" if word.startswith("error") else word] = int(n)
    return counts


def read_pytest_log(text: str) -> dict:
    """What a (possibly cut-off) `pytest -v -rA --durations=0` log says: its final summary line and counts, the skip
    reasons with their counts, and the last test that started (the one running when a log ends without a summary)."""
    lines = text.splitlines()
    summary = next((ln.strip("= ") for ln in reversed(lines)
                    if ln.startswith("=") and _SUMMARY_RE.search(ln) and " in " in ln), "")
    skips = {}
    for count, reason in re.findall(r"^SKIPPED \[(\d+)\] [^\n]*?:\d+: (.*)$", text, flags=re.M):
        skips[reason] = skips.get(reason, 0) + int(count)
    started = [ln.split(" ", 1)[0] for ln in lines  # `-v` writes "path::test " before the test runs
               if "::" in ln.split(" ", 1)[0] and not ln.startswith(_OUTCOME_WORDS)]
    return {"summary": summary, "counts": pytest_counts(summary), "skip_reasons": skips,
            "last_test_started": started[-1] if started else None}


def stage_pytest(progress, cap_s: float, out_dir: Path) -> dict:
    log = out_dir / "pytest.log"
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-v", "-rA", "--durations=0",
           "-p", "no:cacheprovider", "--continue-on-collection-errors"]
    # pytest-timeout is carried in .whl/ (tools/gpu_wheels.txt): the box has pytest but not it. Without it the stage
    # cap is the only limit, and the record says so.
    per_test = min(PER_TEST_TIMEOUT_S, max(int(cap_s) - 30, 10)) if importlib.util.find_spec("pytest_timeout") else None
    if per_test:
        cmd.append(f"--timeout={per_test}")
    limit = max(cap_s - 15, 10)  # the rest is for reading the log and writing the record
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.kill()  # its own children go with the stage's process group
            proc.wait()
            rc = None
    seen = read_pytest_log(log.read_text(errors="replace"))
    out = {"returncode": rc, "log": log.name, "per_test_timeout_s": per_test, **seen}
    if rc is None:
        out.update(ok=False, error=f"pytest ran past {limit:.0f} s; last test started: {seen['last_test_started']} "
                                   f"(see {log.name})")
    elif rc == 5:
        out.update(ok=False, error=f"no gpu-marked tests were collected ({seen['summary']})")
    elif rc != 0:
        out.update(ok=False, error=f"pytest -m gpu tests/gpu exited {rc}: {seen['summary'] or 'see ' + log.name}")
    return out


def _require_cuda() -> None:
    if not _cuda_available():
        import torch

        raise RuntimeError(f"needs a CUDA device (torch {torch.__version__} sees none)")


def stage_train(progress, cap_s: float, out_dir: Path) -> dict:
    _require_cuda()
    import torch

    from ..model.spec import resolve_impl
    from .train import bench_train

    impl = resolve_impl("auto")
    plan = memory_plan(torch.cuda.get_device_properties(0).total_memory, impl=impl)
    print(plan.describe(), flush=True)
    progress({"plan": plan.describe(), "recompute": plan.recompute, "predicted_peak_gib": plan.peak_bytes / 2**30})
    tokens = PROMPT + RESPONSE
    raws, oom = [], None

    def run(recompute: str) -> None:
        raws.append(bench_train(model=MODEL, tokens=tokens, seq_len=tokens, prompt_len=PROMPT, dtype="bf16", tp=1,
                                transformer_impl=impl, recompute=recompute, steps=2, warmup=1,
                                max_tokens_per_micro_batch=tokens))

    recompute = plan.recompute
    if not runs_in_memory(lambda: run(recompute)) and recompute != "full":
        # the plan promised a fit that did not hold: say so, and still measure the update under full recompute
        import gc

        oom, recompute = f"recompute={recompute} ran out of memory (the plan predicted a fit)", "full"
        progress({"plan": plan.describe(), "recompute": recompute, "plan_oom": oom})
        gc.collect()
        torch.cuda.empty_cache()
        run(recompute)
    if not raws:
        raise RuntimeError("recompute=full ran out of memory: the plan predicted a fit")
    raw = raws[-1]
    peak = raw.get("gpu_peak_allocated_gib")
    return {"plan": plan.describe(), "recompute": recompute, "plan_oom": oom, "ok": oom is None,
            "transformer_impl": raw["transformer_impl"],
            "tokens": raw["tokens_per_step"], "device": raw["device"], "peak_tflops": raw["peak_tflops"],
            "forward_only": _phase(raw["logprob"]), "update": _phase(raw["update"]),
            "peak_allocated_gib": peak, "predicted_peak_gib": plan.peak_bytes / 2**30 if oom is None else None,
            "peak_over_prediction": None if peak is None or oom else peak * 2**30 / plan.peak_bytes}


# the mfu stage's A/B, (name, JUSTRL_FAST_PATHS_OFF, model.attention_backend): the baseline (every fast path off,
# flash attention), all of them, then each alone on the baseline
MFU_VARIANTS = (("baseline", "all", "flash"), ("all", "", "auto"), ("cudnn_attention", "all", "cudnn"),
                *((name, ",".join(s for s in SWITCHES if s != name), "flash") for name in SWITCHES))


def stage_mfu(progress, cap_s: float, out_dir: Path) -> dict:
    """Microbenchmarks of each fast path (bench/kernels.py), then the train phase (the `train` stage's model and
    lengths, recompute none) once per MFU_VARIANTS entry on this card, in this process: the baseline, each switch
    alone, all; device-to-host syncs of one update counted for the baseline and for all."""
    _require_cuda()
    import gc

    import torch

    from . import kernels
    from .train import bench_train

    from ..model.spec import fused_swiglu_check

    t_end = time.monotonic() + cap_s
    record = {"micro": {}, "variants": {}, "fused_swiglu": fused_swiglu_check("cuda") or "ok"}
    # (the check first: it resets torch.compile's caches once per process, which would drop what the
    # microbenchmarks compiled and make the variants compile again)
    record["micro"] = kernels.run_all(lambda partial: progress({**record, "micro": partial}))
    progress(record)
    tokens = PROMPT + RESPONSE
    for name, off, backend in MFU_VARIANTS:
        if time.monotonic() > t_end - 25:
            record["variants"][name] = {"error": "no time left in the stage"}
            continue
        os.environ["JUSTRL_FAST_PATHS_OFF"] = off
        try:
            raw = bench_train(model=MODEL, tokens=tokens, seq_len=tokens, prompt_len=PROMPT, dtype="bf16", tp=1,
                              transformer_impl="local", recompute="none", steps=2, warmup=1,
                              max_tokens_per_micro_batch=tokens, attention_backend=backend,
                              count_syncs=name in ("baseline", "all"))
            record["variants"][name] = {
                "fast_paths_off": off, "attention_backend": backend,
                "update": _phase(raw["update"]), "forward_only": _phase(raw["logprob"]),
                "fwd_bwd": _phase(raw["fwd_bwd"]) if raw.get("fwd_bwd") else None,
                "optimizer_s": raw.get("optimizer_s"), "peak_allocated_gib": raw.get("gpu_peak_allocated_gib"),
                "syncs": raw.get("syncs"), "grad_norm": raw.get("grad_norm"), "loss": raw.get("loss")}
        except Exception as exc:  # noqa: BLE001  (one variant failing still leaves the others' figures)
            record["variants"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        finally:
            os.environ.pop("JUSTRL_FAST_PATHS_OFF", None)
            gc.collect()
            torch.cuda.empty_cache()
        progress(record)
    record["justrl_packed"] = justrl_packed_rows(progress, record, t_end)
    base = record["variants"].get("baseline", {}).get("update")
    if base:
        for v in record["variants"].values():
            if v.get("update"):
                v["update_speedup_vs_baseline"] = base["seconds"] / v["update"]["seconds"]
    record["ok"] = all("error" not in v for v in [*record["variants"].values(), *record["justrl_packed"].values()])
    return record


JUSTRL_GROUPS = 2  # 16 responses, ~100K tokens: several micro-batches at the plan's budget
JUSTRL_BACKENDS = ("auto", "flash")


def justrl_packed_rows(progress, record: dict, t_end: float) -> dict:
    """The update on a JustRL-shaped batch (bench/packed_shape.py) under the memory plan (its recompute mode and the
    largest token budget it allows), trainer.shared_prompt on, every fast path on; once per attention backend."""
    import gc

    import torch

    from .packed_shape import justrl_samples
    from .train import BUILTIN_SHAPES, bench_train

    plan = memory_plan(torch.cuda.get_device_properties(0).total_memory, max_tokens=1 << 17)
    samples = justrl_samples(JUSTRL_GROUPS, BUILTIN_SHAPES[MODEL].vocab_size, seed=0)
    rows = {}
    for backend in JUSTRL_BACKENDS:
        if time.monotonic() > t_end - 30:
            rows[backend] = {"error": "no time left in the stage"}
            continue
        try:
            raw = bench_train(model=MODEL, samples=samples, shared_prompt="on", dtype="bf16", tp=1,
                              transformer_impl="local", recompute=plan.recompute, steps=2, warmup=1,
                              max_tokens_per_micro_batch=plan.max_tokens_per_micro_batch, attention_backend=backend)
            rows[backend] = {"attention_backend": raw["attention_backend"], "recompute": plan.recompute,
                             "budget": plan.max_tokens_per_micro_batch, "sequences": raw["num_sequences"],
                             "tokens": raw["tokens_per_step"], "micro_batches": raw["micro_batches"],
                             "update": _phase(raw["update"]), "forward_only": _phase(raw["logprob"]),
                             "peak_allocated_gib": raw.get("gpu_peak_allocated_gib")}
        except Exception as exc:  # noqa: BLE001  (one row failing still leaves the other's figures)
            rows[backend] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        progress({**record, "justrl_packed": rows})
    return rows


def stage_moe(progress, cap_s: float, out_dir: Path) -> dict:
    """Grouped vs sequential experts on the Qwen3-30B-A3B slice: tokens/s of the update both ways (MFU is left out:
    bench/flops.py counts dense MLPs), and the two runs' loss and grad norm (same weights, same batch)."""
    _require_cuda()
    from .update_ab import QWEN3_30B_A3B_SLICE, TOLERANCES, speed

    got = speed("moe_grouped_gemm", model=QWEN3_30B_A3B_SLICE, tokens=16384, prompt_len=1024, recompute="none")
    tol = TOLERANCES["moe_grouped_gemm"]
    off, on = got["off"], got["on"]
    got["loss_abs_diff"] = abs(on["loss"] - off["loss"])
    got["grad_norm_rel_diff"] = abs(on["grad_norm"] - off["grad_norm"]) / max(abs(off["grad_norm"]), 1e-12)
    got["within_tolerance"] = got["loss_abs_diff"] <= tol["loss_abs"] and got["grad_norm_rel_diff"] <= tol["grad_rel"]
    got["goal_2x"] = got["speedup"] >= 2.0
    return {**got, "ok": got["within_tolerance"]}


def stage_fp8(progress, cap_s: float, out_dir: Path) -> dict:
    """FP8 vs bf16: the 16K update both ways (MFU over the same bf16 model FLOPs), then 20 updates on fixed data
    both ways (4 x 2,048 tokens, lr 1e-5), their losses and grad norms against update_ab.TOLERANCES."""
    _require_cuda()
    from ..model.fp8 import hopper_problem
    from .train import BUILTIN_SHAPES
    from .update_ab import TOLERANCES, compare, speed, trajectory

    why = hopper_problem()
    if why:
        return {"ok": False, "error": why}
    record = {"speed": speed("fp8", model=MODEL, tokens=PROMPT + RESPONSE, prompt_len=PROMPT, recompute="none")}
    record["goal_1.25x"] = record["speed"]["speedup"] >= 1.25
    progress(record)
    shape = BUILTIN_SHAPES[MODEL]
    ref = trajectory(shape, fp8=False)
    progress({**record, "bf16_trajectory": ref})
    got = trajectory(shape, fp8=True)
    record.update(bf16_trajectory=ref, fp8_trajectory=got, trajectory=compare(ref, got, **TOLERANCES["fp8"]))
    return {**record, "ok": record["trajectory"]["ok"]}


def _phase(p: dict) -> dict:
    return {"seconds": p["time_s"], "tokens_per_s_per_gpu": p["tokens_per_s_per_device"],
            "tflops_per_gpu": p["tflops_per_device"], "mfu": p["mfu"]}


def stage_budget(progress, cap_s: float, out_dir: Path) -> dict:
    _require_cuda()
    import gc
    import random

    import torch

    from ..distributed import init_distributed
    from ..model.memory import estimate_peak_bytes, gpu_kernels
    from ..model.policy import Policy
    from ..model.spec import resolve_impl
    from ..train.batching import Sample
    from ..train.step import grpo_update_on_policy
    from .train import BUILTIN_SHAPES

    t_end = time.monotonic() + cap_s - 20  # leave time to write the result
    shape, impl = BUILTIN_SHAPES[MODEL], resolve_impl("auto")
    device_bytes = torch.cuda.get_device_properties(0).total_memory
    plan = memory_plan(device_bytes, max_tokens=1 << 20, impl=impl)  # the plan's largest budget
    init_distributed()
    policy = Policy.build(shape, tp=1, dtype="bf16", transformer_impl=impl, recompute=plan.recompute,
                          distributed_optimizer=True, max_sequence_length=PROMPT + RESPONSE)
    rng = random.Random(0)
    records = []

    def record() -> dict:
        best = max((r["tokens"] for r in records if r["fits"]), default=0)
        return {"recompute": plan.recompute, "plan_budget": plan.max_tokens_per_micro_batch, "step": BUDGET_STEP,
                "largest_fitting": best, "measured_over_plan": best / plan.max_tokens_per_micro_batch,
                "trials": list(records)}

    def samples(tokens: int) -> list:  # full 16K samples, the rest as one shorter sample
        out, left = [], tokens
        while left > 0:
            n = min(left, PROMPT + RESPONSE)
            p = min(PROMPT, n // 2)
            out.append(Sample(prompt_ids=[rng.randrange(shape.vocab_size) for _ in range(p)],
                              response_ids=[rng.randrange(shape.vocab_size) for _ in range(n - p)],
                              advantage=rng.choice([-1.0, 1.0])))
            left -= n
        return out

    def fits(tokens: int) -> bool:
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        ok = runs_in_memory(lambda: (grpo_update_on_policy(policy, samples(tokens), max_tokens_per_micro_batch=tokens),
                                     torch.cuda.synchronize()))
        peak = torch.cuda.max_memory_allocated()
        for chunk in policy.chunks:  # drop what the failed step left behind
            chunk.zero_grad_buffer()
        policy.optimizer.zero_grad()
        gc.collect()
        torch.cuda.empty_cache()
        predicted = estimate_peak_bytes(shape, tokens=tokens, recompute=plan.recompute, impl=impl,
                                        kernels=gpu_kernels(impl))
        records.append({"tokens": tokens, "fits": ok, "seconds": round(time.perf_counter() - t0, 2),
                        "peak_allocated_gib": round(peak / 2**30, 2),
                        "predicted_peak_gib": round(predicted / 2**30, 2)})
        print(records[-1], flush=True)
        progress(record())  # the report is rewritten after every try
        return ok

    progress(record())
    search_budget(fits, plan.max_tokens_per_micro_batch, grow=1.25, limit=1 << 20, deadline=t_end)
    return record()


STAGE_FUNCTIONS = {"probe": stage_probe, "pytest": stage_pytest, "train": stage_train, "budget": stage_budget,
                   "mfu": stage_mfu, "moe": stage_moe, "fp8": stage_fp8}


def _stage_main(name: str, result: Path, cap_s: float, out_dir: Path) -> int:
    try:
        if name != "pytest":  # its own process runs no torch (pytest is a child of it)
            import justrl_megatron.compat  # noqa: F401  (first, as every entry point)

        data = {"ok": True, **STAGE_FUNCTIONS[name](lambda partial: _write_json(result, partial), cap_s, out_dir)}
    except Exception as err:  # noqa: BLE001  (recorded, the driver goes on with the next stage)
        import traceback

        traceback.print_exc()
        data = {"ok": False, "error": f"{type(err).__name__}: {str(err)[:2000]}"}
    _write_json(result, {**data, "final": True})
    return 0 if data["ok"] else 1


# --- driver: no torch here --------------------------------------------------------------------------------------------

def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid`` (Linux /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d.name))
    return out


def _kill_group(pgid: int, leader: int) -> int:
    """SIGKILL the whole process group and wait (up to 10 s) until it is gone, so that nothing a stage started (a
    hung pytest child, torchrun or vLLM workers) holds the GPU into the next stage. Returns how many processes
    besides the leader were still there."""
    left = [p for p in _group_members(pgid) if p != leader]
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    t_end = time.monotonic() + 10
    while time.monotonic() < t_end and [p for p in _group_members(pgid) if p != leader]:
        time.sleep(0.1)
    return len(left)


def _run_stage(name: str, cap_s: float, out_dir: Path, on_progress: Callable[[dict], None],
               cmd: list[str] | None = None) -> dict:
    """Run one stage (``cmd``: its command, by default this module's `--stage NAME`; it writes its record, partial
    or final, to the file given after `--result`) in a process group of its own, at most ``cap_s`` seconds."""
    result = out_dir / f".{name}.json"
    result.unlink(missing_ok=True)
    t0 = time.monotonic()
    cmd = (cmd or [sys.executable, "-m", "justrl_megatron.bench.gpu_check", "--stage", name]) + [
        "--result", str(result), "--cap", str(cap_s), "--out", str(out_dir)]
    print(f"\n=== gpu_check: {name} (cap {cap_s:.0f} s): {STAGES.get(name, ('', cmd))[1]}", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)  # its own process group (pgid = its pid)
    seen, timed_out, stopped = None, False, None
    try:
        while True:
            # exited? (WNOWAIT: not reaped yet, so its pid, the group's id, cannot be reused before the kill below)
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                break
            if time.monotonic() - t0 >= cap_s:
                timed_out = True
                break
            time.sleep(0.5)
            if result.exists() and result.stat().st_mtime_ns != seen:  # a partial record: into the report now
                seen = result.stat().st_mtime_ns
                try:
                    on_progress({"stage": name, "status": "running", "cap_s": cap_s,
                                 "seconds": round(time.monotonic() - t0, 1), **json.loads(result.read_text())})
                except (OSError, ValueError):
                    pass
    except _Stopped as err:  # the driver was told to stop (the shell's backstop): the stage goes too
        stopped = err
    leftovers = _kill_group(proc.pid, proc.pid)  # after every stage, not only a timed-out one
    rc = proc.wait()
    record = {"stage": name, "status": "done", "seconds": round(time.monotonic() - t0, 1), "cap_s": cap_s}
    data = {}
    if result.exists():
        try:
            data = json.loads(result.read_text())
        except ValueError:
            pass
        result.unlink()
    record.update({k: v for k, v in data.items() if k != "final"})
    if leftovers:
        record["killed_leftover_processes"] = leftovers
    if stopped is not None:
        record.update(ok=False, error=f"stopped by {stopped} after {record['seconds']:.0f} s"
                                      + (" (partial record kept)" if data else ""))
    elif timed_out:
        record.update(ok=False, error=f"timed out after {cap_s:.0f} s" + (" (partial record kept)" if data else ""))
    elif not data.get("final"):
        record.update(ok=False, error=f"exited {rc} without a final record")
    elif rc != 0 and record.get("ok", True):
        record.update(ok=False, error=record.get("error") or f"exited {rc}")
    print(f"=== gpu_check: {name} {'ok' if record.get('ok') else 'FAILED'}: {json.dumps(record, default=str)[:3000]}",
          flush=True)
    if stopped is not None:
        raise _Stopped(str(stopped), record)
    return record


class _Stopped(Exception):
    """SIGTERM/SIGINT reached the driver (`timeout` in gpu_check.sh, or a person): the stage's group is killed, the
    report written, and the driver exits."""

    def __init__(self, why: str, record: dict | None = None):
        super().__init__(why)
        self.record = record


def _raise_stopped(signum, frame):
    raise _Stopped(signal.Signals(signum).name)


def _machine() -> dict:
    """What the driver can say without torch (the probe stage adds the rest: GPU, versions)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True, capture_output=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "python": platform.python_version(), "git_commit": commit}


def write_report(out_dir: Path, report: dict) -> None:
    stages = report["stages"]
    report["device"] = next((s.get("device") for s in stages if s.get("device")), None)
    report["complete"] = all(s.get("status") in ("done", "not run") for s in stages)
    report["ok"] = report["complete"] and all(s.get("ok") for s in stages)
    _write_json(out_dir / "gpu_check.json", report)
    tmp = out_dir / "gpu_check.md.tmp"
    tmp.write_text(markdown(report))
    os.replace(tmp, out_dir / "gpu_check.md")


def markdown(report: dict) -> str:
    rows = ["| stage | ok | seconds | result |", "| --- | --- | --- | --- |"]
    for s in report["stages"]:
        status = s.get("status", "done")
        ok = {"pending": "pending", "running": "running"}.get(status, "yes" if s.get("ok") else "NO")
        rows.append(f"| {s['stage']} | {ok} | {s.get('seconds', '')} | {_summary(s)} |")
    head = f"# gpu_check {report['date']} on {report.get('device') or 'unknown device'} (commit {report['commit']})"
    lines = [head, "", *rows, ""]
    later = report.get("plan", {}).get("second_call")
    if later:
        lines += [f"Not in this call: `{later}`", ""]
    return "\n".join(lines)


def _summary(s: dict) -> str:
    try:
        text = _result(s)
    except (KeyError, TypeError, ValueError) as err:  # a partial record: say what is there
        text = f"(partial: {type(err).__name__} {err})"
    if s.get("status", "done") in ("done", "not run") and not s.get("ok"):
        text = f"failed: {s.get('error', '')}" + (f"; {text}" if text else "")
    return text.replace("|", "/").replace("\n", " ")[:400]


def _result(s: dict) -> str:
    if s["stage"] == "probe" and "torch" in s:
        text = f"torch {s['torch']} CUDA {s['cuda']}, megatron-core {s['megatron_core']}"
        if "device" in s:
            text += (f", {s['device']} {s['device_total_gib']} GiB, varlen: "
                     f"{s.get('varlen_choice') or s.get('varlen_signature')}")
        return text
    if s["stage"] == "pytest" and "summary" in s:
        return s["summary"] + (f"; last test started: {s['last_test_started']}" if s.get("returncode") is None else "")
    if s["stage"] == "train" and "update" in s:
        f, u = s["forward_only"], s["update"]
        mfu = lambda p: "n/a" if p["mfu"] is None else f"{100 * p['mfu']:.1f}%"  # noqa: E731
        return (f"{s['tokens']} tokens, recompute={s['recompute']}: forward {f['tokens_per_s_per_gpu']:,.0f} tok/s "
                f"(MFU {mfu(f)}), update {u['tokens_per_s_per_gpu']:,.0f} tok/s (MFU {mfu(u)}); peak "
                f"{s['peak_allocated_gib']:.1f} GiB vs plan {s['predicted_peak_gib']:.1f} GiB")
    if s["stage"] == "budget" and "largest_fitting" in s:
        return (f"largest fitting {s['largest_fitting']} tokens/micro-batch (recompute={s['recompute']}, "
                f"{len(s['trials'])} tries, {s['step']}-token steps), plan {s['plan_budget']}")
    pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    if s["stage"] == "mfu" and "variants" in s:
        rows = [f"{n} {pct((v.get('update') or {}).get('mfu'))}" for n, v in s["variants"].items()]
        rows += [f"justrl_packed[{n}] {pct((v.get('update') or {}).get('mfu'))}"
                 for n, v in s.get("justrl_packed", {}).items()]
        return "update MFU: " + ", ".join(rows)
    if s["stage"] == "moe" and "speedup" in s:
        return (f"grouped {s['on']['update_tokens_per_s']:,.0f} vs sequential {s['off']['update_tokens_per_s']:,.0f} "
                f"tok/s ({s['speedup']:.2f}x); loss diff {s['loss_abs_diff']:.2g}, grad norm "
                f"{100 * s['grad_norm_rel_diff']:.2g}%")
    if s["stage"] == "fp8" and "speed" in s:
        sp = s["speed"]
        text = (f"update {sp['speedup']:.2f}x (MFU bf16 {pct(sp['off']['update_mfu'])}, fp8 "
                f"{pct(sp['on']['update_mfu'])})")
        if "trajectory" in s:
            t = s["trajectory"]
            text += (f"; {t['updates']} updates: loss diff <= {t['max_loss_abs_diff']:.2g}, grad norm "
                     f"<= {100 * t['max_grad_norm_rel_diff']:.2g}% ({'within' if t['ok'] else 'OUTSIDE'} tolerance)")
        return text
    return ""


def dry_run(wheels: Path) -> int:
    bundle = check_bundle(wheels)
    if not bundle.present:
        print(f"gpu_check --dry-run: {bundle.problems[0]}")
    else:
        for w in bundle.wheels:
            print(f"  {w['bytes']:>10,d}  {w['file']}")
        print(f"  {bundle.total_bytes:>10,d}  total ({len(bundle.wheels)} wheels, limit {BUNDLE_LIMIT_BYTES:,d})")
        print(f"gpu_check --dry-run: bundle {'ok' if bundle.ok else 'BROKEN'}")
        for p in bundle.problems:
            print(f"  - {p}")
    print(f"each call is planned at <= {CALL_PLAN_S} s: pip install + start-up, then at most {TOTAL_CAP_S} s of stages")
    for i, names in enumerate(CALLS, 1):
        total = sum(STAGES[n][0] for n in names)
        print(f"call {i}: {call_command(names)}   ({total} s of stages)")
        for name in names:
            cap, what = STAGES[name]
            print(f"  {name:7s} cap {cap:3d} s  {what}")
    print(f"on an 80 GB H100 at TP=1, {PROMPT} + {RESPONSE} tokens: {memory_plan(H100_80GB_BYTES).describe()}")
    return 1 if bundle.present and not bundle.ok else 0


def run_stages(names: list[str], out_dir: Path, *, call_started: float | None = None,
               clock: Callable[[], float] = time.monotonic) -> int:
    """Run ``names`` in order within TOTAL_CAP_S (and CALL_PLAN_S of the whole call, counted from ``call_started``,
    a time.time() taken when the call began), rewriting gpu_check.json/.md before and after each stage."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub on the box; every test model is a local folder
    out_dir.mkdir(parents=True, exist_ok=True)
    t_end = clock() + TOTAL_CAP_S
    if call_started is not None:
        t_end = min(t_end, clock() + CALL_PLAN_S - 15 - (time.time() - call_started))
    before = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _run_stages(names, out_dir, t_end, clock)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _run_stages(names: list[str], out_dir: Path, t_end: float, clock: Callable[[], float]) -> int:
    machine = _machine()
    stages = [{"stage": n, "status": "pending"} for n in names]
    report = {"date": machine["date"], "commit": machine["git_commit"], "device": None, "machine": machine,
              "plan": {"call_s": CALL_PLAN_S, "stages_s": TOTAL_CAP_S, "this_call": names, "second_call": None},
              "stages": stages}
    write_report(out_dir, report)
    for i, name in enumerate(names):
        # a stage's cap keeps a hang from eating the stages after it; the last one (a stage run alone too) has none
        # after it and may use the rest of the call
        cap = t_end - clock() if i == len(names) - 1 else min(STAGES[name][0], t_end - clock())
        if cap < MIN_STAGE_S:
            rest = names[i:]
            report["plan"]["second_call"] = call_command(rest)
            for j in range(i, len(names)):
                stages[j] = {"stage": names[j], "status": "not run", "ok": False,
                             "error": f"no time left in this call's {TOTAL_CAP_S} s; run it as a second call: "
                                      f"{call_command(rest)}"}
            write_report(out_dir, report)
            break
        stages[i] = {"stage": name, "status": "running", "cap_s": round(cap)}
        write_report(out_dir, report)

        def on_progress(partial, i=i):
            stages[i] = partial
            write_report(out_dir, report)

        try:
            stages[i] = _run_stage(name, cap, out_dir, on_progress)
        except _Stopped as err:
            stages[i] = err.record or {"stage": name, "status": "done", "ok": False, "error": f"stopped by {err}"}
            for j in range(i + 1, len(names)):
                stages[j] = {"stage": names[j], "status": "not run", "ok": False, "error": f"stopped by {err}"}
            write_report(out_dir, report)
            print(f"gpu_check: stopped by {err}; wrote {out_dir}/gpu_check.json", flush=True)
            return 124
        write_report(out_dir, report)
    print("\n" + markdown(report))
    verdict = "all stages ok" if report["ok"] else "FAILED"
    print(f"gpu_check: wrote {out_dir}/gpu_check.json and gpu_check.md; {verdict}")
    return 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="check the bundle and print the plan (CPU)")
    p.add_argument("--out", default=os.environ.get("OUT") or str(Path.cwd() / "gpu_check_out"))
    p.add_argument("--wheels", default=str(ROOT / ".whl"))
    p.add_argument("--stages", default=",".join(CALLS[0]),
                   help=f"comma-separated, run in this order (default: {','.join(CALLS[0])}); known: "
                        + ", ".join(STAGES))
    p.add_argument("--check-bundle", action="store_true", help="only check the wheel bundle (exit 2 if unusable)")
    p.add_argument("--stage", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--cap", type=float, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.stage:
        return _stage_main(a.stage, Path(a.result), a.cap, Path(a.out))
    if a.check_bundle:  # before installing it: stdlib only
        bundle = check_bundle(a.wheels)
        for problem in bundle.problems:
            print(f"gpu_check: {problem}", file=sys.stderr)
        return 0 if bundle.ok else 2
    if a.dry_run:
        return dry_run(Path(a.wheels))
    names = [s.strip() for s in a.stages.split(",") if s.strip()]
    unknown = sorted(set(names) - set(STAGES))
    if unknown or not names:
        print(f"gpu_check: unknown stages {unknown}; known: {list(STAGES)}", file=sys.stderr)
        return 2
    started = os.environ.get("JUSTRL_CALL_STARTED")  # set by tools/gpu_check.sh: the install counts too
    return run_stages(names, Path(a.out), call_started=float(started) if started else None)


if __name__ == "__main__":
    sys.exit(main())
