"""CPU tests of the Python package (run everywhere, CI included): import and
packaging, the device packer's index mapping against the host packer, the
CPU reference against a NumPy evaluation on dequantised weights, W4A4 (fp4
activations) from the engines' input scales against the checkpoint path,
NVFP4 (de)quantisation, checkpoint prefix discovery and loading, routing
inferred from Hugging Face configs, and one-line error messages."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

import fp4moe
from conftest import (checkpoint_tensors, random_routing, random_stacked, rel_err, write_nvfp4_checkpoint,
                      write_safetensors)


def test_import_exposes_the_api():
    assert issubclass(fp4moe.Error, ValueError)
    for name in ("MoeLayer", "reference_forward", "checkpoint_reference_forward", "pack_stacked", "pack_host",
                 "quantize", "dequantize", "load_stacked", "describe_plan", "layer_config_from_hf",
                 "find_moe_prefixes", "cuda_device_count"):
        assert hasattr(fp4moe, name), name
    assert re.fullmatch(r"\d+\.\d+\.\d+", fp4moe.__version__)
    assert fp4moe.cuda_device_count() >= 0


def test_package_version_matches_the_cmake_project():
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    with open(os.path.join(root, "CMakeLists.txt")) as f:
        cmake_version = re.search(r"project\(fp4moe VERSION (\S+)", f.read()).group(1)
    assert fp4moe.__version__ == cmake_version


# (E, n, k, gate_up): N and K at and off the 128/256 padding, gate/up stacks
# whose halves are not multiples of 128.
PACK_SHAPES = [(1, 16, 16, False), (3, 128, 256, False), (2, 144, 272, False), (2, 32, 16, True),
               (3, 96, 80, True), (2, 256, 512, True), (4, 320, 48, True)]


@pytest.mark.parametrize("E,n,k,gate_up", PACK_SHAPES)
def test_device_packer_mapping_equals_host_packer(E, n, k, gate_up):
    rng = np.random.default_rng(E * 1000 + n + k)
    packed = rng.integers(0, 256, size=(E, n, k // 2), dtype=np.uint8)
    scales = rng.integers(0, 0x7F, size=(E, n, k // 16), dtype=np.uint8)  # zero scales included
    scales.reshape(-1)[::5] = 0
    w_dev, s_dev = fp4moe.pack_stacked(packed, scales, gate_up)
    w_host, s_host = fp4moe.pack_host(packed, scales, gate_up)
    assert w_dev.shape == w_host.shape and s_dev.shape == s_host.shape
    bad = np.flatnonzero(w_dev != w_host)
    assert bad.size == 0, f"weight bytes differ first at {bad[:5]}"
    bad = np.flatnonzero(s_dev != s_host)
    assert bad.size == 0, f"scale bytes differ first at {bad[:5]}"


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 (nearest even), kept as float32."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def numpy_moe(w: dict, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, activation="swiglu") -> np.ndarray:
    """The MoE layer on dequantised weights, in float64."""
    E, two_i, _ = w["w13"].shape
    I = two_i // 2
    s13 = w["w13_scale_2"].reshape(E, -1)
    gate = fp4moe.dequantize(w["w13"][:, :I], w["w13_scale"][:, :I], s13[:, 0]).astype(np.float64)
    up = fp4moe.dequantize(w["w13"][:, I:], w["w13_scale"][:, I:], s13[:, -1]).astype(np.float64)
    down = fp4moe.dequantize(w["w2"], w["w2_scale"], w["w2_scale_2"]).astype(np.float64)
    out = np.zeros((x.shape[0], down.shape[1]))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            g, u = gate[e] @ x[t], up[e] @ x[t]
            if "w13_bias" in w:
                g, u = g + w["w13_bias"][e, :I], u + w["w13_bias"][e, I:]
            if activation == "gptoss":
                g = np.minimum(g, 7.0)
                u = np.clip(u, -7.0, 7.0)
                act = g / (1 + np.exp(-1.702 * g)) * (u + 1)
            else:
                act = g / (1 + np.exp(-g)) * u
            act = bf16_round(act.astype(np.float32)).astype(np.float64)
            y = down[e] @ act
            if "w2_bias" in w:
                y = y + w["w2_bias"][e]
            out[t] += weights[t, j] * y
    return out


@pytest.mark.parametrize("scale_2_shape,bias,activation",
                         [("E", False, "swiglu"), ("E2", False, "swiglu"), ("E", True, "gptoss")])
def test_reference_forward_matches_numpy_on_dequantised_weights(scale_2_shape, bias, activation):
    rng = np.random.default_rng(3)
    E, H, I, T, k = 6, 64, 48, 5, 2
    w = random_stacked(rng, E, H, I, scale_2_shape, bias)
    x = bf16_round(rng.normal(size=(T, H)).astype(np.float32))
    ids, weights = random_routing(rng, T, E, k)
    got = fp4moe.reference_forward(w["w13"], w["w13_scale"], w["w13_scale_2"], w["w2"], w["w2_scale"],
                                   w["w2_scale_2"], w.get("w13_bias"), w.get("w2_bias"), x, ids, weights,
                                   activation)
    ref = numpy_moe(w, x, ids, weights, activation)
    assert got.shape == (T, H)
    assert rel_err(got, ref) < 1e-5


# ------------------------------------------------------------------ W4A4


def engine_scales(w: dict, form: str) -> tuple:
    """w13_input_scale and w2_input_scale as an engine holds them: "E2" as
    loaded ([E, 2], gate and up), "E" reduced per expert (the larger of
    the two, as vLLM and SGLang do), "one" a single value each (the largest,
    as an engine with one activation scale per layer keeps it)."""
    s13, s2 = w["w13_input_scale"], w["w2_input_scale"]
    if form == "E2":
        return s13, s2
    if form == "E":
        return s13.max(axis=1), s2
    return np.array(s13.max(), np.float32), np.array(s2.max(), np.float32)


def reference_args(w: dict) -> tuple:
    return (w["w13"], w["w13_scale"], w["w13_scale_2"], w["w2"], w["w2_scale"], w["w2_scale_2"],
            w.get("w13_bias"), w.get("w2_bias"))


@pytest.mark.parametrize("form", ["E", "E2", "one"])
def test_w4a4_from_engine_scales_equals_the_checkpoint_path(tmp_path, form):
    """Stacked tensors with the engines' input scales run the numerics of the
    ModelOpt NVFP4 export they came from (MoeLayer.from_checkpoint's loader
    and rules), bit for bit, on the CPU reference. With one value for every
    expert, the export's scales are that value too."""
    rng = np.random.default_rng(31)
    E, H, I, T, k = 6, 64, 48, 9, 2
    w = random_stacked(rng, E, H, I, input_scales=True)
    if form == "one":  # an export whose input scales are one per layer
        w["w13_input_scale"][:] = w["w13_input_scale"].max()
        w["w2_input_scale"][:] = w["w2_input_scale"].max()
    write_nvfp4_checkpoint(tmp_path, w)
    x = bf16_round(rng.normal(size=(T, H)).astype(np.float32))
    ids, weights = random_routing(rng, T, E, k)
    s13, s2 = engine_scales(w, form)

    from_checkpoint = fp4moe.checkpoint_reference_forward(str(tmp_path), "model.layers.0.mlp.", x, ids, weights)
    from_engine = fp4moe.reference_forward(*reference_args(w), x, ids, weights, w13_input_scale=s13,
                                           w2_input_scale=s2)
    forced = fp4moe.reference_forward(*reference_args(w), x, ids, weights, w13_input_scale=s13,
                                      w2_input_scale=s2, activations="fp4")
    np.testing.assert_array_equal(from_engine, from_checkpoint)
    np.testing.assert_array_equal(forced, from_checkpoint)
    # ... and they are W4A4, not the bf16 layer.
    bf16 = fp4moe.reference_forward(*reference_args(w), x, ids, weights)
    assert rel_err(from_engine, bf16.astype(np.float64)) > 1e-2


