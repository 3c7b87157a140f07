"""The streaming seed band: 3 runs before and after the one engine path (docs/benchmarks.md)."""
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
KEYS = ["reward/mean", "response/length_mean", "actor/entropy", "actor/grad_norm", "rollout/logprob_diff_mean",
        "rollout/staleness_max", "rollout/multi_version_frac"]
def load(side, i):
    return [json.loads(line) for line in open(os.path.join(HERE, f"{side}-{i}.jsonl"))]


runs = {s: [load(s, i) for i in (1, 2, 3)] for s in ("before", "after")}
rows = []
for k in KEYS:
    for step in range(3):
        b = [r[step][k] for r in runs["before"] if k in r[step]]
        a = [r[step][k] for r in runs["after"] if k in r[step]]
        if not b or not a: continue
        inside = min(b) <= statistics.mean(a) <= max(b) if len(b) > 1 else None
        rows.append((k, step + 1, min(b), max(b), statistics.mean(a), min(a), max(a), inside))
for r in rows: print("%-28s step %d  before [%.4g, %.4g]  after mean %.4g [%.4g, %.4g]  inside: %s" % r)
