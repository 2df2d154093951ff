"""The demo: the built-in decoder (`q8rules.models.Transformer`) served float and as Q8_0.

`python -m q8rules` prints what the rules matched and which path each op took,
the weight bytes, the error of the Q8_0 model against the float one, and the
time of one decode step of each.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import qwix

import q8rules
from q8rules.demo_options import add_arguments
from q8rules.models import Transformer, TransformerConfig, init_cache
from q8rules.timing import median_time


def tree_bytes(tree) -> int:
  """Bytes of every array leaf of a param tree (Q8 weights count int8 + scales)."""
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
  """Defaults shown after each option's help; the description kept as written."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
    prog="q8rules demo", description=__doc__, formatter_class=_HelpFormatter
  )
  add_arguments(p)
  return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
  """Parse `argv` and run the demo; returns what it measured."""
  return run(parse_args(argv))


def run(args: argparse.Namespace) -> dict:
  """The demo on parsed options (`add_arguments`'); returns what it measured."""
  config = TransformerConfig(
    vocab=args.vocab,
    dim=args.dim,
    layers=args.layers,
    heads=args.dim // 64,
    kv_heads=args.kv_heads or max(1, args.dim // 128),
    head_dim=64,
    ffn=args.ffn,
    context_length=8 + args.steps + 1,
    tied_embeddings=args.tied,
    dtype=jnp.bfloat16 if args.bf16 else jnp.float32,
  )
  print(f"q8rules demo on {jax.default_backend()}: {config}")
  model = Transformer(config)
  prompt = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab, (1, 8)), jnp.int32)
  cache = init_cache(config, config.context_length)
  float_vars = jax.jit(model.init)(jax.random.key(0), prompt, cache, 0)

  # The rules: every Dense weight and the embedding table as Q8_0.
  provider = q8rules.Q8Provider([q8rules.Q8Rule(implementation=args.implementation)])
  q8_model = qwix.quantize_model(model, provider)
  abstract = jax.eval_shape(q8_model.init, jax.random.key(0), prompt, cache, 0)
  q8_params = jax.jit(q8rules.quantize_params)(float_vars["params"], abstract["params"])
  q8_vars = {"params": q8_params}

  float_step, q8_step = jax.jit(model.apply), jax.jit(q8_model.apply)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    # Prefill, then greedy decode with both models from the same prompt.
    logits_f, cache_f = float_step(float_vars, prompt, cache, 0)
    logits_q, cache_q = q8_step(q8_vars, prompt, cache, 0)
    prefill_err = float(jnp.linalg.norm(logits_q - logits_f) / jnp.linalg.norm(logits_f))
    tok_f = jnp.argmax(logits_f[:, -1:], -1)
    agree, errs = 0, []
    for i in range(args.steps):
      lf, cache_f = float_step(float_vars, tok_f, cache_f, 8 + i)
      lq, cache_q = q8_step(q8_vars, tok_f, cache_q, 8 + i)  # the same token into both
      errs.append(float(jnp.linalg.norm(lq - lf) / jnp.linalg.norm(lf)))
      agree += int(jnp.argmax(lf[:, -1]) == jnp.argmax(lq[:, -1]))
      tok_f = jnp.argmax(lf[:, -1:], -1)

  report = provider.report()  # the latest trace: the one-token decode step
  print("\nWhat matched and which path each op took (decode step, M = 1 token):")
  print(report)

  pos = 8 + args.steps
  t_float = 1e3 * median_time(float_step, float_vars, tok_f, cache_f, pos, reps=args.repeats)
  t_q8 = 1e3 * median_time(q8_step, q8_vars, tok_f, cache_q, pos, reps=args.repeats)
  float_bytes, q8_bytes = tree_bytes(float_vars["params"]), tree_bytes(q8_params)
  moved_f, moved_q = report.float_bytes, report.q8_bytes
  print("\nWeights (whole param tree, embeddings and norms included):")
  print(f"  float {float_bytes / 2**20:8.2f} MiB   Q8_0 {q8_bytes / 2**20:8.2f} MiB")
  print("Error of the Q8_0 model against the float model (relative L2 of logits):")
  print(f"  prefill {prefill_err:.2e}   decode mean {np.mean(errs):.2e}   max {np.max(errs):.2e}")
  print(f"  greedy next-token agreement over {args.steps} steps: {agree}/{args.steps}")
  print("One decode step (jit, median of", args.repeats, "runs):")
  print(
    f"  float {t_float:7.3f} ms   reads {moved_f / 2**20:6.2f} MiB of matched weights"
    f"  ({moved_f / t_float / 1e6:5.1f} GB/s)"
  )
  print(
    f"  Q8_0  {t_q8:7.3f} ms   reads {moved_q / 2**20:6.2f} MiB of matched weights"
    f"  ({moved_q / t_q8 / 1e6:5.1f} GB/s)   {t_float / t_q8:.2f}x the float speed"
  )
  return {
    "report": report,
    "prefill_err": prefill_err,
    "decode_errs": errs,
    "agree": agree,
    "float_ms": t_float,
    "q8_ms": t_q8,
    "float_bytes": float_bytes,
    "q8_bytes": q8_bytes,
  }
