"""Several processes, one model: `load_gguf` on a mesh over 2 processes of 2 CPU devices each
(`jax.distributed` on localhost, gloo collectives), against one process with the same mesh.

Each process reads from the file only its own shards' byte ranges (and the replicated
tensors): with TP=4 over the 2 processes, about half the block tensors each.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from q8rules.llm import load_gguf
from tests.multiproc_worker import IDS, LOCAL_DEVICES, NEW_TOKENS, rules_forward

ROOT = Path(__file__).resolve().parent.parent
PROCESSES = 2
TIMEOUT_S = 240
"""The whole run's limit; a process that fails gets the others killed within `PEER_GRACE_S`."""
PEER_GRACE_S = 60


def write_llama(
  path: Path, *, vocab=256, dim=128, layers=2, heads=4, kv_heads=4, ffn=512, split_max_tensors=0
) -> Path:
  """A llama GGUF of random Q8_0 weights (F32 norms), no tokenizer: block tensors dominate
  the file, as in real models (here the token embedding and output are 11% of it). With
  `split_max_tensors`, the same tensors as a split set (`NAME-0000i-of-0000n.gguf`); the
  first part's path is returned."""
  rng = np.random.default_rng(0)
  path.parent.mkdir(parents=True, exist_ok=True)
  w = gguf.GGUFWriter(str(path), "llama", split_max_tensors=split_max_tensors)
  w.add_context_length(256)
  w.add_embedding_length(dim)
  w.add_block_count(layers)
  w.add_feed_forward_length(ffn)
  w.add_head_count(heads)
  w.add_head_count_kv(kv_heads)
  w.add_rope_dimension_count(dim // heads)
  w.add_rope_freq_base(10000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_vocab_size(vocab)
  hd = dim // heads

  def q8(name: str, n_out: int, n_in: int) -> None:
    x = rng.normal(0, n_in**-0.5, (n_out, n_in)).astype(np.float32)
    w.add_tensor(
      name,
      gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
      raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )

  def norm(name: str) -> None:
    w.add_tensor(name, (1 + 0.1 * rng.normal(size=dim)).astype(np.float32))

  q8("token_embd.weight", vocab, dim)
  for i in range(layers):
    norm(f"blk.{i}.attn_norm.weight")
    q8(f"blk.{i}.attn_q.weight", heads * hd, dim)
    q8(f"blk.{i}.attn_k.weight", kv_heads * hd, dim)
    q8(f"blk.{i}.attn_v.weight", kv_heads * hd, dim)
    q8(f"blk.{i}.attn_output.weight", dim, heads * hd)
    norm(f"blk.{i}.ffn_norm.weight")
    q8(f"blk.{i}.ffn_gate.weight", ffn, dim)
    q8(f"blk.{i}.ffn_up.weight", ffn, dim)
    q8(f"blk.{i}.ffn_down.weight", dim, ffn)
  norm("output_norm.weight")
  q8("output.weight", vocab, dim)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  if split_max_tensors:
    return sorted(path.parent.glob(f"{path.stem}-0000*-of-*.gguf"))[0]
  return path


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def start_processes(
  path: Path, out: Path, scenarios: list[str]
) -> tuple[list[int], list[str], float]:
  """Start the processes and wait for all: when one fails, the others get `PEER_GRACE_S` to
  exit, then are killed, as they are after `TIMEOUT_S` in all. Returns their exit codes (None:
  killed), their output and the seconds from the first failure to the last exit (0: none)."""
  port = free_port()
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)
  logs = [out / f"log-{i}.txt" for i in range(PROCESSES)]
  procs = []
  for i in range(PROCESSES):
    cmd = [sys.executable, "-m", "tests.multiproc_worker", str(port), str(i), str(PROCESSES)]
    with open(logs[i], "w") as log:
      procs.append(
        subprocess.Popen(
          [*cmd, str(path), str(out), *scenarios], cwd=ROOT, env=env, stdout=log, stderr=log
        )
      )
  start, failed_at = time.monotonic(), None
  codes: list[int | None] = [None] * PROCESSES
  try:
    while any(p.poll() is None for p in procs):
      now = time.monotonic()
      if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
        failed_at = now
      if now - start > TIMEOUT_S or (failed_at is not None and now - failed_at > PEER_GRACE_S):
        break
      time.sleep(0.25)
    codes = [p.poll() for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  after = time.monotonic() - failed_at if failed_at is not None else 0.0
  return codes, [log.read_text() for log in logs], after


def run_processes(path: Path, out: Path, scenarios: list[str]) -> None:
  """`start_processes`, failing with every process's output unless all succeed."""
  codes, texts, _ = start_processes(path, out, scenarios)
  if any(c != 0 for c in codes):
    report = "\n".join(
      f"--- process {i} (exit {'killed' if c is None else c}):\n{t[-3000:]}"
      for i, (c, t) in enumerate(zip(codes, texts, strict=True))
    )
    pytest.fail(f"a process failed or hung (limit {TIMEOUT_S} s):\n{report}")


@pytest.mark.slow
@pytest.mark.heavy
def test_two_processes_one_model(tmp_path):
  path = write_llama(tmp_path / "tp4-llama-q8_0.gguf")
  bad = write_llama(tmp_path / "bad-llama-q8_0.gguf", kv_heads=2, ffn=192)
  split = write_llama(tmp_path / "split" / "tp4-llama-q8_0.gguf", split_max_tensors=7)
  run_processes(path, tmp_path, ["tp", "dp_tp", "tp_dp", "rules", f"split={split}", f"error={bad}"])
  size = path.stat().st_size

  devices = jax.devices()[: PROCESSES * LOCAL_DEVICES]
  single = load_gguf(path, dtype=jnp.float32)
  ref = single.logits(IDS)
  grid = np.array(devices).reshape(PROCESSES, LOCAL_DEVICES)
  meshes = {
    "tp": jax.sharding.Mesh(np.array(devices), ("tp",)),
    "dp_tp": jax.sharding.Mesh(grid, ("dp", "tp")),
    "tp_dp": jax.sharding.Mesh(grid.T, ("dp", "tp")),
  }
  for scenario, mesh in meshes.items():
    one = load_gguf(path, dtype=jnp.float32, mesh=mesh)  # the same mesh in one process
    want = one.logits(IDS)
    want_tokens = one.generate(IDS, NEW_TOKENS)
    for i in range(PROCESSES):
      got = np.load(tmp_path / f"{scenario}-{i}.npz")
      # bit-equal: row-parallel partial sums are added in mesh order on every device
      # (`sharding.product.ordered_sum`), whichever process holds them
      scale = float(np.abs(want).max())
      np.testing.assert_array_equal(got["logits"], want)
      assert got["tokens"].tolist() == want_tokens == single.generate(IDS, NEW_TOKENS)
      rel = float(np.linalg.norm(got["logits"] - ref) / np.linalg.norm(ref))
      assert rel < 1e-5, rel
      share = int(got["bytes_read"]) / size
      print(
        f"{scenario} {dict(mesh.shape)} process {i}: read {int(got['bytes_read'])} of"
        f" {size} bytes ({share:.2f}x the file), peak RSS {float(got['peak_rss_mib']):.0f} MiB"
        f" (load: +{float(got['peak_rss_at_load_mib'] - got['rss_before_load_mib']):.1f} MiB"
        f" at its peak, +{float(got['rss_after_load_mib'] - got['rss_before_load_mib']):.1f}"
        " MiB after),"
        f" max |logit - one process| {np.abs(got['logits'] - want).max():.2e} (logits up to"
        f" {scale:.2f}),"
        f" rel. L2 to unsharded {rel:.1e}"
      )
      if scenario in ("tp", "tp_dp"):  # half the block tensors, all the replicated ones
        assert share <= 0.6, (scenario, i, share)
      # the load's memory: its share of the file + 300 MB at most, above what the process
      # held before it (the runtime: jax, flax, qwix, gguf)
      grown_mb = float(got["peak_rss_at_load_mib"] - got["rss_before_load_mib"]) * 2**20 / 1e6
      assert grown_mb <= int(got["bytes_read"]) / 1e6 + 300, (scenario, i, grown_mb)
  # A split set loads over the processes the same way: the same logits, each process its share.
  parts = sorted(split.parent.iterdir())
  split_size = sum(p.stat().st_size for p in parts)
  for i in range(PROCESSES):
    got, whole = np.load(tmp_path / f"split-{i}.npz"), np.load(tmp_path / f"tp-{i}.npz")
    np.testing.assert_array_equal(got["logits"], whole["logits"])
    share = int(got["bytes_read"]) / split_size
    print(f"split set of {len(parts)} files, process {i}: read {share:.2f}x the set")
    assert len(parts) >= 3 and share <= 0.6, (len(parts), share)
  # The Flax rules path (shard_params, shard_products): equal to one process on the same
  # mesh bit for bit, and to the unsharded model within float32 rounding.
  unsharded = rules_forward(jax.sharding.Mesh(np.array(devices[:1]), ("tp",)))
  for name, mesh in (
    ("tp", jax.make_mesh((4,), ("tp",), devices=devices)),
    ("tp_dp", meshes["tp_dp"]),
  ):
    want = rules_forward(mesh)
    for i in range(PROCESSES):
      got = np.load(tmp_path / f"rules-{i}.npz")[name]
      np.testing.assert_array_equal(got, want)
      rel = float(np.linalg.norm(got - unsharded) / np.linalg.norm(unsharded))
      assert rel < 1e-6, (name, i, rel)
      print(f"rules path {name} {dict(mesh.shape)} process {i}: rel. L2 to unsharded {rel:.1e}")
  for i in range(PROCESSES):
    msg = (tmp_path / f"error-{i}.txt").read_text()
    assert "'blk.0.attn_k.weight'" in msg and "2 key/value heads" in msg, msg
    assert "'blk.0.ffn_down.weight'" in msg and "cuts a 32-row" in msg, msg


@pytest.mark.slow  # two more pairs of processes (about a minute): `pytest -m slow`
@pytest.mark.parametrize("dies", [0, 1])
def test_a_process_that_dies_fails_the_other(tmp_path, dies):
  """Process `dies` (0: the coordinator) exits after joining; the other, running the model
  (collectives each step), fails with jax.distributed's error within 60 s: never a hang."""
  path = write_llama(tmp_path / "tp4-llama-q8_0.gguf")
  codes, texts, after = start_processes(path, tmp_path, [f"die={dies}"])
  other = 1 - dies
  assert codes[dies] == 3, texts[dies][-2000:]
  assert codes[other] not in (None, 0), f"process {other}: {codes[other]}\n{texts[other][-2000:]}"
  assert after < PEER_GRACE_S, after
  assert "another task died" in texts[other], texts[other][-2000:]
  print(f"process {dies} died; process {other} failed {after:.1f} s later (exit {codes[other]})")
