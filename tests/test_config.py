"""Hydra configs: composition, the JustRL recipes carry the paper's numbers, validation says what to change."""

import pytest
from hydra.errors import ConfigCompositionException

from justrl_megatron.config import (CONFIG_DIR, ConfigError, compose, key_problem, unknown_keys, validate,
                                    value_type_problem, yaml_bool_problems)
from justrl_megatron.model.hf_config import ModelShape
from justrl_megatron.run_config import ResumeCheck, history, record_launch
from justrl_megatron.train_entry import check_config, data_problems, override_problems

DEEPSEEK_1P5B = ModelShape(family="qwen2", num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12,
                           num_query_groups=2, head_dim=128, vocab_size=151936, max_position_embeddings=131072,
                           rope_theta=10000.0, rms_norm_eps=1e-6, qkv_bias=True, tie_word_embeddings=False, init_std=0.02)


def test_default_is_the_cpu_demo():
    cfg = compose()
    assert cfg.recipe_name == "cpu_demo"
    assert cfg.model.path == "builtin:smollm2-135m-instruct"
    assert cfg.data.train.startswith("generated:")
    validate(cfg, world_size=1)


@pytest.mark.parametrize("recipe,steps,model", [
    ("justrl_deepseek_1p5b", 4380, "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"),
    ("justrl_nemotron_1p5b", 3440, "nvidia/OpenMath-Nemotron-1.5B"),
])
def test_justrl_recipes_carry_the_paper_hyperparameters(recipe, steps, model):
    cfg = compose([f"recipe={recipe}"])
    assert cfg.model.path == model
    assert cfg.trainer.total_steps == steps
    assert (cfg.trainer.prompts_per_step, cfg.rollout.n, cfg.trainer.mini_batch_size) == (256, 8, 64)
    assert cfg.trainer.prompts_per_step // cfg.trainer.mini_batch_size == 4  # optimizer steps per RL step
    assert (cfg.algo.clip_low, cfg.algo.clip_high, cfg.algo.dual_clip_c) == (0.2, 0.28, 10.0)
    assert (cfg.algo.kl_coef, cfg.algo.entropy_coef) == (0.0, 0.0)
    assert cfg.algo.reward == "dapo" and cfg.algo.loss_agg == "token-mean" and cfg.algo.norm_adv_by_std
    assert (cfg.trainer.lr, cfg.trainer.warmup_steps, cfg.trainer.weight_decay, cfg.trainer.grad_clip) == (1e-6, 10, 0.1, 1.0)
    assert (cfg.rollout.temperature, cfg.rollout.top_p) == (1.0, 1.0)
    assert (cfg.data.max_prompt_length, cfg.rollout.max_response_length) == (1024, 15360)
    assert cfg.trainer.max_tokens_per_micro_batch == 32768
    assert cfg.data.format == "dapo" and cfg.data.template == "justrl"
    validate(cfg, world_size=32, shape=DEEPSEEK_1P5B)


def test_any_override_works_and_groups_switch():
    cfg = compose(["recipe=justrl_deepseek_1p5b", "parallel=tp2", "trainer.lr=3e-6", "model.path=/some/dir"])
    assert cfg.parallel.tensor == 2 and cfg.parallel.sequence_parallel
    assert cfg.trainer.lr == 3e-6 and cfg.model.path == "/some/dir"


def test_unknown_keys_are_rejected():
    with pytest.raises(ConfigCompositionException, match="trainer.no_such_knob"):
        compose(["trainer.no_such_knob=1"])


def _problems(overrides, world_size=1, shape=DEEPSEEK_1P5B):
    with pytest.raises(ConfigError) as err:
        validate(compose(["recipe=justrl_deepseek_1p5b"] + overrides), world_size=world_size, shape=shape)
    return str(err.value)


def test_tp_must_divide_query_groups():
    msg = _problems(["parallel.tensor=4"], world_size=4)
    assert "parallel.tensor=4 must divide" in msg and "2 query groups" in msg and "[1, 2]" in msg


def test_world_size_divisible_by_tp_pp():
    assert "world size 3 is not divisible by parallel.tensor x parallel.pipeline = 2x1" in _problems(
        ["parallel.tensor=2"], world_size=3)


def test_prompts_times_rollouts_divisible_by_mini_batch():
    msg = _problems(["trainer.mini_batch_size=60"])
    assert "not divisible by the mini-batch" in msg and "multiple of mini_batch_size" in msg


