#include "tools/optimize_model/args.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <limits>
#include <sstream>

#include "torchfuse/optimize.h"
#include "torchfuse/registry.h"

namespace torchfuse::tools {
namespace {

[[noreturn]] void usageError(const std::string& message) {
  throw ToolError(kUsage, message + " (see --help)");
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::string::size_type start = 0;
  while (true) {
    const auto end = s.find(sep, start);
    parts.push_back(s.substr(start, end - start));
    if (end == std::string::npos) {
      return parts;
    }
    start = end + 1;
  }
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (const auto& s : v) {
    out += (out.empty() ? "" : sep) + s;
  }
  return out;
}

double parseTolerance(const std::string& option, const std::string& value) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(value.c_str(), &end);
  if (value.empty() || *end != '\0' || errno != 0 || !(v >= 0.0)) {
    usageError(option + " expects a non-negative number, got '" + value + "'");
  }
  return v;
}

} // namespace

const std::vector<std::string>& dtypeNames() {
  static const std::vector<std::string> names{"float32", "float16", "bfloat16", "float64"};
  return names;
}

std::string formatShape(const Shape& shape) {
  std::string out;
  for (const auto d : shape) {
    out += (out.empty() ? "" : "x") + std::to_string(d);
  }
  return out;
}

std::vector<Shape> parseShapes(const std::string& spec) {
  const auto bad = [&](const std::string& why) {
    usageError("--input-shape '" + spec + "' does not parse: " + why +
               "; expected e.g. 1x3x224x224 or 1x3x224x224,1x10");
  };
  if (spec.empty()) {
    bad("it is empty");
  }
  std::vector<Shape> shapes;
  for (const auto& item : split(spec, ',')) {
    if (item.empty()) {
      bad("an input has no shape");
    }
    Shape shape;
    for (const auto& dim : split(item, 'x')) {
      if (dim.empty() || dim.size() > 12 ||
          !std::all_of(dim.begin(), dim.end(), [](char c) { return c >= '0' && c <= '9'; })) {
        bad("'" + dim + "' in '" + item + "' is not a positive integer");
      }
      const auto value = std::stoll(dim);
      if (value <= 0) {
        bad("'" + dim + "' in '" + item + "' is not a positive integer");
      }
      shape.push_back(value);
    }
    // NB: at::randn would fail deep inside with a c10 error (exit 1); the
    // shape is the user's input, so say so here, before anything is loaded.
    int64_t numel = 1;
    for (const auto d : shape) {
      if (__builtin_mul_overflow(numel, d, &numel)) {
        throw ToolError(kUsage, "--input-shape '" + spec + "': the input " + item +
                                    " has more elements than fit in int64 (at most " +
                                    std::to_string(std::numeric_limits<int64_t>::max()) + ")");
      }
    }
    shapes.push_back(std::move(shape));
  }
  return shapes;
}

