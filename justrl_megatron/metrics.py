"""Where a run's numbers go: metrics.jsonl in the run dir, wandb (offline by default), a console table, a live
progress bar, GPU memory / utilisation / power through nvidia-ml-py, and curves.png at the end.

A full disk (or quota) on any of these writers ends the run with the one line every run-dir writer uses
(checkpoint/save.full_disk_error: where, the free space, what was undone; a checkpoint still being written is
abandoned), never a traceback, and leaves nothing torn: a metrics row is appended whole or cut back to the file's
previous length, rewrites and curves.png go through a temp file that a failure removes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

CURVES = ("reward/mean", "reward/accuracy", "response/length_mean", "actor/entropy")
DISTILL_CURVE = "distill/reverse_kl"  # plotted too when a run distils (algo.distill.teacher)


def gpu_stats() -> dict[str, float]:
    """Memory, utilisation and power of this process' GPU; empty where there is no NVIDIA driver (CPU machines)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return {}
    try:
        import torch

        from . import compat

        index = compat.default_device().index or 0
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(index))
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        return {
            "gpu/memory_used_gib": mem.used / 2**30,
            "gpu/memory_total_gib": mem.total / 2**30,
            "gpu/utilization_pct": float(util.gpu),
            "gpu/power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            "gpu/torch_peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
    except Exception:
        return {}


class MetricsLogger:
    """Rank 0 writes; other ranks get a logger that does nothing (so the loop needs no `if rank == 0`)."""

    def __init__(self, run_dir: str | os.PathLike, logging_cfg, *, config: dict, total_steps: int, start_step: int,
                 enabled: bool = True):
        self.enabled = enabled
        self.every = max(int(logging_cfg.console_every), 1)
        self.path = Path(run_dir) / "metrics.jsonl"
        self.console = Console(stderr=True, width=160)
        self._wandb = None
        self._progress = None
        if not enabled:
            return
        try:
            lost = drop_rows_after(self.path, start_step)  # a resumed run logs the steps after its checkpoint again
        except OSError as exc:
            _raise_if_full(exc, self.path, f"{self.path.name} (dropping the rows after step {start_step})",
                           "the file is unchanged")
            raise
        if lost:
            print(f"justrl-train: warning: {lost}", file=sys.stderr, flush=True)
        if logging_cfg.wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self._histogram = wandb.Histogram  # a per-sample list (response/lengths) is charted as a histogram
            try:
                self._wandb = wandb.init(project=logging_cfg.wandb_project, name=logging_cfg.wandb_name,
                                         mode=logging_cfg.wandb_mode, dir=str(run_dir), config=config,
                                         resume="allow", id=_wandb_id(run_dir))
            except Exception as exc:  # noqa: BLE001 - wandb wraps what failed in its own errors
                _raise_if_full(exc, Path(run_dir) / "wandb", "wandb's start", "wandb's run was not started")
                raise
        if logging_cfg.progress:
            self._progress = Progress(
                TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
                TimeRemainingColumn(), console=self.console, transient=False)
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, stats="")
            self._progress.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        try:
            append_row(self.path, json.dumps(record) + "\n")
        except OSError as exc:
            self._stop_display()
            _raise_if_full(exc, self.path, f"{self.path.name} row of step {step}", "the partial row was removed")
            raise
        if self._wandb is not None:
            try:
                self._wandb.log({k: self._histogram(v) if isinstance(v, list) else v for k, v in record.items()},
                                step=step)
            except Exception as exc:  # noqa: BLE001 - wandb wraps what failed in its own errors
                self._stop_display()
                _raise_if_full(exc, self.path.parent / "wandb", f"wandb's log of step {step}",
                               f"{self.path.name} has the row")
                raise
        if self._progress is not None and "reward/mean" in metrics:  # not for step 0's validation-only record
            self._progress.update(self._task, completed=step, stats=(
                f"reward {metrics.get('reward/mean', float('nan')):+.3f}  acc {metrics.get('reward/accuracy', 0):.2f}  "
                f"len {metrics.get('response/length_mean', 0):.0f}  {metrics.get('time/step_s', 0):.1f} s/step"))
        if step % self.every == 0:
            self.console.print(_table(step, record))

    def print(self, *args) -> None:
        if self.enabled:
            self.console.print(*args)

    def close(self) -> None:
        self._stop_display()
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception as exc:  # noqa: BLE001 - wandb wraps what failed in its own errors
                _raise_if_full(exc, self.path.parent / "wandb", "wandb's finish", f"{self.path.name} has every row")
                raise

    def _stop_display(self) -> None:
        """The progress bar ends before any last line (a full disk's) is printed under it."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def append_row(path: Path, text: str) -> None:
    """Append one row to `path` whole: one unbuffered write (repeated only after a short write), so the row is in
    the file when this returns; a write that fails (a full disk) cuts the file back to its previous length, so no
    torn row stays and the next run's rows start on a fresh line."""
    data = memoryview(text.encode())
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        try:
            while data:
                data = data[os.write(fd, data):]
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