def test_any_data_parallel_size_that_has_a_sample_per_rank():
    """14 trainers + 18 engines of 32 GPUs (the planner's balance for JustRL): 64 x 8 samples over 14 replicas is
    accepted (the split is by tokens; tests/test_step.py's uneven mini-batches check the update); fewer samples than
    replicas is refused in one line."""
    split = ["rollout.placement=split", "rollout.num_rollout_ranks=18"]
    validate(compose(["recipe=justrl_deepseek_1p5b", *split]), world_size=32, shape=DEEPSEEK_1P5B)
    msg = _problems([*split, "trainer.mini_batch_size=1", "trainer.prompts_per_step=1", "rollout.n=8"],
                    world_size=32)
    assert "a mini-batch of 1 x 8 samples leaves some of the 14 data-parallel ranks without a sample" in msg


def test_the_streaming_recipe_is_valid_on_32_gpus():
    """The planner's most robust JustRL setting (docs/benchmarks.md): 11 trainers + 21 engines, streaming eta=2."""
    cfg = compose(["recipe=justrl_deepseek_1p5b_streaming"])
    validate(cfg, world_size=32, shape=DEEPSEEK_1P5B)
    assert (cfg.rollout.num_rollout_ranks, cfg.rollout.streaming, cfg.rollout.max_staleness) == (21, True, 2)


def test_lengths_fit_the_model_context():
    msg = _problems(["model.max_context=8192"])
    assert "exceeds the model context 8192" in msg


def test_micro_batch_budget_holds_one_sample():
    assert "must hold one full sample" in _problems(["trainer.max_tokens_per_micro_batch=4096"])


def test_every_problem_is_reported_at_once():
    msg = _problems(["parallel.tensor=4", "trainer.mini_batch_size=60", "model.dtype=fp8"], world_size=4)
    assert msg.count("\n  - ") == 3


# --- unknown keys: also hydra's `+key=value`, which appends past the structured schema ------------------------------

def test_a_plus_typo_is_rejected_naming_the_closest_key():
    with pytest.raises(ConfigError, match=r"unknown key trainer\.lrr; did you mean trainer\.lr\?"):
        validate(compose(["+trainer.lrr=1"]), world_size=1)


@pytest.mark.parametrize("key,closest", [
    ("trainer.temperature", "rollout.temperature"),  # the right name in the wrong section
    ("trainr.lr", "trainer.lr"),                     # a misspelt section
    ("rollout.nn", "rollout.n"),
])
def test_unknown_keys_name_their_closest_schema_key(key, closest):
    assert unknown_keys(compose([f"+{key}=1"])) == [f"unknown key {key}; did you mean {closest}?"]


def test_keys_under_dict_fields_stay_free_form():
    cfg = compose(["algo.reward=dapo", "+algo.reward_options.strict=false", "++data.task_options.min_terms=2"])
    assert unknown_keys(cfg) == []
    assert key_problem("algo.reward_options.any.depth") is None and key_problem("trainer.lr.x") is not None


def test_the_loss_keys_are_loss_configs_fields():
    """algo.<name> (algo.distill.<name> for distill_<name>) is every LossConfig field, with its type and default:
    written once there, a new loss knob is a key without an edit here."""
    import dataclasses

    from justrl_megatron.algo.loss_config import LossConfig
    from justrl_megatron.config.keys import _schema_default, schema_keys

    for f in dataclasses.fields(LossConfig):
        key = f"algo.distill.{f.name.removeprefix('distill_')}" if f.name.startswith("distill_") else f"algo.{f.name}"
        assert schema_keys()[key] == "value", key
        if f.name != "rollout_correction":  # its config default follows rollout.max_staleness
            assert _schema_default(key) == f.default, key
    assert LossConfig.from_algo(compose([]).algo) == LossConfig()
    assert key_problem("algo.clip_high") is None and "must be a number" in str(value_type_problem("algo.clip_high", "x"))


def test_command_line_typos_are_taken_off_before_hydra_composes():
    """hydra refuses `trainer.lrr=1` with advice to append it with `+`; justrl-train reports both forms itself."""
    args = ["trainer.lrr=1", "+trainer.seeed=3", "recipe=cpu_demo", "parallel=tp2", "model.path=/x", "--cfg", "job",
            "hydra.run.dir=/tmp/x", "+algo.reward_options.strict=false", "~trainer.profile_steps"]
    problems, kept = override_problems(args)
    assert problems == ["unknown key trainer.lrr; did you mean trainer.lr?",
                        "unknown key trainer.seeed; did you mean trainer.seed?"]
    assert kept == args[2:]