Options parseArgs(const std::vector<std::string>& args) {
  Options opts;
  std::vector<std::string> positional;
  bool options_done = false;
  bool any_check_option = false;
  std::string check_option_seen;
  bool verbose = false;
  bool quiet = false;

  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (options_done || arg.empty() || arg[0] != '-' || arg == "-") {
      positional.push_back(arg);
      continue;
    }
    if (arg == "--") {
      options_done = true;
      continue;
    }
    // --name=value or --name value
    std::string name = arg;
    std::optional<std::string> inline_value;
    if (arg.rfind("--", 0) == 0) {
      const auto eq = arg.find('=');
      if (eq != std::string::npos) {
        name = arg.substr(0, eq);
        inline_value = arg.substr(eq + 1);
      }
    }
    const auto value = [&]() -> std::string {
      if (inline_value) {
        return *inline_value;
      }
      if (i + 1 >= args.size()) {
        usageError(name + " needs a value");
      }
      return args[++i];
    };
    const auto flag = [&]() {
      if (inline_value) {
        usageError(name + " takes no value");
      }
    };

    if (name == "-h" || name == "--help") {
      flag();
      opts.help = true;
    } else if (name == "--version") {
      flag();
      opts.version = true;
    } else if (name == "-v" || name == "--verbose") {
      flag();
      verbose = true;
    } else if (name == "-q" || name == "--quiet") {
      flag();
      quiet = true;
    } else if (name == "--freeze") {
      flag();
      opts.freeze = true;
    } else if (name == "--passes") {
      const auto list = value();
      const auto& known = torchfuse::passNames();
      opts.passes.clear();
      for (const auto& pass : split(list, ',')) {
        if (pass.empty()) {
          usageError("--passes '" + list + "' has an empty pass name");
        }
        if (std::find(known.begin(), known.end(), pass) == known.end()) {
          usageError("unknown pass '" + pass + "' in --passes; known passes: " + join(known, ", "));
        }
        if (std::find(opts.passes.begin(), opts.passes.end(), pass) == opts.passes.end()) {
          opts.passes.push_back(pass);
        }
      }
    } else if (name == "--layout") {
      opts.layout = value();
      if (opts.layout != "auto" && opts.layout != "channels_last" && opts.layout != "keep") {
        usageError(
            "expected --layout to be one of auto, channels_last, keep, got '" + opts.layout + "'");
      }
    } else if (name == "--preserve-attr") {
      const auto list = value();
      for (const auto& attr : split(list, ',')) {
        if (attr.empty()) {
          usageError("--preserve-attr '" + list + "' has an empty name");
        }
        if (std::find(opts.preserved_attrs.begin(), opts.preserved_attrs.end(), attr) ==
            opts.preserved_attrs.end()) {
          opts.preserved_attrs.push_back(attr);
        }
      }
    } else if (name == "--check") {
      flag();
      opts.check = true;
    } else if (name == "--input-shape") {
      opts.input_shape_spec = value();
      opts.input_shapes = parseShapes(opts.input_shape_spec);
      any_check_option = true;
      check_option_seen = name;
    } else if (name == "--dtype") {
      opts.dtype = value();
      const auto& names = dtypeNames();
      if (std::find(names.begin(), names.end(), opts.dtype) == names.end()) {
        usageError("unknown --dtype '" + opts.dtype + "'; expected one of " + join(names, ", "));
      }
      any_check_option = true;
      check_option_seen = name;
    } else if (name == "--device") {
      opts.device = value();
      const bool cuda_index = opts.device.rfind("cuda:", 0) == 0 && opts.device.size() > 5 &&
          std::all_of(opts.device.begin() + 5, opts.device.end(),
                      [](char c) { return c >= '0' && c <= '9'; });
      if (opts.device != "cpu" && opts.device != "cuda" && !cuda_index) {
        usageError("unknown --device '" + opts.device + "'; expected cpu, cuda or cuda:N");
      }
    } else if (name == "--rtol") {
      opts.rtol = parseTolerance(name, value());
      any_check_option = true;
      check_option_seen = name;
    } else if (name == "--atol") {
      opts.atol = parseTolerance(name, value());
      any_check_option = true;
      check_option_seen = name;
    } else if (name == "--report") {
      opts.report_path = value();
      if (opts.report_path.empty()) {
        usageError("--report needs a file name");
      }
    } else {
      usageError("unknown option '" + arg + "'");
    }
  }

  if (opts.help || opts.version) {
    return opts;
  }
  if (verbose && quiet) {
    usageError("-v and -q exclude each other");
  }
  opts.verbosity = quiet ? Verbosity::kQuiet : verbose ? Verbosity::kVerbose : Verbosity::kNormal;
  if (positional.empty()) {
    usageError("missing arguments IN.pt and OUT.pt");
  }
  if (positional.size() == 1) {
    usageError("missing argument OUT.pt");
  }
  if (positional.size() > 2) {
    usageError("unexpected argument '" + positional[2] + "'; expected IN.pt OUT.pt");
  }
  opts.input = positional[0];
  opts.output = positional[1];
  if (opts.input.empty() || opts.output.empty()) {
    usageError("IN.pt and OUT.pt must not be empty");
  }
  if (!opts.freeze && !opts.preserved_attrs.empty()) {
    usageError("--preserve-attr is only used with --freeze");
  }
  if (opts.check && opts.input_shapes.empty()) {
    usageError("--check needs --input-shape");
  }
  if (!opts.check && any_check_option) {
    usageError(check_option_seen + " is only used with --check");
  }
  return opts;
}

namespace {

// The pass names, comma-separated, wrapped to `width` columns with
// continuation lines indented by `indent` (the help's second column).
// "prefix a, b, c" wrapped at `width`, continuation lines at `indent`; the
// first line starts at column `indent` too.
std::string wrapNames(
    const std::string& prefix,
    const std::vector<std::string>& names,
    size_t indent,
    size_t width) {
  std::string text = prefix;
  size_t column = indent + prefix.size();
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string item = names[i] + (i + 1 < names.size() ? "," : "");
    if (i > 0 && column + 1 + item.size() > width) {
      text += "\n" + std::string(indent, ' ');
      column = indent;
    } else if (i > 0) {
      text += " ";
      ++column;
    }
    text += item;
    column += item.size();
  }
  return text;
}

