"""The package's shape: floors that imports respect, no import circle, one module picks the
kernel, Qwix behind one shim."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "q8rules"
FLOORS_PAGE = PACKAGE.parent / "docs" / "kernels.md"
"""The page that shows the floors (a ``` block after `<!-- floors -->`)."""

FLOORS: list[tuple[str, tuple[str, ...]]] = [
  (
    "format",
    (
      "q8rules.q8_0",
      "q8rules.tree_paths",
      "q8rules.timing",
      "q8rules._qwix",
      "q8rules.attention_params",
      "q8rules.lora",
    ),
  ),
  ("kernels", ("q8rules.kernels",)),
  ("layout", ("q8rules.layout",)),
  ("sharding", ("q8rules.sharding",)),
  ("rules", ("q8rules.rules", "q8rules.report")),
  (
    "providers",
    (
      "q8rules.providers",
      "q8rules.lora.placement",
      "q8rules.lora.provider",
      "q8rules.lora.params",
      "q8rules.lora.merge",
    ),
  ),
  ("core", ("q8rules",)),
  (
    "checkpoints, models",
    (
      "q8rules.checkpoint",
      "q8rules.models",
      "q8rules.lora.safetensors_file",
      "q8rules.lora.gguf_file",
    ),
  ),
  ("engine", ("q8rules.engine",)),
  (
    "applications",
    (
      "q8rules.llm",
      "q8rules.cli",
      "q8rules.demo",
      "q8rules.demo_options",
      "q8rules.__main__",
      "q8rules.serve",
      "q8rules.lora.gguf_model",
      "q8rules.lora.convert",
      "q8rules.lora.fuse",
      "q8rules.lora.tree",
      "q8rules.lora.trainer",
      "q8rules.lora.fit",
      "q8rules.lora.heldout",
      "q8rules.lora.datasets",
      "q8rules.lora.loaded",
    ),
  ),
]
"""The floors, lowest first: a module imports only modules on its own floor or below (lazily
or not). A name covers the module and everything under it (`q8rules`, the package's
`__init__`, only itself); the longest name that covers a module places it. docs/kernels.md's
Architecture section shows this table."""

APPLICATIONS = ("q8rules.checkpoint", "q8rules.models", "q8rules.llm")
"""What `import q8rules` must not load (nor gguf, safetensors, tokenizers)."""


def module_name(path: Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
  return {module_name(p): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def imported(tree: ast.Module, name: str, is_package: bool, known: set[str]) -> set[str]:
  """The q8rules modules `name` imports anywhere in its body (lazily or not): `from X import a`
  imports the module X.a when there is one, else (a name defined in X) X itself."""
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        here = name.split(".") if is_package else name.split(".")[:-1]
        base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
      for a in node.names:
        out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
  return {m for m in out if m == "q8rules" or m.startswith("q8rules.")}


def direct_imports() -> dict[str, set[str]]:
  """Module -> the q8rules modules its own import statements name (no implied parent packages)."""
  mods = modules()
  packages = {module_name(p) for p in PACKAGE.rglob("__init__.py")}
  edges = {}
  for name, tree in mods.items():
    targets = set()
    for m in imported(tree, name, name in packages, set(mods)):
      while m not in mods and "." in m:
        m = m.rsplit(".", 1)[0]
      if m != name:
        targets.add(m)
    edges[name] = targets
  return edges


def graph() -> dict[str, set[str]]:
  """`direct_imports`, plus the parent packages each import runs first (their `__init__`)."""
  edges = direct_imports()
  for name, targets in edges.items():
    for m in list(targets):
      parent = m.rsplit(".", 1)[0] if "." in m else None
      while parent and parent != name and not name.startswith(parent + "."):
        targets.add(parent)
        parent = parent.rsplit(".", 1)[0] if "." in parent else None
  return edges


def floor_of(module: str, floors: list[tuple[str, tuple[str, ...]]] = FLOORS) -> int:
  """The index of the floor whose longest covering name covers `module`."""
  best, where = -1, None
  for i, (_, names) in enumerate(floors):
    for n in names:
      covers = module == n or (n != "q8rules" and module.startswith(n + "."))
      if covers and len(n) > best:
        best, where = len(n), i
  if where is None:
    raise AssertionError(f"{module} is on no floor: add it to FLOORS (and docs/kernels.md's table)")
  return where


def upward_imports(
  edges: dict[str, set[str]], floors: list[tuple[str, tuple[str, ...]]] = FLOORS
) -> list[str]:
  """Every import from a floor to a higher one, as 'a (floor) -> b (floor)'."""
  out = []
  for a, targets in sorted(edges.items()):
    fa = floor_of(a, floors)
    for b in sorted(targets):
      fb = floor_of(b, floors)
      if fb > fa:
        out.append(f"{a} ({floors[fa][0]}) -> {b} ({floors[fb][0]})")
  return out


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
  state: dict[str, int] = {}
  stack: list[str] = []

  def visit(n: str) -> list[str] | None:
    state[n] = 1
    stack.append(n)
    for m in sorted(edges.get(n, ())):
      if state.get(m) == 1:
        return stack[stack.index(m) :] + [m]
      if state.get(m) is None and (cycle := visit(m)):
        return cycle
    stack.pop()
    state[n] = 2
    return None

  for n in sorted(edges):
    if state.get(n) is None and (cycle := visit(n)):
      return cycle
  return None


def test_no_upward_import():
  """Each module imports only its own floor or lower ones; every module is on a floor."""
  assert upward_imports(direct_imports()) == []


def test_floors_check_catches_a_violation():
  """A deliberate upward import (the format importing the GGUF loader, lazily inside a
  function) is reported, and so is a module on no floor."""
  tree = ast.parse("def f():\n  from q8rules.llm import load_gguf\n")
  edges = direct_imports()
  found = imported(tree, "q8rules.q8_0", False, set(edges))
  assert "q8rules.llm" in found
  edges["q8rules.q8_0"] = edges["q8rules.q8_0"] | {"q8rules.llm"}
  assert upward_imports(edges) == ["q8rules.q8_0 (format) -> q8rules.llm (applications)"]
  try:
    floor_of("q8rules.newthing.module")
  except AssertionError as e:
    assert "on no floor" in str(e)
  else:
    raise AssertionError("a module on no floor was accepted")


def test_docs_show_the_floors():
  """docs/kernels.md's Architecture section lists the floors as FLOORS has them, top floor
  first."""
  text = FLOORS_PAGE.read_text()
  block = re.search(r"<!-- floors -->\n```\n(.*?)```", text, re.S)
  assert block, f"{FLOORS_PAGE.name}: no floors table (a ``` block after '<!-- floors -->')"
  rows = [line.split("|") for line in block.group(1).strip().splitlines()]
  shown = [(r[0].strip(), tuple(n.strip() for n in r[1].split(","))) for r in rows]
  assert shown == [
    (f, tuple(n.removeprefix("q8rules.") or "q8rules" for n in names))
    for f, names in reversed(FLOORS)
  ]


