// Functions of libtorch's C shim looked up at run time: those of a libtorch
// library the library does not link (libtorch_cuda, absent from a CPU-only
// torch). torch loads its libraries outside the process's global symbol
// scope, so the lookup asks the loaded library by name.
#pragma once

#include <dlfcn.h>

namespace kvcanary {

// `name` in the already loaded `library` (e.g. "libtorch_cpu.so"), else
// anywhere in the global scope; null when neither has it. Never loads a
// library.
inline void* find_shim_function(const char* library, const char* name) {
  void* function = nullptr;
  if (void* handle = dlopen(library, RTLD_LAZY | RTLD_NOLOAD)) {
    function = dlsym(handle, name);
    dlclose(handle);  // RTLD_NOLOAD took a reference; torch keeps its own
  }
  return function != nullptr ? function : dlsym(RTLD_DEFAULT, name);
}

}  // namespace kvcanary
