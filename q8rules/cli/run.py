"""`q8rules run MODEL.gguf -p "..." -n 32`: generate text from a GGUF model.

The prompt is `-p TEXT`, `-f FILE` (llama.cpp's `--file`), or stdin when it is not a terminal
(`echo "Once upon a time" | q8rules run model.gguf`); with none of them, an error. The generated
text alone goes to stdout (`> out.txt` holds only the text; `--echo` puts the prompt first, as
llama.cpp's `--no-display-prompt` off does); the load's progress (on a terminal only), the model
line and the rates (prompt tokens/s, generated tokens/s) go to stderr. Sampling follows
llama.cpp's chain (repetition penalty, top-k, top-p, min-p, temperature:
`q8rules.engine`); greedy by default. The compilation cache is on
(`q8rules.llm.enable_compile_cache`; `Q8RULES_NO_COMPILE_CACHE=1` turns it off).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from q8rules.cli import errors as E
from q8rules.cli.load_options import add_load_options, load_model
from q8rules.cli.threads import add_threads

if TYPE_CHECKING:  # the annotations only: importing the model loads JAX
  from q8rules.llm.model import GGUFModel

NAME = "run"
HELP = "generate text from a GGUF model"
EXAMPLE = 'q8rules run model.gguf -p "The capital of France is" -n 32'


def add_sampling(p: argparse.ArgumentParser) -> None:
  """The model, load and sampling flags `run` and `chat` share."""
  p.add_argument("model", help="a .gguf file (or the first part of a split set)")
  p.add_argument(
    "-n", "--max-new-tokens", type=E.positive_int, default=32, help="tokens to generate"
  )
  p.add_argument("-c", "--ctx", type=E.positive_int, default=None,
                 help="the context: the most tokens the prompt and the generated text may take"
                 " together (None: the model's context length)")  # fmt: skip
  p.add_argument("--temp", "--temperature", dest="temperature", type=E.non_negative_float,
                 default=0.0, help="the sampling temperature; 0: greedy")  # fmt: skip
  p.add_argument("--top-k", type=E.non_negative_int, default=0,
                 help="sample among the k most likely tokens; 0: off")  # fmt: skip
  p.add_argument("--top-p", type=E.unit_open_closed, default=1.0,
                 help="sample among the most likely tokens up to this probability; 1.0: off")  # fmt: skip
  p.add_argument("--min-p", type=E.unit_closed, default=0.0,
                 help="drop tokens below this fraction of the most likely's probability; 0: off")  # fmt: skip
  p.add_argument("--repeat-penalty", type=E.positive_float, default=1.0,
                 help="divide the logits of recently seen tokens by this; 1.0: off")  # fmt: skip
  p.add_argument("--repeat-last-n", type=E.non_negative_int, default=64,
                 help="how many of the last tokens the repeat penalty looks at")  # fmt: skip
  p.add_argument("-s", "--seed", type=int, default=0, help="the sampling's seed")
  add_threads(p)
  add_load_options(p)


def add_arguments(p: argparse.ArgumentParser) -> None:
  add_sampling(p)
  prompt = p.add_mutually_exclusive_group()
  prompt.add_argument("-p", "--prompt", default=None,
                      help="the prompt text (None: -f, --ids, or stdin when it is not a terminal)")  # fmt: skip
  prompt.add_argument("-f", "--file", default=None, metavar="FILE",
                      help="read the prompt from this file (None: -p, --ids or stdin)")  # fmt: skip
  prompt.add_argument("--ids", "--prompt-ids", dest="prompt_ids", default=None,
                      help="comma-separated token ids instead of text (None: the text)")  # fmt: skip
  p.add_argument("--echo", action="store_true", help="print the prompt to stdout first")


def sampler_of(args: argparse.Namespace) -> Any:
  """The `SamplingParams` of `add_sampling`'s flags (the seed's low 32 bits: the same key)."""
  from q8rules.engine.sampling import SEED_MODULUS, SamplingParams

  return SamplingParams(
    temperature=args.temperature,
    top_k=args.top_k,
    top_p=args.top_p,
    min_p=args.min_p,
    repeat_penalty=args.repeat_penalty,
    penalty_last_n=args.repeat_last_n,
    seed=args.seed % SEED_MODULUS,
  )


def load(args: argparse.Namespace) -> tuple[Any, float]:
  """The model of `args` (its line and what was requantized on stderr), and its load time."""
  from q8rules.checkpoint.gguf.requant import describe_requantized

  t0 = time.perf_counter()
  m = load_model(args)
  load_s = time.perf_counter() - t0
  c = m.config
  print(
    f"{args.model}: {c.arch}, {c.layers} layers, dim {c.dim}, {c.heads} heads ({c.kv_heads} KV),"
    f" vocab {c.vocab}, context {c.context_length}; loaded in {load_s:.2f} s",
    file=sys.stderr,
  )
  if m.requantized:
    print(describe_requantized(m.requantized), file=sys.stderr)
  if m.lora is not None:
    print(
      f"LoRA: {', '.join(map(str, args.lora))} (rank {m.lora.rank}, on"
      f" {', '.join(m.lora.targets)})",
      file=sys.stderr,
    )
  return m, load_s


def context_of(m: GGUFModel, args: argparse.Namespace) -> int:
  """The context of -c/--ctx (the model's context length without it).

  Raises:
    UsageError: a --ctx beyond the model's context length.
  """
  if args.ctx is None:
    return m.config.context_length
  if args.ctx > m.config.context_length:
    raise E.UsageError(f"--ctx {args.ctx}: the model's context is {m.config.context_length}")
  return args.ctx


def check_ids(m: GGUFModel, ids: list[int], new: int, context: int | None = None) -> None:
  """UsageError unless `ids` are in the vocabulary and fit the context (`context`, else the
  model's) with `new` more."""
  vocab = m.config.vocab
  context = m.config.context_length if context is None else context
  bad = [i for i in ids if not 0 <= i < vocab]
  if bad:
    raise E.UsageError(f"token ids {bad[:5]} lie outside the vocabulary [0, {vocab})")
  if len(ids) + new > context:
    raise E.UsageError(
      f"the prompt's {len(ids)} tokens and {new} new ones exceed the context of {context}"
      " (-c/--ctx, the model's context length at most)"
    )


def prompt_text(args: argparse.Namespace) -> str | None:
  """The prompt's text: -p, the file of -f, or stdin when it is not a terminal; None with
  --ids.

  Raises:
    UsageError: an unreadable -f, or no prompt given at all (stdin a terminal).
  """
  if args.prompt_ids is not None or args.prompt is not None:
    return args.prompt
  if args.file is not None:
    try:
      with open(args.file, encoding="utf-8") as f:
        return f.read()
    except OSError as e:
      raise E.UsageError(f"-f {args.file}: {e.strerror}") from None
  if not no_prompt(args):
    try:
      return sys.stdin.read()
    except (OSError, ValueError):  # a closed stdin, or one that cannot be read
      pass
  raise E.UsageError(NO_PROMPT)


NO_PROMPT = "no prompt: give -p TEXT, -f FILE or --ids, or pipe the prompt to stdin"


def no_prompt(args: argparse.Namespace) -> bool:
  """No -p, -f or --ids, and stdin a terminal (or none): nothing to start from."""
  if args.prompt is not None or args.file is not None or args.prompt_ids is not None:
    return False
  isatty = getattr(sys.stdin, "isatty", None)
  return sys.stdin is None or isatty is None or isatty()


def prompt_ids(m: GGUFModel, args: argparse.Namespace, text: str | None = None) -> list[int]:
  """The prompt's ids: --ids, or `text` (-p's when None) tokenized (an empty text: BOS, as
  llama.cpp)."""
  tok = m.tokenizer
  text = args.prompt if text is None else text
  if args.prompt_ids is not None:
    try:
      ids = [int(i) for i in args.prompt_ids.split(",") if i.strip()]
    except ValueError:
      raise E.UsageError(f"--ids {args.prompt_ids!r}: not comma-separated integers") from None
    if not ids:
      raise E.UsageError("--ids: no token id given")
    return ids
  if tok is None:
    raise E.ModelError(
      f"{args.model}: its tokenizer could not be built (the warning above says why): pass"
      " token ids with --ids 1,2,3"
    )
  ids = tok.encode(text)
  if not ids:
    if tok.bos_id is None:
      raise E.UsageError("an empty prompt, and the vocabulary has no BOS token to start from")
    ids = [tok.bos_id]
  return ids


def stream_text(m: GGUFModel, ids: list[int], args: argparse.Namespace, stop: list[int]) -> dict:
  """Generate after `ids`, writing the text to stdout as it comes; the ids and the times."""
  from q8rules.engine.detokenize import TextStream
  from q8rules.llm import compile_cache

  text, before = TextStream(m.tokenizer, []), compile_cache.stats()
  times: dict[str, float] = {}
  new: list[int] = []
  stamps: list[float] = []
  start = time.perf_counter()
  for t in m.stream(
    ids,
    args.max_new_tokens,
    sampler=sampler_of(args),
    stop_ids=stop,
    on_prefill=lambda: times.setdefault("prefill", time.perf_counter() - start),
  ):
    stamps.append(time.perf_counter())
    if len(stamps) == 1:
      times["compiled"] = {k: v - before[k] for k, v in compile_cache.stats().items()}
    new.append(t)
    sys.stdout.write(text.add(t)[0])  # ' <id>' a token without a tokenizer
    sys.stdout.flush()
  sys.stdout.write(text.flush() + "\n")
  sys.stdout.flush()
  return dict(new_ids=new, stamps=stamps, start=start, **times)


def execute(args: argparse.Namespace) -> dict:
  """Run the command; returns what it measured (load_s, ids, rates)."""
  from q8rules.cli.rates import decode_rate, prefill_rate
  from q8rules.llm.generate import CHUNK

  if no_prompt(args):
    raise E.UsageError(NO_PROMPT)
  t0 = time.perf_counter()
  m, load_s = load(args)
  ids = prompt_ids(m, args, prompt_text(args))
  check_ids(m, ids, args.max_new_tokens, context_of(m, args))
  tok = m.tokenizer
  if args.echo:
    sys.stdout.write(tok.decode(ids) if tok is not None else " ".join(map(str, ids)))
  stop = sorted(tok.eog_ids) if tok is not None else []
  out = stream_text(m, ids, args, stop)
  decode = decode_rate(out["stamps"], CHUNK)
  prefill_tps = prefill_rate(len(ids), out["prefill"])
  stopped = (
    " (stopped at an end-of-generation token)"
    if out["new_ids"][-1:] and (out["new_ids"][-1] in stop)
    else ""
  )
  print(
    f"prefill: {len(ids)} prompt tokens, {prefill_tps:.1f} prompt tokens/s (with its"
    f" compilation); generated {len(out['new_ids'])} tokens{stopped}; decode:"
    f" {decode.describe()}",
    file=sys.stderr,
  )
  first_token_s = out["stamps"][0] - t0
  c = out["compiled"]
  print(
    f"cold start: load {load_s:.2f} s, first token {first_token_s:.2f} s after the load began;"
    f" {c['compiled']} program(s) compiled, {c['cache_hits']} from the compilation cache",
    file=sys.stderr,
  )
  return dict(
    load_s=load_s,
    prompt_ids=ids,
    new_ids=out["new_ids"],
    prefill_tps=prefill_tps,
    decode_tps=decode.per_s,
    first_token_s=first_token_s,
    compile=c,
  )