def test_a_renamed_key_names_its_new_one_in_one_line(tmp_path):
    """The tool settings moved under rollout.tool: an old key on the command line (with or without +) or in a YAML
    file of the config is one line naming the new key (a YAML file's was hydra's "ConfigKeyError raised while
    composing config:")."""
    from justrl_megatron.config import composition_problem

    problems, _ = override_problems(["rollout.tool_workers=3", "+rollout.max_turns=2", "rollout.tool.workers=3"])
    assert problems == ["rollout.tool_workers is now rollout.tool.workers: rename it",
                        "rollout.max_turns is now rollout.tool.max_turns: rename it"]
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - cpu_demo\n  - _self_\n"
                                                   "rollout:\n  tool_packages: [sympy]\n")
    with pytest.raises(ConfigCompositionException) as err:
        compose([f"hydra.searchpath=[file://{tmp_path}]", "recipe=mine"])
    assert composition_problem(err.value) == ("recipe/mine: rollout.tool_packages is now rollout.tool.packages: "
                                              "rename it")


# --- every value, before any heavy work ------------------------------------------------------------------------------

@pytest.mark.parametrize("override,message", [
    ("trainer.save_every=0", "trainer.save_every must be >= 1"),
    ("trainer.keep_last=0", "trainer.keep_last must be >= 1"),
    ("trainer.hf_every=-1", "trainer.hf_every must be >= 0"),
    ("trainer.lr=-1e-6", "trainer.lr must be in (0, 1] (Adam moves each weight by about lr per step; JustRL: "
                          "1e-6), got -1e-06"),
    ("trainer.warmup_steps=-1", "trainer.warmup_steps must be >= 0"),
    ("trainer.total_steps=0", "trainer.total_steps must be >= 1"),
    ("trainer.grad_clip=0", "trainer.grad_clip must be > 0"),
    ("trainer.adam_beta2=1", "trainer.adam_beta2 must be in [0, 1)"),
    ("rollout.temperature=-0.5", "rollout.temperature must be >= 0"),
    ("rollout.top_p=0", "rollout.top_p must be in (0, 1]"),
    ("rollout.top_p=1.5", "rollout.top_p must be in (0, 1]"),
    ("rollout.top_k=0", "rollout.top_k must be -1 (off) or >= 1"),
    ("rollout.n=0", "rollout.n must be >= 1"),
    ("rollout.gpu_memory_utilization=0", "rollout.gpu_memory_utilization must be in (0, 1]"),
    ("algo.reward=dapoo", "algo.reward must be one of dapo, dapo_minerva"),
    ("algo.kl_estimator=k4", "algo.kl_estimator must be one of k1, k2, k3"),
    ("logging.wandb_mode=off", "logging.wandb_mode must be one of offline, online, disabled"),
    ("rollout.weight_sync_backend=nccl", "rollout.weight_sync_backend=nccl is for rollout.placement=split"),
    ("rollout.weight_sync_backend=shm", "rollout.weight_sync_backend must be one of auto, local"),
    ("rollout.placement=split", "rollout.placement=split needs 1 <= rollout.num_rollout_ranks < the world size"),
    ("data.template=justr", "data.template must be one of boxed, boxed_tool, justrl"),
    ("logging.console_every=0", "logging.console_every must be >= 1"),
])
def test_each_bad_value_is_named_with_its_rule(override, message):
    with pytest.raises(ConfigError) as err:
        validate(compose([override]), world_size=1)
    assert message in str(err.value) and str(err.value).count("\n  - ") == 1, str(err.value)


@pytest.mark.parametrize("override,message", [  # issue 32: each of these was accepted
    ("trainer.lr=inf", "trainer.lr must be a finite number, got inf; write a number (the default is 1e-06)"),
    ("rollout.temperature=inf", "rollout.temperature must be a finite number, got inf"),
    ("trainer.adam_eps=inf", "trainer.adam_eps must be a finite number, got inf"),
    ("trainer.weight_decay=inf", "trainer.weight_decay must be a finite number, got inf"),
    ("algo.kl_coef=inf", "algo.kl_coef must be a finite number, got inf"),
    ("algo.entropy_coef=nan", "algo.entropy_coef must be a finite number, got nan"),
    ("algo.entropy_coef=-5", "algo.entropy_coef must be >= 0"),
    ("algo.dual_clip_c=nan", "algo.dual_clip_c must be a finite number, got nan; write a number (the default is 10.0)"),
    ("algo.clip_low=nan", "algo.clip_low must be a finite number, got nan"),
    ("+algo.reward_options.correct=nan", "algo.reward_options.correct must be a finite number, got nan"),
    ("+algo.reward_options.wrong=-inf", "algo.reward_options.wrong must be a finite number, got -inf"),
    ("model.lora.alpha=inf", "model.lora.alpha must be a finite number, got inf"),
    ("trainer.lr=10", "trainer.lr must be in (0, 1]"),
])
def test_non_finite_and_out_of_range_numbers_are_refused(override, message):
    with pytest.raises(ConfigError) as err:
        validate(compose([override]), world_size=1)
    assert message in str(err.value) and str(err.value).count("\n  - ") == 1, str(err.value)


