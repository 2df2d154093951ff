"""The native CPU library (`kernels/cpu/library.cc` and its headers), one module per job:

- `library`: build it on first use, load it, register its FFI targets (`TARGET*`);
- `simd`: the SIMD path its calls run (AVX-512, AVX2 or scalar; `$Q8RULES_CPU_ISA`);
- `settings`: what the environment and `threads.set_threads` ask of its threads;
- `threads`: how many threads a native call runs on (`$Q8RULES_THREADS`, the helpers' spin);
- `repack`: GGUF tensors into the kernel layout through it.

The ops' 'cpu' implementations call it through XLA's FFI (`kernels/matmul/cpu.py`,
`kernels/matmul_act_q8/cpu.py`, `kernels/matmul_t/cpu.py`, `kernels/decode_attention/cpu.py`).
"""
