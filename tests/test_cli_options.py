"""What a new user of the command line meets: every option's help and default, `--version`,
`-c/--ctx`, the prompt from `-f FILE` or stdin, `demo`'s shape checked, the rate lines saying
what they count, and the README's commands runnable as written."""

from __future__ import annotations

import argparse
import io
import re
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from q8rules.cli import COMMANDS, main, parser
from q8rules.llm import load_gguf

ROOT = Path(__file__).resolve().parents[1]
QWEN2 = ROOT / "tests" / "data" / "gguf_models" / "tiny-qwen2-q8_0.gguf"


def subparsers() -> dict[str, argparse.ArgumentParser]:
  top = parser()
  (sub,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
  return dict(sub.choices)


@pytest.mark.parametrize("name", [c.NAME for c in COMMANDS])
def test_every_option_has_help_and_shows_its_default(name):
  p = subparsers()[name]
  formatter = p._get_formatter()
  for action in p._actions:
    if not action.option_strings or action.default == argparse.SUPPRESS:
      continue  # positionals, --help
    if action.help == argparse.SUPPRESS:
      continue  # hidden on purpose
    shown = " ".join(formatter._format_action(action).split())
    assert action.help, f"{name} {action.option_strings}: no help"
    if action.required:  # no default to show ("(default: None)" said there was one)
      assert "(default: " not in shown, f"{name} {action.option_strings}: {shown}"
    else:
      assert "(default: " in shown, f"{name} {action.option_strings}: no default shown:\n{shown}"
  assert "(default: " in p.format_help()


def test_run_chat_and_serve_load_a_model_with_the_same_options():
  load_options = {"--bf16", "--quantize", "--dequantize-other", "--act-qtype", "--no-progress",
                  "--lora", "--lora-scale"}  # fmt: skip
  for name in ("run", "chat", "serve"):
    have = {o for a in subparsers()[name]._actions for o in a.option_strings}
    assert load_options <= have, f"{name} lacks {sorted(load_options - have)}"
  args = parser().parse_args(["serve", str(QWEN2), "--quantize", "q8_0", "--dequantize-other"])
  assert (args.quantize, args.dequantize_other) == ("q8_0", True)


def test_a_required_option_shows_no_default():
  p = subparsers()["finetune"]
  (out,) = [a for a in p._actions if "--out" in a.option_strings]
  assert out.required
  shown = " ".join(p._get_formatter()._format_action(out).split())
  assert "default" not in shown and "adapter file" in shown, shown


def test_finetunes_schedule_line_says_why_its_epochs_are_not_whole():
  from q8rules.cli.finetune_data import EPOCHS, _schedule

  args = argparse.Namespace(steps=None, eval_every=None, batch=4)
  steps, _, line = _schedule(args, 128, per_step=4.0, size=18.0, unit="text")
  assert steps == 9 and EPOCHS == 2  # 2 epochs are 9 whole steps, 36 / 18 = 2.0
  steps, _, line = _schedule(args, 128, per_step=4.0, size=17.0, unit="text")
  assert steps == 9, line  # 8.5 steps for 2 epochs: 9 whole ones read the text 2.1 times
  assert "the fewest whole steps that make 2 epochs" in line and "make 2.1 epochs" in line, line
  assert "None" not in line, line
  given = argparse.Namespace(steps=5, eval_every=None, batch=4)
  assert "fewest" not in _schedule(given, 128, per_step=4.0, size=17.0, unit="text")[2]


def test_version(capsys):
  with pytest.raises(SystemExit) as e:
    main(["--version"])
  assert e.value.code == 0 and re.fullmatch(r"q8rules \S+\n", capsys.readouterr().out)


def execute(capsys, *args: str) -> tuple[str, str]:
  """`q8rules run` on the tiny qwen2 in this process: (stdout, stderr)."""
  assert main(["run", str(QWEN2), "-n", "4", "--no-progress", *args]) == 0
  printed = capsys.readouterr()
  return printed.out, printed.err


def greedy_text(prompt: str, n: int = 4) -> str:
  m = load_gguf(QWEN2, dtype=jnp.float32)
  ids = m.tokenizer.encode(prompt)
  return m.tokenizer.decode(m.generate(ids, n, stop_ids=sorted(m.tokenizer.eog_ids))) + "\n"


@pytest.mark.slow
def test_prompt_from_stdin_and_from_a_file(tmp_path, monkeypatch, capsys):
  """`echo TEXT | q8rules run MODEL` and `-f FILE`: the prompt is that text (not a default)."""
  monkeypatch.setattr(sys, "stdin", io.StringIO("The quick brown fox"))  # a pipe: no terminal
  out, _ = execute(capsys)
  assert out == greedy_text("The quick brown fox")
  prompt = tmp_path / "prompt.txt"
  prompt.write_text("A lazy dog")
  out, err = execute(capsys, "-f", str(prompt))
  assert out == greedy_text("A lazy dog")
  assert "prompt tokens/s" in err and "generated tokens/s" in err


def test_no_prompt_on_a_terminal_is_an_error(monkeypatch, capsys):
  class Terminal:
    def isatty(self) -> bool:
      return True

  monkeypatch.setattr(sys, "stdin", Terminal())
  with pytest.raises(SystemExit) as e:
    main(["run", str(QWEN2), "--no-progress"])
  assert e.value.code == 2 and "no prompt: give -p TEXT, -f FILE" in capsys.readouterr().err


def test_ctx_bounds_the_prompt_and_the_text(capsys):
  with pytest.raises(SystemExit) as e:
    main(["run", str(QWEN2), "-p", "The quick brown fox", "-n", "8", "-c", "6", "--no-progress"])
  err = capsys.readouterr().err
  assert e.value.code == 2 and "exceed the context of 6" in err, err
  with pytest.raises(SystemExit) as e:
    main(["run", str(QWEN2), "-p", "Hi", "--ctx", "100000", "--no-progress"])
  assert e.value.code == 2 and "--ctx 100000: the model's context is" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--layers", "--dim", "--steps"])
def test_demo_rejects_an_empty_model(flag, capsys):
  with pytest.raises(SystemExit) as e:
    main(["demo", flag, "0"])
  err = capsys.readouterr().err
  assert e.value.code == 2 and "is not an integer >= 1" in err and "KeyError" not in err


def bash_commands(text: str) -> list[str]:
  """The command lines of the ```bash blocks of a markdown text."""
  blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
  return [line for b in blocks for line in b.replace("\\\n", " ").splitlines() if line.strip()]


def test_readme_commands_run_as_written():
  """A fresh shell after the README's setup has no `q8rules` or venv `python` on its PATH: each
  command names the venv's (`.venv/bin/...`), and that console script exists."""
  lines = bash_commands((ROOT / "README.md").read_text())
  assert any(line.startswith(".venv/bin/q8rules ") for line in lines)
  for line in lines:
    for command in re.split(r"\s*(?:&&|;|\|)\s*", line):
      first = command.split()[0] if command.split() else ""
      assert first not in ("q8rules", "python", "pip", "jupyter"), line
  assert (Path(sys.executable).parent / "q8rules").exists()
