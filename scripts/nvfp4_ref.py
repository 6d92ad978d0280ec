"""NumPy-only reading and float64 evaluation of ModelOpt NVFP4 MoE layers.

Used by tests/conformance/modelopt-compat to compute what `fp4moe moe` must
output for an exported checkpoint, independently of fp4moe's own code:

  read_safetensors / read_checkpoint   the tensors of a file or directory, raw
  dequantize                           e2m1 codes (even element in the low
                                       nibble) x e4m3 weight_scale x weight_scale_2
  quantize_like_modelopt               the NVFP4 rule of docs/design.md §3 in
                                       fp32 (ModelOpt's order of operations),
                                       used for W4A4 activations with
                                       input_scale as the global scale
  route_softmax / route_noaux_tc       the models' routers, in float64
  moe_reference                        experts (SwiGLU, down, weighted sum) and
                                       shared experts, accumulated in float64

Tested by tests/python/test_nvfp4_ref.py against `fp4moe quantize` and
`fp4moe moe --device cpu`.
"""
from __future__ import annotations

import glob
import json
import os
import struct

import numpy as np

E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def _e4m3fn_table() -> np.ndarray:
    """Value of every float8_e4m3fn byte: bias 7, no infinities, 0x7f/0xff NaN."""
    table = np.empty(256, np.float64)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent = (code >> 3) & 0xF
        mantissa = code & 0x7
        if exponent == 0xF and mantissa == 0x7:
            table[code] = np.nan
        elif exponent == 0:
            table[code] = sign * mantissa / 8.0 * 2.0 ** -6
        else:
            table[code] = sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)
    return table


E4M3_VALUES = _e4m3fn_table()
_E4M3_POSITIVE = E4M3_VALUES[:127]  # 0 ... 448, increasing
E4M3_MAX = 448.0

# ---------------------------------------------------------------------------
# safetensors


_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U8": np.uint8,
           "I8": np.int8, "I32": np.int32, "I64": np.int64, "F8_E4M3": np.uint8, "BOOL": np.bool_}


