"""Training prompts: rows (data/) -> chat-templated token ids -> a reproducible, resumable stream of batches.

The order is a pure function of (seed, epoch): each epoch is a fresh permutation, and the position (epoch, index) is
saved in every checkpoint, so a resumed run sees exactly the prompts an uninterrupted one would have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import OmegaConf


@dataclass
class Prompt:
    ids: list[int]
    answer: object
    data_source: str
    id: str


HELDOUT_SEED_OFFSET = 10_007  # generated held-out problems come from another seed: never training prompts


def load_training_rows(data_cfg, *, seed: int, split: str = "train", limit: int | None = None) -> list[dict]:
    """Rows {problem, answer, data_source, id} of data.train (split="train") or of the held-out set (split="eval":
    data.eval, or for a generated task the same task under another seed). 'generated:<task>' draws from
    reasoning-gym."""
    return load_training_source(data_cfg, seed=seed, split=split, limit=limit).rows


def load_training_source(data_cfg, *, seed: int, split: str = "train", limit: int | None = None):
    """load_training_rows' rows with what the loader read and dropped on the way (a data.loaders.LoadResult)."""
    from . import LoadResult, generate_rows, load_rows

    spec = data_cfg.train if split == "train" else (data_cfg.eval or data_cfg.train)
    if spec.startswith("generated:"):
        n = data_cfg.num_generated if limit is None else limit
        task_seed = seed if split == "train" else seed + HELDOUT_SEED_OFFSET
        options = OmegaConf.to_container(data_cfg.task_options) if data_cfg.task_options else {}
        rows = generate_rows(spec.split(":", 1)[1], n, task_seed, **options)
        return LoadResult(rows=rows, source=spec, read=len(rows))
    if split != "train" and not data_cfg.eval:
        return LoadResult(rows=[])
    fmt = data_cfg.format if split == "train" else (data_cfg.eval_format or data_cfg.format)
    return load_rows(spec, fmt, dedup=data_cfg.dedup, limit=limit)


def none_fit(too_long: int, source, of: str = "") -> str:
    """The prompts of `source` (a LoadResult) none of which fits data.max_prompt_length, counted as the loader left
    them, with the verb that agrees: "all 3 prompts of data.train are", "the one prompt of data.train (3 records; 2
    exact duplicate(s) dropped: data.dedup) is"."""
    what = ("the one prompt" if too_long == 1 else f"all {too_long} prompts") + (f" of {of}" if of else "")
    dropped = [f"{source.duplicates} exact duplicate(s) dropped: data.dedup"] if source.duplicates else []
    skipped = sum(source.skipped.values())
    dropped += [f"{skipped} malformed skipped"] if skipped else []
    return what + (f" ({source.read} records; {', '.join(dropped)})" if dropped else "") + \
        (" is" if too_long == 1 else " are")


def tokenize_prompts(rows: list[dict], tokenizer, data_cfg) -> tuple[list[Prompt], int]:
    """Chat-template and tokenize; prompts longer than data.max_prompt_length are dropped (and counted)."""
    from . import render_prompt, row_messages

    # DAPO-Math-17k with data.dedup=false repeats each prompt ~100 times: tokenize each distinct prompt once
    prompts, too_long, cache = [], 0, {}
    for row in rows:
        messages = row_messages(row, data_cfg.template, data_cfg.system_prompt)
        key = messages if isinstance(messages, str) else tuple((m["role"], m["content"]) for m in messages)
        ids = cache.get(key)
        if ids is None:
            text = messages if isinstance(messages, str) else render_prompt(tokenizer, messages)
            ids = cache[key] = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > data_cfg.max_prompt_length:
            too_long += 1
            continue
        prompts.append(Prompt(ids=ids, answer=row["answer"], data_source=row.get("data_source", ""),
                              id=str(row.get("id", len(prompts)))))
    return prompts, too_long


class PromptSampler:
    def __init__(self, prompts: list[Prompt], batch_size: int, *, seed: int, shuffle: bool = True):
        if not prompts:
            raise ValueError("no training prompts left (all rows skipped or too long for data.max_prompt_length)")
        self.prompts, self.batch_size, self.seed, self.shuffle = prompts, batch_size, seed, shuffle
        self.epoch, self.index = 0, 0

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.prompts)))
        return torch.randperm(len(self.prompts), generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def next_batch(self) -> list[Prompt]:
        batch, order = [], self._order(self.epoch)
        while len(batch) < self.batch_size:
            if self.index >= len(order):
                self.epoch, self.index = self.epoch + 1, 0
                order = self._order(self.epoch)
            batch.append(self.prompts[order[self.index]])
            self.index += 1
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
