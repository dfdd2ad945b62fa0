#include "tools/optimize_model/output.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <sstream>

namespace torchfuse::tools {
namespace {

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) {
    return "";
  }
  return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
}

std::string parentDir(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) {
    return ".";
  }
  return slash == 0 ? "/" : path.substr(0, slash);
}

std::string baseName(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

std::string errnoText(int err) {
  return std::strerror(err);
}

const char* kindName(mode_t mode) {
  if (S_ISDIR(mode)) {
    return "a folder";
  }
  if (S_ISCHR(mode)) {
    return "a character device";
  }
  if (S_ISBLK(mode)) {
    return "a block device";
  }
  if (S_ISFIFO(mode)) {
    return "a FIFO";
  }
  if (S_ISSOCK(mode)) {
    return "a socket";
  }
  return "not a regular file";
}

[[noreturn]] void notAFile(const std::string& what, const std::string& path, const std::string& got) {
  throw ToolError(kWrite, "cannot write " + what + " '" + path +
                              "': expected a regular file or a new path, got " + got);
}

// Where `path` points: an existing file by device and inode (symlinks
// followed, so hard links and links compare equal), a missing one by its
// resolved folder and name.
struct FileIdentity {
  bool exists = false;
  dev_t dev = 0;
  ino_t ino = 0;
  std::string where;

  bool operator==(const FileIdentity& o) const {
    return exists == o.exists && (exists ? dev == o.dev && ino == o.ino : where == o.where);
  }
};

FileIdentity identify(const std::string& path) {
  FileIdentity id;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    id.exists = true;
    id.dev = st.st_dev;
    id.ino = st.st_ino;
    return id;
  }
  char resolved[PATH_MAX];
  if (::realpath(parentDir(path).c_str(), resolved) != nullptr) {
    id.where = std::string(resolved) + "/" + baseName(path);
  } else {
    id.where = path;  // the folder is missing: checkWritable says so
  }
  return id;
}

// NB: an interrupted run must not leave its temporary files behind; the
// handler may only call async-signal-safe functions, hence fixed buffers.
constexpr int kMaxTemps = 4;
char g_temps[kMaxTemps][4096];
volatile sig_atomic_t g_temp_used[kMaxTemps];

void onSignal(int sig) {
  for (int i = 0; i < kMaxTemps; ++i) {
    if (g_temp_used[i]) {
      ::unlink(g_temps[i]);
    }
  }
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

int registerTemp(const std::string& path) {
  static bool installed = false;
  if (!installed) {
    std::signal(SIGINT, onSignal);
    std::signal(SIGTERM, onSignal);
    std::signal(SIGHUP, onSignal);
    installed = true;
  }
  for (int i = 0; i < kMaxTemps; ++i) {
    if (!g_temp_used[i] && path.size() < sizeof(g_temps[i])) {
      std::memcpy(g_temps[i], path.c_str(), path.size() + 1);
      g_temp_used[i] = 1;
      return i;
    }
  }
  return -1;
}

void unregisterTemp(const std::string& path) {
  for (int i = 0; i < kMaxTemps; ++i) {
    if (g_temp_used[i] && path == g_temps[i]) {
      g_temp_used[i] = 0;
    }
  }
}

std::string jsonString(const std::string& s) {
  std::ostringstream o;
  o << '"';
  for (const unsigned char c : s) {
    switch (c) {
      case '"':
        o << "\\\"";
        break;
      case '\\':
        o << "\\\\";
        break;
      case '\n':
        o << "\\n";
        break;
      case '\t':
        o << "\\t";
        break;
      case '\r':
        o << "\\r";
        break;
      default:
        if (c < 0x20) {
          o << "\\u" << std::hex << std::setw(4) << std::setfill('0') << int(c) << std::dec;
        } else {
          o << c;
        }
    }
  }
  o << '"';
  return o.str();
}

std::string jsonNumber(double v) {
  if (!std::isfinite(v)) {
    return "null";  // JSON has no NaN or Infinity
  }
  std::ostringstream o;
  o << std::setprecision(9) << v;
  return o.str();
}

std::string seconds(double s) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(s < 10 ? 3 : 1) << s << " s";
  return o.str();
}

} // namespace