def test_every_float_of_the_schema_is_checked_for_finiteness():
    """Generic: the walk covers every float field of the schema, not a hand-kept list."""
    import dataclasses
    import typing

    from justrl_megatron.config import JustRLConfig, nonfinite_problems, schema_keys

    def floats(cls, prefix=""):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = hints[f.name]
            if dataclasses.is_dataclass(kind):
                yield from floats(kind, f"{prefix}{f.name}.")
            elif float in (kind, *typing.get_args(kind)):
                yield prefix + f.name

    keys = list(floats(JustRLConfig))
    assert len(keys) >= 15 and set(keys) <= set(schema_keys())
    cfg = compose([f"{k}=nan" for k in keys])
    assert sorted(p.split(" ")[0] for p in nonfinite_problems(cfg)) == sorted(keys)


def test_reward_options_must_fit_the_verifier():
    with pytest.raises(ConfigError, match=r"algo.reward_options=\{'stric': True\} do not fit algo.reward=dapo: "):
        validate(compose(["algo.reward=dapo", "+algo.reward_options.stric=true"]), world_size=1)


def test_data_format_is_checked_unless_the_data_is_generated():
    validate(compose(["data.format=nope"]), world_size=1)  # the demo's data is generated: no format applies
    msg = _problems(["data.format=parquet"])
    assert "data.format must be one of dapo, gsm8k" in msg


def test_several_kinds_of_problem_in_one_message():
    with pytest.raises(ConfigError) as err:
        validate(compose(["+trainer.lrr=1", "trainer.save_every=0", "rollout.temperature=-1", "algo.reward=nope",
                          "trainer.mini_batch_size=3"]), world_size=1, also=["data.train: x.parquet: no such file"])
    msg = str(err.value)
    assert msg.count("\n  - ") == 6 and msg.startswith("invalid config:\n  - data.train: x.parquet")
    for part in ("trainer.lrr", "save_every", "temperature", "algo.reward", "multiple of mini_batch_size"):
        assert part in msg


# --- bools in YAML files: OmegaConf reads 2 as true; the command line already refuses it (above) ----------------------

def test_committed_config_files_hold_true_or_false_in_bool_keys():
    files = [("", "config")] + [(p.parent.name, p.stem) for p in sorted(CONFIG_DIR.glob("*/*.yaml"))]
    assert len(files) > 15
    assert yaml_bool_problems([str(CONFIG_DIR)], files) == []


def test_a_bool_key_of_a_yaml_file_takes_true_or_false_only(tmp_path):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "parallel").mkdir()
    recipe = tmp_path / "recipe" / "mine.yaml"
    recipe.write_text("# @package _global_\ndefaults:\n  - /model: qwen3_1p7b\ntrainer:\n  async_save: 2\n"
                      "  lr: 1e-6\nrollout:\n  streaming: 'no'\n  max_staleness: 1\n"
                      "algo:\n  reward_options: {flag: 2}\nlogging:\n  wandb_mode: \"${oc.env:X,offline}\"\n")
    (tmp_path / "parallel" / "mine.yaml").write_text("tensor: 1\nsequence_parallel: 0\ndistributed_optimizer: true\n")
    assert yaml_bool_problems([str(tmp_path), str(CONFIG_DIR)], [("recipe", "mine"), ("parallel", "mine"),
                                                                   ("model", "qwen3_1p7b")]) == [
        f"{tmp_path / 'parallel' / 'mine.yaml'}: parallel.sequence_parallel must be true or false, got 0",
        f"{recipe}: rollout.streaming must be true or false, got 'no'",
        f"{recipe}: trainer.async_save must be true or false, got 2"]


def test_justrl_train_refuses_a_yaml_bool_in_one_line(tmp_path, monkeypatch, capfd):
    """Through justrl-train (hydra.main, in this process): a --config-dir file's bool read as true is refused, exit
    2, one line, among the other problems."""
    import logging

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from justrl_megatron import train_entry

    (tmp_path / "configs" / "parallel").mkdir(parents=True)
    (tmp_path / "configs" / "parallel" / "mine.yaml").write_text(
        "tensor: 1\npipeline: 1\nsequence_parallel: false\ndistributed_optimizer: 2\n")
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    monkeypatch.setattr("sys.argv", ["justrl-train", "--config-dir", str(tmp_path / "configs"), "parallel=mine",
                                     f"trainer.run_dir={tmp_path / 'run'}", "model.path=/nonexistent/model"])
    try:
        with pytest.raises(SystemExit) as exit_:
            train_entry.main()
    finally:
        root.handlers[:], root.level = handlers, level
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None  # later validate() calls in this process compose without hydra.main
    err = capfd.readouterr().err
    line = (f"  - {tmp_path / 'configs' / 'parallel' / 'mine.yaml'}: parallel.distributed_optimizer must be true or "
            f"false, got 2")
    assert exit_.value.code == 2 and line in err.splitlines(), err
    # the refused launch leaves nothing: the run dir it would have created (its name composed with --config-dir's
    # files too) is gone
    assert not (tmp_path / "run").exists()