def _raise_if_full(exc: BaseException, target: Path, what: str, left: str) -> None:
    """A full disk under a metrics writer: the run dir's one line (CheckpointWriteError, printed by justrl-train);
    another failure returns (the caller re-raises it)."""
    from .checkpoint.save import full_disk_error  # (megatron: only when a write failed)

    error = full_disk_error(exc, target, what, left=left)
    if error is not None:
        raise error from None


def drop_rows_after(path: Path, step: int) -> str | None:
    """Keep only the rows of steps <= `step` in metrics.jsonl, one per step (and no torn last line from a killed run),
    so that every step appears once however often a run resumes. Rewritten atomically; untouched when nothing
    changes. A torn row (a file cut short, a kill mid-write) is dropped, but an intact row glued behind it is kept;
    returns one line naming what was dropped and the steps up to `step` left without a row (their checkpoint is
    resumed, so they are not logged again), or None."""
    if not path.exists():
        return None
    text = path.read_text()
    lines = text.splitlines()
    by_step, torn = {}, []
    for line in lines:
        for row in _rows(line, torn):
            if row[0] <= step:
                by_step[row[0]] = row[1]  # a run dir from before this rule may repeat a step: its last row counts
    keep = [by_step[s] for s in sorted(by_step)]
    if keep != lines or not text.endswith("\n"):  # (a last line without one would glue to the next row)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text("".join(line + "\n" for line in keep))
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # (a full disk: nothing half-written stays beside the file)
            raise
    torn = [what for row_step, what in torn if row_step is None or row_step <= step]  # later ones are logged again
    missing = [s for s in range(1, step + 1) if s not in by_step]
    if not torn and not missing:
        return None
    said = [f"dropped {len(torn)} torn row(s) ({'; '.join(torn)})"] if torn else []
    if missing:
        said.append(f"no row is left for step(s) {_ranges(missing)}, which the checkpoint at step {step} covers: "
                    f"they are not logged again")
    return f"{path}: " + "; ".join(said)


_ROW_START = re.compile(r'\{"step": (\d+)')  # MetricsLogger writes "step" first in every row


def _rows(line: str, torn: list[str]):
    """(step, row text) of the intact rows in one line: normally one; a torn row followed by an intact one (a cut
    file appended to) gives the intact one, and the torn part goes to `torn` as (its step or None, what it was)."""
    try:
        yield int(json.loads(line)["step"]), line
        return
    except (ValueError, KeyError, TypeError):
        pass
    if not line.strip():
        return
    starts = [m.start() for m in _ROW_START.finditer(line)]
    for i, start in enumerate(starts):
        piece = line[start:starts[i + 1]] if i + 1 < len(starts) else line[start:]
        try:
            yield int(json.loads(piece)["step"]), piece
        except (ValueError, KeyError, TypeError):
            row_step = int(_ROW_START.match(piece).group(1))
            torn.append((row_step, f"step {row_step}'s, cut after {len(piece)} characters"))
    if not starts or starts[0] > 0:
        torn.append((None, f"{len(line[:starts[0]] if starts else line)} characters of no row"))


def _ranges(steps: list[int]) -> str:
    out, start = [], steps[0]
    for prev, cur in zip(steps, steps[1:] + [None]):
        if cur != prev + 1:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(out)


def _wandb_id(run_dir) -> str:
    """One wandb run per run dir, so that a resumed job continues its curves."""
    marker = Path(run_dir) / "wandb_id"
    if not marker.exists():
        import uuid

        tmp = marker.with_name(f".{marker.name}.tmp")
        try:
            tmp.write_text(uuid.uuid4().hex[:12])
            os.replace(tmp, marker)  # (never an empty id after a full disk)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return marker.read_text().strip()


