"""The package's shape: no import circle, one module picks the kernel, Qwix behind one shim."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "q8rules"


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


def graph() -> dict[str, set[str]]:
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
      # importing a submodule runs its parent packages' __init__ first
      parent = m.rsplit(".", 1)[0] if "." in m else None
      while parent and parent != name and not name.startswith(parent + "."):
        targets.add(parent)
        parent = parent.rsplit(".", 1)[0] if "." in parent else None
    edges[name] = targets
  return edges


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


def test_graph_sees_imports():
  edges = graph()
  assert "q8rules.kernels.api" in edges["q8rules.providers.serving"] or (
    "q8rules.kernels" in edges["q8rules.providers.serving"]
  )
  assert "q8rules.q8_0" in edges["q8rules.layout"]
  assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_no_import_circle():
  """No module imports another that imports it back, directly or through others (package
  `__init__`s, which run before their submodules, included)."""
  cycle = find_cycle(graph())
  assert cycle is None, " -> ".join(cycle)


def test_qwix_internals_only_in_the_shim():
  for name, tree in modules().items():
    if name == "q8rules._qwix":
      continue
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom | ast.Import):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
        assert not any(n.startswith("qwix._src") for n in names), name


def test_one_module_picks_the_implementation():
  """Only kernels/api.py reads the registry's order or calls an implementation by name."""
  for name, tree in modules().items():
    if name == "q8rules.kernels.api":
      continue
    for node in ast.walk(tree):
      if isinstance(node, ast.Name):
        assert node.id not in ("DEFAULT_ORDER", "REGISTRY") or name == "q8rules.kernels", name
      if isinstance(node, ast.Attribute):
        assert node.attr not in ("DEFAULT_ORDER", "REGISTRY"), name


def qwix_private_uses(tree: ast.Module, private: set[str]) -> list[str]:
  """Where `tree` reaches into Qwix: an attribute or keyword named like one of Qwix's private
  members (`private`), or a string naming a `qwix._src` object."""
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and node.attr in private:
      found.append(f"line {node.lineno}: .{node.attr}")
    elif isinstance(node, ast.keyword) and node.arg in private:
      found.append(f"line {node.value.lineno}: {node.arg}=")
    elif (
      isinstance(node, ast.Constant)
      and isinstance(node.value, str)
      and node.value.startswith("qwix._src")
    ):
      found.append(f"line {node.lineno}: {node.value!r}")
  return found


def test_qwix_private_members_only_in_the_shim():
  """Outside q8rules/_qwix.py nothing uses a private member of Qwix's providers (the set taken
  from the installed Qwix's classes and instances) or names a `qwix._src` object in a string."""
  import qwix

  private = set()
  for cls in (qwix.PtqProvider, qwix.QtProvider, qwix.QuantizationProvider):
    names = set(dir(cls)) | set(vars(cls([])))
    private |= {n for n in names if n.startswith("_") and not n.startswith("__")}
  assert {"_get_current_rule_and_op_id", "_rules", "_initial_run_complete"} <= private
  assert "_qarray_module" in private
  violation = ast.parse(
    "rule, op_id = self._get_current_rule_and_op_id('einsum')\n"
    "create_quantized_param(name, value, how, _qarray_module=m)\n"
    "PLUMBING = {'qwix._src.qconfig.get_current_rule'}\n"
    "self._record(rule)\n"  # a q8rules name: not Qwix's
  )
  assert sorted(f.split(":")[0] for f in qwix_private_uses(violation, private)) == [
    "line 1",
    "line 2",
    "line 3",
  ]
  uses = {
    name: found
    for name, tree in modules().items()
    if name != "q8rules._qwix" and (found := qwix_private_uses(tree, private))
  }
  assert not uses, uses
