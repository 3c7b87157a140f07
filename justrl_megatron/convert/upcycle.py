"""Sparse upcycling (`justrl-convert upcycle`): a dense Llama-family HF folder -> a Mixtral HF folder whose every MLP
is copied into E experts, with a router that starts neutral.

The router weights are zero, so every token's router logits are equal: softmax gives each expert 1/E, top-k picks k
of them and Mixtral renormalises their weights to 1/k each. The k chosen experts are copies of the same MLP, so the
layer computes sum_k (1/k) MLP(x) = MLP(x): the upcycled model computes what the dense one does (tests: logits equal).
Training then moves the experts apart: the load-balancing loss is the router's first gradient (with identical
experts the policy loss gives it none), which makes routing depend on the token, and the experts it newly picks get
their own updates.

Only tensors are renamed and copied: no model is built, memory stays at one tensor at a time plus one output shard.
Llama and Mistral (no sliding window) map onto Mixtral's attention exactly; a model whose attention Mixtral lacks
(Qwen2's qkv bias, Qwen3's q/k norm, biases anywhere) is refused by name.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
_MLP = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # Mixtral's expert names for the dense MLP's


class UpcycleError(ValueError):
    """The input cannot be upcycled (said before any tensor is written)."""


def mixtral_config(dense_dir: str | os.PathLike, experts: int, top_k: int, aux_loss_coef: float) -> dict:
    """config.json of the upcycled model: the dense model's fields that MixtralConfig has, plus the MoE ones."""
    from transformers import AutoConfig, MixtralConfig

    if experts < 2:
        raise UpcycleError(f"--experts must be >= 2, got {experts}")
    if not 1 <= top_k <= experts:
        raise UpcycleError(f"--top-k must be in 1..--experts ({experts}), got {top_k}")
    if not aux_loss_coef >= 0:
        raise UpcycleError(f"--aux-loss-coef must be >= 0, got {aux_loss_coef}")
    dense = AutoConfig.from_pretrained(dense_dir)
    arch = (getattr(dense, "architectures", None) or ["?"])[0]
    if arch not in DENSE_ARCHITECTURES:
        why = {"Qwen2ForCausalLM": " (its q/k/v projections have biases; Mixtral's have none)",
               "Qwen3ForCausalLM": " (its attention has q/k norms; Mixtral's has none)"}.get(arch, "")
        raise UpcycleError(f"{dense_dir}: {arch} cannot be upcycled to Mixtral{why}; supported: "
                           f"{', '.join(DENSE_ARCHITECTURES)}")
    fields = dense.to_dict()
    for flag in ("attention_bias", "mlp_bias"):
        if fields.get(flag):
            raise UpcycleError(f"{dense_dir}: {flag}=true; Mixtral has no biases, so the upcycled model would differ")
    if fields.get("pretraining_tp", 1) != 1:
        raise UpcycleError(f"{dense_dir}: pretraining_tp={fields['pretraining_tp']} (only 1 maps exactly)")
    if fields.get("sliding_window") is not None:
        raise UpcycleError(f"{dense_dir}: sliding_window={fields['sliding_window']} is not supported")
    own = set(MixtralConfig().to_dict()) - {"architectures", "model_type", "transformers_version", "_name_or_path"}
    out = {k: v for k, v in fields.items() if k in own}
    out.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=experts,
               num_experts_per_tok=top_k, router_aux_loss_coef=aux_loss_coef, output_router_logits=False,
               router_jitter_noise=0.0, sliding_window=None)
    MixtralConfig(**{k: v for k, v in out.items() if k not in ("architectures", "model_type")})  # it must load
    return out


def upcycled_tensors(dense_dir: str | os.PathLike, experts: int):
    """(name, tensor) of the upcycled model, one at a time, in the dense files' order: each MLP weight E times under
    Mixtral's expert names, then each layer's zero router after its MLP."""
    from safetensors import safe_open

    files = sorted(Path(dense_dir).glob("*.safetensors"))
    if not files:
        raise UpcycleError(f"{dense_dir}: no *.safetensors files")
    routers: dict[int, tuple[int, torch.dtype]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                parts = name.split(".")
                if len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[3] == "mlp" and parts[4] in _MLP:
                    layer, tensor = int(parts[2]), sf.get_tensor(name)
                    for e in range(experts):
                        yield (f"model.layers.{layer}.block_sparse_moe.experts.{e}.{_MLP[parts[4]]}.weight",
                               tensor.clone())
                    if parts[4] == "gate_proj":
                        routers[layer] = (tensor.shape[1], tensor.dtype)
                elif ".mlp." in name:
                    raise UpcycleError(f"{dense_dir}: unexpected MLP tensor {name} (only gate/up/down_proj.weight)")
                else:
                    yield name, sf.get_tensor(name)
    for layer, (hidden, dtype) in sorted(routers.items()):
        yield f"model.layers.{layer}.block_sparse_moe.gate.weight", torch.zeros(experts, hidden, dtype=dtype)


def upcycle(dense_dir: str | os.PathLike, out_dir: str | os.PathLike, experts: int, top_k: int,
            aux_loss_coef: float = 0.01, shard_bytes: int = 2 << 30) -> Path:
    """Write the upcycled folder into `out_dir` (which must exist and be empty): sharded safetensors (+ index when
    more than one shard), config.json, and the dense folder's tokenizer / generation files copied as they are."""
    from safetensors.torch import save_file

    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    config = mixtral_config(dense_dir, experts, top_k, aux_loss_coef)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    written: list[tuple[str, list[str]]] = []

    def flush() -> None:
        name = f"model-{len(written) + 1:05d}.safetensors"
        save_file(shards[0], str(out_dir / name), metadata={"format": "pt"})
        written.append((name, list(shards[0])))
        shards[0] = {}

    for name, tensor in upcycled_tensors(dense_dir, experts):
        nbytes = tensor.numel() * tensor.element_size()
        if shards[0] and size + nbytes > shard_bytes:
            flush()
            size = 0
        shards[0][name] = tensor
        size += nbytes
    flush()
    if len(written) == 1:
        os.replace(out_dir / written[0][0], out_dir / "model.safetensors")
    else:
        total = sum((out_dir / n).stat().st_size for n, _ in written)
        index = {"metadata": {"total_size": total},
                 "weight_map": {t: n for n, names in written for t in names}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    for f in dense_dir.iterdir():  # tokenizer, chat template, generation config
        if f.is_file() and f.name != "config.json" and not f.name.startswith("model") and f.suffix != ".safetensors":
            shutil.copy2(f, out_dir / f.name)
    return out_dir