def _plain(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


CONSOLE_KEYS = ("reward/mean", "reward/accuracy", "response/length_mean", "response/truncated_ratio", "actor/entropy",
                "actor/grad_norm", "actor/skipped_steps", "actor/clip_frac_low", "actor/clip_frac_high",
                "rollout/logprob_diff_mean", "rollout/weight_version", "time/step_s", "throughput/tokens_per_s",
                # with algo.dynamic_sampling / overlong_buffer / mask_truncated / rollout_correction
                "batch/kept_groups", "batch/sampling_rounds", "reward/overlong_penalty_mean",
                "response/masked_truncated", "rollout_correction/ratio_max", "tool/calls_per_response")


def _table(step: int, record: dict) -> Table:
    """The headline numbers of a step (all of them go to metrics.jsonl and wandb)."""
    table = Table(title=f"step {step}", show_header=False, box=None, padding=(0, 1))
    keys = [k for k in CONSOLE_KEYS if k in record] + val_keys(record)
    for i in range(0, len(keys), 3):
        row = []
        for k in keys[i:i + 3]:
            v = record[k]
            row += [k, f"{v:.4g}" if isinstance(v, float) else str(v)]
        table.add_row(*row)
    return table


def val_keys(record: dict) -> list[str]:
    """The validation figures of a record (train/validation.py: val/<set>/avg@<n>, pass@<n>, response_length)."""
    return sorted(k for k in record if k.startswith("val/") and k != "val/time_s")


def read_metrics(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    by_step = {}
    for line in path.read_text().splitlines():
        for step, row in _rows(line, []):  # a torn row (a run killed mid-write) is skipped
            by_step[step] = json.loads(row)  # (MetricsLogger drops replayed rows on resume; older run dirs may have them)
    return [by_step[s] for s in sorted(by_step)]


def plot_curves(run_dir, keys=CURVES) -> Path:
    """curves.png: reward, accuracy, response length and entropy against the step (and the reverse KL to the
    teacher when the run distils)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    keys = curve_keys(records, keys)
    val = val_curves(records)
    fig, axes = plt.subplots(1, len(keys) + bool(val), figsize=(4 * (len(keys) + bool(val)), 3.2))
    for ax, key in zip(axes, keys):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            ax.plot(*zip(*points), marker="o", markersize=3)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if val:  # one more panel: every validation set's avg@n
        ax = axes[-1]
        for key, points in val.items():
            ax.plot(*zip(*points), marker="o", markersize=3, label=key.removeprefix("val/"))
        ax.set_title("validation avg@n")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(run_dir) / "curves.png"
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        _raise_if_full(exc, out, out.name, "the partial file was removed")
        raise
    finally:
        plt.close(fig)
    return out


def curve_keys(records: list[dict], keys=CURVES) -> tuple[str, ...]:
    """The panels of curves.png: `keys`, and the reverse KL to the teacher when the run distils (its objective)."""
    return (*keys, DISTILL_CURVE) if any(DISTILL_CURVE in r for r in records) else tuple(keys)


def val_curves(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) points of every val/<set>/avg@<n> key in the records."""
    keys = sorted({k for r in records for k in r if k.startswith("val/") and "/avg@" in k})
    return {k: [(r["step"], r[k]) for r in records if k in r] for k in keys}


def step_metrics(*, rewards, correct, reward_stats: dict, rollouts, prompt_tokens: int, logprob_gap: dict,
                 update: dict, phase_seconds: dict, step_seconds: float) -> dict[str, float]:
    """One RL step's record: rewards, response lengths, trainer<->rollout parity, the update's own figures, timings.
    Response lengths count the tokens the model sampled (a tool's output is context: tool/output_tokens_mean)."""
    from .rollout.tools import tool_metrics

    lengths = rollouts.sampled_lengths()
    tokens = rollouts.num_tokens + prompt_tokens  # everything the trainer forwards, tool outputs included
    return {
        "reward/mean": sum(rewards) / len(rewards),
        "reward/accuracy": sum(correct) / len(correct),
        "reward/worker_timeouts": reward_stats.get("timeouts", 0),
        "reward/worker_crashes": reward_stats.get("crashes", 0),
        "reward/verifier_errors": reward_stats.get("errors", 0),
        "reward/clamped": reward_stats.get("clamped", 0),  # rewards outside the verifier's range, cut back into it
        "response/length_mean": sum(lengths) / len(lengths),
        "response/length_max": max(lengths),
        "response/truncated_ratio": sum(rollouts.truncated) / len(lengths),
        # every sample's, group by group: a run's length distribution, and the trace bench/plan.py replays
        "response/lengths": list(lengths),
        **{f"rollout/{k}": v for k, v in logprob_gap.items()},
        "rollout/weight_version": rollouts.weight_version,
        # the update's own figures under actor/, except those that name their section (rollout_correction/...)
        **{k if "/" in k else f"actor/{k}": v for k, v in update.items()},
        **{f"time/{k}_s": v for k, v in phase_seconds.items()},
        "time/step_s": step_seconds,
        "throughput/tokens_per_s": tokens / step_seconds,
        **tool_metrics(rollouts),  # tool/* with rollout.tools
        **gpu_stats(),
    }
