#!/usr/bin/env python3
"""Markdown tables of the current benchmark runs (bench/results/GPU/*.jsonl).

    python3 bench/results_tables.py                                # print every table
    python3 bench/results_tables.py --update docs/performance.md   # rewrite its tables
    python3 bench/results_tables.py --check docs/performance.md    # exit 1 if stale

Reads, per GPU folder under bench/results/ (h100/, h200/, ...), the JSON lines
`fp4moe bench --json` (gemm.jsonl) and `fp4moe bench --layer --json`
(layer.jsonl) write, and makes these tables:

  GPU run       the run's GPU, date and ceilings, and the points >= 0.8
  GPU gemm      efficiency (t_roof / t) of the planner's choice per model
                shape, GEMM and token count
  GPU peers     per token count, over the GEMMs: fp4moe, cuBLAS' bf16 grouped
                GEMM, the other kernel family's own choice and a streaming
                read of the same bytes (where the run measured it), each as
                median (min-max) efficiency, and fp4moe's speed-up over cuBLAS
  GPU layer     the whole layer's efficiency per model and token count
                (default variant)
  GPU stages    the layer's time, roofline and stage split per model and T
  GPU yardstick for a run measured with the memory ceiling max(copy, read)
                and the layer roofline of each stage's real bytes: each
                point's efficiency again under the earlier yardstick (copy
                bandwidth; the layer as GEMM1 + GEMM2 with GEMM1 writing
                2 moe_inter columns), from the same times, and the points
                that moved across 0.8

A document marks where each goes with a pair of HTML comments,

    <!-- results-table h100 gemm -->
    ...
    <!-- end results-table -->

and --update replaces what lies between them. Python 3 standard library only.
"""
import argparse
import json
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tools/models.hpp's order; other models follow in order of appearance.
MODEL_ORDER = ["deepseek-v3", "kimi-k2", "glm-5", "glm-4.5", "qwen3-235b", "qwen3-30b", "gpt-oss-120b", "mixtral"]
# The layer's default variant: finalize deterministic, gather auto (earlier
# runs, before the gather mode auto: fused).
DEFAULT_LAYER_VARIANTS = ("deterministic/auto", "deterministic/fused")
TARGET = 0.8
BEGIN = "<!-- results-table "
END = "<!-- end results-table -->"


def read_jsonl(path):
    """(ceilings line or None, case lines) of one JSON-lines file."""
    ceilings, cases = None, []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"results_tables: {path}:{number}: not JSON ({e})")
            if record.get("kind") == "ceilings":
                ceilings = ceilings or record
            elif record.get("kind") in ("grouped_gemm", "moe_layer"):
                cases.append(record)
    return ceilings, cases


def model_key(model, seen):
    return (MODEL_ORDER.index(model) if model in MODEL_ORDER else len(MODEL_ORDER), seen.index(model))


def ordered_models(cases):
    seen = list(dict.fromkeys(c["model"] for c in cases))
    return sorted(seen, key=lambda m: model_key(m, seen))


def f2(x):
    return f"{x:.2f}"


def spread(values):
    """'median (min-max)' of a list, or '–' where empty."""
    if not values:
        return "–"
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def markdown(header, rows):
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def run_line(gemm, layer):
    parts = []
    for what, data in (("GEMM", gemm), ("layer", layer)):
        if data is None:
            continue
        ceil, cases = data
        memory = (f"memory {ceil['memory_tbps']:.2f} TB/s (copy {ceil['copy_tbps']:.2f}, read "
                  f"{ceil['read_tbps']:.2f})" if "memory_tbps" in ceil else f"copy {ceil['copy_tbps']:.2f} TB/s")
        sustained = (f" ({ceil['bf16_sustained_tflops']:.0f} sustained)" if "bf16_sustained_tflops" in ceil
                     else "")
        text = (f"{what}: {ceil.get('gpu', '?')}, {ceil.get('date', '?')}, {memory}, "
                f"cuBLAS bf16 {ceil['bf16_tflops']:.0f} TFLOP/s{sustained}")
        if what == "GEMM":
            good = sum(c["efficiency"] >= TARGET for c in cases)
            text += f"; {good} of {len(cases)} points ≥ {TARGET}"
        parts.append(text)
    return "\n".join(f"- {p}" for p in parts)