std::string errorLine(const std::exception& e) {
  std::string text;
  if (const auto* c10e = dynamic_cast<const c10::Error*>(&e)) {
    text = c10e->what_without_backtrace();
  } else {
    text = e.what();
  }
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    line = trim(line);
    if (!line.empty() && line.rfind("Exception raised from", 0) != 0) {
      lines.push_back(line);
    }
  }
  if (lines.empty()) {
    return "unknown error";
  }
  const bool interpreter =
      text.find("The following operation failed in the TorchScript interpreter") != std::string::npos ||
      text.find("Traceback of TorchScript") != std::string::npos;
  auto line = interpreter ? lines.back() : lines.front();
  constexpr size_t kMax = 400;
  if (line.size() > kMax) {
    line = line.substr(0, kMax) + "...";
  }
  return line;
}

void checkDistinctPaths(const Options& opts) {
  const auto in = identify(opts.input);
  const auto out = identify(opts.output);
  const auto same = [](const std::string& what, const std::string& path, const std::string& other,
                       const std::string& other_path, const std::string& loss) {
    throw ToolError(kUsage, what + " '" + path + "' is the same file as " + other + " '" +
                                other_path + "'; expected a separate file (" + loss + ")");
  };
  if (out == in) {
    same("OUT.pt", opts.output, "IN.pt", opts.input, "the input model would be replaced");
  }
  if (opts.report_path.empty()) {
    return;
  }
  const auto report = identify(opts.report_path);
  if (report == in) {
    same("--report", opts.report_path, "IN.pt", opts.input, "the input model would be replaced");
  }
  if (report == out) {
    same("--report", opts.report_path, "OUT.pt", opts.output,
         "the report would replace the optimized model");
  }
}

std::string writeTarget(const std::string& path, const std::string& what) {
  // NB: the file is replaced by rename(), which replaces whatever the name
  // holds: a device node, a FIFO, a symlink.  Only a regular file may go; a
  // symlink is written through (as a shell's > or cp do) and is kept.  A
  // failing lstat (missing path, missing folder) is left to checkWritable.
  std::string target = path;
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    if (!S_ISLNK(st.st_mode)) {
      notAFile(what, path, kindName(st.st_mode));
    }
    char link[PATH_MAX];
    const auto n = ::readlink(path.c_str(), link, sizeof(link) - 1);
    const std::string to = n < 0 ? std::string("?") : std::string(link, static_cast<size_t>(n));
    if (::stat(path.c_str(), &st) != 0) {
      const int err = errno;
      notAFile(what, path, err == ENOENT
                   ? "a symlink to a missing file ('" + to + "')"
                   : "a symlink that cannot be followed ('" + to + "': " + errnoText(err) + ")");
    }
    if (!S_ISREG(st.st_mode)) {
      notAFile(what, path, std::string("a symlink to ") + kindName(st.st_mode) + " ('" + to + "')");
    }
    char resolved[PATH_MAX];
    if (::realpath(path.c_str(), resolved) == nullptr) {
      const int err = errno;
      throw ToolError(kWrite, "cannot write " + what + " '" + path + "': " + errnoText(err));
    }
    target = resolved;
  }
  return target;
}

void checkWritable(const std::string& target, const std::string& what) {
  const auto dir = parentDir(target);
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    throw ToolError(kWrite, "cannot write " + what + " '" + target + "': folder '" + dir +
                                "' does not exist");
  }
  if (!S_ISDIR(st.st_mode)) {
    throw ToolError(kWrite, "cannot write " + what + " '" + target + "': '" + dir +
                                "' is not a folder");
  }
  // NB: access(W_OK) says yes to root on a read-only folder; creating the
  // temporary file the real write will use is the one reliable test.
  AtomicFile probe(target, what);
}

