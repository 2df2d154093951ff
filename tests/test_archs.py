"""One module an arch: `q8rules/llm/archs/` holds every arch `load_gguf` runs, registered in
`ARCHS`; the generic reader and tensor table name none; a MoE load passes through few modules."""

from __future__ import annotations

import ast
import functools
import importlib
import sys
from collections.abc import Iterable
from pathlib import Path

import jax.numpy as jnp
import pytest

from q8rules.checkpoint.gguf import open_gguf
from q8rules.llm.arch import Arch
from q8rules.llm.archs import ARCHS

PACKAGE = Path(__file__).resolve().parents[1] / "q8rules"
DATA = Path(__file__).parent / "data" / "gguf_models"
ARCH_MODULES = sorted(
  p.stem for p in (PACKAGE / "llm" / "archs").glob("*.py") if p.stem != "__init__"
)
GENERIC = ("llm/config.py", "llm/tensors.py", "llm/arch.py")
"""The modules that read every arch the same way: the reader of the common keys and the
experts' keys, the tensor table and the `Arch` type."""


def docstrings(tree: ast.Module) -> set[int]:
  """The ids of the docstring nodes of `tree` (module, classes, functions) and of the string
  right after an assignment (an attribute's docstring)."""
  out = set()
  for node in ast.walk(tree):
    body = getattr(node, "body", None)
    if not isinstance(body, list):
      continue
    for i, stmt in enumerate(body):
      is_str = isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
      if is_str and isinstance(stmt.value.value, str):
        after_assign = i > 0 and isinstance(body[i - 1], ast.Assign | ast.AnnAssign)
        if i == 0 or after_assign:
          out.add(id(stmt.value))
  return out


def arch_names_in(tree: ast.Module, names: Iterable[str]) -> list[str]:
  """'line: what' for each place of `tree` that names an arch: a string (docstrings aside) that
  is an arch's name or starts with one of its keys ('gemma2.' ...), or an import of an arch's
  module (`q8rules.llm.archs.<module>`)."""
  names = set(names)
  skip = docstrings(tree)
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
      v = node.value
      if v in names or any(v.startswith(n + ".") for n in names):
        out.append(f"{node.lineno}: {v!r}")
    elif isinstance(node, ast.ImportFrom) and node.module:
      modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
      out += [
        f"{node.lineno}: import {m}"
        for m in modules
        if m.startswith("q8rules.llm.archs.") and m.rsplit(".", 1)[1] in ARCH_MODULES
      ]
    elif isinstance(node, ast.Import):
      out += [
        f"{node.lineno}: import {a.name}"
        for a in node.names
        if a.name.startswith("q8rules.llm.archs.")
      ]
  return out


def test_generic_modules_name_no_arch():
  """The metadata's reader, the tensor table and `Arch` hold no arch's name: what differs per
  arch is its module's."""
  found = {
    path: hits
    for path in GENERIC
    if (hits := arch_names_in(ast.parse((PACKAGE / path).read_text()), ARCHS))
  }
  assert found == {}


def test_arch_name_check_catches_a_violation():
  code = (
    '"""Reads gemma2 files."""\n'
    "from q8rules.llm.archs import gpt_oss\n"
    "import q8rules.llm.archs.gemma4\n"
    "def f(arch, meta):\n"
    '  """For gemma3 too."""\n'
    '  if arch == "gemma2":\n'
    '    return meta.get("gemma3.final_logit_softcapping", "llama-ish")\n'
  )
  assert arch_names_in(ast.parse(code), ARCHS) == [
    "2: import q8rules.llm.archs.gpt_oss",
    "3: import q8rules.llm.archs.gemma4",
    "6: 'gemma2'",
    "7: 'gemma3.final_logit_softcapping'",
  ]


def test_each_arch_is_one_module_in_the_table():
  """Every module of q8rules/llm/archs/ builds one `Arch` (its `ARCH`), `ARCHS` holds exactly
  those, and `q8rules.llm.SUPPORTED_ARCHS` is that table."""
  import q8rules.llm

  arches = {m: importlib.import_module(f"q8rules.llm.archs.{m}").ARCH for m in ARCH_MODULES}
  assert all(isinstance(a, Arch) for a in arches.values())
  assert {a.name: a for a in arches.values()} == ARCHS
  assert sorted(m.replace("_", "-") for m in arches) == sorted(ARCHS)
  assert q8rules.llm.SUPPORTED_ARCHS is ARCHS