std::string defaultPassesText() {
  std::vector<std::string> on;
  std::vector<std::string> off;
  for (const auto& f : torchfuse::fusions()) {
    (f.by_default ? on : off).push_back(f.name);
  }
  auto text = wrapNames("default: ", on, 24, 78);
  if (!off.empty()) {
    text += "\n" + std::string(24, ' ') + wrapNames("only when named: ", off, 24, 78);
  }
  return text;
}

} // namespace

std::string helpText() {
  // NB: docs/cli.md repeats this text verbatim; change both together.
  return R"(usage: optimize-model IN.pt OUT.pt [options]

Fuses operator chains of a TorchScript model into torchfuse::custom_* ops and
saves the result.  OUT.pt is written atomically: on any failure an existing
OUT.pt is left untouched and no partial file remains.  OUT.pt and the report
must each be a new path or a regular file (a symlink to a regular file is
written through and kept), and must not be IN.pt or each other, also through
a symlink or a hard link.  Running OUT.pt needs the torchfuse ops library
(torch.ops.load_library(torchfuse.library_path()) in Python; link
torchfuse::ops in C++).

options:
  --freeze              freeze the model for inference first (it must have
                        been saved in eval mode); constants are folded and the
                        eval-mode batch-norm fusion applies
    --preserve-attr=NAME
                        keep this attribute or method (e.g. an
                        @torch.jit.export one; sub.name for a submodule's)
                        through freezing; repeat it or give a comma list
  --layout=auto|channels_last|keep
                        the 2-d convolutions' layout: with --freeze, auto
                        (default) stores CUDA weights channels-last where the
                        cost model says it is faster, channels_last does so
                        on any device; without --freeze the first weight is
                        converted on each call, by channels_last always, by
                        auto for CUDA weights where the cost model says so
                        and each call site's timed first calls agree; keep
                        leaves them; outputs keep the original's memory
                        format
  --device=D            load, optimize and check the model on D: cpu
                        (default), cuda or cuda:N; on CUDA, --layout=auto can
                        store the weights channels-last; OUT.pt's tensors are
                        on D (load it elsewhere with map_location)
  --passes=a,b,...      run only these passes (in the pipeline's own order);
                        )" +
      defaultPassesText() + R"(
  --check               run the original and the optimized model on the same
                        random inputs, print the max absolute and relative
                        error and the time of each, and fail (exit 5, nothing
                        saved) when the outputs differ beyond the tolerance
                        and the optimized model's error against a float64
                        run of the original is above 2x the original's + atol
    --input-shape=S     shapes of the random inputs, one per forward argument,
                        comma-separated: 1x3x224x224 or 1x16,1x32 (required
                        with --check)
    --dtype=T           dtype of the inputs: float32 (default), float16,
                        bfloat16, float64; the model's parameters must match
    --rtol=R, --atol=A  override the dtype's tolerance; an output element
                        passes when |optimized - original| <= A + R*|original|
                        default (rtol, atol): float64 (1e-7, 1e-7),
                        float32 (1e-5, 1e-5), float16 (1e-3, 1e-3),
                        bfloat16 (1.6e-2, 1e-2)
  --report=FILE.json    also write the report as JSON (atomically)
  -v, --verbose         also print the optimized graph and each step's time
  -q, --quiet           print nothing but errors
  -h, --help            print this help and exit
  --version             print the torchfuse and torch versions and exit

exit codes:
  0  success
  1  unexpected internal error (a bug; please report it)
  2  usage: a bad or missing argument, an unknown option or pass name, an
     input shape that does not parse, overflows int64, does not fit in
     memory or that the model rejects (running out of memory included), a
     missing CUDA device, OUT.pt or the report naming IN.pt or each other
  3  IN.pt cannot be loaded: missing, unreadable, not a TorchScript archive,
     truncated, or using ops that are not loaded
  4  the model cannot be optimized as asked, e.g. --freeze on a model saved
     in training mode, or the optimized model fails to load back
  5  --check failed: the outputs differ beyond the tolerance (or are NaN),
     or the optimized model fails where the original runs
  6  OUT.pt or the report cannot be written: the folder does not exist or is
     not writable, or the path is neither a new path nor a regular file (a
     folder, a device, a FIFO, a socket, a dangling symlink)
Errors print one line on stderr, starting with "optimize-model: ".
)";
}

} // namespace torchfuse::tools
