"""tests/gpu: the CUDA-only tests (`pytest -m gpu tests/gpu`, the pytest stage of tools/gpu_check.sh on a lent
H100/H200, which collects this folder only).

The box has no vllm, transformer_engine, wandb, datasets, trl, math_verify or reasoning_gym: nothing here may import
one of them at collection time (import them inside the test, after `gpu_util.require`). tests/test_gpu_check.py
rehearses that on the CPU: it runs the kit's pytest stage with those modules unimportable.

Every test in this folder is marked `gpu` here and, where no CUDA device is present, skipped with the reason
"needs CUDA" (only then), so a CPU checkout still collects them (`pytest --collect-only -m gpu`). Tests that also
need transformer-engine or vLLM skip with "needs transformer-engine" / "needs vllm" when those are not importable.
Helpers shared with the CPU tests are imported from tests/ and tests/mp/, not copied.
"""

import sys
from pathlib import Path

import pytest

from gpu_util import cuda_available

HERE = Path(__file__).resolve().parent
for path in (HERE.parent, HERE.parent / "mp"):  # tests/test_model.py, tests/mp/step_parity.py
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


@pytest.hookimpl(tryfirst=True)  # before `-m gpu` deselects by marker
def pytest_collection_modifyitems(config, items):
    no_cuda = not cuda_available()
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if no_cuda:  # prepended: evaluated before any other skip mark of the test
                item.add_marker(pytest.mark.skipif(True, reason="needs CUDA"), append=False)


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """Tiny random HF folders (transformers' config classes, offline): Qwen2 untied with QKV bias and GQA 4/2,
    Llama tied; head_dim 32, a size every flash kernel takes."""
    from justrl_megatron.assets import tiny_model

    root = tmp_path_factory.mktemp("hf_gpu")
    return {"qwen2": tiny_model(root / "qwen2", "qwen2", hidden_size=128, intermediate_size=200, vocab_size=1100),
            "llama": tiny_model(root / "llama", "llama", hidden_size=128, intermediate_size=200, vocab_size=1000)}
