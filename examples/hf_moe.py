#!/usr/bin/env python3
"""A small Qwen3-MoE (or Mixtral) model from a transformers config, random
weights, no downloads: its experts are quantised to NVFP4 (ModelOpt's
recipe, fp4moe.quantize), then

  reference  the model with every expert weight replaced by its dequantised
             value, run by transformers in torch;
  fp4moe     the same model with each MoE block's experts replaced by an
             fp4moe.MoeLayer built from the stacked NVFP4 tensors on the GPU.

Both greedily generate --new-tokens tokens from the same prompt; the logits
of the reference's sequence are compared (relative error, limit 1e-2) and the
tokens/s of both printed. Exit status 1 when the logits disagree.

The model runs in float32 by default, so that the reference holds the
dequantised weights exactly and the comparison measures fp4moe (bf16
activations in and out of each MoE layer, W4A16) rather than bf16 rounding
in the reference; --dtype bfloat16 runs both in bf16 (what serving does).

    python examples/hf_moe.py [--model qwen3|mixtral] [--dtype float32|bfloat16] [--new-tokens 32]
                              [--json results.json]

Needs a CUDA GPU, torch and transformers (5.x: experts held as 3-D
gate_up_proj / down_proj tensors).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

import fp4moe


def small_config(model: str):
    if model == "qwen3":
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
                              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                              num_experts=32, num_experts_per_tok=4, norm_topk_prob=True,
                              max_position_embeddings=512, architectures=["Qwen3MoeForCausalLM"])
    from transformers import MixtralConfig
    return MixtralConfig(vocab_size=4096, hidden_size=1024, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=512, architectures=["MixtralForCausalLM"])


def moe_blocks(model):
    """(name, block) of every MoE block: a module with .experts holding 3-D
    gate_up_proj [E, 2I, H] (gate rows, then up rows) and down_proj [E, H, I]."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "experts") and hasattr(m.experts, "gate_up_proj")]


def quantize_experts(experts) -> dict:
    """NVFP4 (ModelOpt) of an experts module, as stacked host arrays in the
    engines' layout; gate and up of an expert share one weight_scale_2."""
    gate_up = experts.gate_up_proj.detach().float().cpu().numpy()
    down = experts.down_proj.detach().float().cpu().numpy()
    E, two_i, H = gate_up.shape
    I = two_i // 2
    w13 = np.empty((E, two_i, H // 2), np.uint8)
    w13_scale = np.empty((E, two_i, H // 16), np.uint8)
    w2 = np.empty((E, H, I // 2), np.uint8)
    w2_scale = np.empty((E, H, I // 16), np.uint8)
    s13 = np.empty(E, np.float32)
    s2 = np.empty(E, np.float32)
    for e in range(E):
        _, _, s13[e] = fp4moe.quantize(np.ascontiguousarray(gate_up[e]))  # amax of gate and up together
        for half in (slice(0, I), slice(I, two_i)):
            w13[e, half], w13_scale[e, half], _ = fp4moe.quantize(np.ascontiguousarray(gate_up[e, half]), s13[e])
        w2[e], w2_scale[e], s2[e] = fp4moe.quantize(np.ascontiguousarray(down[e]))
    return dict(w13=w13, w13_scale=w13_scale, w13_scale_2=s13, w2=w2, w2_scale=w2_scale, w2_scale_2=s2)


class Fp4moeExperts(torch.nn.Module):
    """Drop-in for transformers' experts module: (hidden [T, H], top_k_index,
    top_k_weights) -> [T, H], computed by an fp4moe.MoeLayer (bf16 in and
    out; a float32 model converts around it)."""

    def __init__(self, layer: fp4moe.MoeLayer):
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = self.layer(hidden_states.to(torch.bfloat16).contiguous(), topk_ids=top_k_index.to(torch.int32),
                         topk_weights=top_k_weights.float())
        return out.to(hidden_states.dtype)


def timed_generate(model, prompt, new_tokens):
    out = model.generate(prompt, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return out, new_tokens / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["qwen3", "mixtral"], default="qwen3")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args()

    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    config = small_config(args.model)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).cuda().eval()
    blocks = moe_blocks(model)
    if not blocks:
        print(f"hf_moe: no MoE block with 3-D gate_up_proj experts in {type(model).__name__} "
              f"(transformers {transformers.__version__}; 5.x needed)", file=sys.stderr)
        return 1
    top_k = config.num_experts_per_tok
    print(f"hf_moe: {type(model).__name__}, {len(blocks)} MoE blocks, "
          f"{blocks[0][1].experts.gate_up_proj.shape[0]} experts, top-{top_k}, {args.dtype}, transformers "
          f"{transformers.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")

    # Quantise; the reference gets the dequantised weights, fp4moe the codes.
    layers = []
    start = time.perf_counter()
    for _, block in blocks:
        q = quantize_experts(block.experts)
        d = {k: torch.from_numpy(v).cuda() for k, v in q.items()}
        layers.append(fp4moe.MoeLayer(d["w13"], d["w13_scale"].view(torch.float8_e4m3fn), d["w13_scale_2"],
                                      d["w2"], d["w2_scale"].view(torch.float8_e4m3fn), d["w2_scale_2"],
                                      top_k=top_k, max_tokens=256))
        with torch.no_grad():
            block.experts.gate_up_proj.copy_(fp4moe.dequantize(d["w13"], d["w13_scale"], d["w13_scale_2"]))
            block.experts.down_proj.copy_(fp4moe.dequantize(d["w2"], d["w2_scale"], d["w2_scale_2"]))
    print(f"quantised and prepared {len(layers)} layers in {time.perf_counter() - start:.1f} s")

    prompt = torch.randint(0, config.vocab_size, (1, args.prompt_tokens), device="cuda")
    with torch.no_grad():
        ref_tokens, ref_tps = timed_generate(model, prompt, args.new_tokens)
        ref_logits = model(ref_tokens).logits.float()
        originals = [block.experts for _, block in blocks]
        for (_, block), layer in zip(blocks, layers):
            block.experts = Fp4moeExperts(layer)
        fp4_tokens, fp4_tps = timed_generate(model, prompt, args.new_tokens)
        fp4_logits = model(ref_tokens).logits.float()  # the reference's sequence
        for (_, block), experts in zip(blocks, originals):
            block.experts = experts

    rel = (torch.linalg.norm(fp4_logits - ref_logits) / torch.linalg.norm(ref_logits)).item()
    same = int((fp4_tokens == ref_tokens).all(dim=0).sum().item()) - args.prompt_tokens
    ok = rel < 1e-2
    print(f"logits over {ref_tokens.shape[1]} positions: rel err {rel:.2e} (limit 1e-02) {'PASS' if ok else 'FAIL'}")
    print(f"generated tokens equal to the reference's: {same} of {args.new_tokens}")
    print(f"tokens/s: reference (torch, dequantised {args.dtype} experts) {ref_tps:.1f}, fp4moe {fp4_tps:.1f}")
    for i, layer in enumerate(layers):
        errors = layer.device_errors()
        if errors:
            print(f"layer {i}: device errors: {errors}", file=sys.stderr)
            ok = False
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "moe_blocks": len(blocks), "new_tokens": args.new_tokens,
                       "logits_rel_err": rel, "pass": ok, "tokens_equal": same,
                       "tokens_per_s_reference": ref_tps, "tokens_per_s_fp4moe": fp4_tps,
                       "torch": torch.__version__, "transformers": transformers.__version__,
                       "gpu": torch.cuda.get_device_name()}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
