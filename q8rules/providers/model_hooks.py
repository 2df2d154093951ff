"""The decoder's hooks (`q8rules.models.hooks`) routed to the kernels, as a provider routes the
products: the intercepts both providers add to Qwix's map.

`take_layer(tree, i)` becomes `kernels.layer.layer_of` (Q8_0 weights as `LayerSlice`s, read in
place by the kernels that can), and `attend_one_token(...)` becomes op 'decode_attention'
(`kernels.decode_attention.api.attend`, its implementation chosen by `kernels.resolve`). The
hooks are intercepted by name, only once their module is loaded (a model without them needs
nothing), so the core imports nothing of the models.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from q8rules.kernels.decode_attention.api import attend
from q8rules.kernels.layer import layer_of

HOOKS_MODULE = "q8rules.models.hooks"
"""The module whose functions are the decoder's hooks."""

ROUTES: dict[str, Callable[..., Any]] = {
  "take_layer": layer_of,
  "attend_one_token": attend,
}
"""Hook name -> what a q8rules provider runs in its place (the same signature)."""


def intercepts() -> dict[str, Callable[..., Any]]:
  """{'q8rules.models.hooks.<hook>': its route} once the hooks' module is loaded, else {}."""
  if HOOKS_MODULE not in sys.modules:
    return {}
  return {f"{HOOKS_MODULE}.{name}": route for name, route in ROUTES.items()}


__all__ = ["HOOKS_MODULE", "ROUTES", "intercepts"]
