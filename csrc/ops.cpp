// The kvcanary operator library: the schema lives here, once; each backend
// registers its kernel in its own file (fold_cpu.cpp, fold_cuda.cpp).
#include <Python.h>
#include <torch/library.h>

extern "C" {
// `import torch_kvcanary._C` loads this library, whose static initializers
// register the ops; the module itself is empty.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(kvcanary, m) {
  // The fake (meta) kernels are Python functions in this module: torch imports
  // it, or says to, when an op needs one before the package was imported.
  m.set_python_module("torch_kvcanary.ops");
  // fold(sources, slots, read_bytes, check_bounds) -> int64 tensor shaped
  // like slots. sources[i] is a view [num_pages, page_size, *token_shape] of
  // any dtype; read_bytes[i] leading bytes of each token are folded. Slots < 0
  // give 0; slots >= the smallest capacity raise IndexError when check_bounds
  // (CPU, or eager CUDA) and give 0 otherwise.
  m.def(
      "fold(Tensor[] sources, Tensor slots, SymInt[] read_bytes, "
      "bool check_bounds=True) -> Tensor");
  // The CPU kernel's instruction-set path: "scalar", "avx2" or "avx512"; the
  // best one the CPU has unless $KVCANARY_CPU_ISA names a lesser one.
  m.def("cpu_isa() -> str");
}
