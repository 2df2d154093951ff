"""Fine-tune a real GGUF model with LoRA in JAX and hand the adapter to a natively built llama.cpp.

    python benchmarks/finetune_gguf.py --llama-cpp-python /work/venv-llamacpp/bin/python [--write]

The model: the package index's SmolLM2-135M-Instruct Q4_1 (scripts/fetch_real_models.py,
Apache-2.0), loaded by `load_gguf` (requantized to Q8_0). The text: the Python Language
Reference as CPython ships it (`pydoc_data.topics`, PSF License): the topics TRAIN for training,
the topics HELD_OUT for the held-out perplexity.

  1. held-out perplexity of the loaded model;
  2. `with_lora(rank, alpha)` on all seven block matrices, `LoraTrainer` (optax AdamW) for
     --steps steps of batch x length windows of the training text: tokens/s (after the first,
     compiling, step) and the process's peak RSS; the base's bytes compared before and after;
     beside it, in its own process, a float32 LoRA of the same weights (dequantized at load,
     Qwix's `LoraProvider`, the same adapters, data and steps): its tokens/s and peak RSS;
  3. held-out perplexity after;
  4. `save_lora_gguf`; llama.cpp (`Llama(..., lora_path=)`) on the base file with and without
     the adapter: logits on a held-out window and 32 greedy tokens after a prompt; ours the same.
     Reported: rel. L2 of the logits, ours against llama.cpp, base and adapted; their ratio
     (the target: <= 1.5); whether the greedy tokens are equal.

Each side runs in its own process (llama.cpp in its own venv).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.llamacpp_native import describe, query  # noqa: E402
from benchmarks.results_md import machine, section, write_section  # noqa: E402
from scripts.fetch_real_models import MODELS, cache_dir, fetch  # noqa: E402
from scripts.real_runs import GREEDY, PROMPT, llama_greedy  # noqa: E402
from scripts.run_json import run  # noqa: E402

TRAIN = ("for", "while", "if", "try", "with", "function", "class", "lambda", "import", "return")
HELD_OUT = ("assert", "break", "continue", "del", "global", "pass", "raise", "yield")
"""Topics of `pydoc_data.topics` (the Python Language Reference, PSF License)."""

OURS = r"""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np, optax
import q8rules
from q8rules.lora.trainer import split_adapters
from benchmarks.finetune_gguf import text_ids, perplexity, train

path, out = sys.argv[1], json.loads(sys.argv[2])
m = q8rules.load_gguf(path, dtype=jnp.float32, progress=False)
train_ids, held = text_ids(m)
eval_ids = held[: out["eval_len"]]
res = dict(train_tokens=int(train_ids.size), held_tokens=int(held.size))
res["ppl_before"] = perplexity(m, held, out["length"])
m = m.with_lora(rank=out["rank"], alpha=out["alpha"])
before = [np.asarray(x).tobytes() for x in jax.tree.leaves(split_adapters(m.params)[0])]
trained, losses, tokens_per_s, first_s = train(m, train_ids, out)
after = [np.asarray(x).tobytes() for x in jax.tree.leaves(split_adapters(trained.params)[0])]
res["base_unchanged"] = before == after
res["losses"] = losses
res["tokens_per_s"], res["first_step_s"] = tokens_per_s, first_s
res["ppl_after"] = perplexity(trained, held, out["length"])
trained.save_lora_gguf(out["adapter"])
trained.save_gguf(out["merged"])
merged = q8rules.load_gguf(out["merged"], dtype=jnp.float32, progress=False)
same = jax.tree.leaves(merged.params), jax.tree.leaves(trained.merged().params)
res["merged_reads_back"] = all(
  np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(*same, strict=True)
)
np.save(out["logits_merged"], merged.logits(eval_ids))
np.save(out["logits_base"], q8rules.load_gguf(path, dtype=jnp.float32, progress=False).logits(eval_ids))
np.save(out["logits_lora"], trained.logits(eval_ids))
prompt = trained.tokenizer.encode(out["prompt"])
res["greedy"] = trained.generate(prompt, out["greedy"])
res["eval_ids"] = [int(i) for i in eval_ids]
res["prompt_ids"] = [int(i) for i in prompt]
res["rss_mb"] = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024
print(json.dumps(res))
"""

FLOAT32 = r"""
import dataclasses, json, sys, time
import jax, jax.numpy as jnp, numpy as np, optax, qwix
import q8rules
from q8rules.lora.gguf_model import LoraSpec, adapter_sites, with_adapters, DEFAULT_TARGETS
from q8rules.models.transformer import Transformer
from benchmarks.finetune_gguf import text_ids, train

path, out = sys.argv[1], json.loads(sys.argv[2])
m = q8rules.load_gguf(path, dtype=jnp.float32, progress=False, dequantize_other=True, fuse=False)
train_ids, _ = text_ids(m)
from q8rules.providers.q8_weight import Q8Weight
def as_float(leaf):  # a Q8_0 tensor of the file (the table) as float32: q * d
  if not isinstance(leaf, Q8Weight):
    return leaf
  q, d = leaf.array.q, leaf.array.scale
  return q.astype(jnp.float32) * jnp.repeat(d.astype(jnp.float32), 32, axis=-2)
