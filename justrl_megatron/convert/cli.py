"""`justrl-convert`: HF <-> Megatron dist checkpoints, and a logits check between the two.

  justrl-convert hf-to-mcore --hf DIR --out DIR [--tp N --pp N --vpp N --ep N --dtype bf16]
  justrl-convert mcore-to-hf --ckpt DIR --out DIR [--dtype bf16]
  justrl-convert verify --hf DIR --ckpt DIR [--tol 1e-3]
  justrl-convert lora-export --ckpt DIR --out DIR [--merged DIR] [--base HF_DIR]
  justrl-convert upcycle --hf DIR --out DIR --experts E --top-k K [--aux-loss-coef 0.01]

`lora-export` takes a LoRA training checkpoint (adapters only) and writes a PEFT adapter folder (adapter_config.json +
adapter_model.safetensors, for `peft.PeftModel.from_pretrained` on the base model) and, with --merged, the merged HF
model (W + scale * B A). One process; the base model defaults to the one the run trained on.

`upcycle` turns a dense Llama / Mistral HF folder into a Mixtral one: every MLP copied into E experts, a zero
(neutral) router, top-K renormalised, so the new model computes exactly what the dense one did (convert/upcycle.py).
One process; tensors are copied one at a time.

Each runs as one process, or under torchrun (world = a multiple of tp x pp and of ep x pp) to shard the work: every
rank then reads only its own slices of the HF files and writes only its own shards (`--ep`: an MoE model's experts,
whole, over that many ranks). A dist checkpoint holds global tensors, so one
written at any layout loads at any other; `--tp` also sets the vocab padding (a multiple of
make_vocab_size_divisible_by x TP) and is checked against the heads / query groups before any work starts.
`--ckpt` takes a converter output, a training checkpoint step folder, or a training run folder (its latest step).

`--out` is never an input, inside one, or a folder holding one (symlinks resolved), with or without `--force`. The
output is written into a temporary sibling (`.NAME.justrl-convert-tmp.XXXXXX`, new for each run) and renamed into
place when complete, so a failed run leaves an existing output as it was, and `--force` replaces it only with a
finished one. The converter removes no folder it did not create in the same run (other than the --out it replaces).
"""

from __future__ import annotations

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from megatron.core import parallel_state as ps

from ..checkpoint import (HF_SUBDIR, STEP_PREFIX, checkpoint_problem, find_checkpoint, layout_meta, load_model,
                          newest_intact_step, read_meta, save_model, write_meta)
from ..dtypes import DTYPES
from ..model.hf_config import check_parallel_layout


