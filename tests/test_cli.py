"""The command line (q8rules/cli): subcommands, one-line errors with their exit status, the text
alone on stdout, honest rates, the sampling flags reaching the sampler, --threads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from q8rules.cli import main, parser
from q8rules.cli import run as run_cmd
from q8rules.cli.rates import decode_rate
from q8rules.engine.sampling import SamplingParams
from q8rules.llm import load_gguf

DATA = Path(__file__).parent / "data" / "gguf_models"
QWEN2 = DATA / "tiny-qwen2-q8_0.gguf"


def execute(*args: str) -> dict:
  """`q8rules run ARGS` in this process; what it measured."""
  return run_cmd.execute(parser().parse_args(["run", *args, "--no-progress"]))


def test_run_streams_the_text_and_the_numbers(capsys):
  out = execute(str(QWEN2), "-p", "The quick brown fox", "-n", "8", "--float32")
  m = load_gguf(QWEN2, dtype=jnp.float32)
  assert out["prompt_ids"] == m.tokenizer.encode("The quick brown fox")
  stop = sorted(m.tokenizer.eog_ids)
  assert out["new_ids"] == m.generate(out["prompt_ids"], 8, stop_ids=stop)
  printed = capsys.readouterr()
  assert printed.out == m.tokenizer.decode(out["new_ids"]) + "\n"  # the text alone
  assert "prefill: " in printed.err and "decode: " in printed.err and "loaded in" in printed.err


@pytest.mark.slow
def test_stdout_holds_only_the_text(tmp_path):
  """`python -m q8rules run FILE -p ... -n 32 > out.txt`: out.txt is the generated text."""
  out = tmp_path / "out.txt"
  with open(out, "w") as f:
    proc = subprocess.run(
      [sys.executable, "-m", "q8rules", "run", str(QWEN2), "-p", "Hello", "-n", "32", "--float32"],
      stdout=f,
      stderr=subprocess.PIPE,
      text=True,
    )
  assert proc.returncode == 0, proc.stderr
  m = load_gguf(QWEN2, dtype=jnp.float32)
  ids = m.tokenizer.encode("Hello")
  new = m.generate(ids, 32, stop_ids=sorted(m.tokenizer.eog_ids))
  assert out.read_text() == m.tokenizer.decode(new) + "\n"
  assert "decode: " in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_sampling_flags_reach_the_sampler(capsys):
  args = ["-p", "Hello", "-n", "6", "--float32", "--temp", "0.8", "--top-k", "7"]
  args += ["--top-p", "0.9", "--min-p", "0.05", "--repeat-penalty", "1.2", "-s", "3"]
  out = execute(str(QWEN2), *args)
  m = load_gguf(QWEN2, dtype=jnp.float32)
  sampler = SamplingParams(0.8, top_k=7, top_p=0.9, min_p=0.05, repeat_penalty=1.2, seed=3)
  want = m.generate(out["prompt_ids"], 6, sampler=sampler, stop_ids=sorted(m.tokenizer.eog_ids))
  assert out["new_ids"] == want


def test_empty_prompt_starts_from_bos():
  out = execute(str(QWEN2), "-p", "", "-n", "2", "--float32")
  bos = load_gguf(QWEN2).tokenizer.bos_id
  assert out["prompt_ids"] == [bos]


def test_help_lists_every_command(capsys):
  with pytest.raises(SystemExit) as e:
    main(["--help"])
  assert e.value.code == 0
  text = capsys.readouterr().out
  for command in ("demo", "run", "chat"):
    assert f"  {command} " in text and f"q8rules {command} " in text  # listed, with an example


def test_decode_rate_arithmetic():
  """After the first chunk when tokens came after it; else from the first token; n/a below 2."""
  assert decode_rate([], 16).per_s is None and decode_rate([1.0], 16).describe().startswith("n/a")
  stamps = [0.0] + [2.0] * 16 + [2.5] * 16 + [3.0] * 16  # first, then three chunks of 16
  r = decode_rate(stamps, 16)
  assert r.warm and r.tokens == 32 and r.seconds == 1.0 and r.per_s == 32.0
  assert "over 32 tokens (the last 32 of 49: the first 17 wait on the decode program's" in (
    r.describe()
  ), r.describe()  # why not all 49 (it said 'over 32 tokens' alone)
  early = [0.0] + [0.5] * 12  # stopped inside the first chunk: 12 tokens in 0.5 s, cold
  r = decode_rate(early, 16)
  assert not r.warm and r.per_s == 24.0 and "compilation" in r.describe()


def bad_files(tmp_path: Path) -> dict[str, Path]:
  from tests.test_llm_gguf_errors import rewrite_to

  cut = tmp_path / "cut.gguf"
  data = QWEN2.read_bytes()
  cut.write_bytes(data[: len(data) - 5000])
  return {
    "missing": tmp_path / "nope.gguf",
    "dir": tmp_path,
    "notgguf": Path(__file__),
    "cut": cut,
    "arch": rewrite_to(tmp_path, "mamba.gguf", arch="mamba"),
  }


GOOD = str(QWEN2)
BAD = [  # (name, arguments ({x}: a file of bad_files), exit status, a piece of the message)
  ("missing file", ["run", "{missing}"], 1, "No such file"),
  ("a directory", ["run", "{dir}"], 1, "Is a directory"),
  ("not a GGUF", ["run", "{notgguf}"], 1, "not a GGUF file"),
  ("truncated", ["run", "{cut}"], 1, "truncated"),
  ("unsupported arch", ["run", "{arch}"], 1, "mamba"),
  ("ids outside the vocab", ["run", GOOD, "--ids", "1,99999"], 2, "outside the vocabulary"),
  ("ids not ints", ["run", GOOD, "--ids", "1,x"], 2, "not comma-separated integers"),
  ("no ids", ["run", GOOD, "--ids", ","], 2, "no token id"),
  ("zero tokens", ["run", GOOD, "-n", "0"], 2, "integer >= 1"),
  ("negative tokens", ["run", GOOD, "-n", "-3"], 2, "integer >= 1"),
  ("negative temperature", ["run", GOOD, "--temp", "-1"], 2, "number >= 0"),
  ("nan temperature", ["run", GOOD, "--temp", "nan"], 2, "number >= 0"),
  ("top-p zero", ["run", GOOD, "--top-p", "0"], 2, "(0, 1]"),
  ("top-p above one", ["run", GOOD, "--top-p", "1.5"], 2, "(0, 1]"),
  ("min-p above one", ["run", GOOD, "--min-p", "2"], 2, "[0, 1]"),
  ("negative top-k", ["run", GOOD, "--top-k", "-1"], 2, "integer >= 0"),
  ("zero penalty", ["run", GOOD, "--repeat-penalty", "0"], 2, "number > 0"),
  ("zero threads", ["run", GOOD, "-t", "0"], 2, "integer >= 1"),
  ("too many threads", ["run", GOOD, "-t", "100000"], 2, "may use"),
  ("unknown command", ["frobnicate"], 2, "invalid choice"),
  ("unknown option", ["run", GOOD, "--frob"], 2, "unrecognized arguments"),
  ("bad quantize", ["run", GOOD, "--quantize", "q4_0"], 2, "invalid choice"),
  ("no model", ["run"], 2, "required: model"),
  ("prompt past the context", ["run", GOOD, "-p", "Hi", "-n", "1000"], 2, "exceed the context"),
  ("ctx past the model's", ["run", GOOD, "-p", "Hi", "-c", "100000"], 2, "the model's context"),
  ("unreadable prompt file", ["run", GOOD, "-f", "{missing}"], 2, "No such file"),
  ("chat without a template", ["chat", GOOD, "-p", "hi"], 1, "no chat template"),
  ("chat bad tokens", ["chat", GOOD, "-n", "0"], 2, "integer >= 1"),
]


@pytest.mark.parametrize(("name", "argv", "status", "said"), BAD, ids=[b[0] for b in BAD])
def test_bad_invocation_is_one_line(name, argv, status, said, tmp_path, capsys):
  files = bad_files(tmp_path) if any("{" in a for a in argv) else {}
  argv = [a.format(**files) for a in argv] + ["--no-progress"] * (
    argv[0] == "run" and len(argv) > 1
  )
  with pytest.raises(SystemExit) as e:
    main(argv)
  assert e.value.code == status, (name, e.value.code)
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if line.startswith("q8rules: error:")]
  assert len(lines) == 1 and said in lines[0], err
  assert "Traceback" not in err


def test_entry_point_errors_without_traceback(tmp_path):
  """The real entry point (a fresh process): one line, status 1, no traceback; --debug shows
  the traceback."""
  cmd = [sys.executable, "-m", "q8rules", "run", str(tmp_path / "nope.gguf")]
  proc = subprocess.run(cmd, capture_output=True, text=True)
  assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
  assert proc.stderr.startswith("q8rules: error: ") and "Traceback" not in proc.stderr
  debug = subprocess.run([*cmd, "--debug"], capture_output=True, text=True)
  assert debug.returncode == 1 and "Traceback" in debug.stderr


@pytest.mark.slow
def test_threads_limit_the_process(tmp_path):
  """`-t 1`: the process runs on one CPU (its affinity) with XLA told one thread."""
  code = (
    "import os, sys\n"
    "from q8rules.cli import main\n"
    "status = main(['run', sys.argv[1], '-p', 'Hi', '-n', '2', '-t', '1', '--no-progress'])\n"
    "print(status, len(os.sched_getaffinity(0)), 'intra_op_parallelism_threads=1' in"
    " os.environ['XLA_FLAGS'])\n"
  )
  proc = subprocess.run([sys.executable, "-c", code, str(QWEN2)], capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.splitlines()[-1] == "0 1 True"


@pytest.mark.slow
def test_act_qtype_runs_the_q8_0_activation_model():
  """`--act-qtype q8_0`: the tokens are those of `load_gguf(..., act_qtype='q8_0')`."""
  out = execute(str(QWEN2), "--ids", "1,5,9", "-n", "6", "--float32", "--act-qtype", "q8_0")
  m = load_gguf(QWEN2, dtype=jnp.float32, act_qtype="q8_0")
  assert out["new_ids"] == m.generate([1, 5, 9], 6, stop_ids=sorted(m.tokenizer.eog_ids))
