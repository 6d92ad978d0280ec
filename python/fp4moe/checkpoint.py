"""What a checkpoint says about its MoE layers, without loading weights:
the expert-tensor prefixes (from safetensors headers or the shard index) and
the routing/activation its config.json declares, as the library's one
config.json reader reads them (the extension's moe_model_config;
src/format/config_json.hpp).

    prefixes = find_moe_prefixes("Qwen3-30B-A3B-NVFP4/")    # ["model.layers.0.mlp.", ...]
    cfg = layer_config_from_hf(json.load(open(".../config.json")))

Tested in tests/python/test_cpu.py (configs of each routing family, a small
checkpoint written there).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import struct

from . import _fp4moe

# An expert's gate weight, named as ModelOpt exports it or as Mixtral does
# (w1), the rule of the C++ loader's prefix detection (tools/cli_util.cpp).
_EXPERT_TENSOR = re.compile(r"^(.*)experts\.(\d+)\.(?:gate_proj|w1)\.weight$")


@dataclasses.dataclass
class LayerConfig:
    """MoeLayer's options (the keyword arguments of fp4moe.MoeLayer)."""

    top_k: int
    routing: str = "softmax"  # "softmax", "noaux_tc" or "gptoss"
    renormalize: bool = True
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    activation: str = "swiglu"  # "swiglu" or "gptoss"

    def as_kwargs(self) -> dict:
        return dataclasses.asdict(self)


def _layer_config(json_text: str, where: str) -> LayerConfig:
    """The routing and activation of config.json's text, read by the
    library (fp4moe.Error, a ValueError, for a value it refuses)."""
    config = _fp4moe.moe_model_config(json_text, where)
    if config is None:
        raise ValueError(f"{where} gives no routed expert count (n_routed_experts, num_local_experts or "
                         "num_experts): not an MoE config")
    if config["top_k"] is None:
        raise ValueError(f"{where} (model_type '{config['model_type']}') has no num_experts_per_tok or "
                         "experts_per_token: not an MoE config")
    return LayerConfig(top_k=config["top_k"], routing=config["routing"], renormalize=config["renormalize"],
                       num_groups=config["num_groups"], topk_groups=config["topk_groups"],
                       routed_scaling_factor=config["routed_scaling_factor"], activation=config["activation"])


def layer_config_from_hf(config: dict) -> LayerConfig:
    """Routing and activation of a Hugging Face MoE config (DeepSeek-V3,
    Kimi K2, GLM-4.5+, Qwen2/3-MoE, Mixtral, gpt-oss), with each family's
    defaults, as the library reads config.json (fp4moe/model_config.hpp).
    A multimodal config's text_config is used when present. Raises
    ValueError for a config without MoE routing fields, fp4moe.Error for a
    value or routing the library refuses."""
    return _layer_config(json.dumps(config), "config.json")


def read_layer_config(path: str) -> LayerConfig | None:
    """The routing and activation of config.json beside a checkpoint (the
    directory, or the file's folder); None when there is no config.json."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    candidate = os.path.join(folder, "config.json")
    if not os.path.exists(candidate):
        return None
    with open(candidate) as f:
        return _layer_config(f.read(), candidate)


def _safetensors_names(path: str) -> list[str]:
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    return [name for name in header if name != "__metadata__"]


def tensor_names(path: str) -> list[str]:
    """Tensor names of a .safetensors file or a checkpoint directory (through
    model.safetensors.index.json, else its single .safetensors file)."""
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                return list(json.load(f)["weight_map"])
        files = sorted(p for p in os.listdir(path) if p.endswith(".safetensors"))
        if not files:
            raise ValueError(f"{path}: no model.safetensors.index.json and no .safetensors file")
        return [n for p in files for n in _safetensors_names(os.path.join(path, p))]
    return _safetensors_names(path)


def find_moe_prefixes(path: str) -> list[str]:
    """The prefixes (e.g. 'model.layers.3.mlp.') under which the checkpoint
    holds per-expert ModelOpt tensors '<prefix>experts.<e>.gate_proj.weight'
    (or Mixtral's '<prefix>experts.<e>.w1.weight'), in layer order."""
    prefixes = {m.group(1) for n in tensor_names(path) if (m := _EXPERT_TENSOR.match(n))}

    def layer_key(prefix: str):
        numbers = [int(x) for x in re.findall(r"\d+", prefix)]
        return numbers, prefix

    return sorted(prefixes, key=layer_key)


def prefix_for_layer(path: str, layer: int | None) -> str:
    """The one prefix of decoder layer `layer` ('layers.<layer>.'), or the
    checkpoint's only MoE prefix when layer is None."""
    prefixes = find_moe_prefixes(path)
    if not prefixes:
        raise ValueError(f"{path}: no ModelOpt expert tensors ('<prefix>experts.<e>.gate_proj.weight')")
    if layer is None:
        if len(prefixes) > 1:
            raise ValueError(f"{path}: {len(prefixes)} MoE layers ({prefixes[0]} ... {prefixes[-1]}); "
                             "pass layer=N")
        return prefixes[0]
    matching = [p for p in prefixes if re.search(rf"(^|\.)layers\.{int(layer)}\.", p)]
    if len(matching) != 1:
        raise ValueError(f"{path}: layer {layer} has {len(matching)} MoE prefixes {matching}; the "
                         f"checkpoint's MoE layers are {[_layer_number(p) for p in prefixes]}")
    return matching[0]


def _layer_number(prefix: str):
    m = re.search(r"layers\.(\d+)\.", prefix)
    return int(m.group(1)) if m else prefix
