"""The ModelOpt compatibility check behind tests/conformance/modelopt-compat (which
sets up the Python environment and runs this file).

For each small random MoE model (transformers config objects, no downloads):

  1. build it, save it (bfloat16 safetensors) and capture, with the float
     model, the hidden states that enter each MoE block;
  2. in a fresh process per config (a failed mtq.quantize can leave torch
     patched), quantise it with NVIDIA ModelOpt with calibration data and
     export it (export_hf_checkpoint), for every NVFP4 config in CONFIGS
     that ModelOpt can run on a CPU;
  3. run `fp4moe moe --device cpu` on each MoE layer of each export and
     compare its output with a float64 NumPy evaluation of the exported
     tensors (scripts/nvfp4_ref.py) under the checkpoint's activation
     numerics: for NVFP4 (W4A4) layers the inputs of gate/up and of down are
     NVFP4-quantised against that layer's input_scale, once with the NumPy
     rule and once with ModelOpt's own NVFP4QTensor quantiser; shared experts
     are part of the layer's output; the group-32 exports must be refused
     in one line;
  4. run `fp4moe quantize` on the float checkpoint and compare every tensor
     with ModelOpt's W4A16_NVFP4 export, byte for byte.

Prints a table, writes it and one JSON line per check to --out, and exits 1
when a check fails. Internal subcommands (`_build`, `_export`) are the
per-process steps.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import nvfp4_ref as ref  # noqa: E402

REL_ERR_LIMIT = 1e-2
CALIB_SEQUENCES, CALIB_LEN = 16, 32
EVAL_SEQUENCES, EVAL_LEN = 2, 16

# ---------------------------------------------------------------------------
# models: tiny but real architectures (sizes multiples of 16)


def model_config(name: str):
    import transformers as tf
    common = dict(vocab_size=512, hidden_size=128, num_attention_heads=4, max_position_embeddings=256)
    if name == "qwen3-moe":
        return tf.Qwen3MoeConfig(**common, num_hidden_layers=2, num_key_value_heads=2, head_dim=32,
                                 intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                                 num_experts_per_tok=2, norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])
    if name == "mixtral":
        return tf.MixtralConfig(**common, num_hidden_layers=2, num_key_value_heads=2, intermediate_size=64,
                                num_local_experts=8, num_experts_per_tok=2, architectures=["MixtralForCausalLM"])
    if name == "qwen2-moe":
        return tf.Qwen2MoeConfig(**common, num_hidden_layers=2, num_key_value_heads=2, intermediate_size=256,
                                 moe_intermediate_size=64, shared_expert_intermediate_size=128, num_experts=8,
                                 num_experts_per_tok=2, norm_topk_prob=False, architectures=["Qwen2MoeForCausalLM"])
    if name == "deepseek-v3":
        return tf.DeepseekV3Config(**common, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=256,
                                   moe_intermediate_size=64, n_routed_experts=16, n_shared_experts=1,
                                   num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                   norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=32,
                                   qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
                                   architectures=["DeepseekV3ForCausalLM"])
    raise ValueError(f"unknown model {name}")


MODELS = ["qwen3-moe", "mixtral", "qwen2-moe", "deepseek-v3"]

# ---------------------------------------------------------------------------
# configs: name -> (how to build the ModelOpt config, what fp4moe must do)

# ModelOpt 0.47's other NVFP4 configs do not run on a CPU: the AWQ ones
# ("amax must be a CUDA tensor for dynamic block quantization") and
# NVFP4_FOUR_OVER_SIX_CFG (its static fake-quant needs triton on a GPU).
CONFIGS = {
    "NVFP4_DEFAULT_CFG": "run",          # W4A4, calibrated input_scale
    "W4A16_NVFP4_CFG": "run",            # weights only
    "NVFP4_EXPERTS_ONLY_CFG": "run",     # W4A4 experts, the rest (attention) in bf16
    "NVFP4_MLP_WEIGHT_ONLY_CFG": "refuse",  # group size 32
    "W4A8_NVFP4_FP8_CFG": "refuse",      # group size 32, FP8 activations
    "MIXED_PRECISION": "run",            # per layer: W4A4 / W4A16_NVFP4 experts, FP8 attention
}


def modelopt_config(name: str, num_layers: int):
    import modelopt.torch.quantization as mtq
    if name != "MIXED_PRECISION":
        return getattr(mtq, name)
    # The last layer's inputs stay bf16 (W4A16_NVFP4) while the others are
    # W4A4; attention is FP8: the export lists each layer's format.
    cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    fp8 = {"num_bits": (4, 3), "axis": None}
    cfg["quant_cfg"] += [
        {"quantizer_name": f"*layers.{num_layers - 1}.*input_quantizer", "enable": False},
        {"quantizer_name": "*self_attn*weight_quantizer", "cfg": fp8},
        {"quantizer_name": "*self_attn*input_quantizer", "cfg": fp8},
    ]
    return cfg


# ---------------------------------------------------------------------------
# step 1 and 2 (each in its own process, inside the ModelOpt environment)


def cmd_build(name: str, out_dir: str) -> None:
    """Random float model -> out_dir (bf16 safetensors) + inputs.safetensors
    with the hidden states entering each MoE block."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    config = model_config(name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    hidden = config.hidden_size
    with torch.no_grad():
        for module_name, module in model.named_modules():
            # Routers with logits of O(1), as trained ones have, so that the
            # top-k choice is clear; a non-zero correction bias.
            if module_name.endswith("mlp.gate") or module_name.endswith("shared_expert_gate"):
                module.weight.normal_(0.0, 1.0 / hidden ** 0.5)
                if hasattr(module, "e_score_correction_bias"):
                    module.e_score_correction_bias.normal_(0.0, 0.05)
    model.save_pretrained(out_dir)

    captured = {}

    def hook(layer_idx):
        def fn(_module, args):
            x = args[0]
            captured.setdefault(layer_idx, []).append(x.reshape(-1, x.shape[-1]).detach().clone())
        return fn

    for layer_idx, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "experts"):
            layer.mlp.register_forward_pre_hook(hook(layer_idx))
    tokens = torch.randint(0, config.vocab_size, (EVAL_SEQUENCES, EVAL_LEN), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        model(tokens)
    save_file({f"layers.{i}": torch.cat(xs) for i, xs in captured.items()}, os.path.join(out_dir, "inputs.safetensors"))


def cmd_export(name: str, config_name: str, float_dir: str, export_dir: str) -> None:
    import torch
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.bfloat16).eval()
    calib = torch.randint(0, model.config.vocab_size, (CALIB_SEQUENCES, CALIB_LEN),
                          generator=torch.Generator().manual_seed(1))

    def forward_loop(m):
        with torch.no_grad():
            for i in range(0, CALIB_SEQUENCES, 4):
                m(calib[i:i + 4])

    mtq.quantize(model, modelopt_config(config_name, model.config.num_hidden_layers), forward_loop)
    export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=export_dir)


