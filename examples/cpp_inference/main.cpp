// Loads a torchfuse-optimized TorchScript model, runs it on a random input and
// prints the output shape and a checksum.
//
//   cpp_inference MODEL.pt 1x3x224x224 [SEED]
//
// The input is torch.manual_seed(SEED) (default 0) followed by
// torch.randn(shape), so Python reproduces it exactly on the CPU.

#include <torch/script.h>
#include <torch/utils.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::vector<int64_t> parseShape(const std::string& spec) {
  std::vector<int64_t> shape;
  std::stringstream in(spec);
  for (std::string dim; std::getline(in, dim, 'x');) {
    char* end = nullptr;
    const long long v = std::strtoll(dim.c_str(), &end, 10);
    if (dim.empty() || *end != '\0' || v <= 0) {
      throw std::invalid_argument("bad shape '" + spec + "'; expected e.g. 1x3x224x224");
    }
    shape.push_back(v);
  }
  return shape;
}

// The first tensor of the output: a tensor, or the first of a tuple or list.
at::Tensor firstTensor(const c10::IValue& v) {
  if (v.isTensor()) {
    return v.toTensor();
  }
  if (v.isTuple() && !v.toTupleRef().elements().empty()) {
    return firstTensor(v.toTupleRef().elements()[0]);
  }
  if (v.isList() && v.toList().size() > 0) {
    return firstTensor(v.toList().get(0));
  }
  throw std::runtime_error("the model's output holds no tensor");
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 3 || argc > 4) {
    std::cerr << "usage: cpp_inference MODEL.pt SHAPE [SEED]   (SHAPE e.g. 1x3x224x224)\n";
    return 2;
  }
  try {
    const auto shape = parseShape(argv[2]);
    const uint64_t seed = argc == 4 ? std::strtoull(argv[3], nullptr, 10) : 0;

    // Fails with "Unknown builtin op: torchfuse::custom_..." if the ops
    // library was not linked.
    auto module = torch::jit::load(argv[1]);
    module.eval();

    torch::manual_seed(seed);
    const auto input = at::randn(shape);
    c10::InferenceMode guard;
    const auto output = firstTensor(module.forward({input}));

    std::cout << "output shape: " << output.sizes() << "\n";
    std::printf("checksum: %.9e\n", output.to(at::kDouble).sum().item<double>());
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "cpp_inference: " << e.what() << "\n";
    return 1;
  }
}