FILE_LIBRARIES = ("gguf", "safetensors", "tokenizers")
"""What only the applications import (a checkpoint touched)."""

HEAVY = ("jax", "jaxlib", "flax", "qwix", "numpy", *FILE_LIBRARIES)
"""What the command line's parsing and `import q8rules` must not import: a command's work loads
them when it runs."""


def applications_in(loaded: list[str]) -> list[str]:
  """The application modules and file libraries among `loaded` module names."""
  return [m for m in loaded if m.startswith(APPLICATIONS) or m.split(".")[0] in FILE_LIBRARIES]


def loaded_after(code: str) -> list[str]:
  """The modules of `HEAVY` (and of q8rules, but the package itself, its command line and the
  demo's options) that running `code` in a fresh interpreter leaves in sys.modules."""
  probe = (
    f"{code}\n"
    "import sys\n"
    "own = ('q8rules', 'q8rules.demo_options')\n"
    f"print('LOADED', ','.join(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}"
    " or m.startswith('q8rules.') and not m.startswith('q8rules.cli') and m not in own)),"
    " file=sys.stderr)\n"
  )
  out = subprocess.run(
    [sys.executable, "-c", probe], capture_output=True, text=True, cwd=PACKAGE.parent, timeout=300
  )
  line = [t for t in out.stderr.splitlines() if t.startswith("LOADED")]
  assert line, out.stderr
  return [m for m in line[-1].removeprefix("LOADED").strip().split(",") if m]


def test_import_q8rules_loads_nothing_else():
  """`import q8rules` loads no submodule and neither JAX nor numpy: every name resolves on first
  use, and the core's names load the core, not the applications (checkpoint, llm, models) nor
  gguf, safetensors or tokenizers."""
  assert loaded_after("import q8rules") == []
  core = loaded_after("import q8rules\nq8rules.Q8Provider, q8rules.kernels, q8rules.sharding")
  assert "jax" in core and "q8rules.providers" in core and "q8rules.kernels" in core
  assert applications_in(core) == [], core
  app = loaded_after("import q8rules\nassert callable(q8rules.load_gguf)")
  assert "q8rules.llm" in app and "gguf" in app


