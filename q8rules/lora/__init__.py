"""LoRA on a frozen Q8_0 base, in one package: the adapters as data, their placement on a mesh,
the provider that adds them to served products, merging them into the base, their files, and
the trainer.

Each module sits on the floor of what it imports (docs/kernels.md, "Architecture"), so this
package's `__init__` imports nothing: `import q8rules` loads the core's part of it, and the
applications' part loads on first use.

  placement.py        a new adapter placed and annotated as its base's Q8 values are
  provider.py         `Q8LoraRule`, `LoraPolicy`, `Q8LoraProvider`: served product + delta
  params.py           `LoraAdapter`, `split_lora` / `join_lora`: adapters as data
  merge.py            `merge_lora`: adapters folded into the base's Q8_0 values
  safetensors_file.py `save_lora` / `load_lora`: adapters as a safetensors file
  gguf_file.py        llama.cpp's LoRA adapter files (GGUF)
  gguf_model.py       adapters on a model loaded from a GGUF file (`GGUFModel.with_lora`)
  tree.py, fuse.py    where a loaded model's adapters sit; fused q|k|v and gate|up split back
  convert.py          llama.cpp LoRA files put on a model, and merged into its Q8_0 weights
  datasets.py         text and conversations as training batches
  heldout.py          the held-out windows an evaluation reads
  trainer.py, fit.py  `LoraTrainer`: steps, evaluation, the best adapters kept
"""