class UsageError(Exception):
    """A problem with the inputs, found before any work: printed without a traceback."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="justrl-convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def layout(s, tp_help):
        s.add_argument("--tp", type=int, default=1, help=tp_help)
        s.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
        s.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank (needs --pp > 1)")
        s.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE models; under torchrun)")

    s = sub.add_parser("hf-to-mcore", help="HF folder -> megatron dist checkpoint")
    s.add_argument("--hf", required=True, help="HF model folder (config.json + *.safetensors)")
    s.add_argument("--out", required=True, help="output checkpoint folder")
    layout(s, "tensor parallel size (sets the vocab padding; the checkpoint loads at any TP)")
    s.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="parameter dtype (default: the HF config's)")
    s.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    s.add_argument("--force", action="store_true", help="overwrite a non-empty --out")

    s = sub.add_parser("mcore-to-hf", help="megatron dist checkpoint -> HF folder (transformers / vLLM)")
    s.add_argument("--ckpt", required=True, help="converter output, training step folder, or training run folder")
    s.add_argument("--out", required=True, help="output HF folder")
    s.add_argument("--hf-config", default=None, help="HF folder with config/tokenizer, if the checkpoint has none")
    layout(s, "tensor parallel size to load at (under torchrun)")
    s.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="exported dtype (default: the checkpoint's)")
    s.add_argument("--shard-size-mb", type=int, default=2048, help="max size of one safetensors file")
    s.add_argument("--force", action="store_true", help="overwrite a non-empty --out")

    s = sub.add_parser("verify", help="max |logit diff| between an HF model and a Megatron checkpoint (both run in "
                                      "fp32 on the checkpoint's weights precision)")
    s.add_argument("--hf", required=True)
    s.add_argument("--ckpt", required=True)
    layout(s, "tensor parallel size to run Megatron at (under torchrun)")
    s.add_argument("--tol", type=float, default=1e-3, 
                   help="fail above this max |logit diff| (fp32; at ~30 layers fp32 noise alone is ~1e-4)")
    s.add_argument("--batch", type=int, default=2)
    s.add_argument("--seq-len", type=int, default=32)
    s.add_argument("--seed", type=int, default=0)

    s = sub.add_parser("lora-export", help="LoRA training checkpoint -> PEFT adapter folder (and a merged HF model)")
    s.add_argument("--ckpt", required=True, help="LoRA training step folder, or its run folder (latest step)")
    s.add_argument("--out", required=True, help="output PEFT adapter folder")
    s.add_argument("--merged", default=None, help="also write the merged HF model here")
    s.add_argument("--base", default=None, help="the base HF model (default: the one recorded in the checkpoint)")
    s.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="merged model dtype (default: the run's)")
    s.add_argument("--force", action="store_true", help="overwrite non-empty outputs")

    s = sub.add_parser("upcycle", help="dense Llama/Mistral HF folder -> Mixtral HF folder (E copies of each MLP, "
                                       "neutral router): the same function, ready for MoE training")
    s.add_argument("--hf", required=True, help="dense HF model folder")
    s.add_argument("--out", required=True, help="output HF folder (Mixtral)")
    s.add_argument("--experts", type=int, required=True, help="experts per layer (E >= 2)")
    s.add_argument("--top-k", type=int, required=True, help="experts per token (1..E)")
    s.add_argument("--aux-loss-coef", type=float, default=0.01,
                   help="router_aux_loss_coef in the new config (the load-balancing loss's weight in training)")
    s.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    return p


# --- checks that run before any work ----------------------------------------------------------------------------------

def _hf_shape(hf_dir: str | os.PathLike, what: str = "--hf"):
    from transformers import AutoConfig

    from ..model.hf_config import model_shape

    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").exists():
        raise UsageError(f"{what} {hf_dir}: no config.json (expected a Hugging Face model folder)")
    try:
        config = AutoConfig.from_pretrained(hf_dir)
    except (OSError, ValueError) as exc:  # not JSON, or not a config transformers knows
        raise UsageError(f"{what} {hf_dir}/config.json: {str(exc).splitlines()[0]}") from None
    try:
        return model_shape(config), config
    except ValueError as exc:
        raise UsageError(f"{what} {hf_dir}: {exc}") from None


def _check_layout(shape, tp: int, pp: int, vpp: int | None, ep: int = 1) -> None:
    if tp < 1 or pp < 1 or (vpp is not None and (vpp < 1 or pp == 1)):
        raise UsageError(f"invalid layout tp={tp} pp={pp} vpp={vpp} (vpp needs pp > 1)")
    problems = check_parallel_layout(shape, tp, pp, vpp, ep, names=("--tp", "--pp", "--vpp"), ep_name="--ep")
    if problems:
        raise UsageError("; ".join(problems))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and world % (tp * pp):
        raise UsageError(f"world size {world} is not divisible by tp x pp = {tp} x {pp}")
    if world > 1 and world % (ep * pp):
        raise UsageError(f"world size {world} is not divisible by ep x pp = {ep} x {pp}")


def _check_out(out: str, force: bool, inputs: dict[str, str | os.PathLike | None]) -> None:
    """--out must not overlap any input (`inputs`: option name -> path), whatever --force says."""
    path = Path(out)
    target = path.resolve()
    for name, value in inputs.items():
        if value is None:
            continue
        source = Path(value).resolve()
        if target == source:
            raise UsageError(f"--out {out} is the {name} input itself; write the output somewhere else")
        if target in source.parents:
            raise UsageError(f"--out {out} contains the {name} input {value}; replacing it would delete the input; "
                             f"write the output somewhere else")
        if source in target.parents:
            raise UsageError(f"--out {out} lies inside the {name} input {value}; write the output somewhere else")
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {out} exists and is not a folder")
    if path.exists() and any(path.iterdir()) and not force:
        raise UsageError(f"--out {out} is not empty (pass --force to overwrite)")


STAGING_SUFFIX = ".justrl-convert-tmp"  # .NAME.justrl-convert-tmp.XXXXXX: the folder an output is written into


def _staging(out: str | os.PathLike) -> Path:
    """A new, empty staging folder beside --out, created by this invocation (rank 0 makes it; every rank gets its
    name). Its name is unique: a folder already there (an input named like a staging folder, or the leftover of a
    run that died) is never reused, so never deleted."""
    out = Path(out)
    name = [None]
    if _rank0():
        out.parent.mkdir(parents=True, exist_ok=True)
        name[0] = tempfile.mkdtemp(prefix=f".{out.name}{STAGING_SUFFIX}.", dir=out.parent)
        leftovers = [p for p in out.parent.glob(f".{out.name}{STAGING_SUFFIX}*") if str(p) != name[0]]
        if leftovers:
            _say(f"note: {len(leftovers)} staging folder(s) of earlier conversions are beside --out (e.g. "
                 f"{leftovers[0]}); remove them once no conversion writes there")
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.broadcast_object_list(name, src=0)
    return Path(name[0])


@contextlib.contextmanager
def _staged_output(out: str | os.PathLike):
    """All ranks: yields a fresh, empty staging folder (made by this invocation) to write into; on success it replaces
    --out (an old output, with --force, is removed only after the rename). On failure --out is left as it was; a
    single process also removes the staging folder (under torchrun the other ranks may still write into it). Nothing
    this invocation did not create is ever removed, except the --out that --force replaces."""
    out = Path(out)
    tmp = _staging(out)
    _barrier()
    try:
        yield tmp
    except BaseException:
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()
    if _rank0():
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.justrl-convert-old.", dir=out.parent))
            os.replace(out, old)  # (onto the empty folder just made: a name nobody else uses)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    _barrier()


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A dist checkpoint folder: the path itself, or the latest step of a training run folder."""
    found = find_checkpoint(path)
    if found is None:
        raise UsageError(f"--ckpt {path}: not a megatron dist checkpoint (no metadata.json) nor a training run folder "
                         f"with a complete checkpoint")
    problem = checkpoint_problem(found, training=False)
    if problem is not None:
        hint = ""
        if found.name.startswith(STEP_PREFIX) and found.parent.name == "checkpoints":
            older = newest_intact_step(found.parent.parent, below=int(found.name[len(STEP_PREFIX):]))
            if older is not None:
                hint = f"; the newest intact one is {found.parent / f'{STEP_PREFIX}{older:08d}'}: pass it as --ckpt"
        raise UsageError(f"--ckpt {path}: {found} is damaged: {problem}{hint}")
    return found


