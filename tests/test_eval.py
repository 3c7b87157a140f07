"""justrl-eval: JustRL's eval protocol (N by benchmark, 31,744 tokens capped to the context, space-joined prompt) and
JustRL's eval parquet layout (chat-list prompt, reward_model.ground_truth stored as \\boxed{X})."""
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import ENV

from justrl_megatron.data import JUSTRL_EVAL_SUFFIX, JUSTRL_SUFFIX, load_rows, row_messages
from justrl_megatron.evaluate import cap_max_tokens, eval_plan, model_context, parse_args
from justrl_megatron.rewards import get_reward_fn

PROBLEMS = [("Every morning Aya goes for a $9$-kilometer-long walk. Find the number of minutes.", "\\boxed{204}"),
            ("What is $\\frac{1}{4} + \\frac{1}{4}$?", "\\boxed{\\frac{1}{2}}"),
            ("Find the sum of all integer bases $b>9$ for which $17_b$ is a divisor of $97_b.$", "70")]


def justrl_parquet(path, problems=PROBLEMS):
    """JustRL's data/AIME24/test.parquet layout: no problem/answer columns; the bare problem is the user turn."""
    records = [{"prompt": [{"content": p, "role": "user"}], "data_source": "AIME24", "ability": "math",
                "reward_model": {"ground_truth": a, "style": "rule"}, "extra_info": {"index": f"AIME24-{i}",
                                                                                     "split": "test"}}
               for i, (p, a) in enumerate(problems)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)
    return str(path)


@pytest.mark.parametrize("fmt", ["generic", "aime", "math"])
def test_justrl_aime_layout_loads_and_a_correct_boxed_response_scores_1(tmp_path, capsys, fmt):
    path = justrl_parquet(tmp_path / "AIME24" / "test.parquet")
    rows = load_rows(path, fmt).rows
    assert [(r["problem"], r["answer"]) for r in rows] == [(PROBLEMS[0][0], "204"), (PROBLEMS[1][0], "\\frac{1}{2}"),
                                                           (PROBLEMS[2][0], "70")]
    err = capsys.readouterr().err
    assert "columns problem<-prompt, answer<-reward_model.ground_truth" in err
    assert "2 \\boxed{} answers unwrapped" in err
    # JustRL's eval prompt: the problem, a space, the instruction
    assert row_messages(rows[0], "justrl_eval") == [
        {"role": "user", "content": PROBLEMS[0][0] + " Please reason step by step, and put your final answer within "
                                                     "\\boxed{}."}]
    dapo, either = get_reward_fn("dapo"), get_reward_fn("dapo_then_math_verify")
    right = "She walks 9 km ... so the walk takes \\boxed{204}"
    assert dapo(right, rows[0]["answer"]) == 1.0 and either(right, rows[0]["answer"]) == 1.0
    assert dapo(right, PROBLEMS[0][1]) == -1.0  # the ground truth as stored: why it is unwrapped
    assert dapo("... \\boxed{240}", rows[0]["answer"]) == -1.0
    assert either("so it is \\boxed{0.5}", rows[1]["answer"]) == 1.0  # math-verify: 1/2 == 0.5
    assert dapo("The bases sum to \\boxed{70}", rows[2]["answer"]) == 1.0


def test_justrl_problem_answer_layout(tmp_path):
    """BRUMO25 / CMIMC25 / HMMT25 in JustRL's repo: problem + answer columns, a trailing newline in some problems."""
    path = tmp_path / "HMMT25" / "test.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"problem_idx": ["1"], "problem": ["Compute $9!$ mod $7$.\n"], "answer": ["0"],
                             "problem_type": [["Number Theory"]]}), path)
    (row,) = load_rows(str(path), "generic", verbose=False).rows
    assert row["problem"] == "Compute $9!$ mod $7$." and row["answer"] == "0"
    assert row_messages(row, "justrl_eval")[0]["content"] == "Compute $9!$ mod $7$." + JUSTRL_EVAL_SUFFIX
    # the training template keeps the source text as stored (JustRL's verl dataset does not strip it)
    assert row_messages(row, "justrl")[0]["content"] == "Compute $9!$ mod $7$.\n" + JUSTRL_SUFFIX


def plan(*argv):
    return eval_plan(parse_args(["--model", "m", *argv]))


