"""The NumPy evaluator of tests/conformance/modelopt-compat
(scripts/nvfp4_ref.py), checked against the fp4moe binary on a tiny
checkpoint written here: its
NVFP4 rule must reproduce `fp4moe quantize` bit for bit, its dequantiser and
layer evaluation must agree with `fp4moe moe --device cpu`. The codecs are
checked against every code. The binary is $FP4MOE_CLI (ctest sets it).
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import nvfp4_ref as ref  # noqa: E402

CLI = os.environ.get("FP4MOE_CLI")
needs_cli = pytest.mark.skipif(not CLI or not os.access(CLI, os.X_OK), reason="FP4MOE_CLI names no fp4moe binary")


def test_e4m3_codes_round_trip():
    finite = [c for c in range(256) if c not in (0x7F, 0xFF)]
    values = ref.E4M3_VALUES[finite]
    codes = ref.e4m3_encode(values)
    # -0 encodes as 0x80, every other value as itself
    assert np.array_equal(codes, np.array(finite, np.uint8))
    assert np.nanmax(ref.E4M3_VALUES) == 448.0 and ref.e4m3_encode(np.array([500.0]))[0] == 0x7F


def test_e2m1_rounding_is_nearest_even_and_saturates():
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.1, -0.75, 0.0])
    expect = np.array([0, 1, 1, 2, 2, 4, 4, 6, -0.0, -1, 0])
    assert np.array_equal(ref.E2M1_VALUES[ref.e2m1_encode(x)], expect)
    assert ref.e2m1_encode(np.array([-0.1]))[0] == 8  # a negative value that rounds to 0 keeps its sign


def test_fake_quantize_saturates_blocks_past_the_global_scale():
    x = np.linspace(-3, 3, 32, dtype=np.float32)[None, :]
    # amax 3 with s2 = 3 / 2688: exactly representable in range
    assert ref.rel_err(ref.fake_quantize(x, 3 / 2688), x.astype(np.float64)) < 0.15  # e2m1 steps on a ramp
    # a global scale 100x too small clamps the block scale at 448: |values| <= 6 * 448 * s2
    y = ref.fake_quantize(x, 0.03 / 2688)
    assert np.abs(y).max() <= 6 * 448 * np.float32(0.03 / 2688) * (1 + 1e-6)


def tiny_checkpoint(path, rng, num_experts=4, hidden=64, inter=32):
    tensors = {}
    for e in range(num_experts):
        for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            w = rng.standard_normal(shape).astype(np.float32) * 0.05
            w[0, :16] = 0.0  # an all-zero block: scale 1 by the rule
            tensors[f"model.layers.0.mlp.experts.{e}.{proj}.weight"] = ("F32", w)
    tensors["model.layers.0.mlp.gate.weight"] = ("F32", rng.standard_normal((num_experts, hidden)).astype(np.float32))
    ref.write_safetensors(path, tensors)
    return {name: t[1] for name, t in tensors.items()}


@needs_cli
def test_rule_and_evaluator_match_fp4moe(tmp_path):
    rng = np.random.default_rng(3)
    num_experts, hidden, top_k, num_tokens = 4, 64, 2, 5
    floats = tiny_checkpoint(tmp_path / "float.safetensors", rng, num_experts, hidden)
    subprocess.run([CLI, "quantize", "--quiet", str(tmp_path / "float.safetensors"), str(tmp_path / "q.safetensors")],
                   check=True)
    q = ref.read_safetensors(str(tmp_path / "q.safetensors"))

    experts = []
    for e in range(num_experts):
        base = f"model.layers.0.mlp.experts.{e}"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"{base}.{proj}"
            s2 = q[name + ".weight_scale_2"].values().item()
            codes, scale_codes = ref.quantize_like_modelopt(floats[name + ".weight"], s2)
            assert np.array_equal(ref.pack_codes(codes), q[name + ".weight"].raw), name
            assert np.array_equal(scale_codes, q[name + ".weight_scale"].raw), name
            assert np.allclose(ref.dequantize_tensors(q, name), floats[name + ".weight"], atol=0.05 * 6 / 8)
        # gate and up share weight_scale_2 = max amax / 2688
        amax = max(np.abs(floats[f"{base}.{p}.weight"]).max() for p in ("gate_proj", "up_proj"))
        assert q[f"{base}.gate_proj.weight_scale_2"].values().item() == np.float32(amax / np.float32(2688))
        experts.append(ref.load_expert(q, base))

    x_bits = ref.bf16_bits(rng.standard_normal((num_tokens, hidden)))
    x = ref.Tensor("BF16", [num_tokens, hidden], x_bits).values()
    ids = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(num_tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (num_tokens, top_k)).astype(np.float32)
    ref.write_safetensors(str(tmp_path / "x.safetensors"), {"hidden_states": ("BF16", x_bits),
                                                            "topk_ids": ("I32", ids), "topk_weights": ("F32", weights)})
    subprocess.run([CLI, "moe", "--weights", str(tmp_path / "q.safetensors"), "--input", str(tmp_path / "x.safetensors"),
                    "--output", str(tmp_path / "y.safetensors"), "--device", "cpu"], check=True, capture_output=True)
    y = ref.read_safetensors(str(tmp_path / "y.safetensors"))["output"].values()
    expected = ref.moe_reference(x, experts, ids, weights.astype(np.float64))
    # fp4moe's output is bf16: rounding alone is < 2^-9 relative
    assert ref.rel_err(y, expected) < 4e-3
    assert ref.rel_err(y, ref.bf16_round(expected)) < 4e-3


def test_routing():
    logits = np.array([[0.0, 2.0, 1.0, -1.0]])
    ids, w, margin = ref.route_softmax(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 2]] and np.isclose(w.sum(), 1.0) and margin > 0
    # noaux_tc: group {2, 3} wins on biased scores, weights from unbiased ones, scaled
    bias = np.array([0.0, 0.0, 0.5, 0.5])
    ids, w, _ = ref.route_noaux_tc(logits, bias, 2, num_groups=2, topk_groups=1, routed_scaling_factor=2.5)
    assert sorted(ids[0].tolist()) == [2, 3]
    s = 1 / (1 + np.exp(-logits[0, [2, 3]]))
    assert np.allclose(np.sort(w[0]), np.sort(s / s.sum() * 2.5))