def test_star_import_loads_no_application():
  """`from q8rules import *` takes the core (every name of `__all__`, resolved), and no
  application."""
  loaded = loaded_after(
    "from q8rules import *\nimport q8rules\nassert all(n in globals() for n in q8rules.__all__)"
  )
  assert "q8rules.providers" in loaded and "q8rules.lora.merge" in loaded
  assert applications_in(loaded) == [], loaded


COMMAND_LINES = (
  ["--help"],
  ["run", "--help"],
  ["serve", "--help"],
  ["chat", "--help"],
  ["finetune", "--help"],
  ["demo", "--help"],
  ["run", "--nope"],
  ["run", "model.gguf", "-n", "0"],
  ["--layers", "x"],
  ["--version"],
)
"""Command lines answered by the parser alone (help, the version, a bad argument)."""


def test_command_line_parsing_imports_no_jax():
  """`python -m q8rules --help`, `q8rules CMD --help` and bad arguments build the parsers and
  answer without importing JAX (nor numpy, Flax, Qwix): the command's work imports them."""
  for argv in COMMAND_LINES:
    module = (
      f"import sys, runpy\nsys.argv = ['q8rules', *{argv!r}]\n"
      "try:\n  runpy.run_module('q8rules', run_name='__main__')\nexcept SystemExit: pass"
    )
    entry = f"from q8rules.cli import main\ntry:\n  main({argv!r})\nexcept SystemExit: pass"
    assert loaded_after(module) == [], argv
    assert loaded_after(entry) == [], argv


def test_loaded_modules_check_catches_an_import():
  """The probe sees what a command that ran far enough to load a model imported: JAX and the
  model's modules."""
  found = loaded_after(
    "from q8rules.cli import main\ntry:\n  main(['run', '/nonexistent.gguf', '-p', 'x'])\n"
    "except SystemExit: pass"
  )
  assert "jax" in found and "q8rules.llm" in found


def test_graph_sees_imports():
  edges = graph()
  assert "q8rules.kernels" in edges["q8rules.providers.mesh"]
  assert "q8rules.q8_0" in edges["q8rules.layout"]
  assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_no_import_circle():
  """No module imports another that imports it back, directly or through others (package
  `__init__`s, which run before their submodules, included)."""
  cycle = find_cycle(graph())
  assert cycle is None, " -> ".join(cycle)


ONE_WAY: list[tuple[str, str]] = [
  ("q8rules.lora", "q8rules.llm"),
  ("q8rules.sharding", "q8rules.llm"),
  ("q8rules.sharding", "q8rules.lora"),
]
"""(a, b): no module under `a` imports one under `b`, lazily or not. The loader's models use
LoRA (`GGUFModel.with_lora`, `merged`, `loss`, `load_gguf(lora=)`), so `llm` imports `lora`
and `lora` takes a loaded model as `q8rules.lora.loaded.LoadedModel`; both place params on a
mesh with `sharding`, which imports neither (a LoRA adapter's spec beside its base's is
`q8rules.sharding.adapters`)."""

AT_MODULE_LEVEL: list[tuple[str, str]] = [("q8rules.llm", "q8rules.lora")]
"""(a, b): a module under `a` imports modules under `b` at its top level only, not inside a
function, where an import hides from a reader (and from an import at load) what the module
needs."""


def under(module: str, package: str) -> bool:
  return module == package or module.startswith(package + ".")


def imports_against(edges: dict[str, set[str]], rules: list[tuple[str, str]]) -> list[str]:
  """'a -> b' for each import of `edges` that a rule (a, b) of `rules` forbids."""
  return [
    f"{a} -> {b}"
    for src, dst in rules
    for a, targets in sorted(edges.items())
    if under(a, src)
    for b in sorted(targets)
    if under(b, dst)
  ]


def in_functions(tree: ast.Module, name: str, is_package: bool, known: set[str]) -> set[str]:
  """The q8rules modules `name` imports inside a function (or method) of `tree`."""
  found: set[str] = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
      found |= imported(ast.Module(body=node.body, type_ignores=[]), name, is_package, known)
  return found


