"""The built extension (fp4moe._fp4moe) itself: it must use the process's
shared C++ runtime. A static libstdc++ inside it sits next to the
libstdc++.so.6 that NumPy and torch load, and the first iostream number
formatting in the extension crashes (the locale facet ids of the two copies
clash). Checked three ways (scripts/check_extension.py has the rule):

  - nm -D: the extension defines none of libstdc++'s or libgcc's own symbols
    (std::locale and facet ids, std::ios_base, std::codecvt, __cxa_*, ...);
    weak instantiations of templates are normal and not counted
  - readelf -d: its NEEDED entries include libstdc++.so.6
  - in a fresh interpreter that imports NumPy (and torch, where installed)
    first, every binding that formats numbers runs without crashing: the
    planner's descriptions, error messages with numbers, checkpoint loading,
    the CPU reference, and on a GPU the layer's workspace and plan.

Runs everywhere (ctest python_extension, label cpu).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import fp4moe
from fp4moe import _fp4moe

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
import check_extension  # noqa: E402

EXTENSION = _fp4moe.__file__
needs_binutils = pytest.mark.skipif(shutil.which("nm") is None or shutil.which("readelf") is None,
                                    reason="nm or readelf (binutils) is not installed")


@pytest.fixture(scope="module")
def report():
    return check_extension.Report(EXTENSION)


@needs_binutils
def test_defines_no_libstdcxx_or_libgcc_symbols(report):
    print(report.text())
    if report.offending:
        first = report.offending[:20]
        names = check_extension.demangle([name for _, name, _ in first])
        listed = "\n".join(f"  {kind} {name}" for (kind, _, _), name in zip(first, names))
        pytest.fail(f"{EXTENSION} defines {len(report.offending)} symbol(s) of libstdc++/libgcc itself: a static C++ "
                    f"runtime is linked in. The first ones:\n{listed}", pytrace=False)


@needs_binutils
def test_needs_the_shared_libstdcxx(report):
    if "libstdc++.so.6" not in report.needed:
        pytest.fail(f"{EXTENSION}: NEEDED is {', '.join(report.needed)}; expected libstdc++.so.6 among them (the "
                    "shared libstdc++ of the process)", pytrace=False)


def test_the_rule_tells_a_static_runtime_apart():
    """The rule on the pieces a static runtime brings, and on what a normal
    extension holds (weak instantiations in namespace std)."""
    def offending(symbols):
        return [(kind, name) for kind, name, _ in check_extension.runtime_symbols(symbols)]

    static = [("T", "_ZNKSt6locale2id5_M_idEv"), ("B", "_ZNSt6locale2id11_S_refcountE"),
              ("T", "_ZNSt8ios_base4InitC1Ev"), ("T", "_ZNKSt7codecvtIDsc11__mbstate_tE10do_unshiftERS0_PcS3_RS3_"),
              ("T", "__cxa_throw"), ("T", "__gxx_personality_v0"), ("T", "_ZSt20__throw_length_errorPKc"),
              ("T", "_Unwind_Resume"), ("T", "_ZNSolsEi")]
    assert len(offending(static)) == len(static)
    normal = [("W", "_ZNKSt5ctypeIcE8do_widenEc"), ("W", "_ZSt19__throw_regex_errorNSt15regex_constants10error_typeEPKc"),
              ("W", "_ZNSt6vectorIfSaIfEE17_M_realloc_insertIJRKfEEEvN9__gnu_cxx17__normal_iteratorIPfS1_EEDpOT_"),
              ("u", "_ZGVZNKSt8__detail11_AnyMatcherINSt7__cxx1112regex_traitsIcEELb0ELb0ELb0EEclEcE5__nul"),
              ("T", "PyInit__fp4moe"), ("T", "_ZN6fp4moe14plan_gemm_withERKNS_11GemmProblemERKNS_10TileConfigEiii")]
    assert offending(normal) == []


# Run in a fresh interpreter: NumPy (and torch) load libstdc++.so.6 before
# the extension, as in an inference server.
CALLS = textwrap.dedent(r"""
    import os, sys, tempfile
    import numpy as np
    try:
        import torch
    except ImportError:
        torch = None
    import fp4moe
    sys.path.insert(0, sys.argv[1])
    from conftest import random_routing, random_stacked, write_nvfp4_checkpoint

    def expect_error(fn, *fragments):
        try:
            fn()
        except fp4moe.Error as e:
            message = str(e)
            for f in fragments:
                assert f in message, (f, message)
            print("error:", message)
            return
        raise AssertionError(f"no fp4moe.Error for {fragments}")

    # The planner's descriptions: numbers through std::ostream (ints, doubles).
    for arch in ("sm80", "sm90", "sm120"):
        for tokens in (1, 37, 4096):
            text = fp4moe.describe_plan(256, 8, 7168, 2048, tokens, arch=arch)
            assert "GEMM1" in text and "split_k" in text, text
    print(fp4moe.describe_plan(8, 2, 4096, 14336, 1, batch_invariant=True), end="")
    # Error messages with numbers.
    expect_error(lambda: fp4moe.describe_plan(0, 1, 4096, 1024, 1), "num_experts = 0: expected 1..")
    expect_error(lambda: fp4moe.describe_plan(8, 2, 4004, 1024, 1), "k = 4004: expected a positive multiple of 16")
    expect_error(lambda: fp4moe.quantize(np.zeros((4, 20), np.float32)), "cols (K) = 20")
    expect_error(lambda: fp4moe.pack_stacked(np.zeros((2, 32, 8), np.uint8), np.zeros((2, 32, 3), np.uint8), False),
                 "[2, 32, 3]")
    rng = np.random.default_rng(1)
    w = random_stacked(rng, 4, 64, 32, input_scales=True)
    args = [w[k] for k in ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2")] + [None, None]
    x = np.ones((3, 64), np.float32)
    ids, weights = random_routing(rng, 3, 4, 2)
    bad = w["w2_input_scale"].copy()
    bad[1] = 2e-20
    expect_error(lambda: fp4moe.reference_forward(*args, x, ids, weights, w13_input_scale=w["w13_input_scale"],
                                                  w2_input_scale=bad), "w2_input_scale[1] is 2e-20")
    expect_error(lambda: fp4moe.reference_forward(*args, x, np.full((3, 2), 7, np.int32), weights), "7")
    # A checkpoint: loading (its checks), the CPU reference in both numerics.
    with tempfile.TemporaryDirectory() as d:
        write_nvfp4_checkpoint(d, w)
        stacked = fp4moe.load_stacked(d, "model.layers.0.mlp.")
        assert stacked["w13_input_scale"].shape == (4, 2)
        for numerics in ("checkpoint", "bf16"):
            out = fp4moe.checkpoint_reference_forward(d, "model.layers.0.mlp.", x, ids, weights, activations=numerics)
            assert np.isfinite(out).all()
        expect_error(lambda: fp4moe.load_stacked(d, "model.layers.9.mlp."), "model.layers.9.mlp.")
        # On a GPU: the layer's workspace and plan (the planner per token count).
        if torch is not None and torch.cuda.is_available() and fp4moe.cuda_device_count() > 0:
            layer = fp4moe.MoeLayer.from_checkpoint(d, layer=0, top_k=2, max_tokens=300)
            assert layer.workspace_bytes > 0
            print(layer.plan(1), end="")
            print(layer.plan(257), end="")
            print("GPU layer: workspace", layer.workspace_bytes, "bytes,", layer.activations, "activations")
    print("torch", torch.__version__ if torch else "not installed")
    print("ALL CALLS RETURNED")
""")


def test_number_formatting_next_to_numpy_and_torch():
    result = subprocess.run([sys.executable, "-c", CALLS, HERE], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    print(result.stdout)
    assert result.returncode == 0 and "ALL CALLS RETURNED" in result.stdout, (
        f"the calls ended with exit status {result.returncode}"
        f"{' (signal ' + str(-result.returncode) + ')' if result.returncode < 0 else ''}; stderr:\n"
        f"{result.stderr[-4000:]}")
