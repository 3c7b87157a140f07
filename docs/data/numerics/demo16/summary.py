"""The table in docs/numerics.md ("On the demo model", 16 steps) from the runs' files beside this script:
bf16_{off,auto}_s{seed}.metrics.jsonl and .heldout.json (each run's metrics.jsonl and heldout_accuracy.json).

    python docs/data/numerics/demo16/summary.py
"""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent


def run(mode: str, seed: int) -> dict:
    rows = [json.loads(line) for line in (HERE / f"bf16_{mode}_s{seed}.metrics.jsonl").read_text().splitlines()]
    held = json.loads((HERE / f"bf16_{mode}_s{seed}.heldout.json").read_text())
    return {"gap_mean": statistics.mean(r["rollout/logprob_diff_mean"] for r in rows),
            "gap_max": max(r["rollout/logprob_diff_max"] for r in rows),
            "update_s": statistics.median(r["time/update_s"] for r in rows[1:]),  # step 1 warms up
            "step_s": statistics.median(r["time/step_s"] for r in rows[1:]),
            "start": held["start"], "end": held["end"], "steps": len(rows)}


def main() -> None:
    seeds = sorted({int(p.name.split("_s")[1].split(".")[0]) for p in HERE.glob("bf16_off_s*.metrics.jsonl")})
    print("| seed | off: gap mean / max over 16 steps | auto: gap mean / max | off: held-out start -> end "
          "| auto: held-out start -> end | update median s, off / auto |")
    print("| --- | --- | --- | --- | --- | --- |")
    ends = {"off": [], "auto": []}
    for seed in seeds:
        off, auto = run("off", seed), run("auto", seed)
        for mode, r in (("off", off), ("auto", auto)):
            ends[mode].append(r["end"])
        print(f"| {seed} | {off['gap_mean']:.3g} / {off['gap_max']:.3g} | {auto['gap_mean']:.3g} / {auto['gap_max']:.3g} "
              f"| {off['start']:.3f} -> {off['end']:.3f} | {auto['start']:.3f} -> {auto['end']:.3f} "
              f"| {off['update_s']:.1f} / {auto['update_s']:.1f} ({auto['update_s'] / off['update_s'] - 1:+.0%}) |")
    mean_off, mean_auto = statistics.mean(ends["off"]), statistics.mean(ends["auto"])
    print(f"\nheld-out end, mean over {len(seeds)} seeds: off {mean_off:.3f}, auto {mean_auto:.3f} "
          f"(difference {mean_auto - mean_off:+.3f}, {round((mean_auto - mean_off) * 64 * len(seeds))} problems "
          f"of {64 * len(seeds)})")


if __name__ == "__main__":
    main()
