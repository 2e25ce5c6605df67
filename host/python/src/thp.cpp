// The one place a Python `torch.Tensor` meets the `torch::Tensor` that tch
// holds. Both directions share the TensorImpl: no copy, and the autograd
// graph behind the tensor is the very one Python sees.
#include <torch/csrc/autograd/python_variable.h>

extern "C" {

// A new heap `at::Tensor` (tch's `C_tensor`) sharing `obj`'s tensor, or
// null if `obj` is not a `torch.Tensor`. Needs the GIL.
void* wasmrpc_thp_unpack(PyObject* obj) {
  if (!THPVariable_Check(obj)) {
    return nullptr;
  }
  return new at::Tensor(THPVariable_Unpack(obj));
}

// A new reference to the Python tensor of `t` (the same Python object when
// Python already has one), or null with a Python error set. Needs the GIL.
PyObject* wasmrpc_thp_wrap(void* t) {
  try {
    return THPVariable_Wrap(*static_cast<at::Tensor*>(t));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

}
