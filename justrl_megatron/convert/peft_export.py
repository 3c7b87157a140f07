"""A trained LoRA policy as a PEFT adapter folder (`justrl-convert lora-export`): the adapters under PEFT's names for
the HF model and its adapter_config.json. Here and not in model/lora.py because splitting the fused linears' B rows
into HF modules is the converter's mapping (convert/mapping.py)."""

from __future__ import annotations

import torch

from ..model.lora import HF_MODULES, adapters, tp_shards
from .mapping import Entry, shards_to_hf


def peft_state(chunks, shape) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's names for the HF model (`base_model.model.model.layers.<i>.self_attn.q_proj.lora_A
    .weight`, ...): B's rows of the fused qkv / [gate; up] split as the converter splits W (mapping.shards_to_hf), A
    shared by the HF modules of one fused linear (exact: B_q A x, B_k A x, B_v A x are the rows of B A x)."""
    out = {}
    for (index, target), adapter in sorted(adapters(chunks).items()):
        kind = {"qkv": "qkv", "fc1": "fc1"}.get(target, "row")
        a_shards, b_shards = tp_shards(adapter, "lora_A"), tp_shards(adapter, "lora_B")
        if adapter.column:
            a, bs = [a_shards[0]], shards_to_hf(Entry("", (), kind), b_shards, shape)
        else:
            a, bs = shards_to_hf(Entry("", (), "row"), a_shards, shape), [b_shards[0]]
        for n, module in enumerate(HF_MODULES[target]):
            prefix = f"base_model.model.model.layers.{index}.{module}."
            out[prefix + "lora_A.weight"] = a[0].clone()  # own storage: safetensors refuses shared tensors
            out[prefix + "lora_B.weight"] = bs[n if adapter.column else 0].contiguous()
    return out


def peft_config(lora: dict, base_model: str | None) -> dict:
    """adapter_config.json of a PEFT LoRA adapter with these settings."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(lora["rank"]), "lora_alpha": lora["alpha"],
            "lora_dropout": float(lora.get("dropout", 0.0)), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "inference_mode": True, "modules_to_save": None,
            "target_modules": sorted(m.rsplit(".", 1)[1] for t in lora["targets"] for m in HF_MODULES[t]),
            "base_model_name_or_path": base_model}

