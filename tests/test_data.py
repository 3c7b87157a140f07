"""Dataset loaders, generated tasks, prompt templates and the prepared parquet format — on small local fixtures."""
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from justrl_megatron.data import (JUSTRL_SUFFIX, build_messages, countdown_problem, generate_rows, last_boxed_content,
                                  load_rows, prepare_dataset, read_parquet, render_prompt, row_messages,
                                  strip_dapo_wrapper, write_parquet)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


def write_jsonl(path, records):
    with open(path, "wb") as f:
        for r in records:
            f.write(r if isinstance(r, bytes) else (json.dumps(r) + "\n").encode())
    return str(path)


@pytest.fixture
def dapo_parquet(tmp_path):
    """Five problems, each repeated 100 times with distinct indices, in the hub's column layout."""
    problems = [("Find $x$ if $x^2 = 4$ and $x > 0$.", "2"), ("What is $\\frac{1}{2} + \\frac{1}{4}$?", "3/4"),
                ("Compute $7 \\times 6$.", "42"), ("How many primes are below 10?", "4"), ("Evaluate $2^{10}$.", "1024")]
    records = []
    for rep in range(100):
        for k, (p, a) in enumerate(problems):
            records.append({"data_source": "math_dapo",
                            "prompt": [{"content": DAPO_PREFIX + p + DAPO_SUFFIX, "role": "user"}],
                            "ability": "MATH", "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"},
                            "extra_info": {"index": f"uuid-{rep}-{k}"}})
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(records), path)
    return str(path), problems


# ------------------------------------------------------------------------------------------------------- dapo
def test_dapo_dedup_and_wrapper(dapo_parquet, capsys):
    path, problems = dapo_parquet
    res = load_rows(path, "dapo")
    assert len(res) == 5 and res.read == 500 and res.duplicates == 495
    assert [(r["problem"], r["answer"]) for r in res.rows] == problems
    assert res.rows[0]["data_source"] == "math_dapo" and res.rows[0]["id"] == "uuid-0-0"
    assert "x100.0 duplication" in capsys.readouterr().err
    full = load_rows(path, "dapo", dedup=False, verbose=False)
    assert len(full) == 500 and full.duplicates == 0
    assert len(load_rows(path, "dapo", limit=3, verbose=False)) == 3


def test_template_justrl_keeps_dapos_prompt_exactly(dapo_parquet):
    """JustRL appended its suffix to DAPO-Math-17k's whole prompt content: "justrl" trains on that text, wrapper and
    all; "justrl_stripped" on the bare problem."""
    path, problems = dapo_parquet
    rows = load_rows(path, "dapo", verbose=False).rows
    source = DAPO_PREFIX + problems[0][0] + DAPO_SUFFIX
    assert rows[0]["source_prompt"] == source and rows[0]["problem"] == problems[0][0]
    assert row_messages(rows[0], "justrl") == [{"role": "user", "content": source + JUSTRL_SUFFIX}]
    assert row_messages(rows[0], "justrl_stripped") == [{"role": "user", "content": problems[0][0] + JUSTRL_SUFFIX}]
    assert row_messages(rows[0], "boxed")[0]["content"].startswith(problems[0][0])  # other templates: bare problem
    out = str(os.path.join(os.path.dirname(path), "p.parquet"))
    prepare_dataset(out, path=path, fmt="dapo")  # the default template is justrl
    assert read_parquet(out)[0]["prompt"] == [{"role": "user", "content": source + JUSTRL_SUFFIX}]


def test_dedup_false_keeps_every_row_and_tokenizes_each_prompt_once(dapo_parquet):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from justrl_megatron import assets
    from justrl_megatron.data.sampler import tokenize_prompts

    path, problems = dapo_parquet
    rows = load_rows(path, "dapo", dedup=False, verbose=False).rows
    assert len(rows) == 500 and len({r["id"] for r in rows}) == 500
    assert rows[5]["source_prompt"] is rows[0]["source_prompt"]  # duplicates share their strings
    tok = AutoTokenizer.from_pretrained(assets.qwen2_tokenizer())
    cfg = OmegaConf.create({"template": "justrl", "system_prompt": None, "max_prompt_length": 1024})
    prompts, too_long = tokenize_prompts(rows, tok, cfg)
    assert len(prompts) == 500 and too_long == 0 and len({id(p.ids) for p in prompts}) == 5
    text = tok.decode(prompts[0].ids)
    assert text.endswith("<|im_start|>user\n" + DAPO_PREFIX + problems[0][0] + DAPO_SUFFIX + JUSTRL_SUFFIX
                         + "<|im_end|>\n<|im_start|>assistant\n")


