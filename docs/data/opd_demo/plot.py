"""The CPU demo's GRPO, OPD and OPD + reward runs side by side (docs/benchmarks.md): held-out greedy accuracy every 2
steps (validation set `heldout`: 64 one-digit sums, greedy, n=1), reverse KL, seconds per step. Reads the
metrics.jsonl of each run in this folder; writes heldout.png and prints the table.

    .venv/bin/python docs/data/opd_demo/plot.py
"""

import json
from pathlib import Path

HERE = Path(__file__).parent
RUNS = {"GRPO": "grpo", "OPD": "opd", "OPD + reward (0.5)": "opd_reward"}
ACC = "val/heldout/avg@1"


def records(name):
    path = HERE / name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def main():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {label: records(name) for label, name in RUNS.items()}
    fig, (acc, kl) = plt.subplots(1, 2, figsize=(11, 4))
    for label, recs in runs.items():
        pts = [(r["step"], r[ACC]) for r in recs if ACC in r]
        if pts:
            acc.plot(*zip(*pts), marker="o", label=label)
        kls = [(r["step"], r["distill/reverse_kl"]) for r in recs if "distill/reverse_kl" in r]
        if kls:
            kl.plot(*zip(*kls), marker=".", label=label)
    acc.set(xlabel="step", ylabel="held-out greedy accuracy (64 sums)", title="held-out accuracy")
    kl.set(xlabel="step", ylabel="reverse KL per token", title="distill/reverse_kl", yscale="log")
    acc.legend(), kl.legend()
    fig.tight_layout()
    fig.savefig(HERE / "heldout.png", dpi=90)
    steps = sorted({r["step"] for recs in runs.values() for r in recs if ACC in r})
    print("| step | " + " | ".join(f"{label} acc" for label in runs) + " |")
    print("|" + " --- |" * (len(runs) + 1))
    for s in steps:
        cells = [next((f"{r[ACC]:.3f}" for r in recs if r["step"] == s and ACC in r), "") for recs in runs.values()]
        print(f"| {s} | " + " | ".join(cells) + " |")
    for label, recs in runs.items():
        times = sorted(r["time/step_s"] for r in recs if "time/step_s" in r)
        teacher = sorted(r["time/teacher_logprob_s"] for r in recs if "time/teacher_logprob_s" in r)
        if times:
            print(f"{label}: median step {times[len(times) // 2]:.1f} s"
                  + (f", of which the teacher's forward {teacher[len(teacher) // 2]:.1f} s" if teacher else ""))


if __name__ == "__main__":
    main()
