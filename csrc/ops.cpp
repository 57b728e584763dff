// The kvcanary operator library: the schema lives here, once; each backend
// registers its kernel in its own file (fold_cpu.cpp, fold_cuda.cpp,
// digest_cpu.cpp, digest_cuda.cpp).
#include <Python.h>
#include <torch/library.h>

extern "C" {
// `import torch_kvcanary._C` loads this library, whose static initializers
// register the ops; the module itself is empty.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr,
      nullptr,               nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(kvcanary, m) {
  // fold(sources, slots, read_bytes, check_bounds) -> int64 tensor shaped
  // like slots. sources[i] is a view [num_pages, page_size, *token_shape] of
  // any dtype; read_bytes[i] leading bytes of each token are folded. Slots < 0
  // give 0; slots >= the smallest capacity raise IndexError when check_bounds
  // (CPU, or eager CUDA) and give 0 otherwise.
  m.def(
      "fold(Tensor[] sources, Tensor slots, SymInt[] read_bytes, "
      "bool check_bounds=True) -> Tensor");
  // digest(views, slots, positions, groups, unit_offsets, num_groups,
  // check_bounds) -> int64 [num_groups] (SPEC "Digest"). views[j] is
  // [num_pages, page_size, units, *unit_shape] of any dtype, its unit k having
  // the global id unit_offsets[j] + k; entry i (slots, positions and groups
  // of one shape; groups None: all 0) with slots[i] >= 0 adds
  // mix3(id, positions[i], unit fold) of every unit to out[groups[i]],
  // wrapping. Slots past the smallest capacity and groups outside
  // [0, num_groups) raise IndexError when check_bounds (CPU, or eager CUDA)
  // and add nothing otherwise.
  m.def(
      "digest(Tensor[] views, Tensor slots, Tensor positions, Tensor? groups, "
      "int[] unit_offsets, SymInt num_groups, bool check_bounds=True) -> Tensor");
  // The CPU kernel's instruction-set path: "scalar", "avx2" or "avx512"; the
  // best one the CPU has unless $KVCANARY_CPU_ISA names a lesser one.
  m.def("cpu_isa() -> str");
}
