"""2-process gloo job: exact resume and resharding of training checkpoints (model, Adam, LR schedule, RNG, data).

Run by tests/test_checkpoint.py under torchrun: python ckpt_resume.py OUT HF_DIR
Real megatron pieces throughout: GPTModel (tiny Qwen2 from HF), megatron DDP, get_megatron_optimizer (Adam, grad clip),
OptimizerParamScheduler (warmup + cosine, so every step has a different LR), megatron's forward/backward schedule.
Every step also draws from python `random`, numpy, torch and megatron's model-parallel RNG tracker (the draws decide
the batch, or are recorded), so a resume that misses any RNG state shows up.

Scenarios (weights compared through `export_hf_stream`, i.e. as full HF tensors, so layouts are comparable):
  A  straight: TP2, 4 steps.
  B  split: TP2, 2 steps, save, a save "killed" before commit + junk temp folder, fresh model (other init, other
     seeds), load latest, 2 steps -> bitwise equal to A (weights, LR, RNG draws, data position).
  C  reshard the TP2 step-2 checkpoint to TP1 (DP2) and to PP2: weights and Adam moments bitwise equal to A's at
     step 2; then 2 more steps, compared to A with a tolerance (grads differ ~1e-8 across layouts).
  D  distributed optimizer (TP1, DP2), its sharded (dp_reshardable) format written asynchronously (two more steps
     run while it is written): exact resume at the same layout (weights, loss and grad norm of the next steps
     bitwise); a resume at TP2 is refused in one line naming the way out; a checkpoint in the former format
     (fully_reshardable, no content metadata) still loads, also at TP2.
  G  another DP size: the `dp1` phase (one process, run first by the test: python ckpt_resume.py OUT HF_DIR dp1)
     trains at DP1 with the distributed optimizer, saves step 2 asynchronously, trains to step 4, then starts an async
     save of step 4 and is SIGKILLed while it is written. Here (DP2): the next start removes the dead staging folder,
     `latest` is still step 2, which loads bitwise (weights) and trains on within Adam's noise of DP1's steps 3-4.
  E  retention: keep_last=2 after saving steps 2, 3, 4.
  F  damage: steps 2 and 3 saved, one shard of step 3 truncated: auto resumes step 2 on both ranks (w2), with a
     warning naming the file; strict raises CheckpointError naming it on every rank. Without a manifest (a checkpoint
     from before them) the truncation is found through the checkpoint's own index; a shard overwritten with zeros
     (same size) only by loading it, which fails on the rank that reads it: both ranks still fall back together.
Each rank writes OUT/rank{r}.json; rank 0 writes OUT/w4.safetensors (A's final weights) for the CLI test.
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import json
import os
import random
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from justrl_megatron import checkpoint as ckpt
from justrl_megatron.checkpoint import save as ckpt_save
from justrl_megatron.checkpoint import state as ckpt_state
from justrl_megatron.convert import export_hf_stream, load_hf_weights
from justrl_megatron.convert.mapping import live_parameters
from justrl_megatron.distributed import init_distributed, init_model_parallel
from justrl_megatron.model.build import build_model_chunks
from justrl_megatron.model.hf_config import model_shape, transformer_config
from justrl_megatron.model.memory import checkpoint_save_bytes

MB, SEQ, NUM_MB = 2, 16, 2


class Trainer:
    """The smallest honest training loop: DDP + megatron optimizer + scheduler + schedule."""

    def __init__(self, hf_dir, shape, tp, pp, *, from_hf, init_seed=0, distributed_optimizer=False):
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.shape, self.hf_dir = shape, hf_dir
        init_model_parallel(tp=tp, pp=pp, seed=1234)
        torch.manual_seed(init_seed)
        config = transformer_config(shape, tp=tp, pp=pp)
        config.finalize_model_grads_func = finalize_model_grads
        chunks = build_model_chunks(shape, config, transformer_impl="local")
        if from_hf:
            load_hf_weights(chunks, hf_dir, progress=False)
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer, grad_reduce_in_fp32=True,
                                            overlap_grad_reduce=False)
        self.chunks = [DistributedDataParallel(config, ddp, c) for c in chunks]
        self.opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.1, clip_grad=1.0,
                            use_distributed_optimizer=distributed_optimizer, params_dtype=torch.float32),
            self.chunks)
        self.sched = OptimizerParamScheduler(
            self.opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=2, lr_decay_steps=8,
            lr_decay_style="cosine", start_wd=0.1, end_wd=0.1, wd_incr_steps=8, wd_incr_style="constant")
        self.data_position = 0  # index of the next batch in the (deterministic) dataset
        self.log = []

    def seed_everything(self, seed):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def batch(self):
        """Dataset item `data_position`, perturbed by the RNGs a real trainer uses (shuffling, sampling)."""
        g = torch.Generator().manual_seed(1000 + self.data_position)
        tokens = torch.randint(0, self.shape.vocab_size, (NUM_MB, MB, SEQ + 1), generator=g)
        shift = random.randrange(self.shape.vocab_size) + int(np.random.randint(self.shape.vocab_size))
        noise = torch.randint(0, self.shape.vocab_size, tokens.shape)  # default torch generator
        return (tokens + shift + noise) % self.shape.vocab_size, shift, int(noise.sum())

    def step(self):
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        tokens, shift, noise = self.batch()
        self.data_position += 1
        with get_cuda_rng_tracker().fork():  # the model-parallel stream (dropout in real models)
            tracker_draw = torch.rand(1).item()
        micro = iter([(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens])

        def forward_step(data_iterator, model):
            inp, labels = next(data_iterator)
            pos = torch.arange(SEQ).unsqueeze(0).expand(MB, SEQ)
            out = model(inp, pos, attention_mask=None, labels=labels)

            def loss_fn(output):
                loss = output.float().mean()
                return loss, {"loss": loss.detach().clone()}

            return out, loss_fn

        for c in self.chunks:
            c.zero_grad_buffer()
        self.opt.zero_grad()
        losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=micro, model=self.chunks,
                                    num_microbatches=NUM_MB, seq_length=SEQ, micro_batch_size=MB, forward_only=False)
        lr = self.opt.param_groups[0]["lr"]
        ok, gnorm, _ = self.opt.step()
        assert ok
        self.sched.step(increment=1)
        self.log.append({"lr": lr, "shift": shift, "noise": noise, "tracker": tracker_draw, "gnorm": float(gnorm),
                         "loss": float(losses[-1]["loss"]) if losses else None})  # None off the last stage

    def weights(self):
        out = {}
        for bucket in export_hf_stream(self.chunks, self.shape, bucket_bytes=1 << 20):
            out.update({n: t.clone() for n, t in bucket})
        return out

    def adam_moments(self):
        """exp_avg / exp_avg_sq of every weight as full HF tensors (plain optimizer: state has the params' shapes)."""
        params = live_parameters(self.chunks)
        inner = [o.optimizer for o in self.opt.chained_optimizers]
        out = {}
        for key in ("exp_avg", "exp_avg_sq"):
            saved = {}
            try:
                for name, p in params.items():
                    state = next(o.state[p] for o in inner if p in o.state)
                    saved[name] = p.data
                    p.data = state[key]
                for bucket in export_hf_stream(self.chunks, self.shape, bucket_bytes=1 << 20):
                    out.update({f"{key}/{n}": t.clone() for n, t in bucket})
            finally:
                for name, data in saved.items():
                    params[name].data = data
        return out

    def save(self, run_dir, step, **kw):
        return ckpt.save_checkpoint(run_dir, step, self.chunks, self.opt, self.sched, self.extra(),
                                    hf_source=self.hf_dir, **kw)

    def extra(self):
        return {"data_position": self.data_position, "log": list(self.log)}

    def load(self, run_dir):
        extra = ckpt.load_latest_checkpoint(run_dir, self.chunks, self.opt, self.sched)
        if extra is not None:
            self.data_position = extra["data_position"]
            self.log = list(extra["log"])
        return extra


def max_diff(a, b):
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    return max((a[n] - b[n]).abs().max().item() for n in a)


def bitwise(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


def main(out, hf_dir):
    from transformers import AutoConfig

    rank, _ = init_distributed()
    shape = model_shape(AutoConfig.from_pretrained(hf_dir))
    v = {}

    # A: straight, TP2
    a = Trainer(hf_dir, shape, 2, 1, from_hf=True)
    a.seed_everything(5)
    a.step(), a.step()
    w2, m2 = a.weights(), a.adam_moments()
    a.step(), a.step()
    w4 = a.weights()
    v["straight_lrs"] = [e["lr"] for e in a.log]

    # B: split with a save in the middle, a dead save and junk around it, then a fresh process-like rebuild
    run_b = os.path.join(out, "run_b")
    b = Trainer(hf_dir, shape, 2, 1, from_hf=True)
    b.seed_everything(5)
    b.step(), b.step()
    b.save(run_b, 2)
    dead = ckpt.checkpoint_root(run_b) / ".tmp_step_00000003.4194304"  # a dead writer's (pid beyond pid_max)
    ckpt_save._stage(run_b, 3, dead, b.chunks, b.opt, b.sched, {"data_position": -1}, None, None)  # died before commit
    if rank == 0:
        os.makedirs(os.path.join(ckpt.checkpoint_root(run_b), ".tmp_step_00000005"))
        with open(os.path.join(ckpt.checkpoint_root(run_b), ".tmp_step_00000005", "metadata.json"), "w") as f:
            f.write("{truncated")
    dist.barrier()
    v["latest_after_dead_save"] = ckpt.latest_step(run_b)
    b = Trainer(hf_dir, shape, 2, 1, from_hf=False, init_seed=77)
    b.seed_everything(77)  # different seeds: only the restored RNG states can reproduce A
    v["fresh_differs"] = not bitwise(b.weights(), w2)
    extra = b.load(run_b)
    v["resumed_extra"] = {"step": extra["step"], "data_position": extra["data_position"]}
    v["resume_weights_equal_w2"] = bitwise(b.weights(), w2)
    v["resume_moments_equal_m2"] = bitwise(b.adam_moments(), m2)
    b.step(), b.step()
    v["resume_weights_equal_w4"] = bitwise(b.weights(), w4)
    v["resume_max_diff_w4"] = max_diff(b.weights(), w4)
    # steps 3-4 as drawn on this rank after the resume (the log's first entries come from rank 0's extra state)
    v["resume_log_equal"] = len(b.log) == 4 and b.log[2:] == a.log[2:]
    v["resume_lrs"] = [e["lr"] for e in b.log]

    # E: retention (and the dead temp folders are gone after the next save)
    b.save(run_b, 3, keep_last=2)
    b.save(run_b, 4, keep_last=2)
    root = ckpt.checkpoint_root(run_b)
    v["retained"] = sorted(os.listdir(root))
    v["latest_after_retention"] = ckpt.latest_step(run_b)
    if rank == 0:
        from safetensors.torch import save_file

        save_file(w4, os.path.join(out, "w4.safetensors"))

    # the noise floor between layouts: the same 4 steps straight at TP1 (grads differ ~1e-8 from TP2; Adam's m/sqrt(v)
    # turns that into up to ~lr on weights whose gradients are ~0)
    base = Trainer(hf_dir, shape, 1, 1, from_hf=True)
    base.seed_everything(5)
    for _ in range(4):
        base.step()
    v["layout_noise_w4"] = max_diff(base.weights(), w4)
    del base

    # C: reshard a TP2 step-2 checkpoint to TP1 (DP2) and to PP2
    run_c = os.path.join(out, "run_c")
    c = Trainer(hf_dir, shape, 2, 1, from_hf=True)
    c.seed_everything(5)
    c.step(), c.step()
    c.save(run_c, 2)
    del c
    for name, (tp, pp) in {"tp1": (1, 1), "pp2": (1, 2)}.items():
        r = Trainer(hf_dir, shape, tp, pp, from_hf=False, init_seed=77)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            extra = r.load(run_c)
        v[f"reshard_{name}"] = {
            "step": extra["step"],
            "weights_equal_w2": bitwise(r.weights(), w2),
            "moments_equal_m2": bitwise(r.adam_moments(), m2),
            "rng_warning": any("RNG states are not restored" in str(w.message) for w in caught),
        }
        r.seed_everything(5)  # RNG states do not cross layouts: replay A's streams up to step 2 by hand
        for _ in range(2):
            r.batch()  # advance the RNG streams past A's first two batches
        r.step(), r.step()
        v[f"reshard_{name}"]["max_diff_w4_after_2_steps"] = max_diff(r.weights(), w4)
        v[f"reshard_{name}"]["lrs"] = [e["lr"] for e in r.log]

    # D: distributed optimizer, TP1 x DP2, saved asynchronously: exact resume; a TP change refused; the former format
    d = Trainer(hf_dir, shape, 1, 1, from_hf=True, distributed_optimizer=True)
    d.seed_everything(5)
    d.step(), d.step()
    dw2 = d.weights()
    run_d = os.path.join(out, "run_d")
    saver = ckpt.Checkpointer(run_d, async_save=True, keep_last=2, hf_source=hf_dir)
    v["async_save_returned"] = saver.save(2, d.chunks, d.opt, d.sched, d.extra()) is None
    v["async_pending_step"] = saver.pending_step
    v["async_latest_while_writing"] = ckpt.latest_step(run_d)  # None: nothing committed yet
    d.step(), d.step()  # train on while the writer writes
    v["async_committed"] = str(saver.wait())
    v["async_format"] = ckpt_state._saved_content(ckpt.step_dir(run_d, 2)).get("justrl_optimizer")
    v["distopt_tensor_bytes"] = sum(p.stat().st_size for p in ckpt.step_dir(run_d, 2).glob("*.distcp"))
    v["distopt_predicted_save_bytes"] = checkpoint_save_bytes(shape, dp=2, dtype=torch.float32)  # per rank
    dw4 = d.weights()
    e = Trainer(hf_dir, shape, 1, 1, from_hf=False, init_seed=77, distributed_optimizer=True)
    e.seed_everything(77)
    e.load(run_d)
    v["distopt_resume_weights_equal_w2"] = bitwise(e.weights(), dw2)
    e.step(), e.step()
    v["distopt_resume_weights_equal_w4"] = bitwise(e.weights(), dw4)
    v["distopt_resume_max_diff"] = max_diff(e.weights(), dw4)
    v["distopt_resume_log_equal"] = e.log[2:] == d.log[2:]  # loss, grad norm, LR, RNG draws of steps 3-4
    f = Trainer(hf_dir, shape, 2, 1, from_hf=False, init_seed=77, distributed_optimizer=True)
    try:
        f.load(run_d)
        v["distopt_tp2_refusal"] = None
    except ckpt.CheckpointError as exc:
        v["distopt_tp2_refusal"] = str(exc)
    v["adam_update_scale"] = max_diff(dw4, dw2)  # how far two steps move the weights, for scale
    # the former format: the distributed optimizer gathered (fully_reshardable), no content metadata
    run_old = os.path.join(out, "run_old")
    real_save, real_format = dist_checkpointing.save, ckpt_state.DISTOPT_METADATA
    ckpt_state.DISTOPT_METADATA = ckpt.OPTIM_METADATA
    dist_checkpointing.save = lambda *a, content_metadata=None, **kw: real_save(*a, **kw)
    try:
        d2 = Trainer(hf_dir, shape, 1, 1, from_hf=True, distributed_optimizer=True)
        d2.seed_everything(5)
        d2.step(), d2.step()
        d2.save(run_old, 2)
    finally:
        dist_checkpointing.save, ckpt_state.DISTOPT_METADATA = real_save, real_format
    v["old_format_content"] = ckpt_state._saved_content(ckpt.step_dir(run_old, 2))
    for name, tp in (("old_format_dp2", 1), ("old_format_tp2", 2)):
        o = Trainer(hf_dir, shape, tp, 1, from_hf=False, init_seed=77, distributed_optimizer=True)
        o.load(run_old)
        v[f"{name}_weights_equal_w2"] = bitwise(o.weights(), dw2)
        o.seed_everything(5)
        for _ in range(2):
            o.batch()
        o.step(), o.step()
        v[f"{name}_max_diff_w4"] = max_diff(o.weights(), dw4)
    del d, e, f, d2, o

    # G: the DP1 run of the `dp1` phase, killed while writing step 4, resumed here at DP2
    run_g = os.path.join(out, "run_dp1")
    if rank == 0:
        from justrl_megatron import run_lock

        run_lock.hold(run_g)  # as justrl-train does: the lock holder removes dead writers' staging folders
        v["dp1_staging_before"] = sorted(p.name for p in ckpt.checkpoint_root(run_g).glob(".tmp_*"))
    dist.barrier()
    g = Trainer(hf_dir, shape, 1, 1, from_hf=False, init_seed=77, distributed_optimizer=True)
    extra = g.load(run_g)
    dp1 = torch.load(os.path.join(out, "dp1.pt"))
    v["dp1_resumed_step"] = extra["step"]
    v["dp1_staging_after"] = sorted(p.name for p in ckpt.checkpoint_root(run_g).glob(".tmp_*"))
    v["dp1_weights_equal_w2"] = bitwise(g.weights(), dp1["w2"])
    g.seed_everything(5)
    for _ in range(2):
        g.batch()
    g.step(), g.step()
    v["dp1_max_diff_w4"] = max_diff(g.weights(), dp1["w4"])
    v["dp1_update_scale"] = max_diff(dp1["w4"], dp1["w2"])
    v["dp1_loss"] = [[e["loss"] for e in g.log[2:]], [e["loss"] for e in dp1["log"][2:]]]
    v["dp1_gnorm"] = [[e["gnorm"] for e in g.log[2:]], [e["gnorm"] for e in dp1["log"][2:]]]
    del g

    # F: a damaged latest checkpoint
    run_f = os.path.join(out, "run_f")
    g = Trainer(hf_dir, shape, 2, 1, from_hf=True)
    g.seed_everything(5)
    g.step(), g.step()
    g.save(run_f, 2, keep_last=None)
    g.step()
    g.save(run_f, 3, keep_last=None)
    shard = sorted(p for p in os.listdir(ckpt.step_dir(run_f, 3)) if p.endswith(".distcp"))[-1]
    shard_size = os.path.getsize(ckpt.step_dir(run_f, 3) / shard)
    dist.barrier()
    if rank == 0:
        with open(ckpt.step_dir(run_f, 3) / shard, "r+b") as fh:
            fh.truncate(100)
    dist.barrier()
    v["damaged_shard"] = shard
    for mode in ("strict", "auto"):
        h = Trainer(hf_dir, shape, 2, 1, from_hf=False, init_seed=77)
        said = []
        try:
            extra = ckpt.load_latest_checkpoint(run_f, h.chunks, h.opt, h.sched, strict=mode == "strict",
                                                warn=said.append)
            v[f"damaged_{mode}"] = {"step": extra["step"], "weights_equal_w2": bitwise(h.weights(), w2),
                                    "warning": said}
        except ckpt.CheckpointError as exc:
            v[f"damaged_{mode}"] = {"error": str(exc)}
    dist.barrier()
    if rank == 0:
        os.remove(ckpt.step_dir(run_f, 3) / ckpt.MANIFEST)
    dist.barrier()
    for damage in ("truncated", "zeroed"):
        if damage == "zeroed" and rank == 0:
            with open(ckpt.step_dir(run_f, 3) / shard, "wb") as fh:
                fh.write(bytes(shard_size))
        dist.barrier()
        h = Trainer(hf_dir, shape, 2, 1, from_hf=False, init_seed=77)
        said = []
        extra = ckpt.load_latest_checkpoint(run_f, h.chunks, h.opt, h.sched, warn=said.append)
        v[f"damaged_no_manifest_{damage}"] = {"step": extra["step"], "weights_equal_w2": bitwise(h.weights(), w2),
                                             "warning": said}

    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(v, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def dp1_phase(out, hf_dir):
    """One process (DP1): distributed optimizer, async save of step 2, on to step 4 (weights kept for the DP2 resume),
    then an async save of step 4 during which the process is SIGKILLed."""
    import signal

    from transformers import AutoConfig

    from justrl_megatron import lifeline

    lifeline.bind_helpers_to_this_process()  # as justrl-train does: the writers die with the killed trainer
    init_distributed()
    shape = model_shape(AutoConfig.from_pretrained(hf_dir))
    t = Trainer(hf_dir, shape, 1, 1, from_hf=True, distributed_optimizer=True)
    t.seed_everything(5)
    t.step(), t.step()
    w2 = t.weights()
    saver = ckpt.Checkpointer(os.path.join(out, "run_dp1"), async_save=True, keep_last=2, hf_source=hf_dir)
    saver.save(2, t.chunks, t.opt, t.sched, t.extra())
    t.step()
    saver.poll()
    t.step()
    torch.save({"w2": w2, "w4": t.weights(), "log": t.log}, os.path.join(out, "dp1.pt"))
    saver.save(4, t.chunks, t.opt, t.sched, t.extra())  # waits for step 2's commit, then starts writing step 4
    os.kill(os.getpid(), signal.SIGKILL)  # while step 4 is written


if __name__ == "__main__":
    if sys.argv[3:] == ["dp1"]:
        dp1_phase(sys.argv[1], sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2])