# ---------------------------------------------------------------------------
# the fp4moe command lines (kept in one place)


ROUTING_FROM_CONFIG = False  # --routing-from-config: fp4moe reads the export's config.json


def routing_flags(config: dict) -> list[str]:
    """`fp4moe moe` flags for routing router_logits as the model does."""
    if ROUTING_FROM_CONFIG:
        return []
    top_k = str(config["num_experts_per_tok"])
    if config["model_type"] in ("deepseek_v3", "glm4_moe", "kimi_k2"):
        flags = ["--routing", "noaux_tc", "--topk", top_k, "--n-group", str(config.get("n_group", 1)),
                 "--topk-group", str(config.get("topk_group", 1)),
                 "--routed-scaling-factor", repr(float(config.get("routed_scaling_factor", 1.0)))]
    else:
        flags = ["--routing", "softmax", "--topk", top_k]
    # Mixtral always renormalises; Qwen2/3-MoE and DeepSeek say so.
    if not config.get("norm_topk_prob", True):
        flags.append("--no-renormalize")
    return flags


def run_fp4moe_moe(fp4moe: str, weights: str, prefix: str, layer_idx: int, input_path: str, output_path: str,
                   config: dict) -> subprocess.CompletedProcess:
    """One layer of a checkpoint on the CPU reference backend."""
    del layer_idx  # the layer is named by --prefix
    cmd = [fp4moe, "moe", "--weights", weights, "--prefix", prefix, "--input", input_path, "--output",
           output_path, "--device", "cpu"] + routing_flags(config)
    return subprocess.run(cmd, capture_output=True, text=True)


