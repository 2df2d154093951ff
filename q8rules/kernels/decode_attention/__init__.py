"""Op 'decode_attention': one new token's attention over a layer of the KV cache (`api.py`), its
reference and one module per implementation."""