AtomicFile::AtomicFile(std::string target, std::string what)
    : target_(std::move(target)), what_(std::move(what)) {
  const auto slash = target_.find_last_of('/');
  const auto base = slash == std::string::npos ? target_ : target_.substr(slash + 1);
  const auto dir = parentDir(target_);
  std::string tmpl = (dir == "/" ? "" : dir) + "/." + base + ".tmp-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  fd_ = ::mkstemp(buf.data());
  if (fd_ < 0) {
    const int err = errno;
    throw ToolError(kWrite, "cannot write " + what_ + " '" + target_ + "': folder '" + dir +
                                "' is not writable (" + errnoText(err) + ")");
  }
  temp_ = buf.data();
  registerTemp(temp_);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {
    ::close(fd_);
  }
  if (!committed_ && !temp_.empty()) {
    ::unlink(temp_.c_str());
  }
  unregisterTemp(temp_);
}

void AtomicFile::write(const std::string& bytes) {
  const auto fail = [&](int err) {
    throw ToolError(kWrite, "cannot write " + what_ + " '" + target_ + "': " + errnoText(err));
  };
  size_t done = 0;
  while (done < bytes.size()) {
    const auto n = ::write(fd_, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      fail(errno);
    }
    done += static_cast<size_t>(n);
  }
  // mkstemp creates the file 0600; give it the mode a plain open() would.
  const mode_t mask = ::umask(0);
  ::umask(mask);
  if (::fchmod(fd_, 0666 & ~mask) != 0 || ::fsync(fd_) != 0) {
    fail(errno);
  }
  if (::close(fd_) != 0) {
    fd_ = -1;
    fail(errno);
  }
  fd_ = -1;
}

