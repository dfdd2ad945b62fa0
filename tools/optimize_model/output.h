#pragma once

// Everything optimize-model writes: one-line error texts, atomic files and
// the report (text and JSON).

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "tools/optimize_model/accuracy.h"
#include "tools/optimize_model/args.h"
#include "torchfuse/optimize.h"

namespace torchfuse::tools {

// One line out of an exception's text: c10::Error without its backtrace, and
// for TorchScript interpreter errors the final "RuntimeError: ..." line rather
// than the traceback.
std::string errorLine(const std::exception& e);

// Refuses, with ToolError(kUsage), an OUT.pt or --report that names the same
// file as IN.pt or as each other: the same device and inode for existing
// paths (symlinks followed, hard links included), the same resolved folder
// and name for missing ones.  Touches no file.
void checkDistinctPaths(const Options& opts);

// The path that writing `path` replaces: `path` itself when it is missing
// or a regular file, or the regular file a symlink leads to, so that the link
// is kept.  Anything else (a folder, a device, a FIFO, a socket, a dangling
// symlink) throws ToolError(kWrite).  Writes nothing.  `what` names the
// option in messages ("OUT.pt").
std::string writeTarget(const std::string& path, const std::string& what);

// Fails early, with ToolError(kWrite), when `target` (from writeTarget)
// cannot be written: its folder is missing or is not a folder, or a file
// cannot be created beside it.
void checkWritable(const std::string& target, const std::string& what);

// A temporary file beside `target`, renamed over it by commit(); destroyed
// uncommitted, it is removed.  A reader of `target` sees the old file or the
// complete new one, never a partial one.  commit() replaces nothing but a
// regular file.  Errors throw ToolError(kWrite).
class AtomicFile {
 public:
  AtomicFile(std::string target, std::string what);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  void write(const std::string& bytes);  // the whole content, flushed to disk
  void commit();

 private:
  std::string target_;
  std::string what_;
  std::string temp_;
  int fd_ = -1;
  bool committed_ = false;
};

struct StepTimes {
  double load_s = 0;
  double optimize_s = 0;
  double save_s = 0;  // serialize and reload
  double check_s = 0;
  double total_s = 0;
};

struct RunReport {
  std::string input;
  std::string output;
  bool freeze = false;
  std::string device;               // where the model was loaded, optimized and checked
  std::vector<std::string> passes;  // the passes run
  torchfuse::FusionReport fusion;
  StepTimes times;
  std::optional<CheckResult> check;
  std::string check_device;
  std::string check_dtype;
  std::string check_shapes;
  Tolerance check_tolerance{};
};

std::string formatText(const RunReport& r);
std::string formatJson(const RunReport& r);

} // namespace torchfuse::tools