def test_strip_dapo_wrapper_leaves_plain_problems_alone():
    assert strip_dapo_wrapper(DAPO_PREFIX + "Find $y$.\n\nIt is nice." + DAPO_SUFFIX) == "Find $y$.\n\nIt is nice."
    assert strip_dapo_wrapper("Find $y$.") == "Find $y$."


# ------------------------------------------------------------------------------------------------------- gsm8k
def test_gsm8k_answers_and_malformed_rows(tmp_path, capsys):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", [
        {"question": "Tom has 3 apples and buys 1231 more. How many?", "answer": "3 + 1231 = 1234\n#### 1,234"},
        {"question": "Half of 10?", "answer": "10 / 2 = 5\n#### 5"},
        {"question": "No answer here"},  # missing answer
        {"question": "   ", "answer": "#### 3"},  # empty problem
        {"question": 17, "answer": "#### 3"},  # wrong type
        b'{"question": "caf\xe9 bytes", "answer": "#### 1"}\n',  # not UTF-8
        b"{not json\n",
        {"question": "Words only", "answer": "#### about three"},  # no numeric final answer
        [1, 2, 3],  # not an object
    ])
    res = load_rows(path, "gsm8k")
    assert [(r["problem"][:3], r["answer"]) for r in res.rows] == [("Tom", "1234"), ("Hal", "5")]
    assert res.skipped == {"missing_answer": 1, "empty_problem": 1, "bad_type_problem": 1, "non_utf8": 1,
                           "bad_json": 1, "no_final_answer": 1, "not_an_object": 1}
    assert res.rows[0]["data_source"] == "openai/gsm8k" and res.rows[1]["id"] == "openai/gsm8k-1"
    err = capsys.readouterr().err
    assert "skipped 7 malformed" in err and "non_utf8=1" in err


@pytest.mark.parametrize("fmt", ["generic", "math", "aime", "dapo"])
def test_a_none_ground_truth_is_an_invalid_row(tmp_path, fmt, capsys):
    """A None ground truth written out as "None" scored \\boxed{None} as correct (issue 32)."""
    problems = [{"problem": f"p{i}", "answer": a} for i, a in enumerate([None, "None", "nan", "3"])]
    if fmt == "dapo":
        problems = [{"prompt": p["problem"], "reward_model": {"ground_truth": p["answer"]}} for p in problems]
    res = load_rows(write_jsonl(tmp_path / "rows.jsonl", problems), fmt)
    assert [r["answer"] for r in res.rows] == ["3"]
    assert res.skipped == {"missing_answer": 1, "null_answer": 2}
    assert "skipped 3 malformed (missing_answer=1, null_answer=2)" in capsys.readouterr().err


def test_missing_column_and_empty_results_name_the_file(tmp_path):
    path = write_jsonl(tmp_path / "q_only.jsonl", [{"question": "a?"}, {"question": "b?"}])
    with pytest.raises(ValueError, match=r"q_only\.jsonl: missing column 'answer'"):
        load_rows(path, "gsm8k")
    pq_path = tmp_path / "no_answer.parquet"
    pq.write_table(pa.table({"problem": ["x"], "solution_text": ["y"]}), pq_path)
    with pytest.raises(ValueError, match=r"no_answer\.parquet: missing column 'answer' / 'reward_model' / 'solution'"):
        load_rows(str(pq_path), "math")
    bad = write_jsonl(tmp_path / "all_bad.jsonl", [{"question": "", "answer": "#### 1"}, {"question": "q"}])
    with pytest.raises(ValueError, match=r"all_bad\.jsonl: no usable rows .*empty_problem=1.*missing_answer=1"):
        load_rows(bad, "gsm8k")
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(ValueError, match=r"empty\.jsonl: no records"):
        load_rows(empty, "gsm8k")
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        load_rows(str(tmp_path / "nope.parquet"), "math")
    with pytest.raises(ValueError, match="unknown dataset format"):
        load_rows(path, "svamp")


# -------------------------------------------------------------------------------------------------- math, aime
def test_math_takes_last_balanced_box_or_answer_column(tmp_path):
    path = write_jsonl(tmp_path / "math.jsonl", [
        {"problem": "Half?", "solution": "First \\boxed{2}, no: it is $\\boxed{\\frac{1}{2}}$."},
        {"problem": "Set?", "solution": "So \\boxed{\\{1, 2\\}} works."},
        {"problem": "Broken", "solution": "It is \\boxed{3"},  # unclosed box
        {"problem": "MATH-500 style", "solution": "ignored \\boxed{9}", "answer": "[1,2]", "unique_id": "test/x/1"},
    ])
    res = load_rows(path, "math", verbose=False)
    assert [r["answer"] for r in res.rows] == ["\\frac{1}{2}", "\\{1, 2\\}", "[1,2]"]
    assert res.rows[2]["id"] == "test/x/1" and res.skipped == {"no_boxed_answer": 1}
    assert last_boxed_content("\\fbox{7}") == "7" and last_boxed_content("none") is None