def test_w4a4_bf16_activations_are_the_plain_layer(tmp_path):
    """activations="bf16" with input scales is the layer without them, bit for
    bit, from the engines' layout and from the checkpoint alike; load_stacked
    gives the export's input scales as an engine loads them ([E, 2], [E])."""
    rng = np.random.default_rng(32)
    E, H, I, T, k = 4, 32, 32, 5, 2
    w = random_stacked(rng, E, H, I, input_scales=True)
    write_nvfp4_checkpoint(tmp_path, w)
    x = bf16_round(rng.normal(size=(T, H)).astype(np.float32))
    ids, weights = random_routing(rng, T, E, k)
    plain = fp4moe.reference_forward(*reference_args(w), x, ids, weights)
    np.testing.assert_array_equal(
        fp4moe.reference_forward(*reference_args(w), x, ids, weights, w13_input_scale=w["w13_input_scale"],
                                 w2_input_scale=w["w2_input_scale"], activations="bf16"), plain)
    np.testing.assert_array_equal(
        fp4moe.checkpoint_reference_forward(str(tmp_path), "model.layers.0.mlp.", x, ids, weights,
                                            activations="bf16"), plain)
    loaded = fp4moe.load_stacked(str(tmp_path), "model.layers.0.mlp.")
    np.testing.assert_array_equal(loaded["w13_input_scale"], w["w13_input_scale"])
    np.testing.assert_array_equal(loaded["w2_input_scale"], w["w2_input_scale"])
    # A W4A16 export (no input scales): none, and bf16 by default.
    plain_w = {key: v for key, v in w.items() if "input_scale" not in key}
    (tmp_path / "w4a16").mkdir()
    write_nvfp4_checkpoint(tmp_path / "w4a16", plain_w, quant_algo="W4A16_NVFP4")
    assert "w13_input_scale" not in fp4moe.load_stacked(str(tmp_path / "w4a16"), "model.layers.0.mlp.")
    np.testing.assert_array_equal(
        fp4moe.checkpoint_reference_forward(str(tmp_path / "w4a16"), "model.layers.0.mlp.", x, ids, weights), plain)


