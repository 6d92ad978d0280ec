"""GPU tests of the Python package (skip visibly without a CUDA device or
torch): the layer from stacked device tensors against the CPU reference and
against the host-prepared layer of the same checkpoint (byte-equal outputs),
[E, 2] global scales, biases, device routing, the caller's tensors left
untouched, CUDA-graph capture, torch.compile(fullgraph=True),
torch.library.opcheck, W4A4 from the engines' input scales against
from_checkpoint (byte-equal outputs), and bad input refused with one-line
messages."""
from __future__ import annotations

import numpy as np
import pytest

import fp4moe
from conftest import (checkpoint_tensors, gpu, random_routing, random_stacked, rel_err, write_nvfp4_checkpoint,
                      write_safetensors)

pytestmark = gpu

# Without torch every test here skips (or fails under FP4MOE_EXPECT_GPU) with
# the reason, through the gpu marker; the name is only used inside them.
try:
    import torch
except ImportError:
    torch = None


def to_cuda(w: dict) -> dict:
    out = {k: torch.from_numpy(v).cuda() for k, v in w.items()}
    for k in ("w13_scale", "w2_scale"):
        out[k] = out[k].view(torch.float8_e4m3fn)  # as engines hold them
    return out


def make_layer(w: dict, **kwargs):
    d = to_cuda({k: v for k, v in w.items() if "input_scale" not in k})
    return fp4moe.MoeLayer(d["w13"], d["w13_scale"], d["w13_scale_2"], d["w2"], d["w2_scale"],
                           d["w2_scale_2"], d.get("w13_bias"), d.get("w2_bias"), **kwargs), d


def reference(w, x_bf16, ids, weights, activation="swiglu"):
    return fp4moe.reference_forward(w["w13"], w["w13_scale"], w["w13_scale_2"], w["w2"], w["w2_scale"],
                                    w["w2_scale_2"], w.get("w13_bias"), w.get("w2_bias"),
                                    x_bf16.float().cpu().numpy(), ids, weights, activation)