def test_aime_json_list_with_integer_answers(tmp_path):
    path = tmp_path / "aime24.json"
    path.write_text(json.dumps([{"ID": "2024-I-1", "Problem": "P1", "Answer": 33},
                                {"ID": "2024-I-2", "Problem": "P2", "Answer": "033"},
                                {"ID": "2024-I-3", "Problem": "P3", "Answer": True}]))
    res = load_rows(str(path), "aime", data_source="aime24", verbose=False)
    assert [(r["id"], r["answer"], r["data_source"]) for r in res.rows] == [("2024-I-1", "33", "aime24"),
                                                                            ("2024-I-2", "33", "aime24")]
    assert res.skipped == {"bad_type_answer": 1}


# --------------------------------------------------------------------------------------------- countdown, mbpp
def test_countdown_rows_carry_numbers_and_target(tmp_path):
    path = tmp_path / "countdown.parquet"
    pq.write_table(pa.Table.from_pylist([{"target": 24, "nums": [4, 6, 1]}, {"target": 10, "nums": [2, 5]},
                                         {"target": 3, "nums": []}]), path)
    res = load_rows(str(path), "countdown", verbose=False)
    assert res.rows[0]["answer"] == {"numbers": [4, 6, 1], "target": 24}
    assert res.rows[0]["problem"] == countdown_problem([4, 6, 1], 24)
    assert "[4, 6, 1]" in res.rows[0]["problem"] and "equals 24" in res.rows[0]["problem"]
    assert res.skipped == {"bad_type_numbers": 1}


def test_mbpp_rows_carry_tests(tmp_path):
    path = write_jsonl(tmp_path / "mbpp.jsonl", [
        {"task_id": 11, "text": "Write a function to add two numbers.", "code": "def add(a, b): return a + b",
         "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"], "test_setup_code": ""},
        {"task_id": 12, "text": "Broken tests", "test_list": "assert True"},
    ])
    res = load_rows(path, "mbpp", verbose=False)
    row = res.rows[0]
    assert row["id"] == "11" and row["answer"] == {"tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"],
                                                   "setup": ""}
    assert "assert add(1, 2) == 3" in row["problem"] and "```python" in row["problem"]
    assert res.skipped == {"bad_type_tests": 1}


def test_directory_picks_the_split(tmp_path):
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "train-00000.jsonl", [{"question": "t?", "answer": "#### 1"}])
    write_jsonl(tmp_path / "data" / "test-00000.jsonl", [{"question": "e?", "answer": "#### 2"}])
    assert load_rows(str(tmp_path), "gsm8k", split="test", verbose=False).rows[0]["answer"] == "2"
    assert load_rows(str(tmp_path), "gsm8k", verbose=False).rows[0]["answer"] == "1"


def test_generic_accepts_verl_style_rows(tmp_path):
    path = write_jsonl(tmp_path / "verl.jsonl", [
        {"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"}, "data_source": "x"},
    ])
    assert load_rows(path, "generic", verbose=False).rows == [
        {"problem": "2+2?", "answer": "4", "data_source": "x", "id": "x-0"}]
    path2 = write_jsonl(tmp_path / "plain.jsonl", [{"question": "2+2?", "answer": 4, "id": "a"}])
    assert load_rows(path2, "generic", verbose=False).rows == [
        {"problem": "2+2?", "answer": "4", "data_source": "generic", "id": "a"}]