def function_imports() -> dict[str, set[str]]:
  """Module -> the q8rules modules it imports inside a function (or method)."""
  mods = modules()
  packages = {module_name(p) for p in PACKAGE.rglob("__init__.py")}
  return {
    name: in_functions(tree, name, name in packages, set(mods)) for name, tree in mods.items()
  }


def test_imports_go_one_way():
  """`lora` never imports `llm`, `sharding` neither of them; `llm` imports `lora` at its modules'
  top level only."""
  assert imports_against(direct_imports(), ONE_WAY) == []
  assert imports_against(function_imports(), AT_MODULE_LEVEL) == []


def test_one_way_check_catches_a_violation():
  """An import of the loader by LoRA's trainer, of LoRA by the sharding, and a function-level
  import of LoRA by the loader are each reported."""
  edges = direct_imports()
  edges["q8rules.lora.trainer"] = edges["q8rules.lora.trainer"] | {"q8rules.llm.model"}
  edges["q8rules.sharding.params"] = edges["q8rules.sharding.params"] | {"q8rules.lora.tree"}
  assert imports_against(edges, ONE_WAY) == [
    "q8rules.lora.trainer -> q8rules.llm.model",
    "q8rules.sharding.params -> q8rules.lora.tree",
  ]
  tree = ast.parse("import os\n\ndef f():\n  from q8rules.lora.convert import merged_params\n")
  lazy = {"q8rules.llm.model": in_functions(tree, "q8rules.llm.model", False, set(modules()))}
  assert imports_against(lazy, AT_MODULE_LEVEL) == ["q8rules.llm.model -> q8rules.lora.convert"]


def test_qwix_internals_only_in_the_shim():
  for name, tree in modules().items():
    if name == "q8rules._qwix":
      continue
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom | ast.Import):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
        assert not any(n.startswith("qwix._src") for n in names), name


def test_one_function_picks_the_implementation():
  """Only `kernels/registry.py`'s `resolve` reads an op's default order; nothing picks with
  `jax.lax.platform_dependent` (every op is chosen per lowering platform by `resolve`)."""
  for name, tree in modules().items():
    for node in ast.walk(tree):
      if isinstance(node, ast.Attribute):
        assert node.attr != "default_order" or name == "q8rules.kernels.registry", name
        assert node.attr != "platform_dependent", name


def test_every_op_is_registered_with_a_reference():
  """Each op folder of kernels/ has an `api.py` that registers the op, a `reference.py`, and
  one module per implementation (`NAME` = the module's implementation name)."""
  import q8rules.kernels

  folders = sorted(p.parent.name for p in (PACKAGE / "kernels").glob("*/api.py"))
  assert folders == sorted(q8rules.kernels.OPS), folders
  for op in q8rules.kernels.OPS.values():
    assert (PACKAGE / "kernels" / op.name / "reference.py").exists(), op.name
    for impl in op.implementations.values():
      module = impl.run.__module__
      assert module.startswith(f"q8rules.kernels.{op.name}."), (op.name, impl.name, module)


def test_models_import_no_kernel():
  """The decoder is plain Flax: no module of models/ imports kernels/ (the providers route its
  hooks to the kernels)."""
  bad = {
    a: sorted(t for t in targets if t == "q8rules.kernels" or t.startswith("q8rules.kernels."))
    for a, targets in direct_imports().items()
    if a.startswith("q8rules.models")
  }
  assert not any(bad.values()), bad


def test_hooks_the_providers_route_are_the_models():
  """Every hook a provider routes is a function of `q8rules.models.hooks` with the parameters
  of the kernel entry point that replaces it."""
  import inspect

  from q8rules.models import hooks
  from q8rules.providers import model_hooks

  assert model_hooks.HOOKS_MODULE == hooks.__name__
  assert set(model_hooks.ROUTES) == set(hooks.__all__)
  for name, route in model_hooks.ROUTES.items():
    mine = list(inspect.signature(getattr(hooks, name)).parameters)
    theirs = list(inspect.signature(route).parameters)
    assert theirs[: len(mine)] == mine, (name, mine, theirs)


SCRIPTS = PACKAGE.parent / "scripts"
BENCHMARKS = PACKAGE.parent / "benchmarks"
"""scripts/ fetches the real files and writes the references; benchmarks/ measures. The
benchmarks may import scripts/ (its fetching and `scripts/real_runs.py`, what both share),
never the reverse."""


