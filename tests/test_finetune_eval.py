"""Fine-tuning with a held-out evaluation (q8rules/lora/heldout.py, finetune_loop.py and `q8rules
finetune`): the held-out tokens are never trained on, the eval loss is the token-weighted mean
over them, the run says the token count and epochs first, warns when the eval loss rises twice
in a row and writes the best adapter; the command's errors come before any training."""

from __future__ import annotations

import io
import os
import re
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from q8rules.cli import main
from q8rules.llm import load_gguf
from q8rules.lora import heldout
from q8rules.lora.datasets import text_windows
from q8rules.lora.fit import EvalHistory
from q8rules.lora.gguf_file import read_lora_gguf
from q8rules.lora.trainer import LoraTrainer

QWEN2 = Path(__file__).parent / "data" / "gguf_models" / "tiny-qwen2-q8_0.gguf"


def words_text(n: int, seed: int = 0) -> str:
  """`n` words drawn from 225 made-up ones, in sentences: no run of 13 tokens stands twice, so
  its held-out part is unseen by training (a repeated sentence is not)."""
  rng = np.random.default_rng(seed)
  syllables = [
    "ka",
    "lo",
    "mi",
    "ne",
    "su",
    "ta",
    "ri",
    "po",
    "ve",
    "da",
    "gu",
    "ho",
    "ze",
    "bi",
    "fu",
  ]
  words = [a + b for a in syllables for b in syllables]
  picked = rng.choice(words, n)
  return " ".join(w + ("." if i % 9 == 8 else "") for i, w in enumerate(picked)) + "\n"


TEXT = words_text(320)
REPEATING = "The quick brown fox jumps over the lazy dog. A lazy dog sleeps in the sun. " * 20


def test_held_out_windows_are_spread_and_never_drawn():
  spans = heldout.held_out_spans(1000, 0.1, 32)
  assert sum(b - a for a, b in spans) == 100 and len(spans) == 4
  assert spans[0][0] > 0 and spans[-1][1] < 1000  # spread over the text, not its end
  ids = np.arange(1000)
  draw = text_windows(ids, 32, 64, seed=3, exclude=spans)
  held = np.zeros(1000, bool)
  for a, b in spans:
    held[a:b] = True
  for _ in range(20):
    tokens, _ = draw()
    assert not held[tokens].any()
  assert heldout.held_out_spans(1000, 0.0, 32) == []
  short = heldout.held_out_spans(600, 0.1, 128)  # a short text: one window of 60 in its middle
  assert short == [(270, 330)] and heldout.longest_gap(600, short) == 270


def test_repeats_of_the_training_text_are_found_token_by_token():
  rng = np.random.default_rng(5)
  train = rng.integers(0, 1000, 400)
  held = rng.integers(0, 1000, 60)
  assert not heldout.repeats_training(held, [train]).any()  # unseen
  held[10:30] = train[100:120]  # 20 tokens said again: all of them flagged, nothing else
  hit = heldout.repeats_training(held, [train[:50], train[50:]])
  assert hit[10:30].all() and hit.sum() == 20
  held[40:52] = train[200:212]  # 12 in a row: below GRAM, an ordinary phrase
  assert heldout.repeats_training(held, [train]).sum() == 20 and heldout.GRAM == 13
  rows, dropped = heldout.without_repeats([(held, np.ones(60, bool))], [train])
  assert dropped == 20 and rows[0][1].sum() == 40
  spans = [(100, 120), (300, 310)]
  parts = heldout.training_streams(np.arange(400), spans)
  assert [(int(p[0]), int(p[-1])) for p in parts] == [(0, 99), (120, 299), (310, 399)]


def test_items_split_by_whole_conversations():
  train, held = heldout.split_items(list(range(20)), 0.1)
  assert len(held) == 2 and not set(train) & set(held) and sorted(train + held) == list(range(20))
  assert heldout.split_items([1], 0.1) == ([1], [])


@pytest.mark.slow
def test_eval_loss_is_the_token_weighted_mean():
  """Rows of different lengths, padded into batches: the mean over every target token, as one
  pass over the concatenated rows gives."""
  m = load_gguf(QWEN2, dtype=jnp.float32).with_lora(rank=2, alpha=4.0)
  trainer = LoraTrainer(m, optax.adam(1e-3))
  state = trainer.init()
  ids = np.asarray(m.tokenizer.encode(TEXT))
  rows = heldout.text_rows(ids, [(0, 20), (40, 52)])
  batches = heldout.eval_batches(rows, 4, 32)
  assert [t.shape for t, _ in batches] == [(4, 20)] and heldout.targets(batches) == 30
  want = sum(float(trainer.loss(state, t[None], None)) * (len(t) - 1) for t, _ in rows) / 30
  assert trainer.evaluate(state, batches) == pytest.approx(want, rel=1e-5)