class Tensor:
    """One tensor as stored: dtype name, shape and the raw values (BF16 as
    uint16 bit patterns, F8_E4M3 as uint8 codes)."""

    def __init__(self, dtype: str, shape: list[int], raw: np.ndarray):
        self.dtype = dtype
        self.shape = list(shape)
        self.raw = raw

    def bytes(self) -> bytes:
        return self.raw.tobytes()

    def values(self) -> np.ndarray:
        """The values as float64 (integers as they are)."""
        if self.dtype == "BF16":
            return (self.raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        if self.dtype == "F8_E4M3":
            return E4M3_VALUES[self.raw]
        return self.raw.astype(np.float64)

    def __repr__(self):
        return f"Tensor({self.dtype}, {self.shape})"


def read_safetensors(path: str) -> dict[str, Tensor]:
    with open(path, "rb") as f:
        data = f.read()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len])
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = np.dtype(_DTYPES[info["dtype"]])
        raw = np.frombuffer(data, dtype, count=(end - begin) // dtype.itemsize, offset=base + begin)
        tensors[name] = Tensor(info["dtype"], info["shape"], raw.reshape(info["shape"]))
    return tensors


def write_safetensors(path: str, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """tensors: name -> (dtype name, array holding the stored bits)."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, array) in tensors.items():
        blob = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for blob in blobs:
            f.write(blob)


def read_checkpoint(path: str) -> dict[str, Tensor]:
    """Every tensor of a .safetensors file or of a checkpoint directory."""
    if os.path.isfile(path):
        return read_safetensors(path)
    tensors = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        tensors.update(read_safetensors(file))
    return tensors


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float -> bf16 bit patterns, rounded to nearest even (finite inputs)."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def bf16_round(x: np.ndarray) -> np.ndarray:
    return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# ---------------------------------------------------------------------------
# NVFP4


def dequantize(packed: np.ndarray, scale_codes: np.ndarray, scale_2: float) -> np.ndarray:
    """[N, K/2] uint8 codes (even element in the low nibble), [N, K/16] e4m3
    codes, fp32 global scale -> [N, K] float64."""
    packed = np.asarray(packed, np.uint8)
    n, half_k = packed.shape
    codes = np.empty((n, half_k * 2), np.uint8)
    codes[:, 0::2] = packed & 0xF
    codes[:, 1::2] = packed >> 4
    scales = E4M3_VALUES[np.asarray(scale_codes, np.uint8)]
    assert scales.shape == (n, half_k * 2 // 16), (scales.shape, packed.shape)
    return E2M1_VALUES[codes] * np.repeat(scales, 16, axis=1) * float(np.float32(scale_2))


def dequantize_tensors(tensors: dict[str, Tensor], base: str) -> np.ndarray:
    return dequantize(tensors[base + ".weight"].raw, tensors[base + ".weight_scale"].raw,
                      tensors[base + ".weight_scale_2"].values().item())


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """fp32 -> float8_e4m3fn codes, rounded to nearest even; magnitudes past
    the largest value's rounding range (>= 464) become NaN (0x7f), as a
    plain cast does."""
    x = np.asarray(x, np.float64)
    magnitude = np.abs(x)
    idx = np.clip(np.searchsorted(_E4M3_POSITIVE, magnitude), 1, 126)  # values[idx-1] < m <= values[idx]
    lo, hi = _E4M3_POSITIVE[idx - 1], _E4M3_POSITIVE[idx]
    pick_hi = (magnitude - lo > hi - magnitude) | ((magnitude - lo == hi - magnitude) & (idx % 2 == 0))
    code = np.where(pick_hi, idx, idx - 1)
    code = np.where(magnitude == 0, 0, code)
    code = np.where(magnitude >= 464.0, 0x7F, code)
    code = np.where(np.isnan(magnitude), 0x7F, code)
    return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


_E2M1_POSITIVE = E2M1_VALUES[:8]


def e2m1_encode(x: np.ndarray) -> np.ndarray:
    """float -> e2m1 codes, rounded to nearest even, saturated at +-6; a
    negative value that rounds to zero is written as -0 (code 8)."""
    x = np.asarray(x, np.float64)
    magnitude = np.minimum(np.abs(x), 6.0)
    idx = np.clip(np.searchsorted(_E2M1_POSITIVE, magnitude), 1, 7)
    lo, hi = _E2M1_POSITIVE[idx - 1], _E2M1_POSITIVE[idx]
    pick_hi = (magnitude - lo > hi - magnitude) | ((magnitude - lo == hi - magnitude) & (idx % 2 == 0))
    code = np.where(pick_hi, idx, idx - 1)
    return (code | np.where(x < 0, 8, 0)).astype(np.uint8)  # ModelOpt: x < 0 keeps its sign, also as -0


def quantize_like_modelopt(x: np.ndarray, scale_2: float) -> tuple[np.ndarray, np.ndarray]:
    """NVFP4 of the rows of x [.., K] against the global scale scale_2, in
    fp32 and in ModelOpt's order (docs/design.md §3): block scale
    b = amax16 / (6 * s2), 1 where 0, clamped to [2^-9, 448], as e4m3 (so
    an activation block past the calibrated range saturates); value codes
    e2m1(x / (b * s2)). Returns (e2m1 codes [.., K], e4m3 codes [.., K/16])."""
    x = np.asarray(x, np.float32)
    s2 = np.float32(scale_2)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // 16, 16)
    block_amax = np.abs(blocks).max(axis=-1)
    block_scale = block_amax / (np.float32(6.0) * s2)
    block_scale = np.where(block_scale == 0, np.float32(1.0), block_scale)
    block_scale = np.clip(block_scale, np.float32(2.0 ** -9), np.float32(E4M3_MAX)).astype(np.float32)
    scale_codes = e4m3_encode(block_scale)
    scale_values = E4M3_VALUES[scale_codes].astype(np.float32)
    divisor = (scale_values * s2).astype(np.float32)[..., None]
    scaled = (blocks / divisor).astype(np.float32)
    codes = e2m1_encode(scaled).reshape(x.shape)
    return codes, scale_codes


def fake_quantize(x: np.ndarray, scale_2: float) -> np.ndarray:
    """x quantised to NVFP4 against scale_2 and dequantised, as float64."""
    codes, scale_codes = quantize_like_modelopt(x, scale_2)
    scales = np.repeat(E4M3_VALUES[scale_codes], 16, axis=-1)
    return E2M1_VALUES[codes] * scales * float(np.float32(scale_2))


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """[N, K] e2m1 codes -> [N, K/2] bytes, even element in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


# ---------------------------------------------------------------------------
# routing (float64)


def route_softmax(logits: np.ndarray, top_k: int, renormalize: bool):
    logits = np.asarray(logits, np.float64)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    ids = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, ids, axis=1)
    if renormalize:
        weights = weights / weights.sum(axis=1, keepdims=True)
    return ids, weights, _margin(probs, ids)


def route_noaux_tc(logits: np.ndarray, bias: np.ndarray, top_k: int, num_groups: int, topk_groups: int,
                   routed_scaling_factor: float, renormalize: bool = True):
    """DeepSeek-V3: sigmoid scores; choice on score + bias within the best
    topk_groups of num_groups groups (group score: sum of its top 2);
    weights from the unbiased scores, renormalised, times the factor."""
    logits = np.asarray(logits, np.float64)
    num_tokens, num_experts = logits.shape
    scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores + np.asarray(bias, np.float64)[None, :]
    grouped = choice.reshape(num_tokens, num_groups, num_experts // num_groups)
    group_scores = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2)
    kept_groups = np.argsort(-group_scores, axis=1, kind="stable")[:, :topk_groups]
    group_mask = np.zeros((num_tokens, num_groups), bool)
    np.put_along_axis(group_mask, kept_groups, True, axis=1)
    masked = np.where(np.repeat(group_mask, num_experts // num_groups, axis=1), choice, -np.inf)
    ids = np.argsort(-masked, axis=1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(scores, ids, axis=1)
    if renormalize:
        weights = weights / weights.sum(axis=1, keepdims=True)
    return ids, weights * routed_scaling_factor, _margin(masked, ids)


def _margin(scores: np.ndarray, ids: np.ndarray) -> float:
    """Smallest gap between a token's k-th chosen score and the best one it
    did not choose: a tiny gap means fp32 routing may choose otherwise."""
    k = ids.shape[1]
    ordered = -np.sort(-scores, axis=1)
    if k >= scores.shape[1]:
        return float("inf")
    return float((ordered[:, k - 1] - ordered[:, k]).min())


# ---------------------------------------------------------------------------
# the layer


def silu(x):
    return x / (1.0 + np.exp(-x))


class Expert:
    """One SwiGLU expert: dequantised float64 weights, and for W4A4 the
    activation scales of its two GEMM inputs (None: bf16 activations)."""

    def __init__(self, gate, up, down, input_scale_gate_up=None, input_scale_down=None):
        self.gate, self.up, self.down = gate, up, down
        self.input_scale_gate_up = input_scale_gate_up
        self.input_scale_down = input_scale_down

    def __call__(self, x: np.ndarray, quantize=None) -> np.ndarray:
        """x [T, H] -> [T, H]. quantize(values, scale_2) fake-quantises an
        activation (default: quantize_like_modelopt's rule)."""
        quantize = quantize or fake_quantize
        if self.input_scale_gate_up is not None:
            x = quantize(x, self.input_scale_gate_up)
        h = silu(x @ self.gate.T) * (x @ self.up.T)
        if self.input_scale_down is not None:
            h = quantize(h, self.input_scale_down)
        return h @ self.down.T


def load_expert(tensors: dict[str, Tensor], base: str, names=("gate_proj", "up_proj", "down_proj"),
                activations: str = "bf16") -> Expert:
    """The expert under base (e.g. 'model.layers.1.mlp.experts.3') from
    export tensors; activations 'fp4' takes each GEMM's input_scale."""
    gate, up, down = (dequantize_tensors(tensors, f"{base}.{n}") for n in names)
    if activations != "fp4":
        return Expert(gate, up, down)
    scale = lambda n: float(tensors[f"{base}.{n}.input_scale"].values().item())  # noqa: E731
    return Expert(gate, up, down, scale(names[0]), scale(names[2]))


def moe_reference(x: np.ndarray, experts: list[Expert], topk_ids: np.ndarray, topk_weights: np.ndarray,
                  shared: list[tuple[Expert, np.ndarray | None]] = (), quantize=None) -> np.ndarray:
    """Sum over each token's top-k of weight x expert(x), plus the shared
    experts (each times sigmoid(x . gate) where it has a gate vector)."""
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    for e in np.unique(topk_ids):
        rows, slots = np.nonzero(topk_ids == e)
        out[rows] += topk_weights[rows, slots][:, None] * experts[e](x[rows], quantize)
    for expert, gate_vector in shared:
        y = expert(x, quantize)
        if gate_vector is not None:
            y = y / (1.0 + np.exp(-(x @ gate_vector)))[:, None]
        out += y
    return out


def rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(y, np.float64) - ref) / max(np.linalg.norm(ref), 1e-300))