# --- data: read a few rows as the loop would; each problem one line ------------------------------------------------

def _parquet(path, table):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(table), path)
    return path


def test_data_problems_are_one_line_each(tmp_path):
    wrong = _parquet(tmp_path / "wrong.parquet", {"text": ["1+1"], "label": ["2"]})
    empty = _parquet(tmp_path / "empty.parquet", {"question": pa_strings(), "answer": pa_strings()})
    cases = {tmp_path / "missing.parquet": "no such file or directory", wrong: "missing column", empty: "no records"}
    for path, reason in cases.items():
        problems = data_problems(compose([f"data.train={path}", "data.format=gsm8k"]))
        assert len(problems) == 1 and "\n" not in problems[0], problems
        assert problems[0].startswith(f"data.train: {path}") and reason in problems[0], problems


def pa_strings():
    import pyarrow as pa

    return pa.array([], type=pa.string())


def test_good_data_and_a_bad_held_out_set(tmp_path):
    good = _parquet(tmp_path / "gsm.parquet", {"question": ["What is 1+1?"], "answer": ["so #### 2"]})
    cfg = compose([f"data.train={good}", "data.format=gsm8k", f"data.eval={tmp_path / 'no_eval.jsonl'}"])
    assert data_problems(cfg) == [f"data.eval: {tmp_path / 'no_eval.jsonl'}: no such file or directory"]
    assert data_problems(compose(["data.train=generated:no_such_task"]))[0].startswith(
        "data.train: reasoning-gym could not build task 'no_such_task'")


# --- resume: what changed since the last launch -----------------------------------------------------------------------

def _launch(tmp_path, *overrides):
    return compose([f"trainer.run_dir={tmp_path / 'run'}", *overrides])


def test_history_keeps_every_launch(tmp_path):
    first = record_launch(_launch(tmp_path), None)
    second = record_launch(_launch(tmp_path, "trainer.lr=2e-6"), 4)
    assert [p.name for p in history(tmp_path / "run")] == ["0001.yaml", "0002.yaml"] == [first.name, second.name]
    assert "fresh start" in first.read_text().splitlines()[0] and "resumed at step 4" in second.read_text()
    from omegaconf import OmegaConf

    assert OmegaConf.load(first).trainer.lr == 1e-5 and OmegaConf.load(second).trainer.lr == 2e-6
    assert OmegaConf.load(second).trainer.run_dir == str(tmp_path / "run")  # resolved


def test_resume_lists_changes_that_take_effect(tmp_path):
    record_launch(_launch(tmp_path), None)
    check = ResumeCheck(_launch(tmp_path, "trainer.lr=3e-6", "trainer.total_steps=200", "logging.progress=false"), 5)
    assert check.problems == []
    assert check.changes == ["logging.progress: True -> False", "trainer.lr: 1e-05 -> 3e-06",
                             "trainer.total_steps: 16 -> 200"]
    assert "at step 5 with settings changed since the last launch (0001.yaml)" in check.describe("run")
    assert ResumeCheck(_launch(tmp_path), 5).describe("run") is None  # same config: nothing to say


@pytest.mark.parametrize("override,key", [
    ("model.path=/other/model", "model.path"),
    ("parallel.tensor=2", "parallel.tensor"),
    ("data.train=generated:chain_sum", "data.train"),
    ("++data.task_options.max_terms=3", "data.task_options.max_terms"),  # under a pinned dict
    ("trainer.seed=2", "trainer.seed"),
    ("model.lora.enabled=true", "model.lora.enabled"),  # a full run's checkpoint has no adapters (issue 20)
    ("model.lora.rank=8", "model.lora.rank"),
    # what a kept group's prompt is (its tokens): refused before any model loads, the kept groups never reach a run
    # that would read them otherwise (the sampling settings: tests/test_admission.py)
    ("model.tokenizer=/other/tokenizer", "model.tokenizer"),
    ("data.template=justrl", "data.template"),
    ("data.system_prompt=hi", "data.system_prompt"),
    ("data.max_prompt_length=77", "data.max_prompt_length"),
])
def test_resume_refuses_what_the_checkpoint_pins(tmp_path, override, key):
    record_launch(_launch(tmp_path), None)
    check = ResumeCheck(_launch(tmp_path, override, "trainer.lr=3e-6"), 5)
    assert len(check.problems) == 1 and check.problems[0].startswith(f"{key} changed since the last launch")
    assert "start a new run (another trainer.run_dir)" in check.problems[0]
    # cpu_demo's validation set takes data.task_options too (${data.task_options}): that change is listed as well
    assert [c for c in check.changes if not c.startswith("data.val:") or key != "data.task_options.max_terms"] == [
        "trainer.lr: 1e-05 -> 3e-06"]


