"""Training checkpoints live in `justrl_megatron/checkpoint.py` (below convert/ and train/). This name stays only for
`from .checkpoint import load_latest_checkpoint, save_checkpoint` in train/loop.py; import from ..checkpoint instead."""

from ..checkpoint import load_latest_checkpoint, save_checkpoint  # noqa: F401
