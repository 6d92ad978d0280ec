#!/usr/bin/env python3
"""Costs of the Python layer on a GPU, one JSON object per measurement
(printed, and written to OUT/python-bench.jsonl with --out OUT or $OUT):

  call_overhead   host time of one forward at T = 1 (device routing), the
                  median over single calls: the C++ MoeLayer::forward
                  alone, fp4moe.MoeLayer.forward_into (no conversions),
                  fp4moe.MoeLayer.__call__ with `out` given, the torch op
                  torch.ops.fp4moe.moe_forward, and the GPU time of one
                  forward and of one CUDA-graph replay (events), for scale.
  prepare         seconds to prepare a DeepSeek-V3-sized layer (E = 256,
                  H = 7168, I = 2048; 5.6 GB of codes) from stacked device
                  tensors (GPU packer) and from the same arrays on the host
                  (host packer on every core, then the upload).

    python bench/python_bench.py [--out DIR] [--skip-prepare] [--model-shape E H I]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import fp4moe
from fp4moe import _fp4moe


def emit(records: list, record: dict) -> None:
    print(json.dumps(record))
    records.append(record)


def random_layer(E, H, I, device="cuda", generator=None):
    def codes(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=generator)

    def scales(*shape):  # e4m3 0.125 .. 2
        return torch.randint(0x28, 0x49, shape, dtype=torch.uint8, device=device, generator=generator)

    return {
        "w13": codes(E, 2 * I, H // 2), "w13_scale": scales(E, 2 * I, H // 16),
        "w13_scale_2": torch.full((E,), 1 / 64, device=device),
        "w2": codes(E, H, I // 2), "w2_scale": scales(E, H, I // 16),
        "w2_scale_2": torch.full((E,), 1 / 64, device=device),
    }


def median_ns(fn, iterations=200, warmup=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for i in range(iterations):
        start = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - start)
        if i % 50 == 49:
            torch.cuda.synchronize()  # keep the launch queue from filling
    torch.cuda.synchronize()
    return statistics.median(samples)


def gpu_us(fn, iterations=100):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iterations):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iterations


def call_overhead(records, E, H, I, top_k):
    w = random_layer(E, H, I)
    layer = fp4moe.MoeLayer(**w, top_k=top_k, routing="noaux_tc", num_groups=8, topk_groups=4,
                            routed_scaling_factor=2.5, max_tokens=64)
    x = torch.randn(1, H, device="cuda").to(torch.bfloat16)
    logits = torch.randn(1, E, device="cuda")
    out = torch.empty_like(x)
    stream = torch.cuda.current_stream().cuda_stream
    cpp_ns = []
    for _ in range(5):
        cpp_ns.append(layer._impl.host_forward_ns(x, out, logits, stream, 50))
        torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    layer(x, router_logits=logits, out=out)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        layer(x, router_logits=logits, out=out)
    emit(records, {
        "bench": "call_overhead", "num_tokens": 1, "experts": E, "hidden": H, "inter": I, "top_k": top_k,
        "host_us_cpp_forward": statistics.median(cpp_ns) / 1e3,
        "host_us_forward_into": median_ns(lambda: layer.forward_into(x, out, router_logits=logits)) / 1e3,
        "host_us_call": median_ns(lambda: layer(x, router_logits=logits, out=out)) / 1e3,
        "host_us_torch_op": median_ns(lambda: torch.ops.fp4moe.moe_forward(layer._id, x, out, logits, None, None,
                                                                            None)) / 1e3,
        "gpu_us_forward": gpu_us(lambda: layer(x, router_logits=logits, out=out)),
        "gpu_us_graph_replay": gpu_us(graph.replay),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
    })


def prepare(records, E, H, I, top_k):
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = random_layer(E, H, I, generator=gen)
    source_gb = sum(t.numel() * t.element_size() for t in w.values()) / 1e9
    torch.cuda.synchronize()
    start = time.perf_counter()
    layer = fp4moe.MoeLayer(**w, top_k=top_k, max_tokens=1)
    torch.cuda.synchronize()
    device_s = time.perf_counter() - start
    weight_gb = layer.device_weight_bytes / 1e9
    del layer
    # Warm: a second device prepare (allocator and kernels loaded).
    start = time.perf_counter()
    layer = fp4moe.MoeLayer(**w, top_k=top_k, max_tokens=1)
    torch.cuda.synchronize()
    device_warm_s = time.perf_counter() - start
    del layer
    host = {k: v.cpu().numpy() for k, v in w.items()}
    del w
    torch.cuda.empty_cache()
    host_s = _fp4moe.time_host_prepare(host["w13"], host["w13_scale"], host["w13_scale_2"], host["w2"],
                                       host["w2_scale"], host["w2_scale_2"], top_k)
    emit(records, {
        "bench": "prepare", "experts": E, "hidden": H, "inter": I, "source_gb": source_gb,
        "prepared_gb": weight_gb, "device_packer_s": device_s, "device_packer_warm_s": device_warm_s,
        "host_packer_s": host_s, "speedup": host_s / device_warm_s, "host_threads": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(),
    })


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for python-bench.jsonl")
    parser.add_argument("--skip-prepare", action="store_true")
    parser.add_argument("--model-shape", nargs=3, type=int, default=[256, 7168, 2048], metavar=("E", "H", "I"))
    args = parser.parse_args()
    E, H, I = args.model_shape
    records = []
    call_overhead(records, E, H, I, top_k=8)
    if not args.skip_prepare:
        prepare(records, E, H, I, top_k=8)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "python-bench.jsonl"), "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