def test_history_warns_after_two_rises_and_keeps_the_best():
  h = EvalHistory()
  for step, loss in ((0, 3.0), (10, 2.5), (20, 2.6)):
    h.add(step, loss)
  assert not h.rising and h.best.step == 10
  h.add(30, 2.7)
  assert h.rising and "step 10" in h.warning() and "2.7000 at step 30" in h.warning()


def test_fit_evaluates_and_keeps_the_best_adapters():
  m = load_gguf(QWEN2, dtype=jnp.float32).with_lora(rank=2, alpha=4.0)
  trainer = LoraTrainer(m, optax.adam(3e-2))
  ids = np.asarray(m.tokenizer.encode(TEXT))
  spans = heldout.held_out_spans(len(ids), 0.1, 32)
  held = heldout.eval_batches(heldout.text_rows(ids, spans), 2, 32)
  draw = text_windows(ids, 32, 2, exclude=spans)
  seen = []
  result = trainer.fit(
    trainer.init(), draw, 6, eval_batches=held, eval_every=4, on_eval=lambda e, h: seen.append(e)
  )
  assert [e.step for e in result.history.evals] == [0, 4, 6] == [e.step for e in seen]
  best = result.history.best
  assert result.best_state.step == best.step
  assert trainer.evaluate(result.best_state, held) == pytest.approx(best.loss, rel=1e-5)
  assert len(result.losses) == 6


def finetune(tmp_path: Path, *extra: str, text: str = TEXT) -> tuple[int, str, Path]:
  """`q8rules finetune` on the tiny qwen2 with stderr written to a file, as `2> log.txt` does:
  (status, the file's text, the adapter path)."""
  notes = tmp_path / "notes.txt"
  notes.write_text(text)
  out = tmp_path / "adapter.gguf"
  args = [str(QWEN2), "--text", str(notes), "--out", str(out), "--rank", "2", "--batch", "2"]
  args += ["--length", "32", *extra]
  log = tmp_path / "log.txt"
  with open(log, "w") as f:
    saved, sys.stderr = sys.stderr, f
    try:
      status = main(["finetune", *args])
    finally:
      sys.stderr = saved
  return status, log.read_text(), out


@pytest.mark.slow
def test_finetune_reports_evaluations_and_writes_the_best(tmp_path):
  """A learning rate that overfits the text: the eval loss falls, then rises at two evaluations
  in a row; the warning names the steps; the adapter written is the best step's."""
  status, log, out = finetune(
    tmp_path, "--steps", "12", "--lr", "5e-2", "--eval-every", "2", "--log-every", "2"
  )
  assert status == 0, log
  assert "\r" not in log  # no progress bar redraws in a log file
  lines = log.splitlines()
  assert re.search(r"notes\.txt: [\d,]+ tokens: [\d,]+ to train on; \d+ held out", log)
  assert re.search(r"12 steps of 2 x 32 tokens make [\d.]+ epochs .*one epoch: [\d.]+ steps", log)
  assert any(line.startswith("before training: eval loss ") for line in lines)
  evals = [float(x) for x in re.findall(r"eval loss ([\d.]+), perplexity", log)]
  assert len(evals) == 7  # before, steps 2, 4, ..., 12
  assert re.search(r"step 4: train loss [\d.]+ \(mean of 2 steps\); eval loss", log)
  assert re.search(r"[\d.]+ training tokens/s after the first step", log)
  best = int(np.argmin(evals))
  rose = any(evals[i] < evals[i + 1] < evals[i + 2] for i in range(len(evals) - 2))
  assert rose == ("warning: the eval loss rose at two evaluations in a row" in log)
  written = re.search(r"wrote .*adapter\.gguf: the adapter of step (\d+)", log)
  assert written and int(written.group(1)) == 2 * best
  ppl = re.findall(r"eval loss [\d.]+, perplexity ([\d.]+)", log)
  assert lines[-1].startswith(f"eval perplexity {ppl[0]} before -> {ppl[best]} after")
  assert read_lora_gguf(out).alpha == 32.0


@pytest.mark.slow
def test_held_out_text_that_training_reads_is_left_out_with_a_warning(tmp_path):
  """A text that says its paragraphs twice: the held-out windows inside a repeat would be read
  from memory (the eval perplexity fell to ~1 while a truly unseen paragraph's rose); those
  tokens leave the evaluation, and the log says how many. All of them: no evaluation."""
  a, b = words_text(150, seed=1), words_text(150, seed=2)
  status, log, _ = finetune(tmp_path, "--steps", "2", "--eval-every", "2", text=a + b + a)
  assert status == 0, log
  said = re.search(r"warning: ([\d,]+) of the ([\d,]+) held-out tokens repeat the training", log)
  assert said, log
  dropped, total = int(said.group(1).replace(",", "")), int(said.group(2).replace(",", ""))
  assert 0 < dropped < total
  assert "before training: eval loss" in log  # the rest is evaluated


