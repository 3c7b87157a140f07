"""The pre-flight check (issue 42): every setting that vLLM, numpy, the tokenizer or the model would refuse later is
one line of check_config's ConfigError (justrl-train: exit 2), before any model is loaded. One row per setting; each
row must produce exactly its own line on top of a config that passes (the first row)."""

import json

import pytest

from justrl_megatron.config import ConfigError, compose
from justrl_megatron.train_entry import check_config

LONG = "Add up every number in the following list and give the total. " + " ".join(["12 plus 7"] * 150)

# (id, overrides, the one line it must give: a fragment; None = the config passes)
TABLE = [
    ("passes", [], None),
    ("greedy with n > 1", ["rollout.temperature=0", "rollout.n=2"],
     "rollout.temperature=0.0 is greedy sampling, which gives one answer per prompt, but rollout.n=2"),
    ("temperature above vLLM's 2", ["rollout.temperature=2.5"], "vLLM samples with temperatures in [0, 2]"),
    ("absurd group size", ["rollout.n=100000", "trainer.mini_batch_size=8"], "rollout.n=100000: vLLM samples at most "
                                                                            "16384 answers per prompt"),
    ("seed beyond numpy's range", ["trainer.seed=4294967296"], "trainer.seed=4294967296: numpy and vLLM take 32-bit "
                                                               "seeds"),
    ("max_context beyond the positions", ["model.max_context=100000"],
     "model.max_context=100000 exceeds the model's positions (max_position_embeddings"),
    ("val: greedy with n > 1", ["trainer.eval_every=1", "data.val=[{path:'generated:basic_arithmetic',limit:2,n:4,"
                                                        "temperature:0}]"],
     "data.val[0].temperature=0.0 is greedy sampling, which gives one answer per prompt, but data.val[0].n=4"),
    ("val: unknown reward_options", ["trainer.eval_every=1", "data.val=[{path:'generated:basic_arithmetic',limit:2,"
                                                             "reward_options:{bogus:1}}]"],
     "data.val[0] (basic_arithmetic): reward_options={'bogus': 1} do not fit reward gsm8k"),
    ("val: another verifier's options", ["trainer.eval_every=1", "data.val=[{path:'generated:basic_arithmetic',"
                                                                 "limit:2,reward:countdown,reward_options:{bogus:1}}]"],
     "reward_options={'bogus': 1} do not fit reward countdown"),
    ("val: every prompt too long", ["trainer.eval_every=1", "data.val=[{path:'LONG',limit:2}]"],
     "data.val[0] (long): all 2 prompts are longer than data.max_prompt_length=128"),
    ("eval: every prompt too long", ["data.eval=LONG", "trainer.eval_samples=2"],
     "all 2 prompts of data.eval are longer"),
]


@pytest.fixture(scope="module")
def long_prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "long.jsonl"
    path.write_text("".join(json.dumps({"problem": f"{LONG} ({i})", "answer": "1"}) + "\n" for i in range(2)))
    return path


@pytest.mark.parametrize("overrides, line", [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_preflight_table(tmp_path, tiny_llama, long_prompts, overrides, line):
    base = [f"trainer.run_dir={tmp_path / 'run'}", f"model.path={tiny_llama}", "data.num_generated=16",
            "rollout.max_response_length=8", "trainer.eval_samples=0"]
    cfg = compose(base + [o.replace("LONG", str(long_prompts)) for o in overrides])
    if line is None:
        check_config(cfg)
        return
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 1 and line in lines[0], lines
    assert not (tmp_path / "run").exists()  # refused before anything is written