m = dataclasses.replace(
  m, params=jax.tree.map(as_float, m.params, is_leaf=lambda x: isinstance(x, Q8Weight))
)
spec = LoraSpec(out["rank"], out["alpha"], DEFAULT_TARGETS)
init = jax.nn.initializers.he_uniform()
adapters = {}
for i, (kind, p) in enumerate(adapter_sites(m.config, m.params, spec.targets)):
  w = m.params
  for k in p:
    w = w[k]
  lead, (k, n) = w.shape[:-2], w.shape[-2:]
  keys = jax.random.split(jax.random.key(i), int(np.prod(lead)))
  a = jax.vmap(lambda key: init(key, (k, spec.rank), jnp.float32))(keys).reshape(*lead, k, spec.rank)
  adapters[p] = (a, jnp.zeros((*lead, spec.rank, n), jnp.float32))
params = with_adapters(m.params, adapters)
provider = qwix.LoraProvider(
  module_path="layers/(attn/(q|k|v|o)|mlp/(gate|up|down))", rank=spec.rank, alpha=spec.alpha
)
model = qwix.quantize_model(Transformer(m.config), provider)
m = dataclasses.replace(m, model=model, params=params, lora=spec)
_, losses, tokens_per_s, _ = train(m, train_ids, out)
res = dict(losses=losses, tokens_per_s=tokens_per_s)
res["rss_mb"] = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024
print(json.dumps(res))
"""


def text_ids(m) -> tuple[np.ndarray, np.ndarray]:
  """(training ids, held-out ids): the TRAIN and HELD_OUT topics, tokenized with the file's
  tokenizer."""
  import pydoc_data.topics as topics

  def ids(names: tuple[str, ...]) -> np.ndarray:
    text = "\n\n".join(topics.topics[n] for n in names)
    return np.asarray(m.tokenizer.encode(text), np.int32)

  return ids(TRAIN), ids(HELD_OUT)


def train(m, ids: np.ndarray, out: dict) -> tuple:
  """`out["steps"]` AdamW steps (`LoraTrainer`) of `m`'s adapters on random windows of `ids`:
  (the trained model, the losses, tokens/s after the first (compiling) step, that step's s)."""
  import time

  import optax

  from q8rules.lora.datasets import text_windows
  from q8rules.lora.trainer import LoraTrainer

  trainer = LoraTrainer(m, optax.adamw(out["lr"]))
  state = trainer.init()
  draw = text_windows(ids, out["length"], out["batch"], seed=0)
  losses, times = [], []
  for _ in range(out["steps"]):
    tokens, mask = draw()
    t = time.perf_counter()
    state, loss = trainer.step(state, tokens, mask)
    losses.append(float(loss))
    times.append(time.perf_counter() - t)
  rate = out["batch"] * out["length"] * (len(times) - 1) / sum(times[1:])
  return trainer.model(state), losses, rate, times[0]


def perplexity(m, ids: np.ndarray, length: int) -> float:
  """exp of the mean next-token loss over the non-overlapping windows of `length` in ids."""
  windows = ids[: ids.size // length * length].reshape(-1, length)
  return float(np.exp(np.mean([m.loss(w) for w in windows])))


def rel(a: np.ndarray, ref: np.ndarray) -> float:
  return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--llama-cpp-python", required=True, help="python of a native llama-cpp-python")
  p.add_argument("--steps", type=int, default=30)
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--length", type=int, default=128)
  p.add_argument("--rank", type=int, default=16)
  p.add_argument("--alpha", type=float, default=32.0)
  p.add_argument("--lr", type=float, default=1e-3)
  p.add_argument("--write", action="store_true", help="write RESULTS.md's finetune section")
  args = p.parse_args()
  path = fetch(MODELS["smollm2-q4_1"], cache_dir())
  with tempfile.TemporaryDirectory() as tmp:
    work = Path(tmp)
    cfg = dict(
      steps=args.steps,
      batch=args.batch,
      length=args.length,
      rank=args.rank,
      alpha=args.alpha,
      lr=args.lr,
      eval_len=128,
      prompt=PROMPT,
      greedy=GREEDY,
      adapter=str(work / "adapter.gguf"),
      logits_base=str(work / "ours_base.npy"),
      logits_lora=str(work / "ours_lora.npy"),
      merged=str(work / "merged.gguf"),
      logits_merged=str(work / "ours_merged.npy"),
    )
    cmd = [sys.executable, "-c", textwrap.dedent(OURS), str(path), json.dumps(cfg)]
    ours = run(cmd, {"PYTHONPATH": str(ROOT)})
    cmd = [sys.executable, "-c", textwrap.dedent(FLOAT32), str(path), json.dumps(cfg)]
    f32 = run(cmd, {"PYTHONPATH": str(ROOT)})
    llama = {}
    for name, lora, file in (
      ("base", None, path),
      ("lora", cfg["adapter"], path),
      ("merged", None, Path(cfg["merged"])),
    ):
      q = dict(
        eval_ids=ours["eval_ids"],
        prompt_ids=ours["prompt_ids"],
        greedy=GREEDY,
        lora=lora,
        out=str(work / f"llama_{name}.npy"),
      )
      llama[name] = llama_greedy(args.llama_cpp_python, file, q)
    ob, ol = np.load(cfg["logits_base"]), np.load(cfg["logits_lora"])
    lb, ll = np.load(work / "llama_base.npy"), np.load(work / "llama_lora.npy")
    om, lm = np.load(cfg["logits_merged"]), np.load(work / "llama_merged.npy")
  r = dict(
    base=rel(ob, lb),
    lora=rel(ol, ll),
    moved=rel(ll, lb),
    merged=rel(om, lm),
    argmax_base=float(np.mean(ob.argmax(-1) == lb.argmax(-1))),
    argmax_lora=float(np.mean(ol.argmax(-1) == ll.argmax(-1))),
    greedy_equal=ours["greedy"] == llama["lora"]["greedy"],
    greedy_prefix=next(
      (
        i
        for i, (a, b) in enumerate(zip(ours["greedy"], llama["lora"]["greedy"], strict=True))
        if a != b
      ),
      GREEDY,
    ),
  )
  rows = [
    "| | value |",
    "|---|---|",
    f"| training text / held-out text (tokens) | {ours['train_tokens']} / {ours['held_tokens']} |",
    f"| steps x batch x length | {args.steps} x {args.batch} x {args.length} |",
    f"| loss, first step -> last step | {ours['losses'][0]:.3f} -> {ours['losses'][-1]:.3f} |",
    f"| held-out perplexity before -> after | {ours['ppl_before']:.3f} -> {ours['ppl_after']:.3f}"
    f" ({100 * (1 - ours['ppl_after'] / ours['ppl_before']):.1f} % lower) |",
    f"| training tokens/s (after the first step; first step {ours['first_step_s']:.1f} s)"
    f" | {ours['tokens_per_s']:.0f} |",
    f"| float32 LoRA of the same weights (Qwix's LoraProvider, dequantized): tokens/s"
    f" | {f32['tokens_per_s']:.0f} (ours {ours['tokens_per_s'] / f32['tokens_per_s']:.2f}x) |",
    f"| loss, first -> last step: float32 LoRA (same data) | {f32['losses'][0]:.3f} ->"
    f" {f32['losses'][-1]:.3f} |",
    f"| peak RSS of the whole run (load, train, evaluate, save) | {ours['rss_mb']:.0f} MB |",
    f"| peak RSS of the float32 LoRA (load, train) | {f32['rss_mb']:.0f} MB |",
    f"| base Q8_0 bytes unchanged by training | {ours['base_unchanged']} |",
    f"| logits rel. L2, ours vs llama.cpp: base file | {r['base']:.4g} |",
    f"| logits rel. L2, ours vs llama.cpp: base + our adapter (lora_path) | {r['lora']:.4g} |",
    f"| ratio adapted / base (target <= 1.5) | {r['lora'] / r['base']:.3f} |",
    f"| how far the adapter moved llama.cpp's logits (rel. L2) | {r['moved']:.4g} |",
    f"| merged file (`save_gguf`): ours vs llama.cpp on it, rel. L2 | {r['merged']:.4g}"
    f" (ratio to the base file's {r['merged'] / r['base']:.3f}) |",
    f"| merged file read back by `load_gguf` = `merged()` params, bit for bit"
    f" | {ours['merged_reads_back']} |",
    f"| argmax agreement with llama.cpp: base / adapted | {r['argmax_base']:.3f} /"
    f" {r['argmax_lora']:.3f} |",
    f"| {GREEDY} greedy tokens after the prompt equal to llama.cpp's with the adapter"
    f" | {r['greedy_equal']} (first {r['greedy_prefix']} equal) |",
  ]
  text = "\n".join(rows)
  print(text)
  print(json.dumps(dict(ours=ours["greedy"], llama=llama["lora"]["greedy"])))
  if args.write:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    build, _ = describe(**query(args.llama_cpp_python))
    header = f"{stamp}. Machine: {machine()}. {build}"
    note = (
      f"SmolLM2-135M-Instruct Q4_1 (package index, Apache-2.0) requantized to Q8_0 at load;"
      f" LoRA rank {args.rank}, alpha {args.alpha} on attn_q/k/v/output and ffn_gate/up/down of"
      f" all 30 layers, AdamW lr {args.lr}; text: the Python Language Reference"
      f" (pydoc_data.topics, PSF License), topics {', '.join(TRAIN)} for training and"
      f" {', '.join(HELD_OUT)} held out. The adapter goes to llama.cpp as the file"
      " `save_lora_gguf` wrote, through llama-cpp-python's `lora_path`."
    )
    write_section(
      "finetune",
      section(
        "finetune",
        "## Fine-tuning a real GGUF model with LoRA, and the adapter in llama.cpp",
        header,
        "python benchmarks/finetune_gguf.py --llama-cpp-python PY --write",
        [text, note],
      ),
    )


if __name__ == "__main__":
  main()
