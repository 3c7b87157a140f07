#!/usr/bin/env python
"""megatron dist checkpoint (converter output or training checkpoint) -> HF folder (`justrl-convert mcore-to-hf`).

  python tools/convert_megatron_to_hf.py --ckpt DIR --out DIR [--dtype bf16 --hf-config DIR]
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import sys

from justrl_megatron.convert.cli import main

if __name__ == "__main__":
    sys.exit(main(["mcore-to-hf", *sys.argv[1:]]))