def run_fp4moe_quantize(fp4moe: str, float_dir: str, out_dir: str) -> subprocess.CompletedProcess:
    return subprocess.run([fp4moe, "quantize", "--quiet", float_dir, out_dir], capture_output=True, text=True)


def error_text(proc: subprocess.CompletedProcess) -> str:
    """The line that says what went wrong (not CLI11's 'Run with --help')."""
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip() and "Run with --help" not in line]
    errors = [line for line in lines if "error" in line]
    return (errors or lines or [f"exit {proc.returncode}, no message"])[-1]


# ---------------------------------------------------------------------------
# the reference for one layer of an export


def expert_names(tensors, prefix: str):
    if f"{prefix}experts.0.w1.weight" in tensors:
        return "w1", "w3", "w2"
    return "gate_proj", "up_proj", "down_proj"


def weight_of(tensors, base: str) -> np.ndarray:
    """float64 weight of a linear layer, dequantised when it is NVFP4."""
    t = tensors[base + ".weight"]
    if t.dtype == "U8" and base + ".weight_scale_2" in tensors:
        return ref.dequantize_tensors(tensors, base)
    return t.values()


def layer_algo(quant: dict, prefix: str) -> str:
    """quant_algo that the export gives the layer's experts."""
    q = quant["quantization"]
    if q.get("quant_algo") != "MIXED_PRECISION":
        return q.get("quant_algo")
    layers = q.get("quantized_layers", {})
    for module, fmt in layers.items():
        # per expert ("<prefix>experts.3.gate_proj") or, for transformers'
        # fused experts, the experts module itself ("<prefix>experts")
        if module == prefix + "experts" or module.startswith(prefix + "experts."):
            return fmt.get("quant_algo")
    return "unquantised"


class LayerReference:
    """The exported layer in float64: routed experts, shared experts, router."""

    def __init__(self, tensors, config: dict, prefix: str, fp4_activations: bool):
        self.prefix = prefix
        names = expert_names(tensors, prefix)
        num_experts = config.get("n_routed_experts") or config.get("num_local_experts") or config["num_experts"]
        act = "fp4" if fp4_activations else "bf16"
        self.experts = [ref.load_expert(tensors, f"{prefix}experts.{e}", names, act) for e in range(num_experts)]
        self.shared = []
        for shared_name in ("shared_expert", "shared_experts"):
            base = f"{prefix}{shared_name}"
            if base + ".gate_proj.weight" not in tensors:
                continue
            w = [weight_of(tensors, f"{base}.{p}") for p in ("gate_proj", "up_proj", "down_proj")]
            scales = [tensors.get(f"{base}.{p}.input_scale") for p in ("gate_proj", "down_proj")]
            use_scales = fp4_activations and all(s is not None for s in scales)
            expert = ref.Expert(*w, *(float(s.values().item()) if use_scales else None for s in scales))
            gate = tensors.get(f"{prefix}shared_expert_gate.weight")
            self.shared.append((expert, None if gate is None else gate.values()[0]))
        self.router = tensors[f"{prefix}gate.weight"].values()
        bias = tensors.get(f"{prefix}gate.e_score_correction_bias")
        self.bias = None if bias is None else bias.values()
        self.config = config

    def logits(self, x: np.ndarray) -> np.ndarray:
        return (x @ self.router.T).astype(np.float32)

    def route(self, logits: np.ndarray):
        c = self.config
        if self.bias is not None:
            return ref.route_noaux_tc(logits, self.bias, c["num_experts_per_tok"], c.get("n_group", 1),
                                      c.get("topk_group", 1), c.get("routed_scaling_factor", 1.0),
                                      c.get("norm_topk_prob", True))
        return ref.route_softmax(logits, c["num_experts_per_tok"], c.get("norm_topk_prob", True))

    def forward(self, x, ids, weights, quantize=None, shared=True, fp4=True):
        experts = self.experts
        shared_list = self.shared if shared else []
        if not fp4:
            experts = [ref.Expert(e.gate, e.up, e.down) for e in experts]
            shared_list = [(ref.Expert(e.gate, e.up, e.down), g) for e, g in shared_list]
        return ref.moe_reference(x, experts, ids, weights, shared_list, quantize)