def gemm_table(cases):
    tokens = sorted({int(c["tokens"]) for c in cases})
    cell = {(c["model"], int(c["gemm"]), int(c["tokens"])): c["efficiency"] for c in cases}
    rows = []
    for model in ordered_models(cases):
        for gemm in sorted({int(c["gemm"]) for c in cases if c["model"] == model}):
            rows.append([model, gemm] + [f2(cell[(model, gemm, t)]) if (model, gemm, t) in cell else "–"
                                         for t in tokens])
    return markdown(["model", "GEMM"] + [f"T={t}" if i == 0 else str(t) for i, t in enumerate(tokens)], rows)


def peers_table(cases):
    has_read = any(c.get("read_peer_us", 0) > 0 for c in cases)
    header = ["T", "fp4moe", "≥ 0.8", "cuBLAS bf16", "speed-up over cuBLAS", "other family"]
    if has_read:
        header += ["read of the same bytes", "fp4moe / read"]
    rows = []
    for t in sorted({int(c["tokens"]) for c in cases}):
        at = [c for c in cases if int(c["tokens"]) == t]
        cublas = [c["cublas_efficiency"] for c in at if c.get("cublas_us", 0) > 0]
        speedup = [c["cublas_us"] / c["time_us"] for c in at if c.get("cublas_us", 0) > 0]
        other = [c["other_family_efficiency"] for c in at if c.get("other_family_us", 0) > 0]
        good = sum(c["efficiency"] >= TARGET for c in at)
        row = [t, spread([c["efficiency"] for c in at]), f"{good} of {len(at)}", spread(cublas),
               spread(speedup).replace(" (", "× (").replace(")", "×)") if speedup else "–", spread(other)]
        if has_read:
            read = [c for c in at if c.get("read_peer_us", 0) > 0]
            row += [spread([c["read_peer_efficiency"] for c in read]) + (f", {len(read)} of {len(at)}"
                                                                          if read and len(read) < len(at) else ""),
                    spread([c["read_peer_us"] / c["time_us"] for c in read])]
        rows.append(row)
    return markdown(header, rows)


def default_layer_cases(cases):
    for variant in DEFAULT_LAYER_VARIANTS:
        chosen = [c for c in cases if c.get("variant") == variant]
        if chosen:
            return chosen
    return []


# The benchmark's routing loads (`--routing`); runs before the option routed
# the skewed way.
LOAD_ORDER = ["uniform", "realistic", "skewed"]


def router_load(case):
    return case.get("router_load", "skewed")


def ordered_loads(cases):
    present = {router_load(c) for c in cases}
    return [load for load in LOAD_ORDER if load in present]


def layer_table(cases):
    cases = default_layer_cases(cases)
    tokens = sorted({int(c["tokens"]) for c in cases})
    cell = {(c["model"], router_load(c), int(c["tokens"])): c["efficiency"] for c in cases}
    rows = [[m, load] + [f2(cell[(m, load, t)]) if (m, load, t) in cell else "–" for t in tokens]
            for m in ordered_models(cases) for load in ordered_loads(cases)
            if any((m, load, t) in cell for t in tokens)]
    return markdown(["model", "routing"] + [f"T={t}" if i == 0 else str(t) for i, t in enumerate(tokens)], rows)


