"""fp4moe: the Mixture-of-Experts layer of NVFP4-quantised LLMs on the GPU.

    import fp4moe
    layer = fp4moe.MoeLayer(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
                            top_k=8, max_tokens=4096)          # stacked CUDA tensors
    out = layer(hidden_states, router_logits=logits)        # bf16 [T, H]

    layer = fp4moe.MoeLayer.from_checkpoint("Qwen3-30B-A3B-NVFP4/", layer=3)

The compiled part (fp4moe._fp4moe) takes any DLPack array, so torch is
optional: it is imported only to register the torch.library op
(fp4moe::moe_forward) that torch.compile and CUDA graphs see.
"""
from ._fp4moe import (  # noqa: F401
    Error,
    checkpoint_reference_forward,
    cuda_device_count,
    cuda_unavailable_reason,
    describe_plan,
    load_stacked,
    pack_host,
    pack_stacked,
    quantize,
    reference_forward,
)
from .checkpoint import LayerConfig, find_moe_prefixes, layer_config_from_hf  # noqa: F401
from .layer import MoeLayer  # noqa: F401
from .nvfp4 import dequantize  # noqa: F401

__version__ = "0.1.0"

__all__ = [
    "Error",
    "LayerConfig",
    "MoeLayer",
    "checkpoint_reference_forward",
    "cuda_device_count",
    "cuda_unavailable_reason",
    "dequantize",
    "describe_plan",
    "find_moe_prefixes",
    "layer_config_from_hf",
    "load_stacked",
    "pack_host",
    "pack_stacked",
    "quantize",
    "reference_forward",
]