def import_nvfp4_qtensor():
    """ModelOpt's NVFP4QTensor, imported without its CPU-machine warnings."""
    import logging
    import warnings
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    return NVFP4QTensor


def modelopt_codes(x: np.ndarray, scale_2: float):
    """(e2m1 codes, e4m3 codes) of ModelOpt's NVFP4QTensor.quantize of x."""
    import torch
    NVFP4QTensor = import_nvfp4_qtensor()
    q, scale, _ = NVFP4QTensor.quantize(torch.from_numpy(np.asarray(x, np.float32).copy()), 16,
                                        weights_scaling_factor_2=torch.tensor(np.float32(scale_2)))
    packed = q._quantized_data.numpy()
    codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(x.shape)
    return codes, scale.view(torch.uint8).numpy()


def modelopt_quantizer():
    """Activation fake-quant with ModelOpt's NVFP4QTensor (CPU, fp32)."""
    import torch
    NVFP4QTensor = import_nvfp4_qtensor()

    def quantize(x, scale_2):
        t = torch.from_numpy(np.asarray(x, np.float32).copy())
        s2 = torch.tensor(np.float32(scale_2))
        q, scale, s2 = NVFP4QTensor.quantize(t, 16, weights_scaling_factor_2=s2)
        deq = q.dequantize(dtype=torch.float32, scale=scale, double_scale=s2, block_sizes={-1: 16})
        return deq.numpy().astype(np.float64)
    return quantize


# ---------------------------------------------------------------------------
# checks


class Results:
    def __init__(self):
        self.rows = []

    def add(self, model, config, check, ok, rel_err=None, notes="", **extra):
        row = dict(model=model, config=config, check=check, result="pass" if ok else "FAIL",
                   rel_err=rel_err, notes=notes, **extra)
        self.rows.append(row)
        err = "" if rel_err is None else f" rel err {rel_err:.2e}"
        print(f"  {model} {config} {check}: {row['result']}{err} {notes}", flush=True)
        return row


def moe_prefixes(tensors) -> list[tuple[int, str]]:
    found = set()
    for name in tensors:
        if ".experts." in name and name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            found.add((layer, name[:name.index("experts.")]))
    return sorted(found)


