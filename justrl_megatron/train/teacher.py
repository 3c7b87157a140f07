"""The on-policy distillation teacher (algo.distill.teacher): a frozen GPTModel of another HF folder with the
student's tokenizer, which scores the student's sampled response tokens (algo/distill.py turns them into per-token
advantages).

It is converted in as any model (convert/load.py; another size or architecture is fine), built at the student's
parallel layout (its own shape must divide at it: `problems` says so before any model loads), frozen, and never the
LoRA student's adapters-off weights: it is always its own copy (train/reference.frozen_copy). On a GPU it waits in
host memory between uses and comes to the device for its forward pass, as the KL reference does. Its log-probs come
from the same forward-only megatron schedule as the old log-probs (step.compute_logprobs), with its top-1
disagreement with the sampled token computed in the same pass. Each launch loads it anew from its folder (also on
resume; run_config.PINNED refuses a changed teacher on resume).
"""

from __future__ import annotations

from pathlib import Path

# megatron loads with the trainer only: config validation imports this module for `problems`


class Teacher:
    """`score(samples, max_tokens_per_micro_batch=...)` -> TeacherScores of the whole batch, the same on every rank."""

    def __init__(self, frozen):
        self.frozen = frozen

    @classmethod
    def load(cls, policy, teacher_dir: str | Path, *, progress: bool = False) -> "Teacher":
        """The teacher's HF weights at the policy's layout and precision (call on every trainer rank)."""
        from transformers import AutoConfig

        from ..assets import resolve_model_path
        from ..model.hf_config import model_shape
        from .reference import frozen_copy

        folder = resolve_model_path(str(teacher_dir))
        shape = model_shape(AutoConfig.from_pretrained(folder))
        return cls(frozen_copy(policy, folder, shape=shape, progress=progress))

    def score(self, samples, *, max_tokens_per_micro_batch: int):
        from .step import TeacherScores, compute_logprobs

        with self.frozen.on_device():
            logprobs, mismatch = compute_logprobs(self.frozen, samples, with_top1_mismatch=True,
                                                  max_tokens_per_micro_batch=max_tokens_per_micro_batch)
        return TeacherScores(logprobs, mismatch)


def problems(cfg, model_dir, shape) -> list[str]:
    """The teacher folder as this launch would load it, one line each, before any model loads: present and an HF
    model, the student's vocabulary (its tokenizer's token -> id map, compared whole), dense, long enough for the
    longest sample, and its shape divisible at the student's parallel layout. `model_dir` / `shape`: the student's
    (None when the student itself could not be read: only the teacher's own problems then)."""
    teacher = cfg.algo.distill.teacher
    if not teacher:
        return []
    from transformers import AutoConfig, AutoTokenizer

    from ..assets import resolve_model_path
    from ..model.hf_config import check_parallel_layout, model_shape

    key = f"algo.distill.teacher={teacher}"
    try:
        folder = resolve_model_path(str(teacher))
        teacher_shape = model_shape(AutoConfig.from_pretrained(folder))
        teacher_vocab = AutoTokenizer.from_pretrained(folder).get_vocab()
    except (OSError, ValueError) as exc:  # FileNotFoundError is an OSError
        why = str(exc).splitlines()[0].replace(f"model.path={teacher}: ", "")  # (resolve_model_path's wording)
        return [f"{key}: {why} (give the teacher's HF folder: config.json, weights, tokenizer)"]
    found = []
    if model_dir is not None:
        student = cfg.model.tokenizer or model_dir
        student_vocab = AutoTokenizer.from_pretrained(student).get_vocab()
        if student_vocab != teacher_vocab:
            differ = len(set(student_vocab.items()) ^ set(teacher_vocab.items()))
            found.append(f"{key}: its tokenizer ({len(teacher_vocab)} tokens, {folder}) is not the student's "
                         f"({len(student_vocab)} tokens, {student}; {differ} token ids differ): distillation scores "
                         f"the student's token ids, so the teacher must share its vocabulary")
    if teacher_shape.num_experts or (shape is not None and shape.num_experts):
        found.append(f"{key}: MoE models (teacher or student) are not verified with distillation yet; use dense ones")
    total = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    if total > teacher_shape.max_position_embeddings:
        found.append(f"{key}: data.max_prompt_length + rollout.max_response_length = {total} exceeds the teacher's "
                     f"context ({teacher_shape.max_position_embeddings})")
    par = cfg.parallel
    found += [f"{key}: {p}" for p in check_parallel_layout(teacher_shape, par.tensor, par.pipeline,
                                                           par.virtual_pipeline, max(par.expert, 1))]
    return found
