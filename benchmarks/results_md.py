"""benchmarks/RESULTS.md: one file, one section per benchmark between its own markers."""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def markers(name: str) -> tuple[str, str]:
  """The start and end markers of section `name`, e.g. `<!-- cpu:start -->`."""
  return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def section(name: str, heading: str, header: str, command: str, blocks: list[str]) -> str:
  """Section `name`: its markers around `heading`, the run's `header` (date, machine,
  versions), the command that wrote it, then `blocks` (paragraphs, tables), a blank line
  between each."""
  start, end = markers(name)
  return "\n".join(
    [start, heading, "", header, "", f"Command: `{command}`", "", "\n\n".join(blocks), end]
  )


def publish(name: str, heading: str, header: str, blocks: list[str], write: bool) -> None:
  """Print `blocks`; with `write`, also replace section `name` of RESULTS.md by them, under
  `heading` and a header that starts with the time, the machine and the load average and goes
  on with `header`, and the command line that ran (this script and its arguments)."""
  print("\n\n".join(blocks))
  if not write:
    return
  when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
  stamp = f"{when}. Machine: {machine()}; load average at the end {load_average()}. {header}"
  command = "python " + " ".join(
    [os.path.relpath(sys.argv[0], RESULTS.parent.parent), *sys.argv[1:]]
  )
  write_section(name, section(name, heading, stamp, command, blocks))


def write_section(name: str, text: str, path: Path = RESULTS) -> None:
  """Replace section `name` of `path` by `text` (which carries the markers), or append it;
  every other section stays as it is."""
  start, end = markers(name)
  old = path.read_text() if path.exists() else "# Benchmark results\n"
  if start in old and end in old:
    head, rest = old.split(start, 1)
    _, tail = rest.split(end, 1)
    new = head + text + tail
  else:
    new = old.rstrip("\n") + "\n\n" + text + "\n"
  path.write_text(new)


def machine() -> str:
  """`lscpu`'s model name, the core count, the OS, and the native kernels' SIMD path (`isa()`)."""
  model = platform.processor() or "unknown CPU"
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"^Model name:\s*(.+)$", out, re.M)
    model = found.group(1).strip() if found else model
  except (OSError, subprocess.CalledProcessError):
    pass
  return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, {isa()}"


def isa() -> str:
  """The SIMD path q8rules' native kernels run here, as `kernels/cpu/isa.h` picks it (the best
  rung of this architecture's ladder the CPU's flags allow, capped by `$Q8RULES_CPU_ISA`),
  read from /proc/cpuinfo without loading the library: e.g. 'SIMD path avx2 (the CPU's best:
  avx2)' or 'SIMD path avx2 ($Q8RULES_CPU_ISA=avx2; the CPU's best: avx512)'."""
  try:
    text = Path("/proc/cpuinfo").read_text()
  except OSError:
    text = ""
  line = next(
    (ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("flags", "Features")), ""
  )
  flags = set(line.partition(":")[2].split())
  if platform.machine().lower() in ("aarch64", "arm64"):
    ladder = ["scalar", "neon", "neon_dotprod"]
    best = "neon_dotprod" if "asimddp" in flags else "neon"
  else:
    ladder = ["scalar", "avx2", "avx512"]
    best = "scalar"
    if {"avx2", "fma", "f16c"} <= flags:
      best = "avx512" if "avx512f" in flags else "avx2"
  want = os.environ.get("Q8RULES_CPU_ISA", "").strip()
  if want in ladder:
    chosen = ladder[min(ladder.index(want), ladder.index(best))]
    return f"SIMD path {chosen} ($Q8RULES_CPU_ISA={want}; the CPU's best: {best})"
  return f"SIMD path {best} (the CPU's best)"


def load_average() -> str:
  """The 1, 5 and 15 minute load averages, e.g. '0.91 1.08 1.33'."""
  try:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())
  except OSError:
    return "n/a"


def idle_fraction(seconds: float = 1.0) -> float:
  """The fraction of all CPUs' time spent idle over the next `seconds` (/proc/stat; 1.0 where
  it cannot be read)."""
  import time

  def sample() -> tuple[int, int]:
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4], sum(fields)  # idle + iowait, total

  try:
    idle0, total0 = sample()
    time.sleep(seconds)
    idle1, total1 = sample()
  except (OSError, ValueError, IndexError):
    return 1.0
  return (idle1 - idle0) / max(1, total1 - total0)


def wait_for_idle(min_idle: float, timeout: float) -> float:
  """Wait until the CPUs are at least `min_idle` idle over a second (other engineers' jobs
  share this machine), at most `timeout` seconds; the last idle fraction seen."""
  import time

  end = time.monotonic() + timeout
  idle = idle_fraction()
  while idle < min_idle and time.monotonic() < end:
    idle = idle_fraction()
  return idle
