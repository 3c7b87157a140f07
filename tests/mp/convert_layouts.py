"""4-process gloo job: HF -> live Megatron at TP1 / TP2 / PP2 / TP2xPP2 / PP2xVPP2 -> streaming export, per tiny model.

Run by tests/test_convert.py under torchrun: python convert_layouts.py OUT family=HF_DIR [family=HF_DIR ...]
Per layout every rank loads the HF weights into its shards (`load_hf_weights`), exports the live model with
`export_hf_stream` (small buckets, so TP all-gathers and PP broadcasts are exercised) and compares every tensor it
receives with the original safetensors, bitwise; the last pipeline stage compares its logits with transformers'.
At TP2xPP2 it also writes a dist checkpoint (OUT/mcore_<family>) that the test converts back with the CLI.
Each rank writes OUT/rank{r}.json.
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import json
import os
import sys

import torch
import torch.distributed as dist

from justrl_megatron.checkpoint import layout_meta, save_model, write_meta
from justrl_megatron.convert import export_hf_stream, load_hf_weights
from justrl_megatron.convert.load import SafetensorsFolder
from justrl_megatron.convert.mapping import model_entries
from justrl_megatron.convert.verify import hf_logits, megatron_logits, random_tokens
from justrl_megatron.distributed import init_distributed, init_model_parallel
from justrl_megatron.model.build import build_model_chunks
from justrl_megatron.model.hf_config import model_shape, transformer_config

LAYOUTS = {"tp1": (1, 1, None), "tp2": (2, 1, None), "pp2": (1, 2, None), "tp2pp2": (2, 2, None),
           "pp2vpp2": (1, 2, 2)}
BUCKET_BYTES = 128 << 10  # small: many buckets, several owners per bucket


def original(hf_dir):
    files = SafetensorsFolder(hf_dir)
    return {n: files.read(n, None, 0, 0) for n in sorted(files.names())}


def check_layout(hf_dir, shape, ref, ref_logits, tokens, tp, pp, vpp, out, family):
    from megatron.core import parallel_state as ps

    torch.manual_seed(99)  # random init differs from the HF weights: the loader must overwrite everything
    chunks = build_model_chunks(shape, transformer_config(shape, tp=tp, pp=pp, vpp=vpp), transformer_impl="local")
    n_set = load_hf_weights(chunks, hf_dir, progress=False)

    entry_of = {n: e.mcore for e in model_entries(shape) for n in e.hf}
    entry_of.setdefault("lm_head.weight", "embedding.word_embeddings.weight")  # the tied copy travels with it
    got, buckets = {}, []
    for bucket in export_hf_stream(chunks, shape, bucket_bytes=BUCKET_BYTES, include_tied_lm_head=True):
        buckets.append((sum(t.numel() * t.element_size() for _, t in bucket), len({entry_of[n] for n, _ in bucket})))
        for name, t in bucket:
            assert name not in got, f"{name} exported twice"
            got[name] = t.clone()
    expected = dict(ref)
    if shape.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        expected["lm_head.weight"] = ref["model.embed_tokens.weight"]  # asked for with include_tied_lm_head
    mismatched = sorted(n for n in expected if n in got and not torch.equal(got[n], expected[n]))
    verdict = {
        "params_set": n_set,
        "missing": sorted(set(expected) - set(got)),
        "unexpected": sorted(set(got) - set(expected)),
        "mismatched": mismatched,
        "n_tensors": len(got),
        "buckets": buckets,  # (bytes, number of Megatron weights in it)
        "bucket_bytes": BUCKET_BYTES,
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "n_chunks": len(chunks),
    }
    logits = megatron_logits(chunks, tokens, shape.vocab_size)
    if logits is not None:
        verdict["logit_diff"] = (logits - ref_logits).abs().max().item()
        verdict["logit_scale"] = ref_logits.abs().max().item()
    if (tp, pp, vpp) == (2, 2, None):
        path = os.path.join(out, f"mcore_{family}")
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        save_model(chunks, path)
        if dist.get_rank() == 0:
            write_meta(path, layout_meta(chunks, shape, kind="test"), hf_source=hf_dir)
        dist.barrier()
    return verdict


def main(out, models):
    from transformers import AutoConfig

    rank, _ = init_distributed()
    verdicts = {}
    inputs = {}
    for family, hf_dir in models.items():
        shape = model_shape(AutoConfig.from_pretrained(hf_dir))
        tokens = random_tokens(shape.vocab_size, batch=2, seq_len=24, seed=3)
        inputs[family] = (shape, original(hf_dir), hf_logits(hf_dir, tokens), tokens)
    # layouts outermost: megatron's groups are built once per layout (each build creates every group anew, and 4
    # gloo ranks on 2 cores pay for each), not once per family and layout
    for name, (tp, pp, vpp) in LAYOUTS.items():
        init_model_parallel(tp=tp, pp=pp, vpp=vpp, seed=1234)
        for family, hf_dir in models.items():
            shape, ref, ref_logits, tokens = inputs[family]
            verdicts[f"{family}/{name}"] = check_layout(hf_dir, shape, ref, ref_logits, tokens, tp, pp, vpp, out,
                                                        family)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(verdicts, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], dict(arg.split("=", 1) for arg in sys.argv[2:]))
