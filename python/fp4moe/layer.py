"""fp4moe.MoeLayer: the GPU MoE layer for torch (or any DLPack) tensors.

    layer = fp4moe.MoeLayer(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
                            top_k=8, max_tokens=4096)
    out = layer(hidden_states, router_logits=logits)            # device routing
    layer(hidden_states, topk_ids=ids, topk_weights=w, out=out)  # caller's routing

    # W4A4 (fp4 activations), with the input scales as the engines hold them
    layer = fp4moe.MoeLayer(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
                            w13_input_scale=w13_in, w2_input_scale=w2_in, top_k=8)

Weights are the stacked tensors inference engines hold for a ModelOpt NVFP4
MoE (w13 = [gate; up] rows per expert). They are repacked on their GPU by
GPU kernels into the layer's own copy; the caller's tensors are untouched.
`activations` picks the experts' input activations: "checkpoint" (fp4 when
input scales are given, as for an NVFP4 (W4A4) checkpoint; bf16 otherwise),
"bf16" (W4A16) or "fp4" (refused without input scales). The input scales
become the layer's per-expert activation scales by the library's rules,
those of MoeLayer.from_checkpoint: w13_input_scale [E, 2] (gate, up, as
loaded) quantises GEMM1's input with the larger of the two, [E] with its
value, and one value serves every expert; each must be finite and in
[1e-15, 1e15].
The workspace is allocated once, for max_tokens; a forward launches on the
current torch stream and neither allocates (given `out`) nor synchronises,
so it can be captured in a CUDA graph. Under torch.compile the call goes
through the torch.library op fp4moe::moe_forward (fp4moe/torch_ops.py).

Tested in tests/python/test_gpu.py (against the CPU reference, graphs,
torch.compile, opcheck, bad input) and tests/python/test_cpu.py.
"""
from __future__ import annotations

from . import _fp4moe, _ops
from .checkpoint import LayerConfig, prefix_for_layer, read_layer_config

# torch, imported when the first layer is made (not by `import fp4moe`), or
# None without it; __call__ reads it from here rather than importing.
_TORCH = None
_TORCH_LOOKED_UP = False


def _torch():
    global _TORCH, _TORCH_LOOKED_UP
    if not _TORCH_LOOKED_UP:
        try:
            import torch
        except ImportError:
            torch = None
        _TORCH, _TORCH_LOOKED_UP = torch, True
        # A forward given stream=None takes the current stream from the
        # arrays' own framework (DLPack's C exchange API, torch >= 2.10); for
        # arrays without one, torch's current stream when torch is present.
        _fp4moe.set_current_stream_fallback(_current_stream if torch is not None else None)
    return _TORCH


def _is_torch_tensor(x) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _as_u8(t):
    """float8_e4m3fn torch tensors as their bytes: DLPack exports of float8
    are not supported by every torch version."""
    if _is_torch_tensor(t) and t.dtype == _TORCH.float8_e4m3fn:
        return t.view(_TORCH.uint8)
    return t


def _as_f32(t):
    if _is_torch_tensor(t) and t.dtype != _TORCH.float32:
        return t.to(_TORCH.float32)
    return t


def _as_i32(t):
    if _is_torch_tensor(t) and t.dtype != _TORCH.int32:
        return t.to(_TORCH.int32)
    return t


def _input_scale(value, like):
    """An input scale as the layer takes it: fp32 on the weights' device. A
    number becomes a one-value tensor there (with torch); arrays of other
    libraries pass as they are."""
    if value is None:
        return None
    torch = _torch()
    if isinstance(value, (int, float)) and torch is not None and _is_torch_tensor(like):
        return torch.tensor(float(value), dtype=torch.float32, device=like.device)
    if _is_torch_tensor(value) and _is_torch_tensor(like):
        return value.to(device=like.device, dtype=torch.float32)
    return value


def _current_stream(device_index: int) -> int:
    torch = _torch()
    if torch is None:
        return 0  # the legacy default stream
    return torch.cuda.current_stream(device_index).cuda_stream


