"""Op 'matmul': the weight-only Q8_0 product (`api.py`), its reference and one module per
implementation."""