def imports_of(paths: list[Path], package: str) -> list[str]:
  """'file:line: module' for each import of `package` or a module under it (lazily or not) in
  `paths`."""
  found = []
  for path in paths:
    for node in ast.walk(ast.parse(path.read_text())):
      names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
      if isinstance(node, ast.ImportFrom) and not node.level:
        names = [node.module or ""]
      found += [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {n}"
        for n in names
        if n == package or n.startswith(package + ".")
      ]
  return found


def test_import_direction_check_catches_a_reverse_import():
  script = SCRIPTS / "_reverse_import.py"
  try:
    script.write_text(
      "import os\nfrom benchmarks.bench_decode import run\n\n\ndef f():\n"
      "  import benchmarks.real_gguf\n  from benchmarks_other import x\n"
    )
    assert imports_of([script], "benchmarks") == [
      "scripts/_reverse_import.py:2: benchmarks.bench_decode",
      "scripts/_reverse_import.py:6: benchmarks.real_gguf",
    ]
  finally:
    script.unlink()


def test_scripts_import_no_benchmark():
  """Imports between scripts/ and benchmarks/ go one way: benchmarks/ -> scripts/."""
  assert imports_of(sorted(SCRIPTS.rglob("*.py")), "benchmarks") == []


def folder_imports(folder: Path) -> dict[str, set[str]]:
  """Module -> the modules of `folder` (scripts run from it, importing each other by their file's
  name) that its import statements name, lazily or not."""
  names = {p.stem for p in folder.glob("*.py")}
  edges: dict[str, set[str]] = {}
  for path in sorted(folder.glob("*.py")):
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        found |= {a.name.split(".")[0] for a in node.names}
      elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
        found.add(node.module.split(".")[0])
    edges[path.stem] = (found & names) - {path.stem}
  return edges


def test_scripts_have_no_import_circle():
  """No script of scripts/ imports another that imports it back, directly or through others (the
  test-file writers share scripts/tiny_gguf_parts.py; scripts/make_gguf_references.py runs
  them)."""
  edges = folder_imports(SCRIPTS)
  assert "tiny_gguf_parts" in edges["gguf_moe"]
  assert "gguf_moe" in edges["make_gguf_references"]
  cycle = find_cycle(edges)
  assert cycle is None, " -> ".join(cycle)


def test_scripts_circle_check_catches_a_circle(tmp_path):
  (tmp_path / "writer.py").write_text("import numpy\nfrom parts import TEXT\n")
  (tmp_path / "parts.py").write_text("TEXT = 'x'\n\n\ndef run():\n  import writer\n")
  (tmp_path / "other.py").write_text("import os.path\nimport parts\n")
  edges = folder_imports(tmp_path)
  assert edges == {"other": {"parts"}, "parts": {"writer"}, "writer": {"parts"}}
  assert find_cycle(edges) == ["parts", "writer", "parts"]


MAX_PY_LINES = 500
MAX_CC_LINES = 600


def too_long(suffixes: tuple[str, ...], limit: int) -> dict[str, int]:
  """The sources of q8rules/ with one of `suffixes` over `limit` lines, with their lengths."""
  return {
    str(p.relative_to(PACKAGE)): n
    for p in PACKAGE.rglob("*")
    if p.suffix in suffixes and (n := len(p.read_text().splitlines())) > limit
  }


def test_no_python_module_too_long():
  """No Python module over 500 lines."""
  assert too_long((".py",), MAX_PY_LINES) == {}


def test_no_cpp_source_too_long():
  """No C++ source over 600 lines."""
  assert too_long((".cc", ".h"), MAX_CC_LINES) == {}


COPY_LINES = 6
"""How many lines of code two places may share before they count as a copy."""


def code_lines(path: Path) -> list[tuple[int, str]]:
  """(line number, the line with its white space folded) for each line of code in `path`:
  no blank lines, comments, lone punctuation, imports or includes. A signature's parameters
  count: a long list of them written out again is a copy too (what several functions take
  together is one value, as `q8rules.attention_params.AttentionCall`)."""
  out: list[tuple[int, str]] = []
  python = path.suffix == ".py"
  for i, line in enumerate(path.read_text().splitlines(), 1):
    s = " ".join(line.split())
    if not s or s.startswith("#" if python else "//") or re.fullmatch(r"[\W_]*", s):
      continue
    if s.startswith(("import ", "from ") if python else ("#include",)):
      continue
    out.append((i, s))
  return out


