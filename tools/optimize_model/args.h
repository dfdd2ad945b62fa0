#pragma once

// Command-line options of optimize-model, their parsing and the help text.
// Parsing needs no model: every error found here exits with kUsage before
// anything is loaded or written.

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace torchfuse::tools {

// Exit codes; --help and docs/cli.md document them.
enum ExitCode : int {
  kOk = 0,
  kInternal = 1,     // an unexpected error (a bug): please report it
  kUsage = 2,        // bad or missing arguments; an input shape that overflows
                     // int64, cannot be allocated, or that the original model
                     // rejects (out of memory included); OUT or the report
                     // naming IN or each other (also through links)
  kLoad = 3,         // IN cannot be read or is not a TorchScript archive
  kOptimize = 4,     // the model cannot be optimized as asked
  kCheckFailed = 5,  // --check: the outputs differ beyond the tolerance, or
                     // only the optimized model fails (out of memory included)
  kWrite = 6,        // OUT or the report cannot be written, or is neither a
                     // missing path nor a regular file (a symlink to one is
                     // written through)
};

// Ends the run: `what()` is the one line printed on stderr.
class ToolError : public std::runtime_error {
 public:
  ToolError(ExitCode code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  ExitCode code() const {
    return code_;
  }

 private:
  ExitCode code_;
};

enum class Verbosity { kQuiet, kNormal, kVerbose };

using Shape = std::vector<int64_t>;

struct Options {
  std::string input;
  std::string output;
  bool freeze = false;
  std::vector<std::string> passes;  // empty: all
  std::vector<std::string> preserved_attrs;  // --preserve-attr, with --freeze
  std::string layout = "auto";               // --layout, with --freeze: auto|channels_last|keep
  bool check = false;
  std::vector<Shape> input_shapes;
  std::string input_shape_spec;     // as given, for messages
  std::string dtype = "float32";
  std::string device = "cpu";
  std::optional<double> rtol;       // override the dtype's tolerance
  std::optional<double> atol;
  std::string report_path;          // empty: no JSON report
  Verbosity verbosity = Verbosity::kNormal;
  bool help = false;
  bool version = false;
};

// Throws ToolError(kUsage) with a one-line message.
Options parseArgs(const std::vector<std::string>& args);

// "1x3x224x224,1x10" -> {{1, 3, 224, 224}, {1, 10}}; throws ToolError(kUsage).
std::vector<Shape> parseShapes(const std::string& spec);

std::string formatShape(const Shape& shape);  // "1x3x224x224"

// The dtypes --dtype accepts, in --help order.
const std::vector<std::string>& dtypeNames();

std::string helpText();

} // namespace torchfuse::tools