def stages_table(cases):
    cases = default_layer_cases(cases)
    with_load = any("expert_rows_max" in c for c in cases)
    with_sustained = any("efficiency_sustained" in c for c in cases)
    header = ["model", "routing", "T", "active experts"] + (
        ["rows per active expert, median / max"] if with_load else []) + [
        "time µs", "graph µs (/ eager in turn)", "roofline µs", "eff"] + (
        ["eff, sustained bf16"] if with_sustained else []) + [
        "route + sort", "gather", "GEMM1", "GEMM2", "finalize", "outside GEMMs"]
    rows = []
    for model in ordered_models(cases):
        for load in ordered_loads(cases):
            chosen = [c for c in cases if c["model"] == model and router_load(c) == load]
            for c in sorted(chosen, key=lambda c: int(c["tokens"])):
                s = c["stage_us"]
                row = [model, load, c["tokens"], c["active_experts"]]
                if with_load:
                    row.append(f"{c['expert_rows_median']} / {c['expert_rows_max']}" if "expert_rows_max" in c
                               else "–")
                graph = "–"
                if c.get("graph_us"):
                    graph = f"{c['graph_us']:.1f}"
                    if c.get("graph_eager_us"):
                        graph += f" ({c['graph_us'] / c['graph_eager_us']:.2f}×)"
                row += [f"{c['time_us']:.1f}", graph, f"{c['roof_us']:.1f}", f2(c["efficiency"])]
                if with_sustained:
                    row.append(f2(c["efficiency_sustained"]) if "efficiency_sustained" in c else "–")
                if c.get("fused_decode"):  # GEMM1, GEMM2 and the combine are one launch, timed as GEMM1's
                    gemms = [f"{s['gemm1']:.1f} (fused)", "–", "–"]
                else:
                    gemms = [f"{s['gemm1']:.1f}", f"{s['gemm2']:.1f}", f"{s['finalize']:.1f}"]
                row += [f"{s['route_sort']:.1f}", f"{s['gather']:.1f}"] + gemms + [
                    f"{100 * c['outside_gemm_share']:.0f} %"]
                rows.append(row)
    return markdown(header, rows)


def gemm_bytes_flops(active, rows, n, k):
    """docs/design.md §6 for one grouped GEMM."""
    return active * n * k * (0.5 + 1 / 16) + rows * k * 2 + rows * n * 2, 2.0 * rows * n * k


def copy_roof_us(nbytes, flops, ceil):
    """The earlier yardstick: the copy rate alone as the memory ceiling."""
    return max(nbytes / (ceil["copy_tbps"] * 1e12), flops / (ceil["bf16_tflops"] * 1e12)) * 1e6


def yardstick_table(gemm, layer):
    """Efficiencies of one run under the earlier and the current yardstick."""
    rows = []
    if gemm is not None:
        ceil, cases = gemm
        old = {}
        for c in cases:
            b, f = gemm_bytes_flops(c["active_experts"], c["rows"], c["n"], c["k"])
            old[id(c)] = copy_roof_us(b, f, ceil) / c["time_us"]
        before = sum(v >= TARGET for v in old.values())
        after = sum(c["efficiency"] >= TARGET for c in cases)
        fell = sorted(f"{c['model']} GEMM{c['gemm']} T={c['tokens']} ({old[id(c)]:.3f} → {c['efficiency']:.3f})"
                      for c in cases if old[id(c)] >= TARGET > c["efficiency"])
        shift = [c["efficiency"] / old[id(c)] for c in cases]
        rows.append(["GEMM points ≥ 0.8", f"{before} of {len(cases)}", f"{after} of {len(cases)}",
                     (f"new / old {min(shift):.3f}–{max(shift):.3f}; below 0.8 now: " + (", ".join(fell) or "none"))])
    if layer is not None:
        ceil, cases = layer
        for c in sorted(default_layer_cases(cases), key=lambda c: (model_key(c["model"], [c["model"]]),
                                                                      c["model"], int(c["tokens"]))):
            rows_, t, h, i, a = c["rows"], int(c["tokens"]), c["hidden"], c["inter"], c["active_experts"]
            old_roof = sum(copy_roof_us(*gemm_bytes_flops(a, rows_, n, k), ceil) for n, k in ((2 * i, h), (h, i)))
            old_eff = old_roof / c["time_us"]
            rows.append([f"layer {c['model']} T={t}", f"{old_eff:.3f}", f"{c['efficiency']:.3f}",
                         "crossed 0.8" if (old_eff >= TARGET) != (c["efficiency"] >= TARGET) else ""])
    return markdown(["", "earlier yardstick", "current yardstick", ""], rows)


