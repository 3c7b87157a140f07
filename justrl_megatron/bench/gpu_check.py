"""`tools/gpu_check.sh`: one command that tells what this stack does on a bare GPU box, in at most 9 minutes.

Stages, each in a process of its own with its own time cap (a crash, hang or CUDA OOM in one is recorded and the next
still runs; the exit code is non-zero if any failed):
  probe   torch / CUDA / device / megatron-core versions, and which torch varlen flash-attention call works here
  pytest  `python -m pytest -m gpu tests -q`: the CUDA-only tests
  train   the train-phase benchmark (bench/train.py) on the DeepSeek-R1-Distill-Qwen-1.5B shape with random weights:
          one sample of 1,024 prompt + 15,360 response tokens, bf16, TP=1, the recompute mode the memory plan picks;
          tokens/s/GPU and MFU of the forward-only pass (old logprobs) and of the update (fwd + bwd + optimizer), and
          the peak allocated memory against the plan's prediction
  budget  the largest token budget per micro-batch that fits: upward from the plan's budget (one update per try,
          catching torch.cuda.OutOfMemoryError), then bisection, within the stage's cap; each try's peak vs the plan
Results: gpu_check.json and gpu_check.md in $OUT when set, else ./gpu_check_out/.

    python -m justrl_megatron.bench.gpu_check [--dry-run] [--out DIR] [--wheels DIR]

`--dry-run` (CPU, CI) checks the wheel bundle (.whl/, see tools/gpu_wheels.txt) and prints the stages and the memory
plan computed for an 80 GB H100. Everything here runs through `python -m` (no console scripts on the box).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
WHEELS_TXT = ROOT / "tools" / "gpu_wheels.txt"
BUNDLE_LIMIT_BYTES = 20 * 1000 * 1000
H100_80GB_BYTES = 81559 * 2**20  # what nvidia-smi reports for an H100 80GB HBM3
MODEL = "deepseek-r1-distill-qwen-1.5b"
PROMPT, RESPONSE = 1024, 15360
TOTAL_CAP_S = 540  # 9 minutes for all stages
STAGES = {  # name -> (time cap in seconds, what it does)
    "probe": (60, "torch / CUDA / device / varlen flash attention probe"),
    "pytest": (150, "python -m pytest -m gpu tests -q"),
    "train": (180, f"train phase, {MODEL} shape, {PROMPT} + {RESPONSE} tokens, bf16, TP=1, under the memory plan"),
    "budget": (140, "largest tokens per micro-batch that fit (upward from the plan, OOM caught)"),
}


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
        return BundleReport(str(path), False, [], 0, [f"bundle missing: no {path}/ (run `bash tools/gpu_wheels.sh` "
                                                      f"on a machine with PyPI, then carry it)"])
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

def search_budget(fits: Callable[[int], bool], start: int, *, multiple: int = 128, grow: float = 1.25,
                  limit: int | None = None, deadline: float | None = None,
                  clock: Callable[[], float] = time.monotonic) -> tuple[int, list[tuple[int, bool]]]:
    """The largest multiple of ``multiple`` for which ``fits`` holds: from ``start`` upward by ``grow`` until the first
    failure (downward if ``start`` fails), then bisection to one ``multiple``. Stops at ``limit`` or ``deadline``
    (then the best found so far). Returns (best, 0 if none fits; [(tokens, fitted), ...] in trial order)."""
    def down(x: float) -> int:
        return int(x) // multiple * multiple

    best, failed, trials = 0, None, []
    n = max(multiple, down(start))
    if limit is not None:
        n = min(n, down(limit))
    while deadline is None or clock() < deadline:
        ok = bool(fits(n))
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
    from ..model.memory import plan_memory
    from .train import BUILTIN_SHAPES

    return plan_memory(BUILTIN_SHAPES[MODEL], device_bytes=device_bytes,
                       max_tokens_per_micro_batch=max_tokens or PROMPT + RESPONSE,
                       min_tokens=PROMPT + RESPONSE, tp=1, pp=1, dp=1, impl=impl)


# --- stages (each runs in its own process: `--stage NAME --result FILE`) ----------------------------------------------

def stage_probe() -> dict:
    import inspect
    import platform

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available()}
    try:
        from importlib.metadata import version

        out["megatron_core"] = version("megatron-core")
    except Exception as err:  # noqa: BLE001
        out["megatron_core"] = f"missing ({err})"
    if not torch.cuda.is_available():
        raise RuntimeError(f"no CUDA device visible to torch {torch.__version__}")
    props = torch.cuda.get_device_properties(0)
    out.update(device=props.name, device_total_gib=round(props.total_memory / 2**30, 2),
               multiprocessors=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
    try:
        from torch.nn.attention.varlen import varlen_attn

        out["varlen_signature"] = str(inspect.signature(varlen_attn))
    except Exception as err:  # noqa: BLE001
        out["varlen_signature"] = f"unavailable ({type(err).__name__}: {err})"
        return out
    # which call form the model's attention will use (the same probe, attention.varlen_choice), GQA and MHA
    from ..model.attention import probe_varlen, varlen_candidates

    out["varlen_choice"] = {}
    for heads, groups in ((12, 2), (4, 4)):
        name, _, rejected = probe_varlen(varlen_candidates(), torch.device("cuda", 0), torch.bfloat16, heads, groups,
                                         128)
        out["varlen_choice"][f"{heads} heads / {groups} KV groups"] = {"chosen": name, "rejected": rejected}
    return out


def stage_pytest(cap_s: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests", "-q", "-p", "no:cacheprovider",
           "--continue-on-collection-errors"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(cap_s - 10, 10))
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    summary = next((ln for ln in reversed(lines)
                    if re.search(r"\b(passed|failed|errors?|skipped|deselected|no tests ran)\b", ln)), "")
    print("\n".join(lines[-40:]))
    out = {"returncode": proc.returncode, "summary": summary.strip("= ")}
    if proc.returncode == 5:
        out["summary"] = f"no gpu-marked tests were collected ({out['summary']})"
    if proc.returncode != 0:
        raise RuntimeError(f"pytest -m gpu exited {proc.returncode}: {out['summary'] or 'see the log'}")
    return out


def _require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"needs a CUDA device (torch {torch.__version__} sees none)")


def stage_train() -> dict:
    import torch

    _require_cuda()
    from ..model.spec import resolve_impl
    from .train import bench_train

    impl = resolve_impl("auto")
    plan = memory_plan(torch.cuda.get_device_properties(0).total_memory, impl=impl)
    print(plan.describe(), flush=True)
    tokens = PROMPT + RESPONSE
    raw = bench_train(model=MODEL, tokens=tokens, seq_len=tokens, prompt_len=PROMPT, dtype="bf16", tp=1,
                      transformer_impl=impl, recompute=plan.recompute, steps=2, warmup=1,
                      max_tokens_per_micro_batch=tokens)
    peak = raw.get("gpu_peak_allocated_gib")
    return {"plan": plan.describe(), "recompute": plan.recompute, "transformer_impl": raw["transformer_impl"],
            "tokens": raw["tokens_per_step"], "device": raw["device"], "peak_tflops": raw["peak_tflops"],
            "forward_only": _phase(raw["logprob"]), "update": _phase(raw["update"]),
            "peak_allocated_gib": peak, "predicted_peak_gib": plan.peak_bytes / 2**30,
            "peak_over_prediction": None if peak is None else peak * 2**30 / plan.peak_bytes}


def _phase(p: dict) -> dict:
    return {"seconds": p["time_s"], "tokens_per_s_per_gpu": p["tokens_per_s_per_device"],
            "tflops_per_gpu": p["tflops_per_device"], "mfu": p["mfu"]}


def stage_budget(cap_s: float) -> dict:
    import gc
    import random

    import torch

    from ..distributed import init_distributed
    from ..model.memory import estimate_peak_bytes
    from ..model.policy import Policy
    from ..model.spec import resolve_impl
    from ..train.batching import Sample
    from ..train.step import grpo_update_on_policy
    from .train import BUILTIN_SHAPES

    _require_cuda()
    t_end = time.monotonic() + cap_s - 20  # leave time to write the result
    shape, impl = BUILTIN_SHAPES[MODEL], resolve_impl("auto")
    device_bytes = torch.cuda.get_device_properties(0).total_memory
    plan = memory_plan(device_bytes, max_tokens=1 << 20, impl=impl)  # the plan's largest budget
    init_distributed()
    policy = Policy.build(shape, tp=1, dtype="bf16", transformer_impl=impl, recompute=plan.recompute,
                          distributed_optimizer=True, max_sequence_length=PROMPT + RESPONSE)
    rng = random.Random(0)
    records = []

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
        try:
            grpo_update_on_policy(policy, samples(tokens), max_tokens_per_micro_batch=tokens)
            torch.cuda.synchronize()
            ok = True
        except torch.cuda.OutOfMemoryError:
            ok = False
        peak = torch.cuda.max_memory_allocated()
        for chunk in policy.chunks:  # drop what the failed step left behind
            chunk.zero_grad_buffer()
        policy.optimizer.zero_grad()
        gc.collect()
        torch.cuda.empty_cache()
        predicted = estimate_peak_bytes(shape, tokens=tokens, recompute=plan.recompute, impl=impl)
        records.append({"tokens": tokens, "fits": ok, "seconds": round(time.perf_counter() - t0, 2),
                        "peak_allocated_gib": round(peak / 2**30, 2),
                        "predicted_peak_gib": round(predicted / 2**30, 2)})
        print(records[-1], flush=True)
        return ok

    best, _ = search_budget(fits, plan.max_tokens_per_micro_batch, grow=1.25, limit=1 << 20, deadline=t_end)
    return {"recompute": plan.recompute, "plan_budget": plan.max_tokens_per_micro_batch, "largest_fitting": best,
            "measured_over_plan": best / plan.max_tokens_per_micro_batch if best else 0.0, "trials": records}


# --- driver ----------------------------------------------------------------------------------------------------------

def _run_stage(name: str, cap_s: float, out_dir: Path) -> dict:
    result = out_dir / f".{name}.json"
    result.unlink(missing_ok=True)
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "justrl_megatron.bench.gpu_check", "--stage", name, "--result", str(result),
           "--cap", str(cap_s)]
    print(f"\n=== gpu_check: {name} (cap {cap_s:.0f} s): {STAGES[name][1]}", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)  # its own group: a timeout kills pytest too
    try:
        rc = proc.wait(timeout=cap_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = None
    record = {"stage": name, "seconds": round(time.monotonic() - t0, 1), "cap_s": cap_s}
    if result.exists():
        record.update(json.loads(result.read_text()))
        result.unlink()
    if rc is None:
        record.update(ok=False, error=f"timed out after {cap_s:.0f} s")
    elif rc != 0 and record.get("ok", True):
        record.update(ok=False, error=record.get("error") or f"exited {rc}")
    print(f"=== gpu_check: {name} {'ok' if record.get('ok') else 'FAILED'}: {json.dumps(record, default=str)}",
          flush=True)
    return record


def _stage_main(name: str, result: Path, cap_s: float) -> int:
    try:
        import justrl_megatron.compat  # noqa: F401  (first, as every entry point)

        fn = {"probe": stage_probe, "pytest": lambda: stage_pytest(cap_s), "train": stage_train,
              "budget": lambda: stage_budget(cap_s)}[name]
        data = {"ok": True, **fn()}
    except Exception as err:  # noqa: BLE001  (recorded, the driver goes on with the next stage)
        import traceback

        traceback.print_exc()
        data = {"ok": False, "error": f"{type(err).__name__}: {str(err)[:2000]}"}
    result.write_text(json.dumps(data, default=str))
    return 0 if data["ok"] else 1


def markdown(report: dict) -> str:
    rows = ["| stage | ok | seconds | result |", "| --- | --- | --- | --- |"]
    for s in report["stages"]:
        rows.append(f"| {s['stage']} | {'yes' if s.get('ok') else 'NO'} | {s.get('seconds', '')} | "
                    f"{_summary(s)} |")
    head = f"# gpu_check {report['date']} on {report.get('device') or 'unknown device'} (commit {report['commit']})"
    return "\n".join([head, "", *rows, ""])


def _summary(s: dict) -> str:
    if not s.get("ok"):
        return f"failed: {s.get('error', '')}".replace("|", "/").replace("\n", " ")[:300]
    if s["stage"] == "probe":
        return (f"torch {s['torch']} CUDA {s['cuda']}, {s['device']} {s['device_total_gib']} GiB, megatron-core "
                f"{s['megatron_core']}, varlen: {s.get('varlen_choice') or s.get('varlen_signature')}")
    if s["stage"] == "pytest":
        return s["summary"]
    if s["stage"] == "train":
        f, u = s["forward_only"], s["update"]
        mfu = lambda p: "n/a" if p["mfu"] is None else f"{100 * p['mfu']:.1f}%"  # noqa: E731
        return (f"{s['tokens']} tokens, recompute={s['recompute']}: forward {f['tokens_per_s_per_gpu']:,.0f} tok/s "
                f"(MFU {mfu(f)}), update {u['tokens_per_s_per_gpu']:,.0f} tok/s (MFU {mfu(u)}); peak "
                f"{s['peak_allocated_gib']:.1f} GiB vs plan {s['predicted_peak_gib']:.1f} GiB")
    if s["stage"] == "budget":
        return (f"largest fitting {s['largest_fitting']} tokens/micro-batch (recompute={s['recompute']}), plan "
                f"{s['plan_budget']}")
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
    print(f"stages (all within {TOTAL_CAP_S} s):")
    for name, (cap, what) in STAGES.items():
        print(f"  {name:7s} cap {cap:3d} s  {what}")
    print(f"on an 80 GB H100 at TP=1, {PROMPT} + {RESPONSE} tokens: {memory_plan(H100_80GB_BYTES).describe()}")
    return 1 if bundle.present and not bundle.ok else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="check the bundle and print the plan (CPU)")
    p.add_argument("--out", default=os.environ.get("OUT") or str(Path.cwd() / "gpu_check_out"))
    p.add_argument("--wheels", default=str(ROOT / ".whl"))
    p.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of " + ", ".join(STAGES))
    p.add_argument("--check-bundle", action="store_true", help="only check the wheel bundle (exit 2 if unusable)")
    p.add_argument("--stage", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--cap", type=float, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.stage:
        return _stage_main(a.stage, Path(a.result), a.cap)
    if a.check_bundle:  # before installing it: stdlib only
        bundle = check_bundle(a.wheels)
        for problem in bundle.problems:
            print(f"gpu_check: {problem}", file=sys.stderr)
        return 0 if bundle.ok else 2
    if a.dry_run:
        return dry_run(Path(a.wheels))
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [s for s in a.stages.split(",") if s]
    unknown = set(names) - set(STAGES)
    if unknown:
        print(f"gpu_check: unknown stages {sorted(unknown)}; known: {list(STAGES)}", file=sys.stderr)
        return 2
    t_end = time.monotonic() + TOTAL_CAP_S
    stages = []
    for name in names:
        cap = min(STAGES[name][0], t_end - time.monotonic())
        if cap < 15:
            stages.append({"stage": name, "ok": False, "error": "no time left in the 9-minute budget"})
            continue
        stages.append(_run_stage(name, cap, out_dir))
    probe = next((s for s in stages if s["stage"] == "probe"), {})
    try:  # the report is written whatever is broken on this machine
        from .cli import machine_info

        machine = machine_info()
    except Exception as err:  # noqa: BLE001
        import datetime

        machine = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "git_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                                capture_output=True).stdout.strip() or None,
                   "error": f"{type(err).__name__}: {err}"}
    report = {"date": machine["date"], "commit": machine["git_commit"], "device": probe.get("device"),
              "machine": machine, "stages": stages, "ok": all(s.get("ok") for s in stages)}
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out_dir / "gpu_check.md").write_text(markdown(report))
    print("\n" + markdown(report))
    verdict = "all stages ok" if report["ok"] else "FAILED"
    print(f"gpu_check: wrote {out_dir}/gpu_check.json and gpu_check.md; {verdict}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