class MoeLayer:
    """An NVFP4 MoE layer on one GPU. See the module docstring."""

    def __init__(self, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2, w13_bias=None, w2_bias=None,
                 *, w13_input_scale=None, w2_input_scale=None, activations: str = "checkpoint", top_k: int,
                 routing: str = "softmax", renormalize: bool = True, num_groups: int = 1,
                 topk_groups: int = 1, routed_scaling_factor: float = 1.0, activation: str = "swiglu",
                 finalize: str = "deterministic", batch_invariant: bool = False,
                 programmatic_launch: bool = True, max_tokens: int = 8192):
        """w13 u8 [E, 2I, H/2], w13_scale e4m3 [E, 2I, H/16], w13_scale_2 fp32 [E]
        or [E, 2] (gate, up), w2 u8 [E, H, I/2], w2_scale e4m3 [E, H, I/16],
        w2_scale_2 fp32 [E]; optional w13_bias [E, 2I] and w2_bias [E, H]
        (converted to fp32). All on one CUDA device.

        W4A4: w13_input_scale fp32 [E], [E, 2] (gate, up) or one value, and
        w2_input_scale fp32 [E] or one value, both or neither (a number or a
        tensor elsewhere is copied to the weights' device as fp32)."""
        on_gpu = _is_torch_tensor(w13) and w13.is_cuda
        stream = _current_stream(w13.device.index) if on_gpu else 0
        self._impl = _fp4moe.Layer.from_device(
            w13, _as_u8(w13_scale), _as_f32(w13_scale_2), w2, _as_u8(w2_scale), _as_f32(w2_scale_2),
            _as_f32(w13_bias), _as_f32(w2_bias), w13_input_scale=_input_scale(w13_input_scale, w13),
            w2_input_scale=_input_scale(w2_input_scale, w13), top_k=top_k, routing=routing,
            renormalize=renormalize, num_groups=num_groups, topk_groups=topk_groups,
            routed_scaling_factor=routed_scaling_factor, activation=activation, activations=activations,
            finalize=finalize, batch_invariant=batch_invariant, programmatic_launch=programmatic_launch,
            max_tokens=max_tokens, stream=stream)
        self._register()

    @classmethod
    def from_checkpoint(cls, path: str, layer: int | None = None, *, prefix: str | None = None,
                        max_tokens: int = 8192, device: int | None = None, finalize: str = "deterministic",
                        batch_invariant: bool = False, programmatic_launch: bool = True,
                        activations: str = "checkpoint", **routing) -> "MoeLayer":
        """Layer `layer` of a ModelOpt NVFP4 checkpoint (a directory with
        model.safetensors.index.json, or one .safetensors file), as the C++
        loader reads it ('<prefix>experts.<e>.{gate,up,down}_proj.*').
        activations: "checkpoint" (fp4 for an NVFP4 (W4A4) export with every
        input_scale, bf16 otherwise), "bf16" or "fp4".

        The prefix is found from the tensor names (or given); top_k, routing
        and activation come from config.json beside the checkpoint unless
        given as keywords (top_k, routing, renormalize, num_groups,
        topk_groups, routed_scaling_factor, activation)."""
        if prefix is None:
            prefix = prefix_for_layer(path, layer)
        declared = read_layer_config(path)
        if declared is not None:
            config = declared.as_kwargs()
        elif "top_k" in routing:
            config = LayerConfig(top_k=routing["top_k"]).as_kwargs()
        else:
            raise ValueError(f"{path}: no config.json beside the checkpoint; pass top_k= (and routing=...)")
        unknown = set(routing) - set(config)
        if unknown:
            raise TypeError(f"MoeLayer.from_checkpoint: unknown keyword(s) {sorted(unknown)}")
        config.update(routing)
        if device is None:
            torch = _torch()
            device = torch.cuda.current_device() if torch is not None and torch.cuda.is_available() else 0
        self = cls.__new__(cls)
        self._impl = _fp4moe.Layer.from_checkpoint(
            str(path), prefix, finalize=finalize, batch_invariant=batch_invariant, activations=activations,
            programmatic_launch=programmatic_launch, max_tokens=max_tokens, device=device, **config)
        self._register()
        return self

    def _register(self):
        self._id = _ops.register(self)  # the torch op names the layer by this id
        if _torch() is not None:
            from . import torch_ops  # noqa: F401  (registers fp4moe::moe_forward)

    # ------------------------------------------------------------------ forward

    def __call__(self, hidden_states, router_logits=None, topk_ids=None, topk_weights=None, out=None,
                 correction_bias=None):
        """bf16 [T, H] -> bf16 [T, H] (written into `out` when given).

        Routing: router_logits fp32 [T, E] (+ correction_bias [E] for
        noaux_tc), routed on the device with the layer's mode; or topk_ids
        int32 [T, k] with topk_weights fp32 [T, k]. Other dtypes of these are
        converted first (an allocation)."""
        torch = _TORCH  # looked up when this layer was made
        if torch is not None:
            if router_logits is not None:
                router_logits = _as_f32(router_logits)
                correction_bias = _as_f32(correction_bias)
            else:
                topk_ids = _as_i32(topk_ids)
                topk_weights = _as_f32(topk_weights)
        if out is None:
            out = hidden_states.new_empty(hidden_states.shape)
        if torch is not None and torch.compiler.is_compiling():
            torch.ops.fp4moe.moe_forward(self._id, hidden_states, out, router_logits, correction_bias,
                                          topk_ids, topk_weights)
        else:
            self._impl.forward(hidden_states, out, router_logits, correction_bias, topk_ids, topk_weights, None)
        return out

    def forward_into(self, hidden_states, out, router_logits=None, correction_bias=None, topk_ids=None,
                     topk_weights=None, stream: int | None = None):
        """The forward with nothing converted or allocated: every array as the
        layer takes it; `stream` defaults to the current stream of the
        arrays' framework (torch's current stream for torch tensors)."""
        self._impl.forward(hidden_states, out, router_logits, correction_bias, topk_ids, topk_weights, stream)

    # ------------------------------------------------------------------ info

    num_experts = property(lambda self: self._impl.num_experts)
    hidden = property(lambda self: self._impl.hidden)
    inter = property(lambda self: self._impl.inter)
    top_k = property(lambda self: self._impl.top_k)
    device = property(lambda self: self._impl.device, doc="CUDA device index")
    max_tokens = property(lambda self: self._impl.max_tokens)
    workspace_bytes = property(lambda self: self._impl.workspace_bytes)
    device_weight_bytes = property(lambda self: self._impl.device_weight_bytes)
    activations = property(lambda self: self._impl.activations,
                           doc='The activation numerics the layer runs: "bf16" or "fp4" (W4A4)')

    def plan(self, num_tokens: int) -> str:
        """The kernels a forward of num_tokens tokens launches, and why."""
        return self._impl.plan(num_tokens)

    def device_errors(self) -> str:
        """Expert ids out of range seen by earlier forwards (synchronises)."""
        return self._impl.device_errors(_current_stream(self._impl.device))

    def __repr__(self):
        return (f"fp4moe.MoeLayer(experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}, "
                f"top_k={self.top_k}, device=cuda:{self.device}, max_tokens={self.max_tokens})")