def gpu_folders(results):
    return sorted(d for d in os.listdir(results)
                  if os.path.isdir(os.path.join(results, d)) and not d.startswith("."))


def all_tables(results):
    """{(gpu, kind): markdown} for every GPU folder under `results`."""
    tables = {}
    for gpu in gpu_folders(results):
        folder = os.path.join(results, gpu)
        gemm = layer = None
        if os.path.exists(os.path.join(folder, "gemm.jsonl")):
            gemm = read_jsonl(os.path.join(folder, "gemm.jsonl"))
        if os.path.exists(os.path.join(folder, "layer.jsonl")):
            layer = read_jsonl(os.path.join(folder, "layer.jsonl"))
        if gemm is None and layer is None:
            continue
        tables[(gpu, "run")] = run_line(gemm, layer)
        if gemm is not None:
            tables[(gpu, "gemm")] = gemm_table(gemm[1])
            tables[(gpu, "peers")] = peers_table(gemm[1])
        if layer is not None:
            tables[(gpu, "layer")] = layer_table(layer[1])
            tables[(gpu, "stages")] = stages_table(layer[1])
        current = [d for d in (gemm, layer) if d is not None and "memory_tbps" in d[0]]
        if current:
            tables[(gpu, "yardstick")] = yardstick_table(*(d if d is not None and "memory_tbps" in d[0] else None
                                                           for d in (gemm, layer)))
    return tables


def fill(text, tables, path):
    """`text` with every marked block replaced by its table."""
    out, pos = [], 0
    while True:
        start = text.find(BEGIN, pos)
        if start < 0:
            out.append(text[pos:])
            return "".join(out)
        head_end = text.index("-->", start) + 3
        key = tuple(text[start + len(BEGIN):head_end - 3].split())
        end = text.find(END, head_end)
        if end < 0:
            sys.exit(f"results_tables: {path}: '{BEGIN}{' '.join(key)} -->' has no '{END}'")
        if key not in tables:
            sys.exit(f"results_tables: {path}: no table '{' '.join(key)}' (have: "
                     + ", ".join(" ".join(k) for k in tables) + ")")
        out.append(text[pos:head_end] + "\n" + tables[key] + "\n")
        pos = end


def main():
    parser = argparse.ArgumentParser(description="Markdown tables of bench/results/GPU/{gemm,layer}.jsonl.")
    parser.add_argument("--results", default=os.path.join(REPO, "bench", "results"),
                        help="folder of per-GPU folders (default bench/results)")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--update", metavar="DOC.md", help="rewrite the marked tables of this document")
    action.add_argument("--check", metavar="DOC.md", help="exit 1 if the marked tables of this document are stale")
    args = parser.parse_args()

    tables = all_tables(args.results)
    if not tables:
        sys.exit(f"results_tables: no GPU folder with gemm.jsonl or layer.jsonl under {args.results}")
    path = args.update or args.check
    if not path:
        for (gpu, kind), table in tables.items():
            print(f"{BEGIN}{gpu} {kind} -->\n{table}\n{END}\n")
        return 0
    with open(path, encoding="utf-8") as f:
        text = f.read()
    new = fill(text, tables, path)
    if args.check:
        if new != text:
            print(f"results_tables: {path}: tables differ from {args.results}; "
                  f"run python3 bench/results_tables.py --update {path}", file=sys.stderr)
            return 1
        print(f"results_tables: {path}: tables up to date")
        return 0
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
        print(f"results_tables: {path}: tables rewritten")
    else:
        print(f"results_tables: {path}: tables already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
