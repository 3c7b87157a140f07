"""LoRA policy training (model/lora.py, train/reference.py): what is trained, the reference policy and the KL term,
TP parity, exact resume, the PEFT / merged export, the config checks and the reward preset; and a short
end-to-end run of recipe=cpu_demo_lora (slow).

The megatron parts run in worker processes (tests/mp/lora_*.py) on a tiny random Qwen2 (qkv bias, 4 heads / 2 KV
groups, so TP=2 splits whole query groups).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from helpers import SHORT_TRAIN, run_mp, run_ok


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    from justrl_megatron import assets

    return assets.tiny_model(tmp_path_factory.mktemp("models") / "tiny_qwen", "qwen2", num_layers=2, hidden_size=64,
                             num_heads=4, num_kv_heads=2, intermediate_size=96, vocab_size=1000)


@pytest.fixture(scope="module")
def checks(tiny_qwen, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_checks")
    run_mp("lora_checks.py", out, tiny_qwen)
    return out, json.loads((out / "checks.json").read_text())


def test_only_the_adapters_are_trained(checks):
    _, v = checks
    assert v["trainable_all_adapters"]
    # rank 4 on qkv (64 -> 128), proj (64 -> 64), fc1 (64 -> 192), fc2 (96 -> 64), two layers: r * (in + out) each
    assert v["adapter_numel"] == 2 * 4 * ((64 + 128) + (64 + 64) + (64 + 192) + (96 + 64))
    assert v["grad_buffer_numel"] == v["adapter_numel"]  # no gradient buffer for a frozen weight
    assert v["optimizer_numel"] == v["adapter_numel"]  # no fp32 copy / Adam state for a frozen weight
    assert v["base_without_main_grad"]
    assert v["base_numel"] > 30 * v["adapter_numel"]


def test_adapters_off_logits_equal_the_base_model_exactly(checks):
    _, v = checks
    assert v["init_equals_base"]  # B = 0 at init
    assert v["b_moved"] > 1e-3 and v["on_differs"] > 1e-2  # two updates changed the adapted model...
    assert v["off_equals_base"]  # ...and switched off it is the base model, bitwise


@pytest.mark.parametrize("mode, name", [("lora", "adapters-off"), ("frozen", "frozen-copy")])
def test_kl_is_zero_at_step_0_and_positive_after_an_update(checks, mode, name):
    _, v = checks
    assert v[f"{mode}_mode"] == name
    assert v[f"{mode}_ref_vs_policy_0"] == 0.0  # the reference is the initial policy, bitwise
    assert v[f"{mode}_kl_0"] == 0.0 and v[f"{mode}_kl_loss_0"] == 0.0
    assert v[f"{mode}_kl_1"] > 1e-3 and v[f"{mode}_kl_loss_1"] > 1e-3
    if mode == "frozen":
        assert v["frozen_ref_unchanged"] and not v["frozen_requires_grad"]


@pytest.mark.slow
def test_lora_tp1_and_tp2_give_the_same_loss_and_adapter_grads(tiny_qwen, tmp_path):
    run_mp("lora_parity.py", tmp_path, tiny_qwen, "tp1")
    run_mp("lora_parity.py", tmp_path, tiny_qwen, "tp2", nproc=2)
    v = json.loads((tmp_path / "tp2.json").read_text())
    assert v["grad_keys"]
    assert v["grad_a_max"] > 1e-3  # A gets a gradient (random B): the check compares real numbers
    assert v["logprobs"] < 1e-5 and v["ref_logprobs"] < 1e-5
    assert v["loss"] < 1e-6 and v["pg_loss"] < 1e-6 and v["kl_loss"] < 1e-6 and v["kl_value"] > 0
    assert v["grads"] < 1e-6 and v["grad_norm"] < 1e-6
    assert v["after"] < 1e-5


@pytest.mark.slow
def test_lora_resume_is_exact(tiny_qwen, tmp_path):
    run_mp("lora_resume.py", tmp_path, tiny_qwen)
    v = json.loads((tmp_path / "resume.json").read_text())
    assert v["resumed_step"] == 2 and v["moved"] > 1e-3
    assert v["adapters_equal"] and v["metrics_equal"], v
    assert v["ckpt_bytes"] < v["base_bytes"] / 2  # adapters and their optimizer state only


def test_merged_export_equals_a_peft_merge_of_the_saved_adapter(checks, tiny_qwen, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out, _ = checks
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    run_ok([sys.executable, "-m", "justrl_megatron.convert.cli", "lora-export", "--ckpt", out / "run",
            "--out", adapter, "--merged", merged])
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                "v_proj"]
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.float32)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    peft_model = PeftModel.from_pretrained(base, adapter)
    saved = torch.load(out / "lora_logits.pt")
    with torch.no_grad():
        logits = peft_model(saved["tokens"]).logits
    assert (logits - saved["logits"]).abs().max() < 1e-4  # PEFT's q/k/v, gate/up adapters == the fused ones
    peft_merged = peft_model.merge_and_unload().state_dict()
    ours = load_file(merged / "model.safetensors")
    assert set(ours) == set(peft_merged)
    assert max(float((ours[k] - peft_merged[k]).abs().max()) for k in ours) < 1e-6
    assert float((ours["model.layers.0.self_attn.k_proj.weight"]
                  - base_state["model.layers.0.self_attn.k_proj.weight"]).abs().max()) > 1e-3


def test_export_commands_say_what_to_use(checks, tiny_qwen, tmp_path):
    out, _ = checks
    proc = run_ok([sys.executable, "-m", "justrl_megatron.convert.cli", "mcore-to-hf", "--ckpt", out / "run",
                   "--out", tmp_path / "hf"], expect=2)
    assert "lora-export" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_ok([sys.executable, "-m", "justrl_megatron.convert.cli", "lora-export", "--ckpt", out / "run",
                   "--out", tmp_path / "a", "--base", tmp_path / "nowhere"], expect=2)
    assert "--base" in proc.stderr and "Traceback" not in proc.stderr


def test_lora_config_checks():
    from justrl_megatron.config import ConfigError, compose, validate

    cfg = compose(["recipe=cpu_demo_lora"])
    assert cfg.model.lora.enabled and cfg.algo.kl_coef > 0
    validate(cfg, world_size=1)
    bad = compose(["recipe=cpu_demo_lora", "model.lora.rank=0", "model.lora.targets=[qkv,up]",
                   "model.transformer_impl=te", "parallel.tensor=2", "parallel.sequence_parallel=true"])
    with pytest.raises(ConfigError) as err:
        validate(bad, world_size=2)
    text = str(err.value)
    for expected in ("model.lora.rank must be an integer >= 1", "model.lora.targets must be",
                     "LoRA does not support parallel.sequence_parallel", "LoRA needs model.transformer_impl=local"):
        assert expected in text
    assert not compose().model.lora.enabled  # off by default


def test_seed_reward_preset():
    from justrl_megatron.rewards import get_reward_fn

    reward = get_reward_fn("gsm8k", preset="seed")
    assert reward("so \\boxed{12}", "12") == 1.0
    assert reward("so \\boxed{13}", "12") == -1.0
    assert reward("no idea", "12") == -0.5
    assert get_reward_fn("dapo", preset="seed", no_answer=-1.0)("no box", "12") == -1.0  # options win
    with pytest.raises(ValueError, match="unknown reward preset"):
        get_reward_fn("gsm8k", preset="nope")


@pytest.mark.slow
def test_cpu_demo_lora_trains_end_to_end(tmp_path, tiny_llama):
    """A short run of the LoRA recipe: the reference phase runs, the KL is logged, the engine takes merged weights
    (the trainer <-> vLLM logprob gap stays small), and the checkpoint holds adapters only."""
    run = tmp_path / "run"
    run_ok([sys.executable, "-m", "justrl_megatron.cli", "train", "recipe=cpu_demo_lora", f"model.path={tiny_llama}",
            f"trainer.run_dir={run}", *SHORT_TRAIN], timeout=1200)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("actor/kl" in r and "time/ref_logprob_s" in r for r in rows), rows[0].keys()
    assert rows[0]["actor/kl"] == 0.0  # the reference is the initial policy
    assert all(r["rollout/logprob_diff_max"] < 1e-3 for r in rows), [r["rollout/logprob_diff_max"] for r in rows]
    meta = json.loads((run / "checkpoints" / "step_00000002" / "justrl_megatron.json").read_text())
    assert meta["lora"]["rank"] == 16 and meta["base_model"]