def _ckpt_hf_dir(ckpt: Path, override: str | None) -> Path:
    if override:
        return Path(override)
    if (ckpt / HF_SUBDIR / "config.json").exists():
        return ckpt / HF_SUBDIR
    raise UsageError(f"{ckpt} holds no HF config ({HF_SUBDIR}/config.json); pass --hf-config DIR "
                     f"(an HF folder of the same architecture)")


# --- shared set-up ----------------------------------------------------------------------------------------------------

def _setup(shape, tp: int, pp: int, vpp: int | None, dtype: torch.dtype, divisible_by: int = 128,
           impl: str = "auto", ep: int = 1):
    """torch.distributed + megatron groups + the model chunks. Single process: TP1 PP1 EP1 (vocab padded as for
    `tp`)."""
    from ..distributed import init_distributed, init_model_parallel
    from ..model.build import build_model_chunks
    from ..model.hf_config import transformer_config

    _, world = init_distributed()
    pad_tp = tp
    if world == 1:
        tp, pp, vpp, ep = 1, 1, None, 1
    init_model_parallel(tp=tp, pp=pp, vpp=vpp, seed=1234, ep=ep)
    config = transformer_config(shape, tp=tp, pp=pp, vpp=vpp, ep=ep, dtype=dtype)
    chunks = build_model_chunks(shape, config, transformer_impl=impl,
                                make_vocab_size_divisible_by=divisible_by * pad_tp // tp)
    return chunks


def _rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _say(msg: str) -> None:
    if _rank0():
        print(msg, flush=True)


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _hf_dtype(config) -> torch.dtype:
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return dt if isinstance(dt, torch.dtype) else DTYPES.get(str(dt), torch.float32)


# --- subcommands ------------------------------------------------------------------------------------------------------

def hf_to_mcore(args) -> int:
    from .load import SafetensorsFolder, load_hf_weights, weights_problem

    shape, config = _hf_shape(args.hf)
    _check_layout(shape, args.tp, args.pp, args.vpp, args.ep)
    _check_out(args.out, args.force, {"--hf": args.hf})
    try:  # shards, headers and shapes, before any model is built
        problem = weights_problem(SafetensorsFolder(args.hf), shape)
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    if problem is not None:
        raise UsageError(f"--hf {args.hf}: {problem}")
    dtype = DTYPES[args.dtype] if args.dtype else _hf_dtype(config)

    chunks = _setup(shape, args.tp, args.pp, args.vpp, dtype, args.make_vocab_size_divisible_by, ep=args.ep)
    load_hf_weights(chunks, args.hf)
    out = Path(args.out)
    _say(f"saving dist checkpoint to {out}")
    with _staged_output(out) as tmp:
        save_model(chunks, tmp)
        if _rank0():
            meta = layout_meta(chunks, shape, kind="hf-to-mcore", source=str(Path(args.hf).resolve()),
                               target_tp=args.tp, target_pp=args.pp, target_vpp=args.vpp, target_ep=args.ep,
                               make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
            write_meta(tmp, meta, hf_source=args.hf)
    _say(f"done: {out} ({shape.family}, {shape.num_layers} layers, {str(dtype).removeprefix('torch.')}; "
         f"loads at any TP/PP/EP, vocab padded for TP={args.tp})")
    return 0


def mcore_to_hf(args) -> int:
    from .export import save_hf

    ckpt = resolve_checkpoint(args.ckpt)
    hf_dir = _ckpt_hf_dir(ckpt, args.hf_config)
    shape, config = _hf_shape(hf_dir, "HF config")
    meta = read_meta(ckpt)
    if meta.get("lora"):
        raise UsageError(f"{ckpt} holds LoRA adapters only (the base weights stay in {meta.get('base_model')}): "
                         f"use `justrl-convert lora-export --ckpt {args.ckpt} --out ADAPTER_DIR --merged HF_DIR`")
    if meta.get("shape") and meta["shape"]["family"] != shape.family:
        raise UsageError(f"{ckpt} holds a {meta['shape']['family']} model but {hf_dir} is {shape.family}")
    _check_layout(shape, args.tp, args.pp, args.vpp, args.ep)
    _check_out(args.out, args.force, {"--ckpt": args.ckpt, "checkpoint": ckpt, "--hf-config": args.hf_config})
    ckpt_dtype = DTYPES.get(meta.get("dtype", ""), _hf_dtype(config))
    export_dtype = DTYPES[args.dtype] if args.dtype else ckpt_dtype

    chunks = _setup(shape, args.tp, args.pp, args.vpp, ckpt_dtype, ep=args.ep)
    _say(f"loading {ckpt}")
    load_model(chunks, ckpt)
    with _staged_output(args.out) as tmp:
        save_hf(chunks, shape, tmp, hf_dir, dtype=export_dtype, bucket_bytes=args.shard_size_mb << 20)
    _say(f"done: {args.out} (loadable by transformers and vLLM)")
    return 0


def lora_export(args) -> int:
    from safetensors.torch import save_file

    from ..model import lora
    from . import peft_export
    from .export import save_hf
    from .load import load_hf_weights

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("lora-export runs as one process (the adapters are small): run it without torchrun")
    ckpt = resolve_checkpoint(args.ckpt)
    meta = read_meta(ckpt)
    settings = meta.get("lora")
    if not settings:
        raise UsageError(f"{ckpt} is not a LoRA checkpoint (its metadata has no lora settings): use mcore-to-hf")
    base = args.base or meta.get("base_model")
    if not base or not (Path(base) / "config.json").exists():
        raise UsageError(f"the base model {base!r} recorded in {ckpt} is not an HF folder here: pass --base HF_DIR")
    shape, config = _hf_shape(base, "--base")
    _check_out(args.out, args.force, {"--ckpt": args.ckpt, "checkpoint": ckpt, "--base": base})
    if args.merged:
        _check_out(args.merged, args.force, {"--ckpt": args.ckpt, "checkpoint": ckpt, "--base": base,
                                             "--out": args.out})
    dtype = DTYPES.get(meta.get("dtype", ""), _hf_dtype(config))

    chunks = _setup(shape, 1, 1, None, dtype, impl="local")
    load_hf_weights(chunks, base, progress=False)
    lora.apply_lora(chunks, rank=settings["rank"], alpha=settings["alpha"], dropout=settings.get("dropout", 0.0),
                    targets=settings["targets"])
    _say(f"loading adapters from {ckpt}")
    load_model(chunks, ckpt)
    with _staged_output(args.out) as tmp:
        save_file(peft_export.peft_state(chunks, shape), str(tmp / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        adapter_config = peft_export.peft_config(settings, str(Path(base).resolve()))
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    _say(f"done: {args.out} (peft.PeftModel.from_pretrained(base model, '{args.out}'))")
    if args.merged:
        with _staged_output(args.merged) as tmp:
            save_hf(chunks, shape, tmp, base, dtype=DTYPES[args.dtype] if args.dtype else dtype, progress=False)
        _say(f"done: {args.merged} (merged weights, loadable by transformers and vLLM)")
    return 0


def verify(args) -> int:
    from .verify import hf_logits, megatron_logits, random_tokens

    shape, _ = _hf_shape(args.hf)
    ckpt = resolve_checkpoint(args.ckpt)
    meta = read_meta(ckpt)
    if meta.get("shape"):
        import dataclasses

        # a field a checkpoint's metadata lacks was written before it existed: it had the default (plain RoPE, ...)
        defaults = {f.name: f.default for f in dataclasses.fields(shape) if f.default is not dataclasses.MISSING}
        theirs = {**defaults, **{k: v for k, v in meta["shape"].items() if k != "init_std"}}
        ours = {k: v for k, v in shape.__dict__.items() if k != "init_std"}
        diff = {k: (theirs.get(k), v) for k, v in ours.items() if theirs.get(k) != v}
        if diff:
            raise UsageError(f"architectures differ between {ckpt} and {args.hf}: "
                             + ", ".join(f"{k}: ckpt {a} vs hf {b}" for k, (a, b) in diff.items()))
    _check_layout(shape, args.tp, args.pp, args.vpp, args.ep)

    chunks = _setup(shape, args.tp, args.pp, args.vpp, torch.float32, ep=args.ep)
    load_model(chunks, ckpt)
    tokens = random_tokens(shape.vocab_size, args.batch, args.seq_len, args.seed)
    ours = megatron_logits(chunks, tokens, shape.vocab_size)
    diff = torch.zeros(1, dtype=torch.float64)
    if ours is not None and ps.get_tensor_model_parallel_rank() == 0:
        ref = hf_logits(args.hf, tokens, weight_dtype=DTYPES.get(meta.get("dtype", ""), torch.float32))
        diff[0] = (ours - ref).abs().max().item()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(diff, op=torch.distributed.ReduceOp.MAX)
    value = float(diff[0])
    ok = value <= args.tol
    _say(json.dumps({"max_abs_logit_diff": value, "tol": args.tol, "ok": ok, "tokens": list(tokens.shape)}))
    return 0 if ok else 1


def upcycle(args) -> int:
    from .upcycle import UpcycleError, mixtral_config, upcycle as write_upcycled

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("upcycle runs as one process (it only copies tensors): run it without torchrun")
    hf = Path(args.hf)
    if not (hf / "config.json").exists():
        raise UsageError(f"--hf {hf}: no config.json (expected a Hugging Face model folder)")
    _check_out(args.out, args.force, {"--hf": args.hf})
    try:
        mixtral_config(hf, args.experts, args.top_k, args.aux_loss_coef)  # every refusal before any writing
        with _staged_output(args.out) as tmp:
            write_upcycled(hf, tmp, args.experts, args.top_k, args.aux_loss_coef)
    except UpcycleError as exc:
        raise UsageError(str(exc)) from None
    _say(f"done: {args.out} (Mixtral, {args.experts} experts, top-{args.top_k}; computes what {hf} does)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    command = {"hf-to-mcore": hf_to_mcore, "mcore-to-hf": mcore_to_hf, "verify": verify,
               "lora-export": lora_export, "upcycle": upcycle}[args.command]
    try:
        code = command(args)
    except UsageError as exc:  # found before any work, alike on every rank
        print(f"justrl-convert {args.command}: error: {exc}", file=sys.stderr)
        return 2
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        parallel_state = sys.modules.get("megatron.core.parallel_state")
        if parallel_state is not None and parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()  # its groups die with the process group: none may outlive it
        torch.distributed.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