def check_export(results, fp4moe, model, config_name, export_dir, inputs, work):
    config = json.load(open(os.path.join(export_dir, "config.json")))
    quant = json.load(open(os.path.join(export_dir, "hf_quant_config.json")))
    tensors = ref.read_checkpoint(export_dir)
    expect = CONFIGS[config_name]
    algo = quant["quantization"].get("quant_algo")
    for layer_idx, prefix in moe_prefixes(tensors):
        x_bf16 = inputs[f"layers.{layer_idx}"]
        x = x_bf16.values()
        in_path = os.path.join(work, f"{model}-{config_name}-{layer_idx}-in.safetensors")
        out_path = os.path.join(work, f"{model}-{config_name}-{layer_idx}-out.safetensors")
        if os.path.exists(out_path):
            os.remove(out_path)
        row_base = dict(layer=layer_idx, quant_algo=algo)

        if expect == "refuse":
            num_experts = config.get("n_routed_experts") or config.get("num_local_experts") or config["num_experts"]
            ref.write_safetensors(in_path, {"hidden_states": ("BF16", x_bf16.raw),
                                            "router_logits": ("F32", np.zeros((x.shape[0], num_experts), np.float32))})
            proc = run_fp4moe_moe(fp4moe, export_dir, prefix, layer_idx, in_path, out_path, config)
            lines = [line.replace(export_dir, "EXPORT") for line in proc.stderr.splitlines() if line.strip()]
            group = quant["quantization"].get("group_size")
            # one line, naming what is not supported
            clean = (proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("fp4moe: error:")
                     and (str(group) in lines[0] or str(algo) in lines[0]) and not os.path.exists(out_path))
            if proc.returncode == 0:
                notes = f"accepted a {algo} checkpoint with group_size {group}"
            else:
                notes = " | ".join(lines) if lines else f"exit {proc.returncode}, no message"
            results.add(model, config_name, f"refused layer {layer_idx}", clean, notes=notes, **row_base,
                        stderr=proc.stderr[-2000:])
            continue

        layer_format = layer_algo(quant, prefix)
        fp4 = layer_format == "NVFP4"
        layer = LayerReference(tensors, config, prefix, fp4)
        logits = layer.logits(x)
        ids, weights, margin = layer.route(logits)
        feed = {"hidden_states": ("BF16", x_bf16.raw), "router_logits": ("F32", logits)}
        if layer.bias is not None:
            feed["e_score_correction_bias"] = ("F32", layer.bias.astype(np.float32))
        ref.write_safetensors(in_path, feed)
        reference = layer.forward(x, ids, weights)
        proc = run_fp4moe_moe(fp4moe, export_dir, prefix, layer_idx, in_path, out_path, config)
        check = f"moe layer {layer_idx} ({layer_format}{', W4A4' if fp4 else ''})"
        extra = dict(row_base, layer_format=layer_format, routing_margin=margin)
        y = None
        if proc.returncode != 0 or not os.path.exists(out_path):
            results.add(model, config_name, check, False,
                        notes=f"refused: {error_text(proc).replace(export_dir, 'EXPORT')}", **extra,
                        stderr=proc.stderr[-2000:])
        else:
            y = ref.read_safetensors(out_path)["output"].values()
            err = ref.rel_err(y, reference)
            # What the difference is made of, when there is one.
            explain = []
            if layer.shared:
                without = ref.rel_err(y, layer.forward(x, ids, weights, shared=False))
                explain.append(f"vs ref without shared experts {without:.1e}")
            if fp4:
                explain.append(f"vs ref with bf16 activations {ref.rel_err(y, layer.forward(x, ids, weights, fp4=False)):.1e}")
            if margin < 1e-5:
                explain.append(f"routing near a tie (margin {margin:.1e})")
            notes = [line.removeprefix("moe: note: ").replace(export_dir, "EXPORT")
                     for line in proc.stderr.splitlines() if "note:" in line]
            results.add(model, config_name, check, err < REL_ERR_LIMIT, err, "; ".join(explain + notes), **extra,
                        stderr=proc.stderr[-2000:])

        if fp4:
            # Second, independent activation rule: ModelOpt's own quantiser.
            # The row also fails when the two rules disagree on a code.
            reference_mo = layer.forward(x, ids, weights, quantize=modelopt_quantizer())
            rule_gap = ref.rel_err(reference_mo, reference)
            scale_2 = layer.experts[0].input_scale_gate_up
            codes, scale_codes = ref.quantize_like_modelopt(x, scale_2)
            mo_codes, mo_scale_codes = modelopt_codes(x, scale_2)
            same = bool((codes == mo_codes).all() and (scale_codes == mo_scale_codes).all())
            rule_note = (f"input codes of the NumPy rule and ModelOpt's quantiser {'identical' if same else 'DIFFER'} "
                         f"({codes.size} values); references differ by {rule_gap:.1e}")
            err_mo = None if y is None else ref.rel_err(y, reference_mo)
            results.add(model, config_name, f"moe layer {layer_idx} vs ModelOpt quantiser",
                        same and err_mo is not None and err_mo < REL_ERR_LIMIT, err_mo,
                        rule_note + ("" if y is not None else "; fp4moe gave no output"), **extra,
                        rule_gap=rule_gap, input_codes_identical=same)