W4A4_REFUSALS = [
    # (what, w13_input_scale, w2_input_scale, activations, message)
    ("fp4 without input scales", None, None, "fp4",
     "fp4moe.reference_forward: fp4 activations (W4A4) need w13_input_scale and w2_input_scale; none are given: "
     "use bf16 activations"),
    ("only w13's", "E", None, "checkpoint",
     "fp4moe.reference_forward: give both w13_input_scale and w2_input_scale, or neither"),
    ("non-finite", "nan", "E", "checkpoint",
     "fp4moe.reference_forward: w13_input_scale[2] is nan; expected a finite input_scale in [1e-15, 1e+15] "
     "(the calibrated activation amax / 2688)"),
    ("zero", "E", "zero", "fp4",
     "fp4moe.reference_forward: w2_input_scale[2] is 0; expected a finite input_scale in [1e-15, 1e+15] "
     "(the calibrated activation amax / 2688)"),
    ("negative, gate/up form", "negative", "E", "checkpoint",
     "fp4moe.reference_forward: w13_input_scale[2, 1] is -0.5; expected a finite input_scale in [1e-15, 1e+15]"),
    ("one value, too large", "one", "huge", "checkpoint",
     "fp4moe.reference_forward: w2_input_scale is 1e+20; expected a finite input_scale in [1e-15, 1e+15]"),
    ("wrong shape", "short", "E", "checkpoint",
     "fp4moe.reference_forward: w13_input_scale has shape [3]; expected [4] or [4, 1] or [4, 2] or [] or [1]"),
    ("w2 as gate/up pairs", "E", "E2", "checkpoint",
     "fp4moe.reference_forward: w2_input_scale has shape [4, 2]; expected [4] or [4, 1] or [] or [1]"),
    ("unknown numerics", "E", "E", "fp8", "activation numerics 'fp8' is not one of checkpoint, bf16, fp4"),
]


@pytest.mark.parametrize("what,s13,s2,activations,message", W4A4_REFUSALS, ids=[r[0] for r in W4A4_REFUSALS])
def test_w4a4_refusals(what, s13, s2, activations, message):
    rng = np.random.default_rng(33)
    E, H, I = 4, 32, 32
    w = random_stacked(rng, E, H, I, input_scales=True)
    per_expert = w["w13_input_scale"].max(axis=1)
    forms = {
        None: None,
        "E": per_expert,
        "E2": w["w13_input_scale"],
        "one": np.array(0.01, np.float32),
        "nan": np.where(np.arange(E) == 2, np.float32("nan"), per_expert).astype(np.float32),
        "zero": np.where(np.arange(E) == 2, 0, w["w2_input_scale"]).astype(np.float32),
        "negative": np.where(np.arange(2 * E).reshape(E, 2) == 5, -0.5, w["w13_input_scale"]).astype(np.float32),
        "huge": np.array([1e20], np.float32),
        "short": per_expert[:3],
    }
    x = np.zeros((1, H), np.float32)
    ids, weights = np.array([[0, 1]], np.int32), np.ones((1, 2), np.float32)
    with pytest.raises(fp4moe.Error) as info:
        fp4moe.reference_forward(*reference_args(w), x, ids, weights, w13_input_scale=forms[s13],
                                 w2_input_scale=forms[s2], activations=activations)
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