CASES = [  # E, H, I, top_k, T, scale_2 shape, bias/activation
    (8, 256, 128, 2, 1, "E", False),
    (8, 256, 128, 2, 37, "E2", False),
    (16, 512, 384, 4, 130, "E", False),
    (4, 2880 // 16 * 16, 256, 2, 9, "E", True),
]


@pytest.mark.parametrize("E,H,I,k,T,s2,bias", CASES)
def test_layer_matches_the_cpu_reference(E, H, I, k, T, s2, bias):
    rng = np.random.default_rng(E + H + T)
    w = random_stacked(rng, E, H, I, s2, bias)
    activation = "gptoss" if bias else "swiglu"
    layer, _ = make_layer(w, top_k=k, activation=activation, max_tokens=256)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    ids, weights = random_routing(rng, T, E, k)
    out = torch.full((T, H), float("nan"), device="cuda", dtype=torch.bfloat16)  # poisoned
    got = layer(x, topk_ids=torch.from_numpy(ids).cuda(), topk_weights=torch.from_numpy(weights).cuda(), out=out)
    assert got is out
    torch.cuda.synchronize()
    ref = reference(w, x, ids, weights, activation)
    assert rel_err(out.float().cpu().numpy(), ref) < 1e-2
    assert layer.device_errors() == ""


def test_device_prepared_equals_host_prepared(tmp_path):
    rng = np.random.default_rng(1)
    E, H, I, k, T = 8, 384, 256, 2, 20
    w = random_stacked(rng, E, H, I)
    path = tmp_path / "layer.safetensors"
    write_safetensors(path, checkpoint_tensors(w, "model.layers.0.mlp."))
    from_device, _ = make_layer(w, top_k=k, max_tokens=64)
    from_host = fp4moe.MoeLayer.from_checkpoint(str(path), layer=0, top_k=k, max_tokens=64)
    assert from_host.device_weight_bytes == from_device.device_weight_bytes
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    ids, weights = random_routing(rng, T, E, k)
    ids_d, weights_d = torch.from_numpy(ids).cuda(), torch.from_numpy(weights).cuda()
    a = from_device(x, topk_ids=ids_d, topk_weights=weights_d)
    b = from_host(x, topk_ids=ids_d, topk_weights=weights_d)
    assert torch.equal(a, b)


def test_caller_tensors_are_untouched():
    rng = np.random.default_rng(2)
    w = random_stacked(rng, 4, 256, 128, "E2", bias=True)
    d = to_cuda(w)
    before = {k: v.clone() for k, v in d.items()}
    fp4moe.MoeLayer(d["w13"], d["w13_scale"], d["w13_scale_2"], d["w2"], d["w2_scale"], d["w2_scale_2"],
                    d["w13_bias"], d["w2_bias"], top_k=2, activation="gptoss", max_tokens=8)
    for k in d:
        assert torch.equal(d[k].view(torch.uint8) if d[k].dtype == torch.float8_e4m3fn else d[k],
                           before[k].view(torch.uint8) if before[k].dtype == torch.float8_e4m3fn else before[k]), k


def test_device_routing_softmax():
    rng = np.random.default_rng(4)
    E, H, I, k, T = 16, 256, 128, 4, 33
    w = random_stacked(rng, E, H, I)
    layer, _ = make_layer(w, top_k=k, routing="softmax", renormalize=True, max_tokens=64)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    logits = torch.randn(T, E, device="cuda")
    out = layer(x, router_logits=logits)
    p = torch.softmax(logits.double(), dim=-1)
    top, ids = torch.topk(p, k, dim=-1)
    weights = (top / top.sum(-1, keepdim=True)).float()
    ref = reference(w, x, ids.int().cpu().numpy(), weights.cpu().numpy())
    assert rel_err(out.float().cpu().numpy(), ref) < 1e-2


def test_cuda_graph_capture_and_replay():
    rng = np.random.default_rng(5)
    E, H, I, k, T = 8, 256, 128, 2, 16
    w = random_stacked(rng, E, H, I)
    layer, _ = make_layer(w, top_k=k, max_tokens=T)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    logits = torch.randn(T, E, device="cuda")
    out = torch.empty_like(x)
    layer(x, router_logits=logits, out=out)  # warm-up: plans the token count
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(x, router_logits=logits, out=out)
    x.copy_(torch.randn_like(x))
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    expected = layer(x, router_logits=logits)
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def test_torch_compile_fullgraph():
    rng = np.random.default_rng(6)
    E, H, I, k, T = 8, 256, 128, 2, 8
    w = random_stacked(rng, E, H, I)
    layer, _ = make_layer(w, top_k=k, max_tokens=T)

    # Logits come in, so that routing is bitwise the same in both runs.
    def block(x, logits):
        y = layer(x, router_logits=logits)
        return y, y.float() * 2 + x.float()

    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    logits = torch.randn(T, E, device="cuda")
    compiled = torch.compile(block, fullgraph=True)
    (y_compiled, z_compiled), (y_eager, z_eager) = compiled(x, logits), block(x, logits)
    assert torch.equal(y_compiled, y_eager)
    torch.testing.assert_close(z_compiled, z_eager)


def test_opcheck():
    rng = np.random.default_rng(7)
    E, H, I, k, T = 8, 256, 128, 2, 4
    w = random_stacked(rng, E, H, I)
    layer, _ = make_layer(w, top_k=k, max_tokens=T)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    ids, weights = random_routing(rng, T, E, k)
    args = (layer._id, x, torch.empty_like(x), None, None, torch.from_numpy(ids).cuda(),
            torch.from_numpy(weights).cuda())
    torch.library.opcheck(torch.ops.fp4moe.moe_forward.default, args)
    args = (layer._id, x, torch.empty_like(x), torch.randn(T, E, device="cuda"), None, None, None)
    torch.library.opcheck(torch.ops.fp4moe.moe_forward.default, args)


def test_bad_input_raises_one_line_errors():
    rng = np.random.default_rng(8)
    E, H, I, k = 8, 256, 128, 2
    w = random_stacked(rng, E, H, I)
    layer, _ = make_layer(w, top_k=k, max_tokens=16)
    x = torch.randn(4, H, device="cuda").to(torch.bfloat16)
    ids = torch.from_numpy(random_routing(rng, 4, E, k)[0]).cuda()
    wts = torch.ones(4, k, device="cuda")
    cases = [
        (lambda: layer(x.float(), topk_ids=ids, topk_weights=wts), "hidden_states has dtype float32; expected bfloat16"),
        (lambda: layer(x.cpu(), topk_ids=ids, topk_weights=wts), "not on a CUDA device"),
        (lambda: layer(x[:, :128], topk_ids=ids, topk_weights=wts), "expected [4, 256]"),
        (lambda: layer(torch.randn(H, 4, device="cuda").to(torch.bfloat16).t(), topk_ids=ids, topk_weights=wts),
         "not contiguous"),
        (lambda: layer(torch.randn(17, H, device="cuda").to(torch.bfloat16),
                       router_logits=torch.randn(17, E, device="cuda")), "max_tokens = 16"),
        (lambda: layer(x, topk_ids=ids[:, :1], topk_weights=wts), "topk_ids has shape [4, 1]"),
        (lambda: layer(x), "give either router_logits or topk_ids"),
        (lambda: layer(x, topk_ids=[[0, 1]] * 4, topk_weights=wts), "topk_ids is a list; expected an array"),
    ]
    for call, text in cases:
        with pytest.raises(fp4moe.Error) as info:
            call()
        assert text in str(info.value)
        assert "\n" not in str(info.value)
    # Bad weights: NaN block scale, wrong scale shape.
    d = to_cuda(w)
    d["w2_scale"].view(torch.uint8)[3, 5, 1] = 0x7F
    with pytest.raises(fp4moe.Error, match=r"w2_scale\[3, 5, 1\]"):
        fp4moe.MoeLayer(d["w13"], d["w13_scale"], d["w13_scale_2"], d["w2"], d["w2_scale"], d["w2_scale_2"],
                        top_k=k)
    with pytest.raises(fp4moe.Error, match="w13_scale has shape"):
        fp4moe.MoeLayer(d["w13"], d["w13_scale"][:, :8], d["w13_scale_2"], d["w2"], d["w2_scale"],
                        d["w2_scale_2"], top_k=k)


# ------------------------------------------------------------------ W4A4


def engine_scales(w: dict, form: str):
    """The input scales as an engine holds them on the GPU: "E2" as loaded
    ([E, 2]), "E" reduced per expert (the larger of gate's and up's), "one"
    a single value each (a 0-d tensor), "float" Python numbers."""
    s13, s2 = w["w13_input_scale"], w["w2_input_scale"]
    if form == "float":
        return float(s13.max()), float(s2.max())
    if form == "one":
        return torch.tensor(float(s13.max()), device="cuda"), torch.tensor(float(s2.max()), device="cuda")
    if form == "E":
        s13 = s13.max(axis=1)
    return torch.from_numpy(np.ascontiguousarray(s13)).cuda(), torch.from_numpy(s2).cuda()


@pytest.mark.parametrize("form", ["E", "E2", "one", "float"])
def test_w4a4_from_engine_scales_equals_from_checkpoint(tmp_path, form):
    """The engines' layout with input scales builds the layer that
    from_checkpoint builds from the ModelOpt NVFP4 export: equal outputs, bit
    for bit, close to the W4A4 CPU reference and away from the bf16 one."""
    rng = np.random.default_rng(41)
    E, H, I, k, T = 8, 256, 128, 2, 37
    w = random_stacked(rng, E, H, I, input_scales=True)
    if form in ("one", "float"):  # an export whose input scales are one per layer
        w["w13_input_scale"][:] = w["w13_input_scale"].max()
        w["w2_input_scale"][:] = w["w2_input_scale"].max()
    write_nvfp4_checkpoint(tmp_path, w)
    s13, s2 = engine_scales(w, form)
    engine, _ = make_layer(w, w13_input_scale=s13, w2_input_scale=s2, top_k=k, max_tokens=64)
    checkpoint = fp4moe.MoeLayer.from_checkpoint(str(tmp_path), layer=0, top_k=k, max_tokens=64)
    assert engine.activations == checkpoint.activations == "fp4"
    assert engine.device_weight_bytes == checkpoint.device_weight_bytes
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    ids, weights = random_routing(rng, T, E, k)
    ids_d, weights_d = torch.from_numpy(ids).cuda(), torch.from_numpy(weights).cuda()
    a = engine(x, topk_ids=ids_d, topk_weights=weights_d)
    b = checkpoint(x, topk_ids=ids_d, topk_weights=weights_d)
    assert torch.equal(a, b)
    logits = torch.randn(T, E, device="cuda")
    assert torch.equal(engine(x, router_logits=logits), checkpoint(x, router_logits=logits))
    got = a.float().cpu().numpy()
    x_host = x.float().cpu().numpy()
    w4a4 = fp4moe.checkpoint_reference_forward(str(tmp_path), "model.layers.0.mlp.", x_host, ids, weights)
    bf16 = fp4moe.checkpoint_reference_forward(str(tmp_path), "model.layers.0.mlp.", x_host, ids, weights,
                                               activations="bf16")
    assert rel_err(got, w4a4) < 1e-2
    assert rel_err(got, bf16) > 1.5e-2


def test_w4a4_bf16_activations_are_todays_layer(tmp_path):
    """activations="bf16" with input scales is the layer built without them,
    bit for bit; so is from_checkpoint(activations="bf16")."""
    rng = np.random.default_rng(42)
    E, H, I, k, T = 8, 256, 128, 2, 20
    w = random_stacked(rng, E, H, I, input_scales=True)
    write_nvfp4_checkpoint(tmp_path, w)
    s13, s2 = engine_scales(w, "E")
    plain, _ = make_layer(w, top_k=k, max_tokens=32)
    forced, _ = make_layer(w, w13_input_scale=s13, w2_input_scale=s2, activations="bf16", top_k=k, max_tokens=32)
    from_checkpoint = fp4moe.MoeLayer.from_checkpoint(str(tmp_path), layer=0, top_k=k, max_tokens=32,
                                                      activations="bf16")
    assert plain.activations == forced.activations == from_checkpoint.activations == "bf16"
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    logits = torch.randn(T, E, device="cuda")
    expected = plain(x, router_logits=logits)
    assert torch.equal(forced(x, router_logits=logits), expected)
    assert torch.equal(from_checkpoint(x, router_logits=logits), expected)


def test_w4a4_refusals():
    rng = np.random.default_rng(43)
    E, H, I, k = 4, 256, 128, 2
    w = random_stacked(rng, E, H, I, input_scales=True)
    s13, s2 = engine_scales(w, "E")
    bad = s13.clone()
    bad[2] = float("nan")
    cases = [
        (dict(activations="fp4"), "fp4moe.MoeLayer: fp4 activations (W4A4) need w13_input_scale and "
                                  "w2_input_scale; none are given: use bf16 activations"),
        (dict(w13_input_scale=s13), "fp4moe.MoeLayer: give both w13_input_scale and w2_input_scale, or neither"),
        (dict(w13_input_scale=s13[:3], w2_input_scale=s2),
         "fp4moe.MoeLayer: w13_input_scale has shape [3]; expected [4] or [4, 1] or [4, 2] or [] or [1]"),
        (dict(w13_input_scale=bad, w2_input_scale=s2),
         "w13_input_scale[2] is nan; expected a finite input_scale in [1e-15, 1e+15]"),
        (dict(w13_input_scale=s13, w2_input_scale=0.0), "w2_input_scale is 0; expected a finite input_scale"),
        (dict(w13_input_scale=s13, w2_input_scale=s2, activations="fp8"),
         "activation numerics 'fp8' is not one of checkpoint, bf16, fp4"),
    ]
    for kwargs, text in cases:
        with pytest.raises(fp4moe.Error) as info:
            make_layer(w, top_k=k, max_tokens=4, **kwargs)
        assert text in str(info.value), str(info.value)
        assert "\n" not in str(info.value)


class DLPackOnly:
    """A CUDA array that offers only __dlpack__ (no C exchange API), as
    other array libraries do."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __dlpack__(self, **kwargs):
        return self.tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


def test_torch_tensors_take_the_exchange_api_and_other_arrays_dlpack():
    """torch (>= 2.10) tensors are read through DLPack's C exchange API, other
    arrays through __dlpack__; both give the same bits, on the current
    stream (a side stream here) when no stream is given."""
    from fp4moe import _fp4moe

    rng = np.random.default_rng(10)
    E, H, I, k, T = 8, 256, 128, 2, 5
    w = random_stacked(rng, E, H, I)
    layer, _ = make_layer(w, top_k=k, max_tokens=T)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    logits = torch.randn(T, E, device="cuda")
    torch_version = tuple(int(p) for p in torch.__version__.split(".")[:2])
    if torch_version >= (2, 10):
        assert _fp4moe.has_exchange_api(x)
    assert not _fp4moe.has_exchange_api(DLPackOnly(x))
    expected = layer(x, router_logits=logits)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fast, slow = torch.empty_like(x), torch.empty_like(x)
        layer.forward_into(x, fast, router_logits=logits)
        layer.forward_into(DLPackOnly(x), DLPackOnly(slow), router_logits=DLPackOnly(logits))
    side.synchronize()
    assert torch.equal(fast, expected)
    assert torch.equal(slow, expected)


@pytest.mark.skipif(fp4moe.cuda_device_count() < 2, reason="GPU test skipped: needs two CUDA devices")
def test_tensor_on_another_gpu_is_refused():
    rng = np.random.default_rng(9)
    w = random_stacked(rng, 4, 256, 128)
    layer, _ = make_layer(w, top_k=2, max_tokens=4)
    x = torch.randn(2, 256, device="cuda:1").to(torch.bfloat16)
    with pytest.raises(fp4moe.Error, match="is on cuda:1 but the layer is on cuda:0"):
        layer(x, router_logits=torch.randn(2, 4, device="cuda:1"))
