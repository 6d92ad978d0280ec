"""The torch.library op behind fp4moe.MoeLayer under torch.compile:

    fp4moe::moe_forward(int layer_id, Tensor hidden_states, Tensor(a!) out,
                        Tensor? router_logits, Tensor? correction_bias,
                        Tensor? topk_ids, Tensor? topk_weights) -> ()

It writes `out` (bf16 [T, H]) and returns nothing, so its fake
implementation has nothing to compute; the layer is named by the id it was
registered under (fp4moe/_ops.py: an op's arguments cannot hold Python
objects).
Imported by fp4moe.layer when torch is present. Tested in
tests/python/test_gpu.py (torch.library.opcheck, torch.compile fullgraph).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _ops


# No device_types: tensors of any device reach the implementation, whose
# argument checks name what was wrong (e.g. a CPU tensor).
@torch.library.custom_op("fp4moe::moe_forward", mutates_args=("out",))
def moe_forward(layer_id: int, hidden_states: torch.Tensor, out: torch.Tensor,
                router_logits: Optional[torch.Tensor], correction_bias: Optional[torch.Tensor],
                topk_ids: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor]) -> None:
    layer = _ops.lookup(layer_id)
    if layer is None:
        raise ValueError(f"fp4moe::moe_forward: no live fp4moe.MoeLayer with id {layer_id}")
    # On the current stream; a CPU tensor is refused by the layer's checks.
    layer.forward_into(hidden_states, out, router_logits, correction_bias, topk_ids, topk_weights)


@moe_forward.register_fake
def _(layer_id, hidden_states, out, router_logits, correction_bias, topk_ids, topk_weights) -> None:
    return None
