"""One process, a real megatron GPTModel (tiny), real saves: a full disk, then a Ctrl-C pressed twice during a save.

Run by tests/test_run_safety.py: python run_safety.py OUT [FULL_DIR]
  disk    (when FULL_DIR, a small tmpfs, is given) three saves into it:
          1. step 1 fits; a filler then leaves less free space than step 1's size;
          2. step 2 is refused before writing (the free-space check): CheckpointWriteError, no staging, latest = 1;
          3. a fresh run dir (no size known yet) on the same full disk: the write itself fails (ENOSPC), the staging
             folder is removed, no `latest`.
          The verdict goes to OUT/disk.json.
  sigint  (always) the trainer's Ctrl-C handler (train/interrupt.py) is installed, step 1 is saved into OUT/run,
          then step 2's save stops inside its staging folder (OUT/staged marks it) until the test's two SIGINTs:
          the process must exit 130 with the staging folder gone. Anything it prints goes to the test.
"""

from justrl_megatron.console import quiet_console

quiet_console()  # as justrl-train does: the known-harmless library warnings off, so the test sees only our lines
import justrl_megatron.compat  # noqa: E402,F401  (CPU redirections before megatron loads)

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from megatron.core import dist_checkpointing  # noqa: E402

from justrl_megatron import checkpoint as ckpt
from justrl_megatron.model.hf_config import ModelShape
from justrl_megatron.model.policy import Policy
from justrl_megatron.interrupt import Interruptible

SHAPE = ModelShape(family="qwen2", num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=2,
                   num_query_groups=1, head_dim=32, vocab_size=512, max_position_embeddings=64, rope_theta=1e4,
                   rms_norm_eps=1e-6, qkv_bias=False, tie_word_embeddings=True, init_std=0.02)


def save(policy, run_dir, step):
    return ckpt.save_checkpoint(run_dir, step, policy.chunks, policy.optimizer, policy.scheduler, {}, keep_last=2)


def staging_left(run_dir) -> list[str]:
    root = ckpt.checkpoint_root(run_dir)
    return sorted(p.name for p in root.glob(".tmp_*")) if root.is_dir() else []


def save_on_full_disk(name: str, policy, run_dir, step: int) -> dict:
    """The save's one-line error ("saved" if none), and the staging folders and `latest` it left."""
    try:
        save(policy, run_dir, step)
        message = "saved"
    except ckpt.CheckpointWriteError as exc:
        message = str(exc)
    return {name: message, f"{name}_staging": staging_left(run_dir), f"{name}_latest": ckpt.latest_step(run_dir)}


def disk(policy, out: Path, full: Path) -> None:
    verdict = {}
    run_dir = full / "run"
    first = save(policy, run_dir, 1)
    size = sum(p.stat().st_size for p in first.rglob("*") if p.is_file())
    verdict["checkpoint_bytes"] = size
    free = os.statvfs(full).f_bavail * os.statvfs(full).f_frsize
    with open(full / "filler", "wb") as f:  # leave half a checkpoint free
        f.write(b"\0" * max(free - size // 2, 0))
    verdict |= save_on_full_disk("precheck", policy, run_dir, 2)  # refused before writing: the size is known
    verdict |= save_on_full_disk("midwrite", policy, full / "fresh", 1)  # a first save: it runs out while writing
    (out / "disk.json").write_text(json.dumps(verdict))


def sigint(policy, out: Path) -> None:
    Interruptible().install()
    run_dir = out / "run"
    save(policy, run_dir, 1)
    real_save = dist_checkpointing.save

    def save_then_wait(state, folder, *args, **kwargs):  # stop inside the staging folder, its shards written
        real_save(state, folder, *args, **kwargs)
        (out / "staged").write_text(folder)
        time.sleep(120)

    dist_checkpointing.save = save_then_wait
    save(policy, run_dir, 2)
    print("the save returned: the second Ctrl-C did not abort", flush=True)


if __name__ == "__main__":  # dist_checkpointing spawns
    out = Path(sys.argv[1])
    policy = Policy.build(SHAPE, dtype="fp32", transformer_impl="local", lr=1e-3)
    policy.optimizer.step()  # Adam state to save
    if len(sys.argv) > 2:
        disk(policy, out, Path(sys.argv[2]))
    sigint(policy, out)
