// The check each moe_ops extension module makes in PyInit before it registers anything: the torch
// that is running must be the one the module was compiled against (setup.py defines
// MOE_OPS_TORCH_VERSION as that torch.__version__). An extension built against another torch can
// load (dlopen resolves its symbols) and then corrupt memory; under CI's torch 2.9.1 ours failed
// with an undefined symbol, but nothing guarantees that for every pair of versions.
#pragma once

#include <Python.h>

#include <cstring>

#ifndef MOE_OPS_TORCH_VERSION
#error "setup.py defines MOE_OPS_TORCH_VERSION as the torch.__version__ this module is built against"
#endif
// Unquoted on the command line (quotes do not survive every build tool's shell), made a string here.
#define MOE_OPS_STR2(x) #x
#define MOE_OPS_STR(x) MOE_OPS_STR2(x)

namespace moe_ops_guard {

// The same version as bytes in the module file, behind a marker, for the loader to read when the
// module cannot even be loaded (an extension built against another torch usually fails dlopen on
// an undefined symbol before PyInit runs; moe_ops/_native.py then names both versions).
[[gnu::used]] static const char kBuiltAgainst[] = "moe_ops: built against torch " MOE_OPS_STR(MOE_OPS_TORCH_VERSION);

// True if torch.version.__version__ is the build's; otherwise false with an ImportError set
// (or the error of importing torch.version).
inline bool same_torch(const char* module_name) {
  PyObject* version = PyImport_ImportModule("torch.version");
  if (version == nullptr) return false;
  PyObject* running = PyObject_GetAttrString(version, "__version__");
  Py_DECREF(version);
  if (running == nullptr) return false;
  const char* s = PyUnicode_AsUTF8(running);
  const bool same = s != nullptr && std::strcmp(s, MOE_OPS_STR(MOE_OPS_TORCH_VERSION)) == 0;
  if (s != nullptr && !same) {
    PyErr_Format(PyExc_ImportError, "%s was built against torch %s, this is torch %s", module_name,
                 MOE_OPS_STR(MOE_OPS_TORCH_VERSION), s);
  }
  Py_DECREF(running);
  return same;
}

}  // namespace moe_ops_guard
