#include <cstdlib>
#include "tools/optimize_model/run.h"

#include <torch/cuda.h>
#include <torch/script.h>

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "tools/optimize_model/accuracy.h"
#include "tools/optimize_model/output.h"
#include "torchfuse/optimize.h"

namespace torchfuse::tools {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Progress of a long check on stderr: silent for the first second (or
// $OPTIMIZE_MODEL_PROGRESS_AFTER_S), then one line rewritten in place on a
// terminal, or a line every few seconds in logs.
double progressDelay() {
  const char* env = std::getenv("OPTIMIZE_MODEL_PROGRESS_AFTER_S");
  if (env == nullptr) {
    return 1.0;
  }
  char* end = nullptr;
  const double value = std::strtod(env, &end);
  return end != env && value >= 0 ? value : 1.0;
}

class Progress {
 public:
  explicit Progress(bool enabled)
      : enabled_(enabled),
        tty_(::isatty(STDERR_FILENO) == 1),
        delay_(progressDelay()),
        start_(Clock::now()) {}
  ~Progress() {
    if (tty_ && shown_) {
      std::cerr << "\r\033[K" << std::flush;
    }
  }
  void operator()(const std::string& what) {
    if (!enabled_ || since(start_) < delay_) {
      return;
    }
    const double every = tty_ ? 0.2 : 5.0;
    if (shown_ && since(last_) < every) {
      return;
    }
    const auto line = "optimize-model: checking: " + what + " (" +
        std::to_string(static_cast<int>(since(start_))) + " s)";
    if (tty_) {
      std::cerr << "\r\033[K" << line << std::flush;
    } else {
      std::cerr << line << std::endl;
    }
    shown_ = true;
    last_ = Clock::now();
  }

 private:
  bool enabled_;
  bool tty_;
  double delay_;
  bool shown_ = false;
  Clock::time_point start_;
  Clock::time_point last_;
};

c10::Device checkDevice(const std::string& name) {
  const c10::Device device(name);
  if (device.is_cuda()) {
    if (!torch::cuda::is_available()) {
      throw ToolError(kUsage, "--device " + name + ": no CUDA device is available");
    }
    if (device.has_index() && device.index() >= static_cast<int>(torch::cuda::device_count())) {
      throw ToolError(kUsage, "--device " + name + ": there are only " +
                                  std::to_string(torch::cuda::device_count()) + " CUDA devices");
    }
  }
  return device;
}

torch::jit::Module loadInput(const std::string& path, const c10::Device& device) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw ToolError(kLoad, "cannot read IN.pt '" + path + "': " + std::strerror(errno));
  }
  if (S_ISDIR(st.st_mode)) {
    throw ToolError(kLoad, "cannot read IN.pt '" + path + "': it is a folder");
  }
  if (::access(path.c_str(), R_OK) != 0) {
    throw ToolError(kLoad, "cannot read IN.pt '" + path + "': " + std::strerror(errno));
  }
  try {
    return torch::jit::load(path, device);
  } catch (const std::exception& e) {
    auto line = errorLine(e);
    if (line.find("PytorchStreamReader") != std::string::npos) {
      // The rest of the reader's text is advice on checkpoints.
      line = "not a TorchScript archive, or a truncated one (" + line.substr(0, line.find(". ")) + ")";
    }
    throw ToolError(kLoad, "cannot load '" + path + "' as a TorchScript model: " + line);
  }
}

} // namespace