void AtomicFile::commit() {
  // checkWritable refused anything but a regular file long before; look again
  // just before replacing, in case the path changed while the model was made.
  struct stat st {};
  if (::lstat(target_.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    notAFile(what_, target_, S_ISLNK(st.st_mode) ? "a symlink" : kindName(st.st_mode));
  }
  if (::rename(temp_.c_str(), target_.c_str()) != 0) {
    const int err = errno;
    throw ToolError(kWrite, "cannot write " + what_ + " '" + target_ + "': " + errnoText(err));
  }
  committed_ = true;
}

std::string formatText(const RunReport& r) {
  std::ostringstream o;
  o << "optimize-model: " << r.input << " -> " << r.output << " (on " << r.device
    << (r.freeze ? ", frozen)" : ")") << "\n";
  o << "  fused chains:\n";
  for (const auto& name : torchfuse::passNames()) {
    const auto found = r.fusion.fused.find(name);
    const int64_t count = found == r.fusion.fused.end() ? 0 : found->second;
    const bool ran = r.passes.empty() ||
        std::find(r.passes.begin(), r.passes.end(), name) != r.passes.end();
    o << "    " << std::left << std::setw(26) << name << std::right;
    if (ran) {
      o << count << "\n";
    } else {
      o << "- (not run)\n";
    }
  }
  o << "  nodes: " << r.fusion.nodes_before << " -> " << r.fusion.nodes_after << "\n";
  if (r.fusion.zero_dropouts_removed > 0) {
    o << "  dropouts removed as their input: " << r.fusion.zero_dropouts_removed << "\n";
  }
  if (r.fusion.attention_masks_dropped > 0) {
    o << "  attention masks proven true everywhere, dropped: " << r.fusion.attention_masks_dropped
      << "\n";
  }
  if (r.freeze) {
    o << "  layout: " << r.fusion.channels_last_weights
      << " convolution weights stored channels-last\n";
  } else if (r.fusion.channels_last_weights > 0) {
    o << "  layout: " << r.fusion.channels_last_weights
      << " convolutions run channels-last where the input and weights are NCHW\n";
  }
  if (r.check) {
    const auto& c = *r.check;
    o << "  check on " << r.check_device << ", " << r.check_dtype << " inputs " << r.check_shapes
      << ": " << (c.passed ? "passed" : "FAILED") << "\n";
    o << "    max abs error " << std::setprecision(3) << c.max_abs_error << ", max rel error "
      << c.max_rel_error << " (tolerance rtol " << r.check_tolerance.rtol << ", atol "
      << r.check_tolerance.atol << ")\n";
    if (c.float64_judged) {
      o << "    against a float64 run of the original: max abs error "
        << c.optimized_error_vs_float64 << " (the original's " << c.original_error_vs_float64
        << "; at most 2x + atol passes)\n";
    }
    o << std::fixed << std::setprecision(3);
    o << "    original  " << std::setw(10) << c.original_ms << " ms/run\n";
    o << "    optimized " << std::setw(10) << c.optimized_ms << " ms/run  (median of " << c.runs
      << ")\n";
    o.unsetf(std::ios::floatfield);
  }
  o << "  time: " << seconds(r.times.total_s) << " (load " << seconds(r.times.load_s)
    << ", optimize " << seconds(r.times.optimize_s) << ", save " << seconds(r.times.save_s);
  if (r.check) {
    o << ", check " << seconds(r.times.check_s);
  }
  o << ")\n";
  return o.str();
}

std::string formatJson(const RunReport& r) {
  std::ostringstream o;
  o << "{\n";
  o << "  \"input\": " << jsonString(r.input) << ",\n";
  o << "  \"output\": " << jsonString(r.output) << ",\n";
  o << "  \"device\": " << jsonString(r.device) << ",\n";
  o << "  \"freeze\": " << (r.freeze ? "true" : "false") << ",\n";
  o << "  \"passes\": [";
  const auto& passes = r.passes.empty() ? torchfuse::passNames() : r.passes;
  for (size_t i = 0; i < passes.size(); ++i) {
    o << (i ? ", " : "") << jsonString(passes[i]);
  }
  o << "],\n";
  o << "  \"fused\": {\n";
  const auto& names = torchfuse::passNames();
  for (size_t i = 0; i < names.size(); ++i) {
    const auto found = r.fusion.fused.find(names[i]);
    o << "    " << jsonString(names[i]) << ": "
      << (found == r.fusion.fused.end() ? 0 : found->second)
      << (i + 1 < names.size() ? ",\n" : "\n");
  }
  o << "  },\n";
  o << "  \"nodes_before\": " << r.fusion.nodes_before << ",\n";
  o << "  \"nodes_after\": " << r.fusion.nodes_after << ",\n";
  o << "  \"channels_last_weights\": " << r.fusion.channels_last_weights << ",\n";
  o << "  \"attention_masks_dropped\": " << r.fusion.attention_masks_dropped << ",\n";
  o << "  \"zero_dropouts_removed\": " << r.fusion.zero_dropouts_removed << ",\n";
  o << "  \"time_s\": {\"load\": " << jsonNumber(r.times.load_s)
    << ", \"optimize\": " << jsonNumber(r.times.optimize_s)
    << ", \"save\": " << jsonNumber(r.times.save_s)
    << ", \"check\": " << jsonNumber(r.times.check_s)
    << ", \"total\": " << jsonNumber(r.times.total_s) << "},\n";
  if (!r.check) {
    o << "  \"check\": null\n";
  } else {
    const auto& c = *r.check;
    o << "  \"check\": {\n"
      << "    \"passed\": " << (c.passed ? "true" : "false") << ",\n"
      << "    \"device\": " << jsonString(r.check_device) << ",\n"
      << "    \"dtype\": " << jsonString(r.check_dtype) << ",\n"
      << "    \"input_shapes\": " << jsonString(r.check_shapes) << ",\n"
      << "    \"rtol\": " << jsonNumber(r.check_tolerance.rtol) << ",\n"
      << "    \"atol\": " << jsonNumber(r.check_tolerance.atol) << ",\n"
      << "    \"max_abs_error\": " << jsonNumber(c.max_abs_error) << ",\n"
      << "    \"max_rel_error\": " << jsonNumber(c.max_rel_error) << ",\n"
      << "    \"elements\": " << c.elements << ",\n"
      << "    \"mismatched\": " << c.mismatched << ",\n"
      << "    \"float64\": "
      << (c.float64_judged ? "{\"original_error\": " + jsonNumber(c.original_error_vs_float64) +
                  ", \"optimized_error\": " + jsonNumber(c.optimized_error_vs_float64) + "}"
                           : std::string("null"))
      << ",\n"
      << "    \"runs\": " << c.runs << ",\n"
      << "    \"original_ms\": " << jsonNumber(c.original_ms) << ",\n"
      << "    \"optimized_ms\": " << jsonNumber(c.optimized_ms) << "\n"
      << "  }\n";
  }
  o << "}\n";
  return o.str();
}

} // namespace torchfuse::tools