def copies(paths: list[Path], window: int = COPY_LINES) -> list[str]:
  """Each run of `window` lines of code that stands in two places, as 'a:line ~ b:line'."""
  seen: dict[tuple[str, ...], tuple[Path, int]] = {}
  found = []
  for path in paths:
    lines = code_lines(path)
    for j in range(len(lines) - window + 1):
      key = tuple(s for _, s in lines[j : j + window])
      first = seen.setdefault(key, (path, lines[j][0]))
      if first[0] != path or lines[j][0] - first[1] >= window:
        found.append(
          f"{first[0].relative_to(PACKAGE)}:{first[1]} ~ {path.relative_to(PACKAGE)}:{lines[j][0]}"
        )
  return found


def test_copy_check_catches_a_copy(tmp_path):
  body = "\n".join(f"  x{i} = f(x{i - 1}, {i})" for i in range(1, 8))
  a, b = PACKAGE / "_copy_a.py", PACKAGE / "_copy_b.py"
  try:
    a.write_text(f"def f(x):\n{body}\n")
    b.write_text(f"def g(x):\n  y = 1\n{body}\n")
    assert copies([a, b]) == ["_copy_a.py:2 ~ _copy_b.py:3", "_copy_a.py:3 ~ _copy_b.py:4"]
  finally:
    a.unlink()
    b.unlink()


def sources(*suffixes: str) -> list[Path]:
  return sorted(p for p in PACKAGE.rglob("*") if p.suffix in suffixes)


def test_no_copied_python_code():
  """No run of six or more lines of code stands twice in q8rules/'s Python."""
  assert copies(sources(".py")) == []


def test_no_copied_cpp_code():
  """No run of six or more lines of code stands twice in q8rules/'s C++."""
  assert copies(sources(".cc", ".h")) == []


CPU_SOURCES = PACKAGE / "kernels" / "cpu"
SIMD_LAYER = ("simd.h", "simd_neon.h")
"""The SIMD layer, the C++ headers that alone may include an intrinsics header, name an
intrinsic or its types, or hold inline assembly or a prefetch: simd.h and its aarch64 half,
which only simd.h includes."""

_INTRINSICS = re.compile(
  # x86: <immintrin.h> and the like, _mm* / _MM_* names, __m128 / __m256 / __m512 and masks
  r"#\s*include\s*[<\"](?:\w*intrin\.h|arm_neon\.h|arm_acle\.h)[>\"]"
  r"|\b(?:_mm\w*|_MM_\w+|__m(?:128|256|512)\w*|__mmask\w*|_cvt(?:ss_sh|sh_ss)|__builtin_ia32_\w+)"
  # aarch64: <arm_neon.h>, NEON intrinsics (vdotq_s32, vget_low_s8, ...) and vector types
  r"|\b(?:__builtin_aarch64_\w+|v[a-z0-9]+(?:_[a-z0-9]+)*_[supf](?:8|16|32|64)"
  r"|(?:u?int|float|poly|bfloat)(?:8|16|32|64)x\d+(?:x\d+)?_t)\b"
  # either: inline assembly, prefetch hints
  r"|\b(?:asm|__asm__|__builtin_prefetch)\b"
)
_CPP_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def intrinsics_outside_simd(paths: list[Path]) -> list[str]:
  """'file:line: name' for each intrinsics include or intrinsic name in the code (comments
  left out) of `paths`, but simd.h's."""
  found = []
  for path in paths:
    if path.name in SIMD_LAYER:
      continue
    code = _CPP_COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())
    for i, line in enumerate(code.splitlines(), 1):
      found += [f"{path.name}:{i}: {m.group(0)}" for m in _INTRINSICS.finditer(line)]
  return found


def test_intrinsics_check_catches_a_bypass(tmp_path):
  header = tmp_path / "bypass.h"
  header.write_text(
    "// _mm_pause() in a comment is fine\n#include <immintrin.h>\n"
    "inline void Wait() { _mm_pause(); }\n__m512 v;\n"
    "#include <arm_neon.h>\n"
    "int32x4_t Dot(int32x4_t a, int8x16_t w) { return vdotq_s32(a, w, w); }\n"
    "float Low(float32x4_t v) { return vgetq_lane_f32(v, 0); }\n"
    'inline void Yield() { asm volatile("yield"); __builtin_prefetch(&v); }\n'
    "int v_s8 = 0, vector_count = 0;\n"
  )
  layer = tmp_path / SIMD_LAYER[0]
  layer.write_text("#include <immintrin.h>\n#include <arm_neon.h>\nint8x16_t v = vdupq_n_s8(0);\n")
  assert intrinsics_outside_simd([header, layer]) == [
    "bypass.h:2: #include <immintrin.h>",
    "bypass.h:3: _mm_pause",
    "bypass.h:4: __m512",
    "bypass.h:5: #include <arm_neon.h>",
    "bypass.h:6: int32x4_t",
    "bypass.h:6: int32x4_t",
    "bypass.h:6: int8x16_t",
    "bypass.h:6: vdotq_s32",
    "bypass.h:7: float32x4_t",
    "bypass.h:7: vgetq_lane_f32",
    "bypass.h:8: asm",
    "bypass.h:8: __builtin_prefetch",
  ]