def test_describe_plan_without_a_gpu():
    """The planner for a shape and an architecture, described as
    MoeLayer.plan describes a layer's plan (no GPU needed)."""
    text = fp4moe.describe_plan(8, 2, 4096, 14336, 1)  # Mixtral at T = 1 on an H100's 132 SMs
    lines = text.splitlines()
    assert lines[0] == "1 tokens -> 2 routed rows"
    assert lines[1].startswith("  GEMM1 + SwiGLU  ") and lines[2].startswith("  GEMM2 + finalize ")
    assert "GEMM2 + finalize n128m8k256s4w4-finalize split_k 4 [heuristic]: block_m 8 for ~1 rows per active " \
           "expert (2 of 8 experts); ~64 tiles x split_k 4 over 264 block slots, 56 k-tiles each" in text
    invariant = fp4moe.describe_plan(8, 2, 4096, 14336, 1, batch_invariant=True)
    assert re.findall(r"split_k (\d+) \[", invariant) == ["1", "1"]
    assert invariant.endswith("; split-K off (batch invariant)\n")
    with pytest.raises(fp4moe.Error, match="unknown architecture 'sm75'"):
        fp4moe.describe_plan(8, 2, 4096, 14336, 1, arch="sm75")
    with pytest.raises(fp4moe.Error, match=r"^num_experts = 0: expected 1\.\.512$"):
        fp4moe.describe_plan(0, 2, 4096, 14336, 1)


def test_quantize_then_dequantize_is_close():
    rng = np.random.default_rng(5)
    w = rng.normal(size=(32, 64)).astype(np.float32)
    packed, scales, s2 = fp4moe.quantize(w)
    assert packed.shape == (32, 32) and scales.shape == (32, 4)
    assert s2 == pytest.approx(np.abs(w).max() / 2688, rel=1e-6)
    back = fp4moe.dequantize(packed, scales, s2)
    assert rel_err(back, w) < 0.15  # 4-bit codes: ~10 % RMS error
    # A given global scale is used as it is (gate and up share one).
    _, _, shared = fp4moe.quantize(w, 0.5)
    assert shared == 0.5


# ------------------------------------------------------------------ checkpoints


def test_checkpoint_prefixes_and_loading(tmp_path):
    rng = np.random.default_rng(11)
    layers = {1: random_stacked(rng, 3, 32, 16), 3: random_stacked(rng, 3, 32, 16, bias=True)}
    tensors = {"model.embed_tokens.weight": np.zeros((4, 4), np.float32)}
    for n, w in layers.items():
        tensors.update(checkpoint_tensors(w, f"model.layers.{n}.mlp."))
    path = tmp_path / "layers.safetensors"
    write_safetensors(path, tensors)

    assert fp4moe.find_moe_prefixes(str(path)) == ["model.layers.1.mlp.", "model.layers.3.mlp."]
    from fp4moe.checkpoint import prefix_for_layer
    assert prefix_for_layer(str(path), 3) == "model.layers.3.mlp."
    with pytest.raises(ValueError, match="pass layer=N"):
        prefix_for_layer(str(path), None)
    with pytest.raises(ValueError, match=r"MoE layers are \[1, 3\]"):
        prefix_for_layer(str(path), 2)

    got = fp4moe.load_stacked(str(path), "model.layers.3.mlp.")
    want = layers[3]
    for name in ("w13", "w13_scale", "w2", "w2_scale", "w2_scale_2", "w13_bias", "w2_bias"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    np.testing.assert_array_equal(got["w13_scale_2"], np.stack([want["w13_scale_2"]] * 2, axis=1))


def test_mixtral_expert_names(tmp_path):
    # Mixtral's block_sparse_moe.experts.<e>.{w1,w3,w2} (gate, up, down), as
    # ModelOpt exports it: found and loaded like gate_proj/up_proj/down_proj.
    rng = np.random.default_rng(14)
    w = random_stacked(rng, 2, 32, 16)
    renames = {".mlp.": ".block_sparse_moe.", ".gate_proj.": ".w1.", ".up_proj.": ".w3.", ".down_proj.": ".w2."}
    tensors = {}
    for name, value in checkpoint_tensors(w, "model.layers.2.mlp.").items():
        for old, new in renames.items():
            name = name.replace(old, new)
        tensors[name] = value
    path = tmp_path / "mixtral.safetensors"
    write_safetensors(path, tensors)
    assert fp4moe.find_moe_prefixes(str(path)) == ["model.layers.2.block_sparse_moe."]
    got = fp4moe.load_stacked(str(path), "model.layers.2.block_sparse_moe.")
    for name in ("w13", "w13_scale", "w2", "w2_scale", "w2_scale_2"):
        np.testing.assert_array_equal(got[name], w[name], err_msg=name)


def test_sharded_checkpoint_directory(tmp_path):
    rng = np.random.default_rng(12)
    w = random_stacked(rng, 2, 32, 16)
    tensors = checkpoint_tensors(w, "model.layers.0.mlp.")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for shard, shard_names in shards.items():
        write_safetensors(tmp_path / shard, {n: tensors[n] for n in shard_names})
        weight_map.update({n: shard for n in shard_names})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 2,
                                                      "num_experts_per_tok": 2, "norm_topk_prob": False}))
    assert fp4moe.find_moe_prefixes(str(tmp_path)) == ["model.layers.0.mlp."]
    np.testing.assert_array_equal(fp4moe.load_stacked(str(tmp_path), "model.layers.0.mlp.")["w2"], w["w2"])
    from fp4moe.checkpoint import read_layer_config
    cfg = read_layer_config(str(tmp_path))
    assert (cfg.top_k, cfg.routing, cfg.renormalize) == (2, "softmax", False)


