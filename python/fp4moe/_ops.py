"""The live layers by id, for the torch.library op fp4moe::moe_forward
(fp4moe/torch_ops.py), whose arguments can carry an int but not a Python
object. fp4moe.layer registers every MoeLayer here; the op looks it up. This
module imports nothing of the package, so fp4moe.layer and fp4moe.torch_ops
both depend on it and not on each other.
"""
from __future__ import annotations

import itertools
import weakref

# Weak: a layer that is garbage collected frees its GPU memory.
_LAYERS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_NEXT_ID = itertools.count(1)


def register(layer) -> int:
    """A new id for `layer`, valid while the layer lives."""
    layer_id = next(_NEXT_ID)
    _LAYERS[layer_id] = layer
    return layer_id


def lookup(layer_id: int):
    """The live layer of `layer_id`, or None."""
    return _LAYERS.get(layer_id)
