"""JAX's persistent compilation cache, opt-in: `q8rules.llm.enable_compile_cache()`.

A model's decode and prefill programs take seconds to compile on a CPU, and a
new process compiles them again every time. `enable()` turns JAX's persistent cache on for
the process, so a second process on the same model and shapes loads the compiled executables
from disk instead of compiling. It changes a process-wide JAX setting, so a library call never
does it for you: `python -m q8rules run` calls it, and a program that loads models opts in
with `q8rules.llm.enable_compile_cache()` (this module's `enable`) before its first compile:

- directory: `$Q8RULES_COMPILE_CACHE`, else `$XDG_CACHE_HOME/q8rules/jax-compile`,
  else `~/.cache/q8rules/jax-compile`;
- `Q8RULES_NO_COMPILE_CACHE=1` switches it off (nothing is read or written);
- a cache directory the user set already (`jax.config.update("jax_compilation_cache_dir",
  ...)`, `$JAX_COMPILATION_CACHE_DIR`) is kept as it is.

Every program is cached (`jax_persistent_cache_min_compile_time_secs` is set to 0
unless the user changed it): what is small to compile is also small to store.
As JAX warns, a compilation cache is trusted code: do not point it at a directory
that others may write.

`stats()` counts what JAX reports through `jax.monitoring` since the process
started (listeners registered at import): programs compiled by XLA, persistent
cache hits and misses, and the seconds spent tracing, lowering and compiling.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import jax
from jax import monitoring

ENV_DIR = "Q8RULES_COMPILE_CACHE"
ENV_OFF = "Q8RULES_NO_COMPILE_CACHE"

_HITS = "/jax/compilation_cache/cache_hits"
_MISSES = "/jax/compilation_cache/cache_misses"
_COMPILE = "/jax/core/compile/backend_compile_duration"  # compile or cache fetch
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"

_lock = threading.Lock()
_counts = {_HITS: 0, _MISSES: 0, _COMPILE: 0}
_seconds = {_COMPILE: 0.0, _TRACE: 0.0, _LOWER: 0.0}


def _on_event(event: str, **_: object) -> None:
  if event in _counts:
    with _lock:
      _counts[event] += 1


def _on_duration(event: str, duration: float, **_: object) -> None:
  if event in _seconds:
    with _lock:
      _seconds[event] += duration
      if event in _counts:
        _counts[event] += 1


monitoring.register_event_listener(_on_event)
monitoring.register_event_duration_secs_listener(_on_duration)


def default_dir() -> Path:
  """`$Q8RULES_COMPILE_CACHE`, else `$XDG_CACHE_HOME/q8rules/jax-compile`, else
  `~/.cache/q8rules/jax-compile`."""
  env = os.environ.get(ENV_DIR)
  if env:
    return Path(env).expanduser()
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return Path(base) / "q8rules" / "jax-compile"


def disabled() -> bool:
  """Whether `$Q8RULES_NO_COMPILE_CACHE` switches the cache off (any value but '', 0, false, no)."""
  return os.environ.get(ENV_OFF, "").strip().lower() not in ("", "0", "false", "no")


def enable() -> Path | None:
  """Turn JAX's persistent compilation cache on (see the module docstring); returns its
  directory, or None when `$Q8RULES_NO_COMPILE_CACHE` switches it off. Idempotent."""
  if disabled():
    return None
  current = jax.config.jax_compilation_cache_dir
  if current:
    return Path(current)
  path = default_dir()
  path.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(path))
  if jax.config.jax_persistent_cache_min_compile_time_secs == 1.0:  # JAX's default
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  return path


def stats() -> dict[str, float]:
  """What JAX reported since the process started: `compiled` (programs XLA compiled),
  `cache_hits` / `cache_misses` (persistent cache), `trace_s`, `lower_s`, `compile_s`
  (seconds tracing to jaxprs, lowering to MLIR, and compiling or fetching from the cache)."""
  with _lock:
    return dict(
      compiled=_counts[_COMPILE] - _counts[_HITS],
      cache_hits=_counts[_HITS],
      cache_misses=_counts[_MISSES],
      trace_s=_seconds[_TRACE],
      lower_s=_seconds[_LOWER],
      compile_s=_seconds[_COMPILE],
    )


__all__ = ["ENV_DIR", "ENV_OFF", "default_dir", "disabled", "enable", "stats"]
