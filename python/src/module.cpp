// The Python extension module fp4moe._fp4moe (nanobind). Arrays cross the
// boundary as nb::ndarray (DLPack, or the buffer protocol for NumPy) without
// copies; the module links neither libtorch nor Python's torch, so any torch
// version (or none) works. The Python package (python/fp4moe/) wraps it.
// Each domain registers its bindings from its own file:
//
//   bind_layer.cpp      Layer (a MoeLayer plus its workspace; forward()
//                       validates every array and launches on the caller's
//                       stream), the CUDA device queries
//   bind_reference.cpp  reference_forward, checkpoint_reference_forward: the
//                       CPU reference of stacked arrays or of a checkpoint
//                       layer
//   bind_prepare.cpp    pack_stacked, pack_host: the two weight packers, for
//                       the tests
//   bind_format.cpp     load_stacked, quantize, moe_model_config: the
//                       checkpoint loader, ModelOpt quantisation, config.json
//   bind_plan.cpp       describe_plan: the planner for a given architecture
//
// Every fp4moe::Error becomes fp4moe.Error (a ValueError) carrying the
// library's one-line message (with the source location when FP4MOE_VERBOSE=1).
// Tested by tests/python/ (CPU parts everywhere, GPU parts on a GPU).
#include <nanobind/nanobind.h>

#include <cstdlib>
#include <exception>
#include <string>

#include "arrays.hpp"
#include "fp4moe/error.hpp"

namespace fp4moe::python {
namespace {

bool verbose_errors() {
  const char* v = std::getenv("FP4MOE_VERBOSE");
  return v != nullptr && *v != '\0' && std::string(v) != "0";
}

}  // namespace
}  // namespace fp4moe::python

NB_MODULE(_fp4moe, m) {
  using namespace fp4moe::python;
  m.doc() = "fp4moe: NVFP4 Mixture-of-Experts layers (the compiled part; see the fp4moe package)";

  static nb::exception<fp4moe::Error> error(m, "Error", PyExc_ValueError);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const fp4moe::Error& e) {
      PyErr_SetString(error.ptr(), verbose_errors() ? e.what() : e.message().c_str());
    }
  });

  register_layer(m);
  register_reference(m);
  register_prepare(m);
  register_format(m);
  register_plan(m);
}
