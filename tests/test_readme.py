"""Every ```python block of README.md and of the docs pages it sends a user to (`PAGES`) runs
as written.

The convention (README.md says it too): a block runs on its own, in a fresh
namespace and an empty working directory. The names it uses but does not
define are the user's own, and its `# yours:` comment line lists them:

    # yours: model (a Flax linen model), key, inputs, float_params

Entries are comma-separated names, each optionally followed by a description in
parentheses; an entry in quotes ('model-q8_0.gguf') is a file the block reads.
`World` below supplies a small value for each: a two-layer
`q8rules.models.Transformer` plays the user's linen model, a small nnx MLP the
user's nnx model. A block that needs several devices says so in a comment
("# 4 devices ..."): it runs in a subprocess with that many forced host devices.

A block that says "# ... 2 processes" is a `jax.distributed` script: it runs as that many
processes, each given its process id as `sys.argv[1]` (its coordinator's port, localhost:12355
as written, moved to a free one), and every process must print the same last line.

A new block is picked up by itself; one that declares a name `World` does not
know fails, asking for it to be added here.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
PAGES = [README] + [
  README.parent / "docs" / name
  for name in ("kernels.md", "numerics.md", "checkpoints.md", "multihost.md", "lora.md")
]
"""The pages whose ```python blocks run as written."""

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_YOURS = re.compile(r"^# yours:(.*)$", re.M)
_DEVICES = re.compile(r"^#.*?\b(\d+) devices\b", re.M)
_PROCESSES = re.compile(r"^#.*?\b(\d+) processes\b", re.M)
_COORDINATOR = "localhost:12355"


def python_blocks(text: str | None = None) -> list[tuple[str, str]]:
  """('page:line', source) of every ```python block of `PAGES` (of `text` alone, if given)."""
  pages = [("text", text)] if text is not None else [(p.name, p.read_text()) for p in PAGES]
  return [
    (f"{name}:{body[: m.start()].count(chr(10)) + 2}", m.group(1))
    for name, body in pages
    for m in _BLOCK.finditer(body)
  ]


def declared(source: str) -> list[str]:
  """The names (and 'quoted' files) a block's `# yours:` lines list."""
  out = []
  for line in _YOURS.findall(source):
    while (stripped := re.sub(r"\([^()]*\)", "", line)) != line:  # descriptions, nested too
      line = stripped
    out += [e.strip() for e in line.split(",") if e.strip()]
  return out


def devices_needed(source: str) -> int:
  m = _DEVICES.search(source)
  return int(m.group(1)) if m else 1


def processes_needed(source: str) -> int:
  m = _PROCESSES.search(source)
  return int(m.group(1)) if m else 1


class World:
  """The user's own names, small. Each attribute is one name a block may declare; a
  quoted file name maps to a method writing that file into the working directory.
  Values are made once per process (`WORLD`) and shared by the blocks."""

  @functools.cached_property
  def config(self):
    from q8rules.models import TransformerConfig

    return TransformerConfig(
      vocab=128,
      dim=64,
      layers=1,
      heads=2,
      kv_heads=1,
      head_dim=32,
      ffn=128,
      context_length=16,
      scan_layers=False,  # the user's model names its blocks layers_0, ...
    )

  @functools.cached_property
  def model(self):
    from q8rules.models import Transformer

    return Transformer(self.config)

  @functools.cached_property
  def key(self):
    import jax

    return jax.random.key(0)

  @functools.cached_property
  def inputs(self):
    import jax.numpy as jnp
    import numpy as np

    from q8rules.models import init_cache

    tokens = np.random.default_rng(0).integers(0, self.config.vocab, (1, 8))
    return (jnp.asarray(tokens, jnp.int32), init_cache(self.config, 16), 0)

  @functools.cached_property
  def float_params(self):
    import jax

    return jax.jit(self.model.init)(self.key, *self.inputs)["params"]

  @functools.cached_property
  def rules(self):
    import q8rules

    return [q8rules.Q8Rule()]

  @functools.cached_property
  def abstract_q8_params(self):
    import jax
    import qwix

    import q8rules

    q8_model = qwix.quantize_model(self.model, q8rules.Q8Provider(self.rules))
    return jax.eval_shape(q8_model.init, self.key, *self.inputs)["params"]

  @functools.cached_property
  def q8_params(self):
    import q8rules

    return q8rules.quantize_params(self.float_params, self.abstract_q8_params)

  @functools.cached_property
  def qat_params(self):
    return self.float_params  # QAT params are float, of the float model's tree

  @property
  def nnx_model(self):  # fresh each time: quantize_model changes it in place
    return _nnx_mlp(0)

  @functools.cached_property
  def float_state(self):
    from flax import nnx

    return nnx.state(_nnx_mlp(1))

  @functools.cached_property
  def x(self):
    import jax

    return jax.random.normal(jax.random.key(2), (2, 64))

  @functools.cached_property
  def w(self):
    import jax

    return jax.random.normal(jax.random.key(3), (64, 32))

  def file_model_q8_0_gguf(self, path: Path) -> None:
    """A llama.cpp-named Q8_0 GGUF holding the user's model's first MLP down projection."""
    import jax.numpy as jnp

    import q8rules
    from q8rules.checkpoint import gguf

    down = self.float_params["layers_0"]["mlp"]["down"]["kernel"]
    a = q8rules.quantize(down, axis=0, scale_dtype=jnp.float16)
    gguf.save(path, {"blk.0.ffn_down.weight": a}, arch="llama")

  def value(self, entry: str, workdir: Path):
    """The value of a declared name (None for a file, which is written into `workdir`)."""
    if entry[0] in "'\"":
      name = entry.strip("'\"")
      maker = getattr(self, "file_" + re.sub(r"\W", "_", name), None)
      if maker is None:
        raise LookupError(f"no file {name!r} in tests/test_readme.py World: add file_...()")
      maker(workdir / name)
      return None
    if not entry.isidentifier() or entry.startswith("_") or not hasattr(type(self), entry):
      raise LookupError(
        f"the README declares {entry!r} as the user's own; add a small value for it to"
        " World in tests/test_readme.py"
      )
    value = getattr(self, entry)
    if isinstance(value, dict):  # the block may change its tree, not the cached one
      return jax.tree.map(lambda leaf: leaf, value)
    return value


