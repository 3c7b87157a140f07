"""HF <-> Megatron conversion: name/shape mapping, loading HF weights into a live sharded model, streaming export.

- `mapping`: per-weight HF <-> Megatron mapping and the TP shard / unshard rules (Qwen2/3, Llama, Mistral; Mixtral and
  Qwen3-MoE experts under global indices, whole per EP rank).
- `load.load_hf_weights(chunks, hf_dir)`: each rank reads only its own shards from the safetensors files.
- `export.export_hf_stream(chunks, shape, bucket_bytes=...)`: buckets of (hf_name, full tensor) from a live model;
  `export.save_hf(...)`: the same stream written as an HF folder.
- `cli.main(argv)`: `justrl-convert hf-to-mcore | mcore-to-hf | verify`.
"""

from .export import export_hf_stream, save_hf
from .load import load_hf_weights

__all__ = ["export_hf_stream", "load_hf_weights", "save_hf"]