@pytest.mark.slow
def test_held_out_text_all_repeated_is_no_evaluation_and_unrepeated_text_no_warning(tmp_path):
  status, log, _ = finetune(tmp_path, "--steps", "2", text=REPEATING)
  assert status == 0, log
  assert re.search(r"warning: all [\d,]+ held-out tokens repeat the training text verbatim", log)
  assert "eval loss" not in log, log
  status, log, _ = finetune(tmp_path, "--steps", "2", text=TEXT)  # nothing repeats: no warning
  assert status == 0 and "repeat the training" not in log and "eval loss" in log, log


@pytest.mark.slow
def test_the_warning_fires_on_a_rise(tmp_path):
  """The tiny model memorises a repeated sentence at a high learning rate: the held-out loss
  rises at two evaluations in a row and the warning says so."""
  status, log, _ = finetune(
    tmp_path, "--steps", "16", "--lr", "2e-1", "--eval-every", "1", "--no-progress"
  )
  assert status == 0, log
  evals = [float(x) for x in re.findall(r"eval loss ([\d.]+), perplexity", log)]
  rose = any(evals[i] < evals[i + 1] < evals[i + 2] for i in range(len(evals) - 2))
  assert rose and log.count("warning: the eval loss rose at two evaluations in a row") == 1


@pytest.mark.parametrize(
  ("argv", "said"),
  [
    (["--out", "/no/such/dir/adapter.gguf"], "--out /no/such/dir/adapter.gguf: the folder"),
    (["--out", "{tmp}"], "a directory, not a file"),
    (["--merged", "/no/such/dir/m.gguf"], "--merged /no/such/dir/m.gguf: the folder"),
  ],
)
def test_outputs_are_checked_before_the_model_loads(argv, said, tmp_path, capsys, monkeypatch):
  import q8rules.llm.load

  def no_load(*a, **k):
    raise AssertionError("the model loaded before the outputs were checked")

  monkeypatch.setattr(q8rules.llm.load, "load_gguf", no_load)
  notes = tmp_path / "notes.txt"
  notes.write_text(TEXT)
  args = ["finetune", str(QWEN2), "--text", str(notes), "--out", str(tmp_path / "a.gguf")]
  with pytest.raises(SystemExit) as e:
    main([*args, *[a.format(tmp=tmp_path) for a in argv]])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("q8rules: error: ") and said in err, err


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_empty_text_is_a_clear_error(content, tmp_path, capsys):
  notes = tmp_path / "empty.txt"
  notes.write_text(content)
  argv = ["finetune", str(QWEN2), "--text", str(notes), "--out", str(tmp_path / "a.gguf")]
  with pytest.raises(SystemExit) as e:
    main([*argv, "--no-progress"])
  err = capsys.readouterr().err
  assert e.value.code == 2 and f"--text {notes}: the file is empty" in err, err
  assert "ValueError" not in err


def test_adapter_file_follows_the_umask(tmp_path):
  m = load_gguf(QWEN2, dtype=jnp.float32).with_lora(rank=2, alpha=4.0, targets=["attn_q"])
  old = os.umask(0o022)
  try:
    m.save_lora_gguf(tmp_path / "a.gguf")
    os.umask(0o027)
    m.save_lora_gguf(tmp_path / "b.gguf")
  finally:
    os.umask(old)
  assert (tmp_path / "a.gguf").stat().st_mode & 0o777 == 0o644
  assert (tmp_path / "b.gguf").stat().st_mode & 0o777 == 0o640
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf"]  # no temporary left


class Terminal(io.StringIO):
  """A stderr that says it is a terminal, so the bars draw on it."""

  def isatty(self) -> bool:
    return True


@pytest.mark.slow
def test_on_a_terminal_no_log_line_shares_a_bar_line(tmp_path, monkeypatch):
  """With bars up (stderr a terminal), each log line starts a line of its own as the terminal
  shows it (the text after a line's last carriage return)."""
  notes = tmp_path / "notes.txt"
  notes.write_text(TEXT)
  term = Terminal()
  monkeypatch.setattr(sys, "stderr", term)
  argv = ["finetune", str(QWEN2), "--text", str(notes), "--out", str(tmp_path / "a.gguf")]
  assert main([*argv, "--rank", "2", "--batch", "2", "--length", "32", "--steps", "4"]) == 0
  raw = term.getvalue()
  assert "\r" in raw and "finetune:" in raw  # the bar was drawn
  shown = [line.rsplit("\r", 1)[-1] for line in raw.split("\n")]
  logs = [line for line in shown if ("loss" in line or "tokens" in line) and "|" not in line]
  starts = r"(step \d+|before training|training:|wrote |.*notes\.txt:|\d+ steps of)"
  glued = [line for line in logs if not re.match(starts, line)]
  glued += [line for line in shown if re.search(r"\|.*(step \d+: |eval loss|training:)", line)]
  assert logs and not glued, glued