def test_every_header_goes_through_simd_h():
  """Only simd.h includes <immintrin.h> or <arm_neon.h> or uses intrinsics (`_mm*`,
  `__m128`/`__m256`/`__m512`, masks; NEON's `v*_s8`-style names and `int8x16_t`-style types),
  inline assembly or prefetches: every other source of the native library reaches SIMD through
  its wrappers."""
  sources = sorted(p for p in CPU_SOURCES.iterdir() if p.suffix in (".h", ".cc"))
  assert all(CPU_SOURCES / name in sources for name in SIMD_LAYER)
  assert intrinsics_outside_simd(sources) == []
  includers = [p.name for p in sources if re.search(r'#\s*include\s*"simd_neon\.h"', p.read_text())]
  assert includers == ["simd.h"]


REPO = PACKAGE.parent
_REPO_PATH = re.compile(
  r"(?<![\w./-])((?:q8rules|kernels|docs|benchmarks|tests|scripts)/[\w./-]*[\w/])"
)
"""A path of this repository in prose: it starts at one of these folders (not inside a longer
path or a URL) and ends before punctuation."""


def prose(path: Path) -> list[tuple[int, str]]:
  """(line, text) of each docstring (any string statement) and comment of a Python or C++
  source."""
  src = path.read_text()
  if path.suffix != ".py":
    return [(src.count("\n", 0, m.start()) + 1, m.group(0)) for m in _CPP_COMMENT.finditer(src)]
  found = [
    (node.lineno, node.value.value)
    for node in ast.walk(ast.parse(src))
    if isinstance(node, ast.Expr)
    and isinstance(node.value, ast.Constant)
    and isinstance(node.value.value, str)
  ]
  tokens = tokenize.generate_tokens(io.StringIO(src).readline)
  return found + [(t.start[0], t.string) for t in tokens if t.type == tokenize.COMMENT]


def dead_paths(paths: list[Path]) -> list[str]:
  """'file:line: path' for each repository path named in the prose of `paths` that exists
  neither from the repository's root nor from q8rules/."""
  found = []
  for path in paths:
    for line, text in prose(path):
      for m in _REPO_PATH.finditer(text):
        if not (REPO / m.group(1)).exists() and not (PACKAGE / m.group(1)).exists():
          found.append(f"{path.relative_to(REPO)}:{line}: {m.group(1)}")
  return found


def test_dead_path_check_catches_a_dead_path():
  module = PACKAGE / "_dead_path.py"
  try:
    module.write_text(
      '"""Built by `kernels/cpu/library.cc` (docs/kernels.md), not kernels/gone.py."""\n\n'
      "X = 1  # see q8rules/kernels/native/ and scripts/nothing_here.py\n"
      'Y = "tests/not_prose.py"\n'
    )
    assert dead_paths([module]) == [
      "q8rules/_dead_path.py:1: kernels/gone.py",
      "q8rules/_dead_path.py:3: scripts/nothing_here.py",
    ]
  finally:
    module.unlink()


def test_paths_in_docstrings_and_comments_exist():
  """Every path like `kernels/...`, `docs/...` or `tests/...` that a docstring or comment of
  q8rules/ names exists (from the repository's root or from q8rules/)."""
  assert dead_paths(sources(".py", ".h", ".cc")) == []


_ISSUE_NUMBER = re.compile(r"\bissues?[ -]?#?\d+|\(#\d+\)", re.I)
"""An issue cited by its number: 'issue' (any case), then a space, '#' or '-' and digits; or
'#' and digits in parentheses. Another repository's issue (owner/name#N) is no citation."""