int run(const Options& opts) {
  const auto start = Clock::now();
  const bool quiet = opts.verbosity == Verbosity::kQuiet;
  const bool verbose = opts.verbosity == Verbosity::kVerbose;
  const auto step = [&](const std::string& what) {
    if (verbose) {
      std::cerr << "optimize-model: " << what << std::endl;
    }
  };

  // Everything that can be checked before the work is checked first, and
  // the paths before anything is read or written.
  checkDistinctPaths(opts);
  const auto output_target = writeTarget(opts.output, "OUT.pt");
  const auto report_target =
      opts.report_path.empty() ? std::string() : writeTarget(opts.report_path, "--report");
  const auto device = checkDevice(opts.device);
  CheckSpec spec;
  if (opts.check) {
    spec.device = device;
    spec.shapes = opts.input_shapes;
    spec.shape_spec = opts.input_shape_spec;
    spec.dtype = parseDtype(opts.dtype);
    spec.dtype_name = opts.dtype;
    spec.tolerance = defaultTolerance(spec.dtype);
    if (opts.rtol) {
      spec.tolerance.rtol = *opts.rtol;
    }
    if (opts.atol) {
      spec.tolerance.atol = *opts.atol;
    }
    checkInputsFitInMemory(spec);
  }
  // NB: last, since it creates (and removes) a file in each folder.
  checkWritable(output_target, "OUT.pt");
  if (!report_target.empty()) {
    checkWritable(report_target, "--report");
  }

  RunReport report;
  report.input = opts.input;
  report.output = opts.output;
  report.freeze = opts.freeze;
  report.device = device.str();
  report.passes = opts.passes;

  step("loading " + opts.input);
  auto t = Clock::now();
  // NB: on the device it will run on, so that the layout decision
  // (Layout::Auto) sees where the weights are.
  auto module = loadInput(opts.input, device);
  if (!module.find_method("forward")) {
    throw ToolError(kLoad, "'" + opts.input + "' has no forward method");
  }
  report.times.load_s = since(t);

  // NB: a frozen model has no training attribute (is_training() says true).
  if (opts.freeze && module.hasattr("training") && module.is_training()) {
    throw ToolError(
        kOptimize, "--freeze needs a model saved in eval mode, but '" + opts.input +
            "' is in training mode (call model.eval() before saving it, or drop --freeze)");
  }

  step("optimizing");
  t = Clock::now();
  torch::jit::Module optimized;
  try {
    torchfuse::OptimizeOptions options;
    options.freeze = opts.freeze;
    options.passes = opts.passes;
    options.preserved_attrs = opts.preserved_attrs;
    options.layout = opts.layout == "channels_last" ? torchfuse::Layout::ChannelsLast
        : opts.layout == "keep"                     ? torchfuse::Layout::Keep
                                                    : torchfuse::Layout::Auto;
    optimized = torchfuse::optimize(module, options, &report.fusion);
  } catch (const std::exception& e) {
    throw ToolError(kOptimize, "cannot optimize '" + opts.input + "': " + errorLine(e));
  }
  report.times.optimize_s = since(t);

  // NB: what is checked and what is saved are the same bytes, reloaded as a
  // user would load them.
  step("serializing");
  t = Clock::now();
  std::string bytes;
  torch::jit::Module reloaded;
  try {
    std::ostringstream out;
    optimized.save(out);
    bytes = out.str();
    std::istringstream in(bytes);
    reloaded = torch::jit::load(in, device);
  } catch (const std::exception& e) {
    throw ToolError(kOptimize, "the optimized model does not load back: " + errorLine(e));
  }
  report.times.save_s = since(t);

  if (verbose) {
    std::cout << "optimized forward graph:\n"
              << *optimized.get_method("forward").graph() << std::flush;
  }

  if (opts.check) {
    step("checking on " + spec.device.str());
    t = Clock::now();
    auto original = loadInput(opts.input, device);
    {
      Progress progress(!quiet);
      report.check = checkAccuracy(
          original, reloaded, spec, [&](const std::string& what) { progress(what); });
    }
    report.times.check_s = since(t);
    report.check_device = spec.device.str();
    report.check_dtype = opts.dtype;
    report.check_shapes = opts.input_shape_spec;
    report.check_tolerance = spec.tolerance;
    if (!report.check->passed) {
      report.times.total_s = since(start);
      if (!quiet) {
        std::cout << formatText(report) << std::flush;
      }
      throw ToolError(kCheckFailed, "check failed: " + report.check->failure +
                                        "; nothing was written");
    }
  }

  // Both files are complete before either is renamed into place.
  step("writing " + opts.output);
  t = Clock::now();
  AtomicFile model_file(output_target, "OUT.pt");
  model_file.write(bytes);
  std::optional<AtomicFile> report_file;
  if (!opts.report_path.empty()) {
    report.times.save_s += since(t);
    report.times.total_s = since(start);
    report_file.emplace(report_target, "--report");
    report_file->write(formatJson(report));
  }
  model_file.commit();
  if (report_file) {
    report_file->commit();
  }
  if (opts.report_path.empty()) {
    report.times.save_s += since(t);
    report.times.total_s = since(start);
  }
  if (!quiet) {
    std::cout << formatText(report) << std::flush;
  }
  return kOk;
}

} // namespace torchfuse::tools
