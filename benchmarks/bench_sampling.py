"""Decode with sampling against greedy decode, on the real SmolLM2-135M-Instruct (vocab 49,152).

    python benchmarks/bench_sampling.py [--rounds 5] [--new 65] [--threads N] [--model PATH]
                                        [--write]

One process, the model loaded once; per round each setting in turn (the order rotating), each
a `GGUFModel.stream` of --new tokens after a 9-token prompt, its decode rate counted as
`q8rules run` counts it (generated tokens after the decode loop's first chunk, over the time
since that chunk: q8rules/cli/rates.py). Every setting runs once before the rounds, so no
compilation is timed. The settings: greedy; `--temp 0.8 --top-k 40 --top-p 0.95` (top-k
picks its candidates with `lax.top_k`, the chain and the draw work on those); `--temp 0.8
--top-p 0.9` alone (its cut found by bisection over the logits, never a sort:
q8rules/engine/chain.py); plain temperature 0.8 (a draw over the whole vocabulary). Beside the ratio of the medians,
the median of each round's ratio to that round's greedy run (the runs of a round are seconds
apart, so a machine shared with other work slows them alike).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.results_md import load_average, machine, section, write_section  # noqa: E402
from scripts.fetch_real_models import MODELS, cache_dir  # noqa: E402

SETTINGS = {
  "greedy": {},
  "--temp 0.8 --top-k 40 --top-p 0.95": dict(temperature=0.8, top_k=40, top_p=0.95),
  "--temp 0.8 --top-p 0.9 (top-p alone)": dict(temperature=0.8, top_p=0.9),
  "--temp 0.8": dict(temperature=0.8),
}


def rate(m, prompt: list[int], new: int, sampler) -> float:
  """Generated tokens/s of one `stream`, as `q8rules run` counts them (after the first chunk)."""
  from q8rules.cli.rates import decode_rate
  from q8rules.llm.generate import CHUNK

  stamps = []
  for _ in m.stream(prompt, new, sampler=sampler):
    stamps.append(time.perf_counter())
  r = decode_rate(stamps, CHUNK)
  if not r.warm:
    raise RuntimeError(f"{len(stamps)} tokens: too few to count after the first chunk")
  return r.per_s


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=5, help="timed rounds of every setting")
  ap.add_argument("--new", type=int, default=65, help="tokens generated per run")
  ap.add_argument("--threads", type=int, default=None, help="CPUs (None: all)")
  ap.add_argument("--model", default=None,
                  help="the GGUF file (None: SmolLM2-135M-Instruct Q4_1 in the models' cache)")  # fmt: skip
  ap.add_argument("--write", action="store_true", help="write RESULTS.md's `sampling` section")
  args = ap.parse_args()
  if args.threads:
    from q8rules.cli.threads import limit_threads

    limit_threads(args.threads)
  import jax.numpy as jnp

  import q8rules
  from q8rules.engine.sampling import SamplingParams

  path = Path(args.model) if args.model else cache_dir() / MODELS["smollm2-q4_1"].file
  if not path.exists():
    raise SystemExit(f"{path}: missing; run scripts/fetch_real_models.py first")
  m = q8rules.load_gguf(path, dtype=jnp.float32, progress=False)
  prompt = m.tokenizer.encode("Once upon a time, in a small village by the sea,")
  samplers = {
    name: SamplingParams(**{"temperature": 0.0, **kw}, seed=1) for name, kw in SETTINGS.items()
  }
  for s in samplers.values():  # compile every program first
    rate(m, prompt, args.new, s)
  runs: dict[str, list[float]] = {name: [] for name in samplers}
  names = list(samplers)
  for r in range(args.rounds):
    for name in names[r % len(names) :] + names[: r % len(names)]:
      runs[name].append(rate(m, prompt, args.new, samplers[name]))
    print(f"round {r}: " + ", ".join(f"{runs[n][-1]:.1f}" for n in names), flush=True)
  greedy = statistics.median(runs["greedy"])
  rows = [
    "| setting | generated tokens/s, median (runs) | x greedy (medians) | x greedy (median of"
    " each round's ratio) |",
    "|---|---|---|---|",
  ]
  for name in names:
    med = statistics.median(runs[name])
    each = ", ".join(f"{x:.1f}" for x in runs[name])
    paired = statistics.median(x / g for x, g in zip(runs[name], runs["greedy"], strict=True))
    rows.append(f"| `{name}` | {med:.1f} ({each}) | {med / greedy:.2f} | {paired:.2f} |")
  table = "\n".join(rows)
  print(table)
  if args.write:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = (
      f"{when}. Machine: {machine()}; load average at the end {load_average()}. {path.name},"
      f" float32 activations, {args.new} tokens a run ({args.new - 17} counted, after the first"
      f" chunk), {args.rounds} interleaved rounds, threads: {args.threads or 'all'}."
    )
    cmd = f"python benchmarks/bench_sampling.py --rounds {args.rounds} --new {args.new}" + (
      f" --threads {args.threads}" if args.threads else ""
    )
    if args.model:
      cmd += f" --model {path.name}"
    note = (
      "Each round's ratio compares runs seconds apart; on a machine shared with other work the"
      " medians of the runs (taken at different moments) move with its load, that ratio less."
    )
    heading = "## Decode with top-k / top-p sampling against greedy"
    blocks = [table, note]
    write_section("sampling", section("sampling", heading, header, cmd + " --write", blocks))


if __name__ == "__main__":
  main()