def test_resume_refuses_another_model_shape_and_fewer_steps(tmp_path):
    check = ResumeCheck(_launch(tmp_path, "trainer.total_steps=10"), 20, saved_shape=dict(DEEPSEEK_1P5B.__dict__,
                                                                                          num_layers=24),
                        shape=DEEPSEEK_1P5B)
    assert len(check.problems) == 2
    assert "is not the model of the checkpoint at step 20 (num_layers 24 -> 28)" in check.problems[0]
    assert "trainer.total_steps=10 is below the checkpoint's step 20" in check.problems[1]


def test_check_config_reports_model_tokenizer_and_data_together(tmp_path):
    cfg = compose([f"trainer.run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'no_model'}",
                   f"model.tokenizer={tmp_path / 'no_tok'}", f"data.train={tmp_path / 'no.jsonl'}",
                   "data.format=gsm8k", "trainer.lr=0"])
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 4, lines
    assert lines[0].startswith(f"  - model.tokenizer={tmp_path / 'no_tok'}: no such folder")
    assert lines[1].startswith(f"  - model.path={tmp_path / 'no_model'}: no such folder")
    assert lines[2] == f"  - data.train: {tmp_path / 'no.jsonl'}: no such file or directory"
    assert lines[3].startswith("  - trainer.lr must be in (0, 1]") and lines[3].endswith("got 0.0")
    assert not (tmp_path / "run").exists()  # a refused launch is not recorded


# --- issue 32: one line, exit 2, before anything is written --------------------------------------------------------

def _main_exit(monkeypatch, capfd, *args):
    """justrl-train's main in this process (a refusal is written to fd 2 in one piece: capfd, not capsys)."""
    from justrl_megatron import train_entry

    monkeypatch.setattr("sys.argv", ["justrl-train", *args])
    with pytest.raises(SystemExit) as exit_:
        train_entry.main()
    return exit_.value.code, capfd.readouterr().err


