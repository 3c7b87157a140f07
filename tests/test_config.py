"""Hydra configs: composition, the JustRL recipes carry the paper's numbers, validation says what to change."""

import pytest
from hydra.errors import ConfigCompositionException

from justrl_megatron.config import ConfigError, compose, validate
from justrl_megatron.model.hf_config import ModelShape

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


def test_lengths_fit_the_model_context():
    msg = _problems(["model.max_context=8192"])
    assert "exceeds the model context 8192" in msg


def test_micro_batch_budget_holds_one_sample():
    assert "must hold one full sample" in _problems(["trainer.max_tokens_per_micro_batch=4096"])


def test_every_problem_is_reported_at_once():
    msg = _problems(["parallel.tensor=4", "trainer.mini_batch_size=60", "model.dtype=fp8"], world_size=4)
    assert msg.count("\n  - ") == 3