def test_loader_errors_are_one_line_and_name_the_tensor(tmp_path):
    rng = np.random.default_rng(13)
    tensors = checkpoint_tensors(random_stacked(rng, 2, 32, 16), "model.layers.0.mlp.")
    del tensors["model.layers.0.mlp.experts.1.down_proj.weight_scale"]
    path = tmp_path / "broken.safetensors"
    write_safetensors(path, tensors)
    with pytest.raises(fp4moe.Error) as info:
        fp4moe.load_stacked(str(path), "model.layers.0.mlp.")
    message = str(info.value)
    assert "model.layers.0.mlp.experts.1.down_proj.weight_scale" in message
    assert "\n" not in message and ".cpp:" not in message


# Each family's config as the library's config.json reader (the extension's
# moe_model_config) reads it, with the routed expert count every MoE config
# declares.
HF_CONFIGS = [
    ({"model_type": "deepseek_v3", "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8,
      "topk_group": 4, "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
     dict(top_k=8, routing="noaux_tc", num_groups=8, topk_groups=4, routed_scaling_factor=2.5)),
    ({"model_type": "glm4_moe", "n_routed_experts": 160, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
      "routed_scaling_factor": 2.5}, dict(top_k=8, routing="noaux_tc", routed_scaling_factor=2.5)),
    ({"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True},
     dict(top_k=8, routing="softmax", renormalize=True)),
    ({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2},
     dict(top_k=2, routing="softmax", renormalize=True)),
    ({"model_type": "gpt_oss", "experts_per_token": 4, "num_local_experts": 128},
     dict(top_k=4, routing="gptoss", activation="gptoss")),
    ({"model_type": "llava", "text_config": {"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 4}},
     dict(top_k=4, routing="softmax")),
]


@pytest.mark.parametrize("config,expected", HF_CONFIGS, ids=[c[0]["model_type"] for c in HF_CONFIGS])
def test_routing_from_hf_config(config, expected):
    got = fp4moe.layer_config_from_hf(config).as_kwargs()
    for key, value in expected.items():
        assert got[key] == value, key


def test_dense_config_is_refused():
    with pytest.raises(ValueError, match="not an MoE config"):
        fp4moe.layer_config_from_hf({"model_type": "llama"})


# ------------------------------------------------------------------ errors


def test_errors_are_fp4moe_errors_with_one_line_messages():
    rng = np.random.default_rng(17)
    packed = rng.integers(0, 256, size=(2, 32, 8), dtype=np.uint8)
    with pytest.raises(fp4moe.Error) as info:
        fp4moe.pack_stacked(packed, np.zeros((2, 32, 3), np.uint8), False)
    assert str(info.value) == "fp4moe.pack_stacked: scales has shape [2, 32, 3]; expected [2, 32, 1]"
    with pytest.raises(fp4moe.Error, match="packed has dtype float32; expected uint8"):
        fp4moe.pack_stacked(packed.astype(np.float32), np.zeros((2, 32, 1), np.uint8), False)
    with pytest.raises(fp4moe.Error, match="not contiguous"):
        fp4moe.pack_stacked(np.zeros((2, 8, 32), np.uint8).transpose(0, 2, 1), np.zeros((2, 32, 1), np.uint8), False)


def test_reference_refuses_out_of_range_expert_ids():
    rng = np.random.default_rng(19)
    w = random_stacked(rng, 4, 32, 16)
    ids = np.array([[0, 4]], np.int32)
    with pytest.raises(fp4moe.Error) as info:
        fp4moe.reference_forward(w["w13"], w["w13_scale"], w["w13_scale_2"], w["w2"], w["w2_scale"],
                                 w["w2_scale_2"], None, None, np.zeros((1, 32), np.float32), ids,
                                 np.ones((1, 2), np.float32))
    assert "4" in str(info.value) and "\n" not in str(info.value)


def test_layer_refuses_host_arrays():
    rng = np.random.default_rng(23)
    w = random_stacked(rng, 2, 32, 16)
    with pytest.raises(fp4moe.Error, match="w13 is not on a CUDA device"):
        fp4moe.MoeLayer(w["w13"], w["w13_scale"], w["w13_scale_2"], w["w2"], w["w2_scale"], w["w2_scale_2"],
                        top_k=1)


def test_verbose_errors_add_the_source_location(monkeypatch):
    monkeypatch.setenv("FP4MOE_VERBOSE", "1")
    with pytest.raises(fp4moe.Error, match=r"\.cpp:\d+\]"):
        fp4moe.pack_stacked(np.zeros((1, 16, 8), np.uint8), np.zeros((1, 16, 2), np.uint8), False)


# ------------------------------------------------------------------ torch (when installed)


def test_torch_compile_fullgraph_traces_the_op(monkeypatch):
    """torch.compile(fullgraph=True) of a block calling a layer: the call
    becomes fp4moe::moe_forward with its fake implementation. On the CPU the
    layer's forward is replaced by a stand-in (out = hidden * 2)."""
    torch = pytest.importorskip("torch")
    from fp4moe import layer as layer_module
    from fp4moe import torch_ops  # noqa: F401

    class StandIn(layer_module.MoeLayer):
        def __init__(self):
            self._register()

        def forward_into(self, hidden_states, out, router_logits=None, correction_bias=None, topk_ids=None,
                         topk_weights=None, stream=None):
            out.copy_(hidden_states * 2)

    layer = StandIn()
    gate = torch.randn(64, 8)

    def block(x):
        logits = x.float() @ gate
        return layer(x, router_logits=logits) + x

    x = torch.randn(4, 64).to(torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), x * 3, rtol=0, atol=0)
    ids = torch.zeros(4, 2, dtype=torch.int64)
    args = (layer._id, x, torch.empty_like(x), None, None, ids.int(), torch.ones(4, 2))
    torch.library.opcheck(torch.ops.fp4moe.moe_forward.default, args)


def test_the_package_modules_import_without_a_cycle():
    """No module of the package imports, at its top level, one that imports
    it back: fp4moe.torch_ops and fp4moe.layer share the layer registry
    (fp4moe/_ops.py) instead of importing each other, so either can be
    imported first. Checked on the sources, so it runs without torch."""
    import ast

    package = os.path.dirname(fp4moe.__file__)
    names = [f[:-3] for f in os.listdir(package) if f.endswith(".py") and f != "__init__.py"]
    imports = {}
    for name in names:
        with open(os.path.join(package, name + ".py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        found = set()
        for node in tree.body:  # top level only: imports inside functions run later
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found |= {node.module} if node.module else {a.name for a in node.names}
        imports[name] = found & set(names)

    def reaches(start, goal, seen=()):
        return any(dep == goal or (dep not in seen and reaches(dep, goal, seen + (dep,))) for dep in imports[start])

    cycles = [name for name in names if reaches(name, name)]
    assert not cycles, f"modules in an import cycle: {cycles} ({imports})"
    assert "layer" not in imports["torch_ops"] and "_ops" in imports["torch_ops"], imports["torch_ops"]