def test_an_empty_run_dir_or_a_file_is_refused_before_hydra_writes(tmp_path, monkeypatch, capfd):
    """An empty trainer.run_dir= was accepted and wrote into the current folder; a file gave hydra's traceback."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("x")
    for value, says in (("", "trainer.run_dir is empty: name the folder"),
                        (str(tmp_path / "a_file"), f"{tmp_path / 'a_file'} is an existing file, not a folder"),
                        (str(tmp_path / "a_file" / "run"), f"{tmp_path / 'a_file'} is an existing file")):
        code, err = _main_exit(monkeypatch, capfd, f"trainer.run_dir={value}")
        assert code == 2 and err.count("\n") == 1 and says in err, err
    code, err = _main_exit(monkeypatch, capfd, "trainer.run_dir=", "rollout.nonexistent=1")  # every problem at once
    assert code == 2 and err.splitlines()[1:] == [
        "  - unknown key rollout.nonexistent; did you mean rollout.exact?",
        "  - trainer.run_dir is empty: name the folder that holds the run (checkpoints, metrics, logs), e.g. "
        "trainer.run_dir=runs/my_run"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_cfg_refuses_unknown_keys_as_a_run_does(monkeypatch, capfd):
    """`--cfg job rollout.nonexistent=1` printed the config without the key and exited 0 (issue 50)."""
    code, err = _main_exit(monkeypatch, capfd, "--cfg", "job", "rollout.nonexistent=1", "+trainer.lrr=1",
                           "rollout.streaming=maybe")
    assert code == 2 and err == ("justrl-train: invalid config:\n"
                                 "  - unknown key rollout.nonexistent; did you mean rollout.exact?\n"
                                 "  - unknown key trainer.lrr; did you mean trainer.lr?\n"
                                 "  - rollout.streaming must be true or false, got 'maybe'\n"), err


@pytest.mark.parametrize("override,line", [  # issue 50: hydra's 6-line merge error and rc 1; 2 was read as true
    ("rollout.max_staleness=abc", "rollout.max_staleness must be a whole number, got 'abc'"),
    ("rollout.max_staleness=1.5", "rollout.max_staleness must be a whole number, got 1.5"),
    ("rollout.streaming=maybe", "rollout.streaming must be true or false, got 'maybe'"),
    ("trainer.async_save=null", "trainer.async_save must be true or false, got null"),
    ("trainer.async_save=2", "trainer.async_save must be true or false, got 2"),
    ("++trainer.async_save=yes", "trainer.async_save must be true or false, got 'yes'"),
    ("trainer.lr=fast", "trainer.lr must be a number, got 'fast'"),
    ("model.max_context=big", "model.max_context must be a whole number (or null), got 'big'"),
    ("rollout.tools=python", "rollout.tools must be a list, e.g. [a, b], got 'python'"),
    ("data.val=[{pth:x}]", "data.val=[{'pth': 'x'}]: Key 'pth' not in 'ValSetConfig'"),
])
def test_a_value_of_the_wrong_type_is_one_line(override, line):
    assert override_problems([override]) == ([line], [])


def test_values_of_the_right_type_pass_to_hydra():
    args = ["trainer.async_save=false", "rollout.max_staleness=2", "trainer.lr=1", "model.max_context=null",
            "model.moe_permute_fusion=null", "trainer.profile_steps=[1,2]", "rollout.max_staleness=${trainer.seed}",
            "data.val=[{path:x,limit:2}]", "+algo.reward_options.anything=x", "~trainer.profile_steps"]
    assert override_problems(args) == ([], args)


@pytest.fixture
def in_process_hydra():
    """hydra.main run in this process: its logging set-up and global state are put back afterwards."""
    import logging

    from hydra.core.global_hydra import GlobalHydra

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level
    GlobalHydra.instance().clear()


def test_a_refused_config_leaves_nothing_behind(tmp_path, tiny_llama, monkeypatch, capfd, in_process_hydra):
    """hydra created the run dir with hydra/ and train_entry.log before the checks refused the config (issue 50);
    each problem is one line, exit 2, on a new run dir (and the folders above it) and on an existing one alike."""
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    for run_dir in (tmp_path / "new" / "run", existing):
        code, err = _main_exit(monkeypatch, capfd, f"trainer.run_dir={run_dir}", f"model.path={tiny_llama}",
                               "rollout.max_staleness=abc", "trainer.async_save=2", "trainer.lr=-1")
        assert code == 2 and err.splitlines() == [
            "justrl-train: invalid config:", "  - rollout.max_staleness must be a whole number, got 'abc'",
            "  - trainer.async_save must be true or false, got 2",
            "  - trainer.lr must be in (0, 1] (Adam moves each weight by about lr per step; JustRL: 1e-6), got -1.0"
        ], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]
    assert [p.name for p in existing.iterdir()] == ["notes.txt"]


def test_a_refusal_is_said_by_local_rank_0_only_and_every_rank_exits_2(monkeypatch, capfd):
    """Every rank of a multi-rank launch printed the same refusal, interleaved (issue 50)."""
    for rank, says in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        code, err = _main_exit(monkeypatch, capfd, "--cfg", "job", "rollout.nonexistent=1")
        assert code == 2 and bool(err) == says, (rank, err)


def test_a_read_only_run_dir_is_one_line(tmp_path):
    """A read-only bind mount (as root, chmod alone does not stop writes); a real launch, refused before hydra."""
    import subprocess
    import sys

    from helpers import ENV

    (tmp_path / "ro").mkdir()
    script = (f"mount --bind -o ro {tmp_path / 'ro'} {tmp_path / 'ro'} || exit 77; exec {sys.executable} -m "
              f"justrl_megatron.cli train trainer.run_dir={tmp_path / 'ro' / 'run'}")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], env=ENV, capture_output=True, text=True, timeout=300)
    if proc.returncode == 77 or "unshare:" in proc.stderr:
        pytest.fail(f"needs a private read-only bind mount (root: unshare -m, mount --bind -o ro), as CI has: "
                    f"{proc.stderr.strip()[:200]}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"justrl-train: invalid config: trainer.run_dir={tmp_path / 'ro' / 'run'}: "
                                   f"{tmp_path / 'ro'} is not writable (read-only); choose a writable folder")


def test_every_prompt_too_long_is_found_before_the_run_dir_is_written(tmp_path, tiny_llama):
    """Found only after config_history was written (issue 32)."""
    cfg = compose([f"trainer.run_dir={tmp_path / 'run'}", f"model.path={tiny_llama}", "data.max_prompt_length=8",
                   "rollout.max_response_length=8", "data.num_generated=16"])
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    lines = str(err.value).splitlines()[1:]
    assert lines == ["  - data.max_prompt_length=8: all 16 prompts of data.train are longer (with "
                     "data.template=boxed); raise it or use shorter prompts"], lines
    assert not (tmp_path / "run").exists()


def test_a_file_of_one_giant_prompt_repeated_is_counted_as_the_loader_left_it(tmp_path, tiny_llama):
    """A file of 3 copies of one giant prompt was refused as "all 1 prompts": the count is of what data.dedup left,
    and the line says so."""
    import json

    data = tmp_path / "giant.jsonl"
    data.write_text(3 * (json.dumps({"problem": "word " * 300, "answer": "1"}) + "\n"))
    cfg = compose([f"trainer.run_dir={tmp_path / 'run'}", f"model.path={tiny_llama}", f"data.train={data}",
                   "data.format=generic", "data.max_prompt_length=64", "rollout.max_response_length=8"])
    with pytest.raises(ConfigError) as err:
        check_config(cfg, launch=False)
    assert str(err.value).splitlines()[1:] == [
        "  - data.max_prompt_length=64: the one prompt of data.train (3 records; 2 exact duplicate(s) dropped: "
        "data.dedup) is longer (with data.template=boxed); raise it or use shorter prompts"]


def test_resume_pins_the_training_data_by_content_and_rereads_a_changed_eval_set(tmp_path):
    """Only data.train's path was pinned: a file rewritten between launches resumed silently (issue 42)."""
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text('{"problem": "1+1", "answer": "2"}\n')
    held_out.write_text('{"problem": "2+2", "answer": "4"}\n')
    launch = _launch(tmp_path, f"data.train={train}", f"data.eval={held_out}")
    record_launch(launch, None)
    assert ResumeCheck(launch, 3).problems == []  # same files
    train.write_text('{"problem": "1+1", "answer": "3"}\n')
    held_out.write_text('{"problem": "2+2", "answer": "5"}\n')
    check = ResumeCheck(launch, 3)
    assert len(check.problems) == 1 and check.problems[0].startswith(f"data.train={train}: its content changed since "
                                                                     f"the last launch (sha256:")
    assert "the checkpoint at step 3 pins it" in check.problems[0] and "Restore the file" in check.problems[0]
    assert len(check.changes) == 1 and check.changes[0].startswith(f"data.eval={held_out}: its content changed")
    assert check.changes[0].endswith("it is read anew")


