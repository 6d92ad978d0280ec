"""NVFP4 (ModelOpt layout) dequantisation in NumPy or torch, for checks and
for running a model on the dequantised weights (examples/hf_moe.py).

A value is e2m1 code x e4m3 block scale (one per 16 along K) x fp32
weight_scale_2; packed bytes hold the even element in the low nibble.
Quantisation is the library's own (fp4moe.quantize), bit-exact with ModelOpt.
Tested in tests/python/test_cpu.py against fp4moe.reference_forward.
"""
from __future__ import annotations

import numpy as np

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def _e4m3_table() -> np.ndarray:
    """float value of every e4m3fn byte (0x7F/0xFF are NaN)."""
    table = np.empty(256, dtype=np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp = (code >> 3) & 0xF
        man = code & 7
        if exp == 0xF and man == 7:
            table[code] = np.nan
        elif exp == 0:
            table[code] = sign * man * 2.0 ** -9
        else:
            table[code] = sign * (1 + man / 8) * 2.0 ** (exp - 7)
    return table


E4M3_VALUES = _e4m3_table()


def dequantize(packed, scales, scale_2):
    """packed u8 [..., N, K/2], scales e4m3 (or its u8 bytes) [..., N, K/16],
    scale_2 broadcastable to [..., 1, 1] -> float32 [..., N, K].

    NumPy arrays give a NumPy array; torch tensors a torch tensor on their
    device (no host round trip)."""
    if type(packed).__module__.startswith("torch"):
        return _dequantize_torch(packed, scales, scale_2)
    packed = np.asarray(packed, dtype=np.uint8)
    scales = np.asarray(scales).view(np.uint8)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    values = E2M1_VALUES[codes]
    block = E4M3_VALUES[scales]
    values = values.reshape(*scales.shape, 16) * block[..., None]
    s2 = np.asarray(scale_2, dtype=np.float32)
    return (values.reshape(codes.shape) * s2.reshape(s2.shape + (1,) * (codes.ndim - s2.ndim))).astype(np.float32)


def _dequantize_torch(packed, scales, scale_2):
    import torch

    dev = packed.device
    table = torch.from_numpy(E2M1_VALUES).to(dev)
    p = packed.to(torch.uint8)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*p.shape[:-1], -1).long()
    values = table[codes]
    if scales.dtype != torch.uint8:
        scales = scales.view(torch.uint8)
    block = torch.from_numpy(E4M3_VALUES).to(dev)[scales.long()]
    values = values.reshape(*scales.shape, 16) * block[..., None]
    s2 = torch.as_tensor(scale_2, dtype=torch.float32, device=dev)
    return values.reshape(codes.shape) * s2.reshape(s2.shape + (1,) * (codes.dim() - s2.dim()))
