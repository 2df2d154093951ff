"""The `rng` fixture: fresh random data per test, seeded from its id (helpers: tests/_utils.py).

Before any test module imports JAX, the CPU backend is given `HOST_DEVICES` devices, so the
multi-device tests (tests/test_sharding_mesh.py, tests/test_llm_gguf_mesh.py) run in this
process; everything else runs on the first (the default device), as with one.
"""

from __future__ import annotations

import os
import zlib

import jax
import numpy as np
import pytest

HOST_DEVICES = 8
"""CPU devices in the test process (`jax_num_cpu_devices`; the CPU backend starts later)."""

jax.config.update("jax_num_cpu_devices", HOST_DEVICES)
# The suite does not read or write the user's JAX compilation cache (load_gguf turns it on by
# default); tests/test_compile_cache.py runs the CLI with it on, in a temporary directory.
os.environ.setdefault("Q8RULES_NO_COMPILE_CACHE", "1")


SLOW_CASES = (
  # The longest cases of the default run, as `pytest --durations` timed them on the 2-core
  # CI machine (2026-12-01, the whole run 19 min; without these, 8 min): marked `slow` here,
  # so the README's test command stays under 10 minutes; `.ci/run` runs them right after it
  # (`pytest -m slow`).
  "tests/test_multiprocess.py::test_two_processes_one_model",  # 74 s
  "tests/test_notebooks.py::test_notebook_executes",  # 85 s, 3 notebooks
  "tests/test_readme.py::test_readme_block_runs",  # ~70 s, every README block
  "tests/test_properties.py::test_quantizer_is_gguf_bit_for_bit",  # 24 s
  "tests/test_properties.py::test_einsum_layout_round_trip",  # 15 s
  "tests/test_properties.py::test_q8_matmul_every_host_implementation_within_1e6",  # 15 s
  "tests/test_qat_usage.py::test_digits_quick",  # 22 s
  "tests/test_shapes_only.py::test_shapes_only_gives_the_quantized_inits_shapes",  # 36 s
  "tests/test_llm_gguf_mesh.py::test_flax_rules_path_on_an_explicit_mesh",  # 19 s
  "tests/test_llm_gguf_mesh.py::test_sharded_load_matches_single_device",  # 33 s
  "tests/test_llm_gguf_mesh.py::test_explicit_mesh_matches_auto_and_single_device",  # 19 s
  "tests/test_provider.py::test_quantize_params_equals_init",  # 17 s
  "tests/test_einsum_decoder.py::test_nd_weights_served_as_q8_0",  # 17 s
  "tests/test_qat.py::test_scan_remat_quantizes_each_layer_slice",  # 15 s
  "tests/test_qat.py::test_linen_trains_and_converts_to_serving",  # 11 s
  "tests/test_qat.py::test_nnx_trains_and_converts_to_serving",  # 9 s
  "tests/test_llm_archs.py::test_unrolled_layers_equal_scanned",  # 26 s
  "tests/ecosystem/test_views.py::test_qat_forward_equals_served_and_trains",  # 14 s
  "tests/test_demo.py::test_demo_runs_and_reports",  # 13 s
  "tests/test_layer_slice.py::test_in_place_scan_gives_the_sliced_scans_logits[gemma3]",  # 13 s
  "tests/test_compile_cache.py::test_second_run_compiles_nothing",  # 13 s
  "tests/test_compile_cache.py::test_switched_off",  # 9 s
  # the Q8_0-activation product's model-level cases (2026-12-02, a Zen 4 VM: 2-4 s each)
  "tests/test_act_q8_0.py::test_quantize_model_runs_the_q8_0_product_and_reports_it",
  "tests/test_act_q8_0.py::test_qat_forward_is_the_served_q8_0_product",
  "tests/test_act_q8_0.py::test_load_gguf_with_q8_0_activations",
  "tests/test_act_q8_0.py::test_export_carries_each_platforms_q8_0_product",
  "tests/test_cnn.py::test_linen_cnn_dense_q8_conv_float",  # 11 s
  "tests/test_llm_gguf_errors.py::test_a_tokenizer_that_cannot_be_built_does_not_block",  # 10 s
  "tests/test_unstack.py::test_unrolled_matches_scanned",  # 16 s
  "tests/ecosystem/test_linen_tied.py::test_qat_apply_first_under_jit_and_grad",  # 12 s
  "tests/test_layer_slice.py::test_in_place_scan_of_a_float_model",  # 8 s
  "tests/test_provider.py::test_provider_dispatches_decode_products_to_the_fold",  # 7 s
  "tests/test_user_errors.py::test_quantize_accepts_every_axis_in_range",  # 7 s
  "tests/test_qat.py::test_ste_gradient_nnx",  # 7 s
  "tests/test_llm_cli.py::test_run_prints_text_and_speed",  # 7 s
  "tests/test_llm_gguf_errors.py::test_sliding_window_pattern_as_an_array",  # 6 s
  "tests/test_checkpoint_safetensors.py::test_load_like_gives_params_apply_takes",  # 6 s
  # 2026-12-02, a slower VM (the default run 9 min 47 s; --durations with other work running):
  "tests/test_generate.py::test_prefill_runs_the_head_on_the_last_position_only",  # 22 s
  "tests/test_cnn.py::test_nnx_cnn_dense_q8_conv_float",  # 15 s
  "tests/test_layer_slice.py::test_in_place_scan_gives_the_sliced_scans_logits[llama]",  # 15 s
  "tests/test_provider.py::test_rule_module_path_excludes_a_layer",  # 13 s
  "tests/test_cpu_kernel.py::test_output_does_not_depend_on_the_threads",  # 12 s
  "tests/test_sharding_mesh.py::test_megatron_mlp",  # 11 s
  "tests/test_qat.py::test_ste_gradient_linen",  # 11 s
  "tests/test_qat_usage.py::test_serving_options_choose_the_forward_kernel",  # 9 s
)
"""Node-id prefixes of the cases marked `slow` at collection (with the `@pytest.mark.slow`
ones: tests/test_fold.py's every-shape TPU form, tests/test_multiprocess.py's dying
processes)."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
  """Mark `SLOW_CASES` slow before `-m` selects (pyproject's addopts leaves slow out)."""
  del config
  for item in items:
    if item.nodeid.startswith(SLOW_CASES):
      item.add_marker(pytest.mark.slow)


@pytest.fixture
def rng(request) -> np.random.Generator:
  """A generator seeded from the test's name: fresh data per test, reproducible."""
  return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def float32_matmuls():
  """Plain-JAX float references at float32 precision on every backend (a GPU's default for
  float32 matmuls is TF32, about 1e-3 off). q8rules' own products are explicit without it:
  tests/test_precision.py checks that on the lowered program."""
  with jax.default_matmul_precision("highest"):
    yield