def _cached_hub_revision(cache, repo: str, commit: str, rows: list[dict], age_s: float) -> None:
    """The datasets cache as a download of hub dataset `repo` at `commit` leaves it (owner___name/default/0.0.0/
    <commit>/), which `datasets` reads offline: the newest copy (modified `age_s` ago) wins."""
    import json
    import os
    import shutil
    import time

    from datasets.packaged_modules.json.json import Json

    owner, name = repo.split("/")
    source = cache.parent / f"{commit}.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    builder = Json(cache_dir=str(cache.parent / "staging"), dataset_name=name, hash=commit,
                   data_files={"train": [str(source)]})
    builder.download_and_prepare()
    copy = cache / f"{owner}___{name}" / "default" / "0.0.0" / commit
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(builder.cache_dir, copy)
    os.utime(copy, (time.time() - age_s,) * 2)


def test_resume_pins_a_hub_dataset_by_its_revision(tmp_path, monkeypatch):
    """A hub name (the JustRL recipes' data.train) was not pinned at all (issue 50): the revision it resolves to is
    recorded and a new one refused. No hub here: offline, the newest copy in the datasets cache is what is read."""
    import datasets

    from justrl_megatron.data.loaders import load_rows

    cache = tmp_path / "datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    first, second = "a1" * 20, "b2" * 20
    _cached_hub_revision(cache, "justrl/tiny", first, [{"problem": "1+1", "answer": "2"}], age_s=60)
    launch = _launch(tmp_path, "data.train=justrl/tiny", "data.format=generic")
    record_launch(launch, None)
    assert ResumeCheck(launch, 3).problems == []
    _cached_hub_revision(cache, "justrl/tiny", second, [{"problem": "1+1", "answer": "3"}], age_s=0)
    assert [r["answer"] for r in load_rows("justrl/tiny", "generic", verbose=False).rows] == ["3"]
    assert ResumeCheck(launch, 3).problems == [
        f"data.train=justrl/tiny: its content changed since the last launch (revision:{first[:12]} -> "
        f"revision:{second[:12]}) but the checkpoint at step 3 pins it: the saved sampler position indexes the "
        f"prompt list this setting builds. Make that revision the newest copy in the datasets cache and launch "
        f"offline (HF_HUB_OFFLINE=1), or start a new run (another trainer.run_dir)"]