@pytest.mark.parametrize("data, n", [
    ("JustRL/data/AIME24/test.parquet", 32), ("JustRL/data/AIME25/test.parquet", 32), ("data/AMC23/test.parquet", 32),
    ("data/HMMT25/test.parquet", 32), ("data/BRUMO25/test.parquet", 32), ("data/CMIMC25/test.parquet", 32),
    ("data/MATH-500/test.parquet", 4), ("data/Minerva/test.parquet", 4), ("data/Olympiad-Bench/test.parquet", 4),
    ("evals/aime_2024.jsonl", 32), ("evals/math500.jsonl", 4),
])
def test_protocol_justrl_picks_n_from_the_file_name(data, n):
    p = plan("--data", data)
    assert (p.n, p.max_tokens, p.template, p.n_from) == (n, 31744, "justrl_eval", "the benchmark")
    assert f"n={n} (the benchmark)" in p.describe() and "(the file name)" in p.describe()


def test_protocol_options_win_and_ours_keeps_the_old_defaults():
    assert plan("--data", "data/AIME24/test.parquet", "--n", "2").n == 2
    p = plan("--data", "custom.parquet", "--benchmark", "hmmt25")
    assert (p.benchmark, p.n, p.benchmark_from) == ("hmmt", 32, "--benchmark")
    p = plan("--data", "data/AIME24/test.parquet", "--protocol", "ours")
    assert (p.n, p.max_tokens, p.template) == (4, 15360, "justrl_stripped")
    p = plan("--data", "data/AIME24/test.parquet", "--max-tokens", "100", "--template", "boxed")
    assert (p.n, p.max_tokens, p.template) == (32, 100, "boxed")
    p = plan("--data", "generated:basic_arithmetic")
    assert (p.benchmark, p.n) == (None, 4) and "not recognised" in p.describe()
    assert plan("--data", "builtin:champ-numeric").n == 4
    with pytest.raises(SystemExit, match="unknown --benchmark 'gsm9k'"):
        plan("--data", "x.parquet", "--benchmark", "gsm9k")


def test_max_tokens_is_capped_by_the_context(tmp_path):
    assert cap_max_tokens(31744, 100, 131072) == (31744, None)
    assert cap_max_tokens(31744, 100, None) == (31744, None)
    tokens, note = cap_max_tokens(31744, 100, 512)
    assert tokens == 412 and "exceed the model's context (512 tokens" in note and "capped to 412" in note
    tokens, note = cap_max_tokens(8, 600, 512)
    assert tokens == 0 and "no room" in note
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    assert model_context(tmp_path) == 4096


@pytest.mark.slow
def test_justrl_eval_end_to_end_on_justrl_layout(tmp_path, tiny_llama):
    """The default protocol on an AIME24 file in JustRL's layout: N=32 from the folder name, 31,744 tokens capped to
    the tiny model's 512 positions, JustRL's space-joined prompt, \\boxed{} ground truths unwrapped."""
    # a ~490-token prompt leaves the tiny model room for a few tokens only: the cap is exercised in seconds
    long_problem = "Every morning Aya goes for a walk. " + "She walks on. " * 108 + "Find the number of minutes."
    data = justrl_parquet(tmp_path / "AIME24" / "test.parquet", [(long_problem, "\\boxed{204}")])
    out = tmp_path / "eval"
    proc = subprocess.run([sys.executable, "-m", "justrl_megatron.cli", "eval", "--model", str(tiny_llama), "--data",
                           data, "--limit", "1", "--reward", "dapo", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "benchmark aime (the file name), n=32 (the benchmark), max_tokens=31744" in proc.stderr
    assert "columns problem<-prompt, answer<-reward_model.ground_truth" in proc.stderr
    assert "exceed the model's context (512 tokens" in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n"] == 32 and summary["protocol"] == "justrl" and summary["template"] == "justrl_eval"
    assert 0 < summary["max_tokens"] < 40 and (summary["temperature"], summary["top_p"]) == (0.7, 0.9)
    lines = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 32 and {line["answer"] for line in lines} == {"204"}
    bad = subprocess.run([sys.executable, "-m", "justrl_megatron.cli", "eval", "--model", str(tiny_llama), "--data",
                          str(tmp_path / "missing.parquet"), "--out", str(out)],
                         capture_output=True, text=True, timeout=300, env=ENV)
    assert bad.returncode == 2 and "missing.parquet: no such file" in bad.stderr and "Traceback" not in bad.stderr
