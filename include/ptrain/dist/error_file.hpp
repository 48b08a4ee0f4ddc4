#pragma once
// torchrun's error file: why a process failed, as JSON, where the launcher asked.
//
// torchrun (and ptrun) give every rank TORCHELASTIC_ERROR_FILE, a path of its own
// (<log dir>/attempt_<k>/<local rank>/error.json). A rank that fails may write there
// what went wrong; when the job fails, the launcher copies the first failed rank's file
// to the launcher's own TORCHELASTIC_ERROR_FILE, where a scheduler (Kubeflow's
// PyTorchJob, TorchX) reads the job's root cause. The shape is that of torchrun's
// ErrorHandler.record_exception:
//
//   {"message": {"message": "<type>: <what>",
//                "extraInfo": {"py_callstack": "<text>", "timestamp": "<unix seconds>"}}}
//
// A C++ exception carries no call stack, so py_callstack holds the same "<type>: <what>"
// line. A program calls record_error from its top-level catch (examples/*.cpp do):
//
//   } catch (const std::exception& e) {
//     ptrain::dist::record_error(e);
//     std::fprintf(stderr, "prog: %s\n", e.what());
//     return 1;
//   }

#include <cxxabi.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <typeinfo>

namespace ptrain::dist {

/// torchrun's error record for `message`, stamped with the current time; `callstack`
/// empty means `message` again.
inline nlohmann::json error_record(const std::string& message, const std::string& callstack = "") {
  return {{"message",
           {{"message", message},
            {"extraInfo",
             {{"py_callstack", callstack.empty() ? message : callstack},
              {"timestamp", std::to_string(static_cast<long long>(std::time(nullptr)))}}}}}};
}

/// "<type>: <what>", the type demangled (std::runtime_error, ptrain::CommError), as
/// torchrun writes "<ExceptionClass>: <message>".
inline std::string describe_exception(const std::exception& e) {
  const char* raw = typeid(e).name();
  int status = -1;
  std::unique_ptr<char, void (*)(void*)> name(abi::__cxa_demangle(raw, nullptr, nullptr, &status), std::free);
  return std::string(status == 0 && name ? name.get() : raw) + ": " + e.what();
}

/// Writes `record` to `path` whole: a reader sees the old file or the new one, never
/// half of one. False (and a warning on stderr) when it cannot be written.
inline bool write_error_file(const std::string& path, const nlohmann::json& record) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << record.dump() << '\n';
    f.close();
    if (!f) {
      std::remove(tmp.c_str());
      std::fprintf(stderr, "[ptrain.dist.error_file] cannot write the error file %s (TORCHELASTIC_ERROR_FILE): %s\n",
                   path.c_str(), std::strerror(errno));
      return false;
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::fprintf(stderr, "[ptrain.dist.error_file] cannot write the error file %s (TORCHELASTIC_ERROR_FILE): %s\n",
                 path.c_str(), std::strerror(errno));
    std::remove(tmp.c_str());
    return false;
  }
  return true;
}

/// The path in TORCHELASTIC_ERROR_FILE; empty when the launcher set none (mpirun, srun,
/// no launcher).
inline std::string error_file_path() {
  const char* p = std::getenv("TORCHELASTIC_ERROR_FILE");
  return p ? p : "";
}

/// Records `message` as this process's failure in TORCHELASTIC_ERROR_FILE. False when the
/// variable is unset (nothing to do) or the file cannot be written.
inline bool record_error(const std::string& message) {
  const std::string path = error_file_path();
  return !path.empty() && write_error_file(path, error_record(message));
}

/// Records the exception `e` ("<type>: <what>") as this process's failure.
inline bool record_error(const std::exception& e) { return record_error(describe_exception(e)); }

}  // namespace ptrain::dist
