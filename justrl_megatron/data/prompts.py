"""Prompt templates: how a problem becomes what the policy sees.

Two kinds of template:

* chat templates (``"justrl"``, ``"justrl_stripped"``, ``"justrl_eval"``, ``"boxed"``, ``"plain"``, ``"think"``,
  and the tool-offering ``"justrl_tool"``, ``"boxed_tool"``)
  produce a list of chat messages; the tokenizer's own chat template turns them into text (:func:`render_prompt`, with
  ``add_generation_prompt=True``);
* raw templates (``"countdown"``, ``"raw:<format string>"``) produce the final prompt string themselves, no chat
  template involved (seed 003's TinyZero-style countdown prompt is written this way: the assistant turn is pre-filled
  with ``<think>``).

:func:`row_messages` is the entry point for loader rows: ``"justrl"`` is applied to the source's own prompt text
(``row["source_prompt"]`` where the loader kept one: JustRL trained on DAPO-Math-17k's full prompt, its "Solve ...
Answer:" wrapper included), every other template to the bare ``row["problem"]``; prepared rows keep their ``prompt``.

In the prepared parquet every prompt is a list of messages; a raw prompt is stored as the single message
``{"role": "raw", "content": text}``, which :func:`render_prompt` passes through untouched.
"""
from __future__ import annotations

from typing import Any

# JustRL (verl `use_boxed_suffix_prompt`): appended to the problem in the user turn, verbatim.
JUSTRL_SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
# JustRL's eval (evals/gen_vllm.py) joins the same instruction to the problem with a space instead.
JUSTRL_EVAL_SUFFIX = " Please reason step by step, and put your final answer within \\boxed{}."

# <think>/<answer> format asked for by the weighted format rewards (seed 001 style).
THINK_SUFFIX = (
    "\n\nThink step by step inside <think> </think> tags, then give only the final answer inside "
    "<answer> </answer> tags."
)

# TinyZero countdown prompt (seed 003 style): base-model "conversation" text, assistant turn opened with <think>.
COUNTDOWN_RAW = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with the answer.\n"
    "User: {problem} Show your work in <think> </think> tags. And return the final answer in <answer> </answer> tags, "
    "for example <answer> (1 + 2) / 3 </answer>.\n"
    "Assistant: Let me solve this step by step.\n<think>"
)

RAW_ROLE = "raw"


def _escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


# Short-answer variant for small models and short budgets (the CPU demo): no "reason step by step".
BOXED_SUFFIX = "\n\nPut your final answer within \\boxed{}."

# Tool use (rollout.tools=[python]): the prompt offers the Python tool in the format rollout/tools.py runs, a fenced
# ```python block answered by an ```output block (the format Qwen / DeepSeek-R1-Distill models write by themselves).
TOOL_OFFER = ("\n\nYou may run Python code while you reason: write it in a ```python code block and its output will "
              "be shown to you in an ```output block.")
JUSTRL_TOOL_SUFFIX = TOOL_OFFER + " Please reason step by step, and put your final answer within \\boxed{}."
BOXED_TOOL_SUFFIX = TOOL_OFFER + " Put your final answer within \\boxed{}."

CHAT_TEMPLATES = {
    "justrl": "{problem}" + _escape(JUSTRL_SUFFIX),  # row_messages fills it with the source's own prompt text
    "justrl_stripped": "{problem}" + _escape(JUSTRL_SUFFIX),  # the bare problem (DAPO's wrapper removed)
    "justrl_eval": "{problem}" + _escape(JUSTRL_EVAL_SUFFIX),
    "boxed": "{problem}" + _escape(BOXED_SUFFIX),
    "plain": "{problem}",
    "think": "{problem}" + _escape(THINK_SUFFIX),
    "justrl_tool": "{problem}" + _escape(JUSTRL_TOOL_SUFFIX),  # as justrl (the source's own text), Python offered
    "boxed_tool": "{problem}" + _escape(BOXED_TOOL_SUFFIX),
}
RAW_TEMPLATES = {"countdown": COUNTDOWN_RAW}
# Templates filled with the dataset's prompt text exactly as stored, not the loader's stripped problem.
VERBATIM_TEMPLATES = frozenset({"justrl", "justrl_tool"})


def _fill(fmt: str, problem: str, fields: dict[str, Any]) -> str:
    # str.format never re-parses substituted values, so braces inside the problem (LaTeX) are safe; literal braces
    # in a template are written doubled.
    try:
        return fmt.format(problem=problem, **fields)
    except KeyError as e:
        raise ValueError(f"prompt template needs field {e.args[0]!r}; pass it as a keyword to build_messages") from None


def build_messages(problem: str, template: str = "justrl", system: str | None = None, **fields: Any):
    """Chat messages for ``problem`` (a list of dicts), or a plain string for raw templates.

    ``template``: a name from CHAT_TEMPLATES / RAW_TEMPLATES, or ``"raw:<format string>"`` (``str.format`` syntax:
    ``{problem}`` plus any extra ``fields`` as placeholders, literal braces doubled). ``system`` adds a system turn
    (chat templates only).
    """
    if template.startswith("raw:"):
        return _fill(template[4:], problem, fields)
    if template in RAW_TEMPLATES:
        return _fill(RAW_TEMPLATES[template], problem, fields)
    if template not in CHAT_TEMPLATES:
        known = sorted(CHAT_TEMPLATES) + sorted(RAW_TEMPLATES)
        raise ValueError(f"unknown prompt template {template!r}; known: {known} or 'raw:<format string>'")
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": _fill(CHAT_TEMPLATES[template], problem, fields)})
    return messages


def row_messages(row: dict, template: str = "justrl", system: str | None = None, **fields: Any):
    """The prompt of a loader row: its ready ``prompt`` (prepared data) as is; else ``template`` applied to the source's
    own prompt text (``source_prompt``) for VERBATIM_TEMPLATES, or to the bare ``problem`` for every other one."""
    if "prompt" in row:
        return row["prompt"]
    text = row.get("source_prompt", row["problem"]) if template in VERBATIM_TEMPLATES else row["problem"]
    return build_messages(text, template, system, **fields)


def as_message_list(prompt) -> list[dict]:
    """The stored (parquet) form of a prompt: raw strings become one ``raw`` message."""
    if isinstance(prompt, str):
        return [{"role": RAW_ROLE, "content": prompt}]
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]


def render_prompt(tokenizer, messages) -> str:
    """The prompt text: the tokenizer's chat template with ``add_generation_prompt=True``; raw prompts as they are."""
    if isinstance(messages, str):
        return messages
    messages = list(messages)
    if len(messages) == 1 and messages[0]["role"] == RAW_ROLE:
        return messages[0]["content"]
    if any(m["role"] == RAW_ROLE for m in messages):
        raise ValueError("a raw prompt must be a single message")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
