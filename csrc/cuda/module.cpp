// `import torch_kvcanary._C_cuda` loads the CUDA kernels' library, whose static
// initializers register the kernels with the ops that torch_kvcanary._C
// defines (torch_kvcanary/ops.py loads it after that one, under a CUDA build of
// torch only); the module itself is empty.
#include <Python.h>

PyMODINIT_FUNC PyInit__C_cuda(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C_cuda", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
