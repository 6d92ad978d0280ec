// The weight packers' bindings, for the tests: pack_stacked (the device
// packer's index mapping evaluated on the CPU) and pack_host (the host
// packer, src/kernels/prepare.cpp) on the same stacked arrays.
// Tested by tests/python/test_cpu.py (the two agree byte for byte).
#include <nanobind/stl/tuple.h>

#include <cstring>
#include <vector>

#include "arrays.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/modelopt.hpp"
#include "fp4moe/moe_layer.hpp"
#include "kernels/grouped_gemm.hpp"
#include "kernels/stacked_layout.hpp"

namespace fp4moe::python {
namespace {

// The device packer's index mapping, evaluated on the CPU.
nb::tuple pack_stacked(const Array& packed, const Array& scales, bool gate_up) {
  FP4MOE_CHECK(packed.ndim() == 3, "fp4moe.pack_stacked: packed has shape ", shape_string(shape_of(packed)),
               "; expected [E, n, k/2]");
  const int64_t E = static_cast<int64_t>(packed.shape(0)), n = static_cast<int64_t>(packed.shape(1));
  const int64_t k = static_cast<int64_t>(packed.shape(2)) * 2;
  layout::StackedNvfp4 s;
  s.packed =
      static_cast<const uint8_t*>(checked("fp4moe.pack_stacked", "packed", packed, DType::kU8, {{E, n, k / 2}}, kHost));
  s.scales = static_cast<const uint8_t*>(
      checked("fp4moe.pack_stacked", "scales", scales, DType::kU8, {{E, n, k / 16}}, kHost));
  s.num_experts = E;
  s.n = n;
  s.k = k;
  s.gate_up = gate_up;
  FP4MOE_CHECK(n % 16 == 0 && k % 16 == 0 && (!gate_up || n % 32 == 0), "fp4moe.pack_stacked: n = ", n, ", k = ", k,
               "; expected multiples of 16 (n of 32 for a gate/up stack)");
  const int64_t frags = s.num_fragments();
  std::vector<uint8_t> w(static_cast<size_t>(frags * kFragBytes)), sc(static_cast<size_t>(frags * kFragScaleBytes));
  {
    nb::gil_scoped_release release;
    for (int64_t i = 0; i < frags * layout::kWordsPerFragment; ++i) {
      const uint32_t word = layout::prepared_weight_word(s, i);
      std::memcpy(w.data() + i * 4, &word, 4);
    }
    for (int64_t i = 0; i < frags * kFragScaleBytes; ++i)
      sc[static_cast<size_t>(i)] = layout::prepared_scale_byte(s, i);
  }
  const size_t wn = w.size(), sn = sc.size();
  return nb::make_tuple(numpy_array(std::move(w), {wn}), numpy_array(std::move(sc), {sn}));
}

// The host packer (prepare.cpp), for the same stacked arrays.
nb::tuple pack_host(const Array& packed, const Array& scales, bool gate_up) {
  std::vector<Nvfp4Matrix> ms = unstack("fp4moe.pack_host", packed, scales, nullptr, 0, 0);
  if (gate_up) {
    for (Nvfp4Matrix& m : ms) {
      FP4MOE_CHECK(m.rows % 16 == 0, "fp4moe.pack_host: a gate/up stack needs rows a multiple of 16, not ", m.rows);
      m = interleave_gate_up(row_slice(m, 0, m.rows / 2), row_slice(m, m.rows / 2, m.rows / 2));
    }
  }
  std::vector<const Nvfp4Matrix*> ptrs;
  for (const auto& m : ms) ptrs.push_back(&m);
  PreparedGemmWeights p = prepare_gemm_weights(ptrs);
  const size_t wn = p.weights.size(), sn = p.scales.size();
  return nb::make_tuple(numpy_array(std::move(p.weights), {wn}), numpy_array(std::move(p.scales), {sn}));
}

}  // namespace

void register_prepare(nb::module_& m) {
  m.def("pack_stacked", &pack_stacked, nb::arg("packed"), nb::arg("scales"), nb::arg("gate_up"),
        "The device packer's index mapping evaluated on the CPU: (weights, scales) uint8 arrays.");
  m.def("pack_host", &pack_host, nb::arg("packed"), nb::arg("scales"), nb::arg("gate_up"),
        "The host packer on the same arrays: (weights, scales) uint8 arrays.");
}

}  // namespace fp4moe::python
