"""GGUF checkpoints (llama.cpp's files): Q8_0 tensors repacked into `Q8Array`s, and back.

Reading parses the file's header here (`parse`: its fields and tensor table,
checked) and maps the file once; writing goes through llama.cpp's own Python
package, `gguf` (`gguf.GGUFWriter`). Q8_0 blocks move between the file's layout
and ours without being dequantised.

A Q8_0 tensor in a GGUF file is a run of 34-byte blocks: a float16 scale `d`
(little-endian) then 32 int8 values `qs`, with `w = qs * d`. The blocks run
along ggml's innermost axis `ne[0]`. Shapes are given in numpy order (ggml's
`ne` reversed, as gguf-py's reader gives them), so a weight matrix is
`[n_out, n_in]` and it is blocked along its last numpy axis, `n_in` (the
contraction axis).

Layouts (`layout=` of `load` and `save`):

  * `'kernel'` (default): the layout of a Flax `Dense` kernel and of the Q8
    params that `q8rules.Q8Provider` makes. The last two numpy axes of every
    tensor of rank >= 2 are swapped, Q8_0 or not:
      - a Q8_0 matrix `[n_out, n_in]` becomes `Q8Array(q=(n_in, n_out) int8,
        scale=(n_in // 32, n_out), axis=0)`: `q = qs.reshape(n_out, n_in).T`,
        `scale = d.reshape(n_out, n_in // 32).T`;
      - a stacked tensor `[*lead, n_out, n_in]` (e.g. experts `[E, n_out, n_in]`)
        becomes `q` of shape `(*lead, n_in, n_out)`, `scale` of shape
        `(*lead, n_in // 32, n_out)`, `axis = ndim - 2`: one (K, N) matrix per
        leading index, blocked along K as in the 2-D case;
      - a Q8_0 vector `[n]` stays `(n,)` with `axis=0`;
      - a float matrix `[n_out, n_in]` comes back as `(n_in, n_out)` too, so a
        square weight can never be loaded the wrong way round. Embedding tables
        (`token_embd.weight`, `[n_vocab, n_embd]`) therefore come back as
        `(n_embd, n_vocab)`: transpose them for an `nn.Embed`, or load them with
        `ckpt.get_tensor(name, layout='gguf')`.
  * `'gguf'`: numpy order as gguf-py's reader reports it; a Q8_0 tensor
    `[..., n_in]` is a `Q8Array` blocked along its last axis (`axis = ndim - 1`).

Scales keep their float16 values exactly: float16 by default, or widened
(exactly) to float32 with `scale_dtype=np.float32`.

Tensor types: Q8_0 becomes a `Q8Array`; F32, F16, F64, I8, I16, I32 and I64
become numpy arrays of that dtype; BF16 becomes an `ml_dtypes.bfloat16` numpy
array (the same dtype as `jnp.bfloat16`, values exact). A matrix of another
quantized type (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, IQ*, TQ*, MXFP4: whatever
`gguf.quants` dequantizes) is requantized to Q8_0 at read (`requant`: dequantized
as llama.cpp does, quantized with the Q8_0 quantizer, a few rows at a time) and
becomes a `Q8Array`; with `dequantize_other=True` it becomes float32 instead.
With `quantize='q8_0'` the float weight matrices (F32, F16, BF16) are quantized to
Q8_0 too, as `llama-quantize` would. A type `gguf.quants` cannot dequantize is
refused with an error naming each tensor and its type.

Every array returned is a numpy array on the host, owned (not a view of the
file). Put it on a device with `jax.device_put`, or let `assign` place it like
the param it replaces.

Modules: `read` (`load`, `GGUFCheckpoint`), `write` (`save`), `parse` (the
header parsed: fields and tensor table), `header` (opening a file: mapped, its
tensor table checked), `metadata` (key-value fields as values), `layouts`
(the Q8_0 block, the tensor types, the two layouts), `requant` (other types
served as Q8_0), `split` (`open_gguf`: split files as one checkpoint).
"""

from q8rules.checkpoint.gguf.layouts import (
  BLOCK_BYTES,
  DTYPE_TO_TYPE,
  GGML_MAX_DIMS,
  LAYOUTS,
  PLAIN_TYPES,
  Q8_0,
  Layout,
)
from q8rules.checkpoint.gguf.read import GGUFCheckpoint, load
from q8rules.checkpoint.gguf.split import GGUFSplitCheckpoint, open_gguf
from q8rules.checkpoint.gguf.write import save

__all__ = [
  "BLOCK_BYTES",
  "DTYPE_TO_TYPE",
  "GGML_MAX_DIMS",
  "LAYOUTS",
  "PLAIN_TYPES",
  "Q8_0",
  "GGUFCheckpoint",
  "GGUFSplitCheckpoint",
  "Layout",
  "load",
  "open_gguf",
  "save",
]
