"""Op 'matmul_act_q8': the Q8_0 x Q8_0 product (`api.py`), its reference and one module per
implementation."""
