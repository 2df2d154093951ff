"""Op 'matmul_t': the transposed Q8_0 product dy @ W^T, the gradient of x @ W with respect to x
(`api.py`), its reference and one module per implementation."""
