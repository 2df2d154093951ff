"""Op 'ragged_matmul': the grouped (ragged) Q8_0 weight-only product of experts (`api.py`), its
reference and one module per implementation."""
