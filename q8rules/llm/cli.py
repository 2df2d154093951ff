"""`python -m q8rules run MODEL.gguf --prompt "..." --max-new-tokens 32`: generate text.

Loads the file (a tqdm bar over tensors), prints the prompt then each new
token's text as it is generated, then prefill and decode speed in tokens/s.
Prefill time includes compiling the model for the prompt's length; decode
tokens/s excludes the first decode step (its compilation). Then the cold-start
times: load, first token (from the start of the load), and what JAX compiled or
took from its persistent compilation cache (`q8rules.llm.compile_cache`: the CLI turns it
on in `~/.cache/q8rules/jax-compile`, `$Q8RULES_COMPILE_CACHE` moves it,
`Q8RULES_NO_COMPILE_CACHE=1` switches it off).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import jax.numpy as jnp

from q8rules.llm import compile_cache
from q8rules.llm.load import load_gguf


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m q8rules run", description=__doc__.splitlines()[0])
  p.add_argument("model", help="a .gguf file (or the first part of a split set)")
  p.add_argument("--prompt", default="Hello", help="text (needs the file's tokenizer)")
  p.add_argument(
    "--ids",
    "--prompt-ids",
    dest="prompt_ids",
    default=None,
    help="comma-separated token ids instead of text (needed when the file's tokenizer"
    " cannot be built: the weights load either way)",
  )
  p.add_argument("--max-new-tokens", type=int, default=32)
  p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--float32", action="store_true", help="float32 activations (default bfloat16)")
  p.add_argument("--dequantize-other", action="store_true", help="load Q4_0, Q4_K, ... as float")
  p.add_argument("--no-progress", action="store_true", help="no loading progress bar")
  p.add_argument(
    "--act-qtype",
    choices=["q8_0"],
    default=None,
    help="quantize the Q8_0 products' activations too, as llama.cpp does (int8 block dots;"
    " default: weight-only, float32-accurate products)",
  )
  return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
  """Run the CLI; returns what it measured (load_s, prefill/decode tokens and tokens/s, ids)."""
  args = parse_args(argv)
  cache_dir = compile_cache.enable()
  before = compile_cache.stats()
  t0 = time.perf_counter()
  m = load_gguf(
    args.model,
    dtype=jnp.float32 if args.float32 else jnp.bfloat16,
    dequantize_other=args.dequantize_other,
    progress=not args.no_progress,
    act_qtype=args.act_qtype,
  )
  load_s = time.perf_counter() - t0
  c = m.config
  print(
    f"{args.model}: {c.arch}, {c.layers} layers, dim {c.dim}, {c.heads} heads"
    f" ({c.kv_heads} KV), vocab {c.vocab}; loaded in {load_s:.2f} s",
    file=sys.stderr,
  )
  tok = m.tokenizer
  if args.prompt_ids is not None:
    ids = [int(i) for i in args.prompt_ids.split(",") if i.strip()]
  elif tok is None:
    raise SystemExit(
      f"{args.model}: the model loaded, but its tokenizer could not be built (the warning"
      " above says why): pass token ids with --ids 1,2,3"
    )
  else:
    ids = tok.encode(args.prompt)
  print(tok.decode(ids) if tok is not None else ids, end="", flush=True)

  times: dict[str, float] = {}
  stop = [tok.eos_id] if tok is not None and tok.eos_id is not None else []
  start = time.perf_counter()
  new: list[int] = []
  shown = ""
  stamps = []
  for t in m.stream(
    ids,
    args.max_new_tokens,
    temperature=args.temperature,
    seed=args.seed,
    stop_ids=stop,
    on_prefill=lambda: times.setdefault("prefill", time.perf_counter() - start),
  ):
    stamps.append(time.perf_counter())
    if len(stamps) == 1:
      first_token_s = stamps[0] - t0
      compiled = {k: v - before[k] for k, v in compile_cache.stats().items()}
    new.append(t)
    if tok is not None:
      text = tok.decode(new).rstrip("\ufffd")  # hold back a character's leading bytes
      print(text[len(shown) :], end="", flush=True)
      shown = text
    else:
      print(f" {t}", end="", flush=True)
  if tok is not None:
    print(tok.decode(new)[len(shown) :], end="")
  print()
  prefill_tps = len(ids) / times["prefill"]
  decode_n = len(stamps) - 2  # steps after the first decode step (which compiles)
  decode_tps = decode_n / (stamps[-1] - stamps[1]) if decode_n > 0 else float("nan")
  print(
    f"prefill: {len(ids)} tokens, {prefill_tps:.1f} tokens/s (incl. compile);"
    f" decode: {len(new)} tokens, {decode_tps:.1f} tokens/s",
    file=sys.stderr,
  )
  print(
    f"cold start: load {load_s:.2f} s, first token {first_token_s:.2f} s after the load began;"
    f" by then {compiled['compiled']} program(s) compiled, {compiled['cache_hits']} from the"
    f" compilation cache ({cache_dir or 'off: $' + compile_cache.ENV_OFF}), tracing"
    f" {compiled['trace_s']:.2f} s, lowering {compiled['lower_s']:.2f} s, compiling or fetching"
    f" {compiled['compile_s']:.2f} s",
    file=sys.stderr,
  )
  return dict(
    load_s=load_s,
    prompt_ids=ids,
    new_ids=new,
    prefill_tps=prefill_tps,
    decode_tps=decode_tps,
    first_token_s=first_token_s,
    compile=compiled,
  )
