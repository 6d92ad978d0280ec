// The names of a ModelOpt checkpoint's MoE expert tensors (expert_names.hpp).
// Tested in tests/format/test_moe_weights_reader.cpp.
#include "format/expert_names.hpp"

#include "fp4moe/modelopt.hpp"

namespace fp4moe {

std::string expert_tensor_name(const std::string& prefix, int64_t expert_idx, const std::string& proj,
                               const std::string& field) {
  return prefix + "experts." + std::to_string(expert_idx) + "." + proj + "." + field;
}

int64_t parse_expert_index(const std::string& name, const std::string& prefix) {
  const std::string head = prefix + "experts.";
  if (name.size() <= head.size() || name.compare(0, head.size(), head) != 0) return -1;
  size_t pos = head.size();
  const size_t digits_begin = pos;
  while (pos < name.size() && name[pos] >= '0' && name[pos] <= '9') ++pos;
  const size_t num_digits = pos - digits_begin;
  if (num_digits == 0 || num_digits > 9) return -1;
  if (num_digits > 1 && name[digits_begin] == '0') return -1;
  if (pos + 1 >= name.size() || name[pos] != '.') return -1;
  return std::stoll(name.substr(digits_begin, num_digits));
}

std::string find_stacked_expert_tensor(const std::vector<std::string>& names, const std::string& prefix) {
  const std::string head = prefix + "experts.";
  for (const std::string& name : names)
    if (name.size() > head.size() && name.compare(0, head.size(), head) == 0 &&
        !(name[head.size()] >= '0' && name[head.size()] <= '9'))
      return name;
  return {};
}

}  // namespace fp4moe
