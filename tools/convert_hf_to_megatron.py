#!/usr/bin/env python
"""HF folder -> megatron dist checkpoint (`justrl-convert hf-to-mcore`). Run directly or under torchrun.

  python tools/convert_hf_to_megatron.py --hf DIR --out DIR [--tp N --pp N --vpp N --dtype bf16]
"""

import justrl_megatron.compat  # noqa: F401  (first: CPU redirections)

import sys

from justrl_megatron.convert.cli import main

if __name__ == "__main__":
    sys.exit(main(["hf-to-mcore", *sys.argv[1:]]))