def _nnx_mlp(seed: int):
  """The user's nnx model: (..., 64) -> (..., 32)."""
  import jax
  from flax import nnx

  class Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.up = nnx.Linear(64, 96, rngs=rngs)
      self.down = nnx.Linear(96, 32, rngs=rngs)

    def __call__(self, x):
      return self.down(jax.nn.relu(self.up(x)))

  return Mlp(nnx.Rngs(seed))


def run_block(index: int, workdir: str) -> None:
  """Run README block `index` in `workdir`, the declared names filled in (warnings shown).

  A block that names a file of this repository (`tests/data/...`) says it runs from the
  repository root, and runs there."""
  line, source = python_blocks()[index]
  if "tests/data/" in source:
    workdir = str(README.parent)
  namespace = {"__name__": "__readme__"}
  for entry in declared(source):
    value = WORLD.value(entry, Path(workdir))
    if value is not None:
      namespace[entry] = value
  cwd = os.getcwd()
  os.chdir(workdir)
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      exec(compile(source, f"{line} (a ```python block)", "exec"), namespace)
  finally:
    os.chdir(cwd)


WORLD = World()
BLOCKS = python_blocks()


def test_the_readme_has_python_blocks():
  assert len(BLOCKS) >= 5


def test_declared_parses_names_descriptions_and_files():
  src = "# yours: model (a model (linen), with commas), key, 'a.gguf'\n# yours: x\nx = 1\n"
  assert declared(src) == ["model", "key", "'a.gguf'", "x"]
  assert devices_needed("# 4 devices (on CPU: ...)\n") == 4
  assert devices_needed("x = 1  # no device count\n") == 1
  assert processes_needed("# serve.py: 2 processes (python serve.py 0 & ...)\n") == 2


def run_processes(source: str, n: int, workdir: Path) -> list[str]:
  """Run a `jax.distributed` block as `n` processes from the repository root; their stdouts."""
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    port = sock.getsockname()[1]
  script = workdir / "block.py"
  script.write_text(source.replace(_COORDINATOR, f"localhost:{port}"))
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)
  procs = [
    subprocess.Popen(
      [sys.executable, str(script), str(i)],
      cwd=README.parent,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(n)
  ]
  outs = []
  try:
    for i, p in enumerate(procs):
      out, err = p.communicate(timeout=300)
      assert p.returncode == 0, f"process {i} failed:\n{out}\n{err[-3000:]}"
      outs.append(out)
  finally:
    for p in procs:
      p.kill()
  return outs


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[line for line, _ in BLOCKS])
def test_readme_block_runs(index, tmp_path):
  source = BLOCKS[index][1]
  if (processes := processes_needed(source)) > 1:
    assert _COORDINATOR in source, f"a {processes}-process block without {_COORDINATOR}"
    lasts = [out.strip().splitlines()[-1] for out in run_processes(source, processes, tmp_path)]
    # each prints its process index first: the rest must be the same everywhere
    assert len({last.split(" ", 1)[1] for last in lasts}) == 1, lasts
    return
  n = devices_needed(source)
  if n <= 1:
    run_block(index, str(tmp_path))
    return
  env = dict(os.environ)
  env["XLA_FLAGS"] = (
    env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
  ).strip()
  env["JAX_PLATFORMS"] = "cpu"
  root = README.parent
  env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  proc = subprocess.run(
    [
      sys.executable,
      "-c",
      f"from tests.test_readme import run_block; run_block({index}, {str(tmp_path)!r})",
    ],
    env=env,
    cwd=root,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
