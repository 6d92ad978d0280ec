"""Shared helpers of the Python tests: random NVFP4 layers in the engines'
stacked layout (W4A4 input scales included on request), a minimal
safetensors writer (no dependency beyond NumPy), ModelOpt NVFP4 checkpoints
of such layers, and the GPU marker that skips visibly where there is no CUDA
device or no torch.

The package under test is the installed one, or a build tree's
(PYTHONPATH=<build>/python, as scripts/run-tests sets it).
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

import fp4moe


def _gpu_skip_reason():
    reason = fp4moe.cuda_unavailable_reason()
    if reason:
        return reason
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    return None


GPU_SKIP_REASON = _gpu_skip_reason()
# FP4MOE_EXPECT_GPU=1 (the GPU machine's scripts set it): a GPU test that
# cannot run fails, naming the cause, instead of skipping.
GPU_EXPECTED = os.environ.get("FP4MOE_EXPECT_GPU", "") not in ("", "0")


@pytest.fixture
def _require_gpu():
    if GPU_SKIP_REASON is None:
        return
    if GPU_EXPECTED:
        pytest.fail(f"FP4MOE_EXPECT_GPU is set but no GPU can be used: {GPU_SKIP_REASON}", pytrace=False)
    pytest.skip(f"GPU test skipped: {GPU_SKIP_REASON}")


gpu = pytest.mark.usefixtures("_require_gpu")


def random_stacked(rng: np.random.Generator, num_experts: int, hidden: int, inter: int,
                   scale_2_shape: str = "E", bias: bool = False, input_scales: bool = False) -> dict:
    """A random layer drawn in the quantised domain: every fp4 code, e4m3
    block scales 0.125 .. 2 (codes 0x28..0x48), global scales near 1/64.

    input_scales: W4A4 input scales as an engine loads them, w13_input_scale
    [E, 2] (gate, up) and w2_input_scale [E]: amax / 2688 of each GEMM's
    input over a calibration batch of 64 unit-normal tokens, as ModelOpt
    calibrates, times 0.8 .. 1 per expert (inputs of the same spread
    saturate a little). Gate and up are equal, as ModelOpt exports them, but
    for every third expert, whose up scale is 1.5x: GEMM1 then takes the
    larger."""
    E, H, I = num_experts, hidden, inter

    def codes(*shape):
        return rng.integers(0, 256, size=shape, dtype=np.uint8)

    def scales(*shape):
        return rng.integers(0x28, 0x49, size=shape, dtype=np.uint8)

    w = {
        "w13": codes(E, 2 * I, H // 2),
        "w13_scale": scales(E, 2 * I, H // 16),
        "w2": codes(E, H, I // 2),
        "w2_scale": scales(E, H, I // 16),
        "w2_scale_2": rng.uniform(0.01, 0.02, size=E).astype(np.float32),
    }
    if scale_2_shape == "E2":
        w["w13_scale_2"] = rng.uniform(0.01, 0.02, size=(E, 2)).astype(np.float32)
    else:
        w["w13_scale_2"] = rng.uniform(0.01, 0.02, size=E).astype(np.float32)
    if bias:
        w["w13_bias"] = rng.normal(0, 0.1, size=(E, 2 * I)).astype(np.float32)
        w["w2_bias"] = rng.normal(0, 0.1, size=(E, H)).astype(np.float32)
    if input_scales:
        x = rng.normal(size=(64, H))
        s13 = w["w13_scale_2"].reshape(E, -1)
        gate_w = fp4moe.dequantize(w["w13"][:, :I], w["w13_scale"][:, :I], s13[:, 0]).astype(np.float64)
        up_w = fp4moe.dequantize(w["w13"][:, I:], w["w13_scale"][:, I:], s13[:, -1]).astype(np.float64)
        g, u = np.einsum("eih,th->eti", gate_w, x), np.einsum("eih,th->eti", up_w, x)
        act_amax = np.abs(g / (1 + np.exp(-g)) * u).max(axis=(1, 2))
        gate = (np.abs(x).max() * rng.uniform(0.8, 1.0, size=E) / 2688).astype(np.float32)
        up = np.where(np.arange(E) % 3 == 1, gate * np.float32(1.5), gate).astype(np.float32)
        w["w13_input_scale"] = np.stack([gate, up], axis=1)
        w["w2_input_scale"] = (act_amax * rng.uniform(0.8, 1.0, size=E) / 2688).astype(np.float32)
    return w


def random_routing(rng: np.random.Generator, num_tokens: int, num_experts: int, top_k: int):
    ids = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(num_tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, size=(num_tokens, top_k)).astype(np.float32)
    return ids, weights


_DTYPES = {np.dtype(np.uint8): "U8", np.dtype(np.float32): "F32", np.dtype(np.int32): "I32"}


def write_safetensors(path, tensors: dict) -> None:
    """tensors: name -> np.ndarray, or (dtype name, np.ndarray) to force a
    dtype such as 'F8_E4M3' for uint8 bytes."""
    header, blobs, offset = {}, [], 0
    for name, value in tensors.items():
        dtype, array = value if isinstance(value, tuple) else (_DTYPES[value.dtype], value)
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def checkpoint_tensors(stacked: dict, prefix: str) -> dict:
    """The stacked layer as ModelOpt's per-expert tensors under `prefix`,
    with each projection's input_scale where the layer has input scales
    (w13_input_scale [E, 2])."""
    E, two_i, _ = stacked["w13"].shape
    I = two_i // 2
    s13 = stacked["w13_scale_2"].reshape(E, -1)
    out = {}
    for e in range(E):
        parts = {
            "gate_proj": (stacked["w13"][e, :I], stacked["w13_scale"][e, :I], s13[e, 0]),
            "up_proj": (stacked["w13"][e, I:], stacked["w13_scale"][e, I:], s13[e, -1]),
            "down_proj": (stacked["w2"][e], stacked["w2_scale"][e], stacked["w2_scale_2"][e]),
        }
        for proj, (w, s, s2) in parts.items():
            base = f"{prefix}experts.{e}.{proj}."
            out[base + "weight"] = np.ascontiguousarray(w)
            out[base + "weight_scale"] = ("F8_E4M3", np.ascontiguousarray(s))
            out[base + "weight_scale_2"] = np.array(s2, dtype=np.float32)
        if "w13_input_scale" in stacked:
            for proj, value in (("gate_proj", stacked["w13_input_scale"][e, 0]),
                                ("up_proj", stacked["w13_input_scale"][e, 1]),
                                ("down_proj", stacked["w2_input_scale"][e])):
                out[f"{prefix}experts.{e}.{proj}.input_scale"] = np.array(value, dtype=np.float32)
        if "w13_bias" in stacked:
            b = stacked["w13_bias"][e]
            out[f"{prefix}experts.{e}.gate_proj.bias"] = np.ascontiguousarray(b[:I])
            out[f"{prefix}experts.{e}.up_proj.bias"] = np.ascontiguousarray(b[I:])
            out[f"{prefix}experts.{e}.down_proj.bias"] = np.ascontiguousarray(stacked["w2_bias"][e])
    return out


def write_nvfp4_checkpoint(folder, stacked: dict, prefix: str = "model.layers.0.mlp.",
                           quant_algo: str = "NVFP4") -> str:
    """A ModelOpt export of one layer in `folder`: model.safetensors and
    hf_quant_config.json declaring quant_algo (NVFP4 is W4A4: with input
    scales, the layer's activations are fp4 by default). Returns the folder."""
    folder = str(folder)
    write_safetensors(f"{folder}/model.safetensors", checkpoint_tensors(stacked, prefix))
    with open(f"{folder}/hf_quant_config.json", "w") as f:
        json.dump({"producer": {"name": "modelopt"},
                   "quantization": {"quant_algo": quant_algo, "group_size": 16}}, f)
    return folder


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))