@functools.cache
def f32_files_by_arch() -> dict[str, list[Path]]:
  """`general.architecture` -> the tiny F32 test files of that arch."""
  out: dict[str, list[Path]] = {}
  for f in sorted(DATA.glob("tiny-*-f32.gguf")):
    ckpt = open_gguf(f)
    try:
      out.setdefault(ckpt.arch, []).append(f)
    finally:
      ckpt.close()
  return out


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_each_arch_has_a_file_checked_against_llama_cpp(name):
  """Each registered arch has a tiny F32 file of its own (`general.architecture`) and
  llama.cpp's outputs on it (made by scripts/make_gguf_references.py and the scripts it
  calls), which its tests load."""
  files = f32_files_by_arch().get(name, [])
  assert files, f"no tests/data/gguf_models/tiny-*-f32.gguf of arch {name!r}"
  for f in files:
    assert f.with_name(f.name.removesuffix("-f32.gguf") + ".npz").exists(), f


LOADER = ("q8rules.llm", "q8rules.models")
"""The packages whose modules a load passes through (the loader, its archs, the model)."""
ONE_MODULE = ("q8rules.llm.tokenizer",)
"""Packages counted as one module: what the loader calls through their interface."""
MAX_MODULES = 15


def modules_run(call) -> list[str]:
  """The q8rules modules whose functions run during `call()`, in the order first entered, each
  consecutive stay counted once (module bodies, run at import, are not counted)."""
  seen: list[str] = []

  def profile(frame, event, arg):
    if event != "call" or frame.f_code.co_name == "<module>":
      return
    name = frame.f_globals.get("__name__", "")
    if name.startswith("q8rules.") and (not seen or seen[-1] != name):
      seen.append(name)

  sys.setprofile(profile)
  try:
    call()
  finally:
    sys.setprofile(None)
  return seen


def passed_through(modules: list[str]) -> list[str]:
  """The distinct modules of `LOADER` in `modules`, a package of `ONE_MODULE` as one."""
  out = []
  for m in modules:
    if not m.startswith(tuple(p + "." for p in LOADER)):
      continue
    m = next((p for p in ONE_MODULE if m.startswith(p + ".")), m)
    if m not in out:
      out.append(m)
  return out


def test_module_count_catches_a_spread():
  calls = ["q8rules.llm.load", "q8rules.checkpoint.gguf.read", "q8rules.llm.config"]
  calls += [f"q8rules.llm.tokenizer.m{i}" for i in range(3)] + ["q8rules.models.x"]
  calls += [f"q8rules.llm.spread{i}" for i in range(13)]
  found = passed_through(calls)
  assert found[:4] == [
    "q8rules.llm.load",
    "q8rules.llm.config",
    "q8rules.llm.tokenizer",
    "q8rules.models.x",
  ]
  assert len(found) == 17 > MAX_MODULES


@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss", "gemma4-moe"])
def test_a_moe_load_passes_through_few_modules(name):
  """A `load_gguf` of a tiny MoE file passes through at most 15 modules, and of the archs' only
  its own.

  "Passes through" means: a function of the module runs during the load (`sys.setprofile`'s
  call events; a module's body, run when it is imported, does not count), for the modules of
  the loader, its archs and the model (`q8rules.llm`, `q8rules.models`), the tokenizer package
  counted as one (the loader calls it through `GGUFTokenizer.from_metadata`). The libraries
  the loader calls through their interfaces (the GGUF reader `q8rules.checkpoint`, the
  providers, the kernels, the Q8_0 core) are not counted.
  """
  from q8rules.llm import load_gguf

  path = DATA / f"tiny-{name}-q8_0.gguf"
  load_gguf(path, dtype=jnp.float32, progress=False)  # imports done: only calls are counted
  ran = modules_run(lambda: load_gguf(path, dtype=jnp.float32, progress=False))
  modules = passed_through(ran)
  assert len(modules) <= MAX_MODULES, modules
  archs = {m for m in ran if m.startswith("q8rules.llm.archs.")}
  own = f"q8rules.llm.archs.{name.split('-moe')[0].replace('-', '_')}"
  assert archs <= {own}, archs