def test_hub_names_go_through_datasets(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        if name == "offline/missing":
            raise ConnectionError("no network")
        return datasets.Dataset.from_list([{"question": "1+1?", "answer": "2\n#### 2"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    res = load_rows("openai/gsm8k:main", "gsm8k", split="test", verbose=False)
    assert calls == [("openai/gsm8k", "main", "test")] and res.rows[0]["answer"] == "2"
    with pytest.raises(FileNotFoundError, match="offline/missing: not a local path.*no network"):
        load_rows("offline/missing", "gsm8k")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_rows("./missing/dir/data.jsonl", "gsm8k")  # path-like names never go to the hub
    assert len(calls) == 2


# ------------------------------------------------------------------------------------------ built-in benchmarks
def test_builtin_champ_loads_offline_with_numeric_answers():
    import re

    from justrl_megatron.data.sampler import load_training_rows

    full = load_rows("builtin:champ", "generic", verbose=False).rows
    numeric = load_rows("builtin:champ-numeric", "aime", verbose=False).rows
    assert len(full) == 270 and len({r["id"] for r in full}) == 270 and len(numeric) == 79
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", r["answer"]) for r in numeric)
    first = next(r for r in full if r["id"] == "P_Combinatorics_1")
    assert first["answer"] == "239" and first["data_source"] == "champ"
    assert first["problem"].startswith("Let a string consist of digit 1, 2, 3.")
    assert not any("@@" in r["problem"] or "@@" in r["answer"] for r in full)  # CHAMP's math markers are dropped
    from omegaconf import OmegaConf
    cfg = OmegaConf.create({"train": "builtin:champ-numeric", "format": "generic", "dedup": True})
    assert [r["id"] for r in load_training_rows(cfg, seed=0, limit=3)] == [r["id"] for r in numeric[:3]]
    with pytest.raises(ValueError, match="unknown built-in dataset builtin:champ2; available: builtin:champ, "):
        load_rows("builtin:champ2", "generic")


# --------------------------------------------------------------------------------------------- generated tasks
@pytest.mark.parametrize("task", ["basic_arithmetic", "chain_sum", "gsm_symbolic"])
def test_generated_tasks_are_reproducible(task):
    a, b = generate_rows(task, 8, seed=3), generate_rows(task, 8, seed=3)
    assert a == b and len(a) == 8
    assert generate_rows(task, 8, seed=4) != a
    for r in a:
        assert set(r) == {"problem", "answer", "data_source", "id"}
        assert isinstance(r["answer"], str) and r["answer"] and r["problem"]
        assert r["data_source"] == f"reasoning_gym/{task}"
    assert len({r["id"] for r in a}) == 8


def test_generated_task_options_and_errors():
    rows = generate_rows("basic_arithmetic", 20, seed=0, min_terms=2, max_terms=2, min_digits=2, max_digits=2)
    for r in rows:
        assert r["answer"].lstrip("-").isdigit()
    with pytest.raises(ValueError, match="no_such_task"):
        generate_rows("no_such_task", 2, seed=0)


# ------------------------------------------------------------------------------------------------------ prompts
def test_justrl_prompt_is_exact():
    assert JUSTRL_SUFFIX == "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
    msgs = build_messages("What is $\\{1\\}$ {x}?")
    assert msgs == [{"role": "user", "content": "What is $\\{1\\}$ {x}?" + JUSTRL_SUFFIX}]
    assert build_messages("Q", system="Be brief.") == [{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": "Q" + JUSTRL_SUFFIX}]
    assert build_messages("Q", "plain") == [{"role": "user", "content": "Q"}]


def test_raw_templates_return_strings():
    text = build_messages(countdown_problem([1, 2, 3], 6), "countdown")
    assert isinstance(text, str) and text.endswith("Assistant: Let me solve this step by step.\n<think>")
    assert "Using the numbers [1, 2, 3], create an equation that equals 6." in text
    assert build_messages("2+2", "raw:Q: {problem} ({n} pts) \\boxed{{}}\nA:", n=5) == "Q: 2+2 (5 pts) \\boxed{}\nA:"
    with pytest.raises(ValueError, match="needs field 'n'"):
        build_messages("2+2", "raw:{problem} {n}")
    with pytest.raises(ValueError, match="unknown prompt template"):
        build_messages("2+2", "fancy")


def _tiny_chat_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
                                   chat_template=template)


def test_render_prompt_uses_the_chat_template_with_generation_prompt():
    tok = _tiny_chat_tokenizer()
    text = render_prompt(tok, build_messages("1+1?", system="S"))
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n1+1?" + JUSTRL_SUFFIX
                    + "<|im_end|>\n<|im_start|>assistant\n")
    raw = build_messages("p", "raw:X {problem} Y")
    assert render_prompt(tok, raw) == "X p Y"
    assert render_prompt(tok, [{"role": "raw", "content": "X p Y"}]) == "X p Y"


# ------------------------------------------------------------------------------------------------ prepared data
def test_prepared_parquet_round_trip(tmp_path):
    rows = [{"problem": "Half?", "answer": "[1,2]", "data_source": "math", "id": "m1"},
            {"problem": countdown_problem([1, 2], 3), "answer": {"numbers": [1, 2], "target": 3},
             "data_source": "countdown", "id": 7}]
    path = str(tmp_path / "out" / "train.parquet")
    assert write_parquet(rows, path) == 2
    assert sorted(os.listdir(tmp_path / "out")) == ["train.parquet"]  # no temp file left behind
    back = read_parquet(path)
    assert back[0] == {"prompt": [{"role": "user", "content": "Half?" + JUSTRL_SUFFIX}], "answer": "[1,2]",
                       "data_source": "math", "id": "m1"}
    assert json.loads(back[1]["answer"]) == {"numbers": [1, 2], "target": 3} and back[1]["id"] == "7"
    assert pq.read_schema(path).names == ["prompt", "answer", "data_source", "id"]

    write_parquet(rows[1:], path, template="countdown")
    (row,) = read_parquet(path)
    assert row["prompt"][0]["role"] == "raw" and render_prompt(None, row["prompt"]).endswith("<think>")
    with pytest.raises(ValueError, match="empty"):
        write_parquet([], path)
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="missing column"):
        read_parquet(str(tmp_path / "bad.parquet"))


def test_prepared_parquet_loads_back_as_rows(tmp_path):
    rows = [{"problem": "1+1?", "answer": "2", "data_source": "s", "id": "a"},
            {"problem": countdown_problem([1, 2], 3), "answer": {"numbers": [1, 2], "target": 3},
             "data_source": "countdown", "id": "b"}]
    path = str(tmp_path / "p.parquet")
    write_parquet(rows, path, system="sys")
    res = load_rows(path, "prepared", verbose=False)
    assert res.rows[0] == {"problem": "1+1?" + JUSTRL_SUFFIX, "answer": "2", "data_source": "s", "id": "a",
                           "prompt": [{"role": "system", "content": "sys"},
                                      {"role": "user", "content": "1+1?" + JUSTRL_SUFFIX}]}
    assert json.loads(res.rows[1]["answer"]) == {"numbers": [1, 2], "target": 3}
    assert write_parquet(res.rows, str(tmp_path / "again.parquet")) == 2  # prompts are kept, not re-templated
    assert read_parquet(str(tmp_path / "again.parquet")) == read_parquet(path)


def test_prepare_dataset_generated_and_loaded(tmp_path, dapo_parquet):
    out = str(tmp_path / "demo.parquet")
    assert prepare_dataset(out, task="chain_sum", n=6, seed=1) == 6
    assert read_parquet(out)[0]["id"] == "chain_sum-1-0"
    assert prepare_dataset(out, path=dapo_parquet[0], fmt="dapo", template="plain") == 5
    assert read_parquet(out)[0]["prompt"] == [{"role": "user", "content": dapo_parquet[1][0][0]}]
    with pytest.raises(ValueError, match="exactly one"):
        prepare_dataset(out)


def test_prepare_data_tool(tmp_path):
    src = write_jsonl(tmp_path / "g.jsonl", [{"question": "1+1?", "answer": "#### 2"}, {"question": "x"}])
    out = tmp_path / "g.parquet"
    env = {**os.environ, "PYTHONPATH": REPO}
    done = subprocess.run([sys.executable, os.path.join(REPO, "tools", "prepare_data.py"), "--input", src,
                           "--format", "gsm8k", "--output", str(out), "--template", "think"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wrote 1 rows" in done.stdout and "missing_answer=1" in done.stderr
    assert "<answer>" in read_parquet(str(out))[0]["prompt"][0]["content"]
    bad = subprocess.run([sys.executable, os.path.join(REPO, "tools", "prepare_data.py"), "--input",
                          str(tmp_path / "missing.jsonl"), "--format", "gsm8k", "--output", str(out)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "missing.jsonl" in bad.stderr


def test_a_structured_ground_truth_needs_a_value_at_every_depth(tmp_path, capsys):
    """{"foo": null} and [null, {...}] were kept as valid rows and always scored 0 (issue 42)."""
    answers = [{"foo": None}, [None, {"a": 1}], {"a": {"b": [1, {"c": float("nan")}]}}, [], {"a": [1, 2]},
               {"tests": ["assert f() is None"], "setup": ""}, [[[[1]]]]]
    rows = [{"problem": f"p{i}", "answer": a} for i, a in enumerate(answers)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # NaN as json's NaN token
    res = load_rows(str(path), "generic")
    assert [r["answer"] for r in res.rows] == answers[4:]
    assert res.skipped == {"null_answer": 3, "empty_answer": 1}
    assert "skipped 4 malformed (empty_answer=1, null_answer=3)" in capsys.readouterr().err
