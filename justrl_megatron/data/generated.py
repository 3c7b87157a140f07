"""Built-in generated tasks (reasoning-gym): seeded, reproducible, offline — for the CPU demo and the tests.

``generate_rows("basic_arithmetic", 100, seed=0)`` gives the same 100 rows on every machine. Task options are passed
to reasoning-gym's dataset config (e.g. ``min_terms=2, max_terms=2, min_digits=2, max_digits=2`` for "a + b" sums).
"""
from __future__ import annotations

# Tasks known to produce short exact answers that the math verifiers (dapo strict box, gsm8k numeric) can score.
RECOMMENDED_TASKS = ("basic_arithmetic", "chain_sum", "gsm_symbolic", "simple_equations")


def generate_rows(task: str, n: int, seed: int, **task_options) -> list[dict]:
    """``n`` rows of reasoning-gym task ``task``: ``{"problem", "answer" (str), "data_source", "id"}``."""
    import reasoning_gym

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    try:
        dataset = reasoning_gym.create_dataset(task, size=n, seed=seed, **task_options)
    except Exception as e:  # noqa: BLE001 - unknown task names and bad options both surface here
        raise ValueError(f"reasoning-gym could not build task {task!r} with {task_options}: {e}") from e
    rows = []
    for i, entry in enumerate(dataset):
        rows.append({
            "problem": str(entry["question"]).strip(),
            "answer": str(entry["answer"]).strip(),
            "data_source": f"reasoning_gym/{task}",
            "id": f"{task}-{seed}-{i}",
        })
    return rows
