"""Model FLOPs, achieved TFLOP/s and MFU: the arithmetic every benchmark shares (pure functions, no device calls).

Model FLOPs of a forward pass over packed sequences (what MFU divides by the peak):
  2 x (matmul weights of the decoder) per token              QKV, attention output, gate/up/down projections
+ 4 x heads x head_dim x L(L+1)/2 per layer and sequence     causal QK^T and PV, only the lower triangle
+ 2 x hidden x vocab per row whose logits are computed       the output projection (vocab padded as Megatron pads it)
A training update is 3 x forward (backward = 2 x forward). Activation recomputation is hardware FLOPs, not model FLOPs:
it is not counted, so recomputation lowers MFU, as it should. Norms, biases, RoPE, softmax and SwiGLU's elementwise
product are O(hidden) per token and left out (< 0.1% at these sizes).

MFU = achieved TFLOP/s per device / the device's dense peak for the dtype. Peaks are known for NVIDIA datacenter GPUs in
bf16; a CPU has no entry (pass ``peak`` yourself to get an MFU there).
"""

from __future__ import annotations

# Dense (no 2:4 sparsity) bf16 tensor-core peaks in TFLOP/s, matched as a substring of the device name, longest first
# ("H100 PCIe" before "H100").
PEAK_BF16_TFLOPS = {"H200": 989.4, "GH200": 989.4, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.4,
                    "H800": 989.4, "H20": 148.0, "A100": 312.0, "A800": 312.0, "L40S": 362.05, "B200": 2250.0}


def forward_flops(shape, seq_lens: list[int], logit_rows: int, vocab: int | None = None) -> float:
    """Model FLOPs of one forward pass over packed sequences of ``seq_lens``, with logits for ``logit_rows`` positions
    (the response tokens whose logprobs are needed). ``vocab``: the padded vocabulary (default: the model's)."""
    s = shape
    q, kv = s.num_attention_heads * s.head_dim, s.num_query_groups * s.head_dim
    matmul_params = s.hidden_size * (q + 2 * kv) + q * s.hidden_size + 3 * s.hidden_size * s.ffn_hidden_size
    tokens = sum(seq_lens)
    linear = 2.0 * matmul_params * s.num_layers * tokens
    attention = 4.0 * q * s.num_layers * sum(n * (n + 1) / 2 for n in seq_lens)
    head = 2.0 * s.hidden_size * (vocab or s.vocab_size) * logit_rows
    return linear + attention + head


def update_flops(shape, seq_lens: list[int], logit_rows: int, vocab: int | None = None) -> float:
    """Model FLOPs of one training update (forward + backward) over the same batch: 3 x forward."""
    return 3.0 * forward_flops(shape, seq_lens, logit_rows, vocab)


def device_peak_tflops(device_name: str, dtype: str) -> float | None:
    """Dense peak TFLOP/s of a device for ``dtype`` ("bfloat16"), or None where unknown (CPUs, fp32)."""
    if dtype not in ("bfloat16", "bf16"):
        return None
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in device_name:
            return PEAK_BF16_TFLOPS[key]
    return None


def tflops_per_device(flops: float, seconds: float, devices: int) -> float:
    if seconds <= 0 or devices < 1:
        raise ValueError(f"seconds ({seconds}) must be > 0 and devices ({devices}) >= 1")
    return flops / seconds / devices / 1e12


def mfu(flops: float, seconds: float, devices: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1]: achieved TFLOP/s per device over the peak; None without a peak."""
    return tflops_per_device(flops, seconds, devices) / peak if peak else None


def throughput(*, flops: float, tokens: int, seconds: float, devices: int, peak: float | None) -> dict:
    """The standard figures of one timed phase."""
    return {"time_s": seconds, "tokens_per_s": tokens / seconds, "tokens_per_s_per_device": tokens / seconds / devices,
            "tflops_per_device": tflops_per_device(flops, seconds, devices), "mfu": mfu(flops, seconds, devices, peak),
            "flops": flops}
