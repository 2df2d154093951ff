"""How a command loads its model: the options `run`, `chat` and `serve` share, and the load.

`add_load_options` adds them to a command's parser (no JAX imported); `load_model` reads them
and loads the file (JAX's persistent compilation cache on first, see q8rules.llm.compile_cache).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from q8rules.cli import errors as E
from q8rules.cli.progress import bars

if TYPE_CHECKING:
  from q8rules.llm.model import GGUFModel


def add_load_options(p: argparse.ArgumentParser) -> None:
  """--bf16, --quantize, --dequantize-other, --act-qtype, --no-progress, --lora, --lora-scale."""
  p.add_argument("--bf16", action="store_true",
                 help="bfloat16 activations (default float32, as llama.cpp: on a small model"
                 " bfloat16 moves the logits by a few percent)")  # fmt: skip
  p.add_argument("--float32", action="store_true", help=argparse.SUPPRESS)  # the default
  p.add_argument("--quantize", choices=["q8_0"], default=None,
                 help="quantize the file's float weight matrices (F16 / BF16 / F32) to Q8_0 at"
                 " load (None: they keep their type)")  # fmt: skip
  p.add_argument("--dequantize-other", action="store_true",
                 help="hold Q4_0, Q4_K, ... as float32 instead of requantizing them to Q8_0")  # fmt: skip
  p.add_argument("--act-qtype", choices=["q8_0"], default=None,
                 help="Q8_0 activations too, as llama.cpp (int8 block dots; None: float)")  # fmt: skip
  p.add_argument("--no-progress", action="store_true",
                 help="no loading progress bar (it shows only on a terminal anyway)")  # fmt: skip
  p.add_argument("--lora", action="append", default=None, metavar="FILE",
                 help="a llama.cpp LoRA adapter file, applied unmerged (repeatable; None: no"
                 " adapter)")  # fmt: skip
  p.add_argument("--lora-scale", type=E.finite_float, default=1.0,
                 help="the adapters' lora_scale (llama.cpp's --lora-scaled)")  # fmt: skip


def load_model(args: argparse.Namespace) -> GGUFModel:
  """`args.model` loaded as `add_load_options`' options say."""
  import jax.numpy as jnp

  from q8rules.llm import compile_cache
  from q8rules.llm.load import load_gguf

  compile_cache.enable()
  return load_gguf(
    args.model,
    dtype=jnp.bfloat16 if args.bf16 else jnp.float32,
    dequantize_other=args.dequantize_other,
    quantize=args.quantize,
    progress=bars(args.no_progress),
    act_qtype=args.act_qtype,
    lora=args.lora,
    lora_scale=args.lora_scale,
  )