def issue_numbers(paths: list[Path]) -> list[str]:
  """'file:line: citation' for each issue number cited in a docstring or comment of `paths`."""
  return [
    f"{path.relative_to(PACKAGE.parent)}:{line}: {m.group(0)}"
    for path in paths
    for line, text in prose(path)
    for m in _ISSUE_NUMBER.finditer(text)
  ]


def test_issue_number_check_catches_a_citation():
  module = PACKAGE / "_issue_number.py"
  try:
    module.write_text(
      '"""Fast (Issue #12), see jax-ml/jax#26799."""\n\n'
      'X = 1  # as issue-3 asked (#45)\nY = "issue 6, a string that is no comment"\n'
    )
    assert issue_numbers([module]) == [
      "q8rules/_issue_number.py:1: Issue #12",
      "q8rules/_issue_number.py:3: issue-3",
      "q8rules/_issue_number.py:3: (#45)",
    ]
  finally:
    module.unlink()


def test_no_issue_number_in_docstrings_or_comments():
  """No docstring or comment of q8rules/, benchmarks/, scripts/ or tests/ cites an issue by its
  number: it says what the code does and why instead."""
  paths = sources(".py", ".h", ".cc") + sorted(
    p
    for folder in (BENCHMARKS, SCRIPTS, PACKAGE.parent / "tests")
    for p in folder.rglob("*")
    if p.suffix in (".py", ".c", ".cc")
  )
  assert issue_numbers(paths) == []


NAMED_TUPLE_API = frozenset({"_replace", "_asdict", "_fields", "_make"})
"""`_`-named members that are a NamedTuple's public API."""


def private_reaches(tree: ast.Module) -> list[str]:
  """Each `x._name` in `tree` whose `x` is not `self` or `cls`: a reach into another object's
  private members (a NamedTuple's `_replace` and the like are public)."""
  out = []
  for node in ast.walk(tree):
    if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
      continue
    if node.attr.startswith("__") or node.attr in NAMED_TUPLE_API:
      continue
    if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
      continue
    out.append(f"{node.lineno}: {ast.unparse(node)}")
  return out


def test_no_reach_into_privates():
  """Nothing outside a class touches its `_` members (the Qwix shim, `_qwix.py`, is the one
  module that reaches into Qwix's)."""
  found = {
    name: hits
    for name, tree in modules().items()
    if name != "q8rules._qwix" and (hits := private_reaches(tree))
  }
  assert found == {}


def test_private_reach_check_catches_one():
  tree = ast.parse(
    "def f(provider):\n  return provider._run\n\nclass A:\n  def g(self):\n    return self._x\n"
  )
  assert private_reaches(tree) == ["2: provider._run"]


def untyped_providers(tree: ast.Module) -> list[str]:
  """Each parameter named `provider` (or ending in `_provider`) annotated `Any` or not at all."""
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
      args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
      for a in args:
        named = a.arg == "provider" or a.arg.endswith("_provider")
        if named and (a.annotation is None or ast.unparse(a.annotation) == "Any"):
          out.append(f"{node.lineno}: {node.name}({a.arg})")
  return out


def test_no_untyped_provider():
  """No function takes a provider without naming its type (a mode's work is its policy's)."""
  found = {name: hits for name, tree in modules().items() if (hits := untyped_providers(tree))}
  assert found == {}
  assert untyped_providers(ast.parse("def f(provider: Any, x):\n  pass\n")) == ["1: f(provider)"]


def getattr_dispatches(tree: ast.Module) -> list[str]:
  """Each `getattr(x, "name", default)` whose `x` is a model or a checkpoint reader (a name
  like `model`, `m`, `ckpt`, `reader`, `checkpoint`): dispatch on what an object may lack,
  where its type should say what it has."""
  subjects = {"model", "m", "ckpt", "reader", "checkpoint", "part"}
  out = []
  for node in ast.walk(tree):
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
      continue
    if node.func.id != "getattr" or len(node.args) != 3:
      continue
    subject = node.args[0]
    if isinstance(subject, ast.Name) and subject.id in subjects:
      out.append(f"{node.lineno}: {ast.unparse(node)}")
  return out


def test_no_getattr_dispatch_on_models_or_readers():
  """Readers and models have typed attributes that always exist (`parts`, `lora`, `source`)."""
  found = {name: hits for name, tree in modules().items() if (hits := getattr_dispatches(tree))}
  assert found == {}
  tree = ast.parse('lora = getattr(model, "lora", None)\n')
  assert getattr_dispatches(tree) == ["1: getattr(model, 'lora', None)"]
