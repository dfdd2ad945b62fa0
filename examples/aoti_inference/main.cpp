// Loads an AOTInductor package (.pt2) compiled from a torchfuse-rewritten
// torch.export program, runs it on a random input and prints the output
// shape and checksums.
//
//   aoti_inference MODEL.pt2 1x3x224x224 [SEED]
//
// The input is torch.manual_seed(SEED) (default 0) followed by
// torch.randn(shape), so Python reproduces it exactly on the CPU.

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/torch.h>

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

} // namespace

int main(int argc, char** argv) {
  if (argc < 3 || argc > 4) {
    std::cerr << "usage: aoti_inference MODEL.pt2 SHAPE [SEED]   (SHAPE e.g. 1x3x224x224)\n";
    return 2;
  }
  try {
    const auto shape = parseShape(argv[2]);
    const uint64_t seed = argc == 4 ? std::strtoull(argv[3], nullptr, 10) : 0;

    // NB: a package compiled for the CPU; the loader runs it on the device
    // it was compiled for.  Without the ops library linked, loading fails
    // with "Could not find schema for torchfuse::custom_...".
    torch::inductor::AOTIModelPackageLoader loader(argv[1]);

    torch::manual_seed(seed);
    const auto input = at::randn(shape);
    c10::InferenceMode guard;
    const auto outputs = loader.run({input});
    if (outputs.empty()) {
      throw std::runtime_error("the model returned no tensor");
    }
    const auto out = outputs[0].to(at::kDouble);
    std::cout << "output shape: " << outputs[0].sizes() << "\n";
    std::printf("checksum: %.9e\n", out.sum().item<double>());
    std::printf("abs checksum: %.9e\n", out.abs().sum().item<double>());
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "aoti_inference: " << e.what() << "\n";
    return 1;
  }
}