def compare_quantize(ours: dict, theirs: dict):
    """Tensor-by-tensor comparison: (differing [(name, what)], missing, extra)."""
    differing = []
    for name in sorted(set(ours) & set(theirs)):
        a, b = ours[name], theirs[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            differing.append((name, f"{a.dtype}{a.shape} vs ModelOpt {b.dtype}{b.shape}"))
        elif a.bytes() != b.bytes():
            if a.dtype == "U8" and name.endswith(".weight"):
                base = name[:-len(".weight")]
                codes_a = np.stack([a.raw & 0xF, a.raw >> 4], -1)
                codes_b = np.stack([b.raw & 0xF, b.raw >> 4], -1)
                n = int((codes_a != codes_b).sum())
                try:
                    d = np.abs(ref.dequantize_tensors(ours, base) - ref.dequantize_tensors(theirs, base)).max()
                    differing.append((name, f"{n} of {codes_a.size} codes, max diff {d:.3g}"))
                except KeyError:
                    differing.append((name, f"{n} of {codes_a.size} codes differ"))
            else:
                va, vb = a.values(), b.values()
                n = int((a.raw != b.raw).sum())
                d = float(np.nanmax(np.abs(va - vb))) if va.size else 0.0
                differing.append((name, f"{n} of {va.size} values, max diff {d:.3g}"))
    missing = sorted(set(theirs) - set(ours))
    extra = sorted(set(ours) - set(theirs))
    return differing, missing, extra


def summarise_names(names: list[str], limit: int = 4) -> str:
    """A few names, then the count of the rest."""
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def check_quantize(results, fp4moe, model, float_dir, modelopt_dir, work):
    out_dir = os.path.join(work, f"{model}-fp4moe-quantize")
    shutil.rmtree(out_dir, ignore_errors=True)
    proc = run_fp4moe_quantize(fp4moe, float_dir, out_dir)
    notes = []
    if proc.returncode != 0:
        notes.append(f"directory form refused: {error_text(proc).replace(float_dir, 'FLOAT')}")
        # Still compare what the one-file form writes, to see where the
        # tensors stand.
        os.makedirs(out_dir, exist_ok=True)
        proc = run_fp4moe_quantize(fp4moe, os.path.join(float_dir, "model.safetensors"),
                                   os.path.join(out_dir, "model.safetensors"))
        if proc.returncode != 0:
            notes.append(f"file form refused: {error_text(proc).replace(float_dir, 'FLOAT')}")
            results.add(model, "fp4moe quantize", "vs W4A16_NVFP4 export", False, notes="; ".join(notes),
                        stderr=proc.stderr[-2000:])
            return
        notes.append("file form compared")
    ours = ref.read_checkpoint(out_dir)
    theirs = ref.read_checkpoint(modelopt_dir)
    differing, missing, extra = compare_quantize(ours, theirs)
    same = len(set(ours) & set(theirs)) - len(differing)
    ok = not differing and not missing and not extra and proc.returncode == 0 and len(notes) == 0
    summary = [f"{same} of {len(theirs)} tensors identical"]
    if differing:
        summary.append(f"{len(differing)} differ: " + "; ".join(f"{n}: {w}" for n, w in differing[:4])
                       + (f" (+{len(differing) - 4} more)" if len(differing) > 4 else ""))
    if missing:
        summary.append(f"{len(missing)} missing: {summarise_names(missing)}")
    if extra:
        summary.append(f"{len(extra)} not in ModelOpt's: {summarise_names(extra)}")
    results.add(model, "fp4moe quantize", "vs W4A16_NVFP4 export", ok, notes="; ".join(notes + summary),
                differing=differing, missing=missing, extra=extra)


# ---------------------------------------------------------------------------
# driver


def run_step(args: list[str], log_path: str) -> tuple[bool, str]:
    """Runs this file with a step subcommand in a fresh process."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)] + args, capture_output=True, text=True)
    with open(log_path, "w") as log:
        log.write(proc.stdout + proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    if proc.returncode != 0:
        last = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "")
        return False, f"{last.strip()} (log: {log_path})"
    return True, f"{time.time() - t0:.0f} s"


def find_fp4moe(given: str | None) -> str:
    candidates = [given, os.environ.get("FP4MOE")] + [os.path.join(REPO, d, "tools", "fp4moe")
                                                       for d in ("build-sm90", "build")]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return os.path.abspath(path)
    sys.exit("modelopt-compat: no fp4moe binary; build one (cmake --preset sm90 && cmake --build build-sm90 "
             "--target fp4moe) or pass --fp4moe PATH")


def format_table(rows, header: str) -> str:
    cols = ["model", "config", "check", "result", "rel err", "notes"]
    cells = [[r["model"], r["config"], r["check"], r["result"],
              "" if r["rel_err"] is None else f"{r['rel_err']:.2e}", r["notes"]] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if i < 5 else 0 for i, c in enumerate(cols)]
    lines = [header, "", "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip(),
             "  ".join("-" * max(w, len(c)) for c, w in zip(cols, widths))]
    for row in cells:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    failed = sum(r["result"] != "pass" for r in rows)
    lines += ["", "EXPORT: the ModelOpt export's folder; FLOAT: the float model's folder", f"{len(rows) - failed} of {len(rows)} checks pass" + (f", {failed} FAIL" if failed else "")]
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_build":
        cmd_build(*sys.argv[2:4])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "_export":
        cmd_export(*sys.argv[2:6])
        return 0
    parser = argparse.ArgumentParser(prog="tests/conformance/modelopt-compat", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fp4moe", help="the fp4moe binary (default: $FP4MOE, build-sm90/ or build/)")
    date = datetime.date.today().isoformat()
    parser.add_argument("--out", default=os.path.join(REPO, ".out"),
                        help="folder for <date>-modelopt-compat.{txt,jsonl} (default .out/)")
    parser.add_argument("--keep", action="store_true", help="keep the models, exports and logs (path printed)")
    parser.add_argument("--work", help="work folder to use and keep; models and exports already in it are reused "
                        "(to re-check another fp4moe binary quickly)")
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--routing-from-config", action="store_true",
                        help="pass no routing flags to fp4moe moe: it routes as the export's config.json says")
    args = parser.parse_args()
    global ROUTING_FROM_CONFIG
    ROUTING_FROM_CONFIG = args.routing_from_config
    fp4moe = find_fp4moe(args.fp4moe)
    version = subprocess.run([fp4moe, "--version"], capture_output=True, text=True).stdout.strip()
    import importlib.metadata as md
    versions = {p: md.version(p) for p in ("nvidia-modelopt", "torch", "transformers")}
    work = args.work or tempfile.mkdtemp(prefix="modelopt-compat-")
    if args.work:
        os.makedirs(work, exist_ok=True)
        args.keep = True
    print(f"modelopt-compat: {version} ({fp4moe}); " + ", ".join(f"{k} {v}" for k, v in versions.items())
          + f"; work dir {work}", flush=True)
    results = Results()
    for model in args.models:
        float_dir = os.path.join(work, model, "float")
        inputs_path = os.path.join(work, model, "inputs.safetensors")
        if not os.path.exists(inputs_path):
            ok, what = run_step(["_build", model, float_dir], os.path.join(work, f"{model}-build.log"))
            if not ok:
                results.add(model, "float model", "build", False, notes=what)
                continue
            # not part of the checkpoint
            os.replace(os.path.join(float_dir, "inputs.safetensors"), inputs_path)
        inputs = ref.read_safetensors(inputs_path)
        for config_name in args.configs:
            export_dir = os.path.join(work, model, config_name)
            ok, what = True, "reused"
            if not os.path.exists(os.path.join(export_dir, "hf_quant_config.json")):
                ok, what = run_step(["_export", model, config_name, float_dir, export_dir],
                                    os.path.join(work, f"{model}-{config_name}-export.log"))
            if not ok:
                results.add(model, config_name, "ModelOpt export", False, notes=what)
                continue
            print(f"{model} {config_name}: export {what if what == 'reused' else 'made in ' + what}", flush=True)
            try:
                check_export(results, fp4moe, model, config_name, export_dir, inputs, work)
            except Exception as e:  # a reference problem is a failed row, not a crash
                results.add(model, config_name, "check", False, notes=f"{type(e).__name__}: {e}")
        if "W4A16_NVFP4_CFG" in args.configs and os.path.isdir(os.path.join(work, model, "W4A16_NVFP4_CFG")):
            check_quantize(results, fp4moe, model, float_dir, os.path.join(work, model, "W4A16_NVFP4_CFG"), work)

    header = (f"ModelOpt compatibility, {date}: {version}; " + ", ".join(f"{k} {v}" for k, v in versions.items())
              + f"; relative error limit {REL_ERR_LIMIT:g}; fp4moe moe --device cpu")
    table = format_table(results.rows, header)
    print("\n" + table)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{date}-modelopt-compat")
    with open(stem + ".txt", "w") as f:
        f.write(table)
    with open(stem + ".jsonl", "w") as f:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        binary = os.path.relpath(fp4moe, REPO) if fp4moe.startswith(REPO + os.sep) else fp4moe
        f.write(json.dumps(dict(kind="versions", fp4moe=version, fp4moe_binary=binary, repo_commit=commit,
                                **versions, rel_err_limit=REL_ERR_LIMIT)) + "\n")
        for row in results.rows:
            f.write(json.dumps(dict(kind="check", **row), default=str) + "\n")
    print(f"wrote {stem}.txt and {stem}.jsonl")
    if args.keep:
        print(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if any(r["result"] != "pass" for r in results.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
