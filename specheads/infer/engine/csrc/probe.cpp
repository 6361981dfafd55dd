// A module of a few lines that any C++ compiler builds in about a second, with no CPU-specific instructions: what
// `python -m specheads.infer.engine.kernel_cache --probe` and tests/test_kernel_cache.py build through the kernel
// cache, to try the cache (builds, locks, damaged files, no compiler) on a machine that cannot run the bf16 kernels.
#include <Python.h>

#define PROBE_CAT(a, b) a##b
#define PROBE_INIT(name) PROBE_CAT(PyInit_, name)
#define PROBE_STR2(x) #x
#define PROBE_STR(x) PROBE_STR2(x)

static PyObject* add(PyObject*, PyObject* args) {
  long a = 0, b = 0;
  if (!PyArg_ParseTuple(args, "ll", &a, &b)) return nullptr;
  return PyLong_FromLong(a + b);
}

static PyMethodDef methods[] = {{"add", add, METH_VARARGS, "add(a, b) -> a + b"}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, PROBE_STR(TORCH_EXTENSION_NAME), "the kernel cache's probe", -1,
                             methods};

PyMODINIT_FUNC PROBE_INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
