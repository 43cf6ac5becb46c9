// The Autograd kernel of moe::grouped_mm in C++ (module moe_ops._autograd), for every device.
//
// moe_ops/_op.py defines the op and registers this kernel when the module loads, otherwise its
// Python Autograd kernel; both compute the same backward (moe_ops/_op.py documents the
// formulas, and tests/test_autograd.py runs every test against each of them). The C++ one
// exists for host time: measured here (CPU tensors, 1 thread, a 2 x 8 x 16 x 8 problem, best of
// 7 x 2000 calls), the Python kernel cost 6.5 us of a 23 us call without gradients and made a
// call with gradients 43 us, forward and backward 105 us.
//
// Beyond the Python kernel, this one serves torch.func transforms (grad, vjp, jvp, jacrev,
// jacfwd, hessian, vmap of those): there it builds its node by hand (GroupedMMBackward below),
// since functorch rejects C++ Functions and an autograd.Function cannot take functorch's route
// from inside the dispatcher. Both kernels set the forward-mode tangent of the output.
//
// Loading the module only defines PyInit: the kernel is registered by register_kernel(), after
// PyInit has checked that the torch that is running is the one this file was compiled against
// (an extension of another torch version can load and then corrupt memory).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <Python.h>

#include <array>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>

#include "../common/torch_version_guard.h"

namespace moe_autograd {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using OpSig = Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, const std::optional<Tensor>&,
                     std::optional<at::ScalarType>);

const c10::TypedOperatorHandle<OpSig>& grouped_mm_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("moe::grouped_mm", "").typed<OpSig>();
  return op;
}

// The layouts, by the ranks of (mat_a, mat_b) (moe_ops/_contract.py).
enum Layout : int64_t { k2d3d = 0, k2d2d = 1, k3d3d = 2, k3d2d = 3 };

Layout layout_of(const Tensor& a, const Tensor& b) {
  if (a.dim() == 2) return b.dim() == 3 ? k2d3d : k2d2d;
  return b.dim() == 3 ? k3d3d : k3d2d;
}

// The op below Autograd: the kernel `ks` reaches without the autograd keys.
Tensor below_autograd(c10::DispatchKeySet ks, const Tensor& a, const Tensor& b, const std::optional<Tensor>& offs,
                      const std::optional<Tensor>& bias, std::optional<at::ScalarType> out_dtype) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return grouped_mm_op().redispatch(ks & c10::after_autograd_keyset, a, b, offs, bias, out_dtype);
}

// What the backward needs besides the incoming gradient (mat_a / mat_b may be undefined when
// the other's gradient is not wanted).
struct Saved {
  Layout layout;
  at::ScalarType dtype;
  std::optional<at::ScalarType> bias_dtype;
};

// The gradients of mat_a, mat_b and bias (undefined where not asked for): moe_ops/_op.py
// documents the formulas. With out_dtype=float32 the incoming gradient is fp32; the gradients
// of bf16/fp16 inputs are computed from it rounded to the input dtype (fp32 accumulation inside
// the op); the bias gradient is a plain sum and keeps the incoming precision.
std::array<Tensor, 3> gradients(const Saved& s, const Tensor& a, const Tensor& b, const std::optional<Tensor>& offs,
                                const Tensor& grad_out, bool need_a, bool need_b, bool need_bias) {
  const Tensor grad = grad_out.to(s.dtype);
  const auto& op = grouped_mm_op();
  const std::optional<Tensor> none;
  Tensor d_a, d_b, d_bias;
  switch (s.layout) {
    case k2d3d:  // da[rows_g] = grad[rows_g] @ b[g]^T; db[g] = a[rows_g]^T @ grad[rows_g] (2d2d over M)
      if (need_a) d_a = op.call(grad, b.transpose(1, 2), offs, none, std::nullopt);
      if (need_b) d_b = op.call(a.t(), grad, offs, none, std::nullopt);
      if (need_bias) {  // dbias[g] = the sum of grad_out over group g's rows, as a [1, M] @ [M, N]
        const Tensor ones = at::ones_symint({1, grad_out.sym_size(0)}, grad_out.options());
        d_bias = op.call(ones, grad_out, offs, none, std::nullopt).squeeze(1);
      }
      break;
    case k3d3d:
      if (need_a) d_a = op.call(grad, b.transpose(1, 2), none, none, std::nullopt);
      if (need_b) d_b = op.call(a.transpose(1, 2), grad, none, none, std::nullopt);
      if (need_bias) d_bias = grad_out.sum(1, false, s.dtype == at::kDouble ? at::kDouble : at::kFloat);
      break;
    case k2d2d:  // da[:, k_g] = grad[g] @ b[k_g]^T (3d2d over K); db[k_g] = a[:, k_g]^T @ grad[g] (2d3d over K)
      if (need_a) d_a = op.call(grad, b.t(), offs, none, std::nullopt);
      if (need_b) d_b = op.call(a.t(), grad, offs, none, std::nullopt);
      break;
    case k3d2d:  // da[g] = grad[:, n_g] @ b[:, n_g]^T (2d2d over N); db[:, n_g] = a[g]^T @ grad[:, n_g] (3d2d)
      if (need_a) d_a = op.call(grad, b.t(), offs, none, std::nullopt);
      if (need_b) d_b = op.call(a.transpose(1, 2), grad, offs, none, std::nullopt);
      break;
  }
  if (d_bias.defined()) d_bias = d_bias.to(*s.bias_dtype);
  return {d_a, d_b, d_bias};
}

Saved saved_of(const Tensor& a, const Tensor& b, const std::optional<Tensor>& bias) {
  const bool has_bias = bias.has_value() && bias->defined();
  return {layout_of(a, b), a.scalar_type(), has_bias ? std::optional<at::ScalarType>(bias->scalar_type()) : std::nullopt};
}

// The usual node: a torch::autograd::Function, which compiled autograd can trace.
struct GroupedMM : public torch::autograd::Function<GroupedMM> {
  // Argument order as the op's, then the key set: the gradient edges are the tensor arguments
  // present, in order (mat_a 0, mat_b 1, offs 2 if given, then bias).
  static Tensor forward(AutogradContext* ctx, const Tensor& a, const Tensor& b, const std::optional<Tensor>& offs,
                        const std::optional<Tensor>& bias, std::optional<at::ScalarType> out_dtype,
                        c10::DispatchKeySet ks) {
    Tensor out = below_autograd(ks, a, b, offs, bias, out_dtype);
    const bool has_offs = offs.has_value() && offs->defined();
    const Saved s = saved_of(a, b, bias);
    // Only what the gradients can read: d mat_a needs mat_b, d mat_b needs mat_a. Asked of the
    // inputs, not of ctx->needs_input_grad: that one answers for the graph task running now, and
    // when this forward runs inside a backward (create_graph) it said false for every input.
    ctx->save_for_backward({b.requires_grad() ? a : Tensor(), a.requires_grad() ? b : Tensor(),
                            has_offs ? *offs : Tensor()});
    ctx->saved_data["layout"] = static_cast<int64_t>(s.layout);
    ctx->saved_data["dtype"] = s.dtype;
    ctx->saved_data["bias_edge"] = s.bias_dtype ? int64_t{has_offs ? 3 : 2} : int64_t{-1};
    if (s.bias_dtype) ctx->saved_data["bias_dtype"] = *s.bias_dtype;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const std::optional<Tensor> offs = saved[2].defined() ? std::optional<Tensor>(saved[2]) : std::nullopt;
    const int64_t bias_edge = ctx->saved_data["bias_edge"].toInt();
    const Saved s{static_cast<Layout>(ctx->saved_data["layout"].toInt()), ctx->saved_data["dtype"].toScalarType(),
                  bias_edge >= 0 ? std::optional<at::ScalarType>(ctx->saved_data["bias_dtype"].toScalarType())
                                 : std::nullopt};
    auto [d_a, d_b, d_bias] = gradients(s, saved[0], saved[1], offs, grads[0], ctx->needs_input_grad(0),
                                        ctx->needs_input_grad(1), bias_edge >= 0 && ctx->needs_input_grad(bias_edge));
    // One entry per forward argument: mat_a, mat_b, offs, bias, out_dtype, the key set.
    return {d_a, d_b, Tensor(), d_bias, Tensor(), Tensor()};
  }
};

// The same node built by hand, as ATen's generated Autograd kernels build theirs, for the case
// a torch::autograd::Function refuses: torch.func transforms (functorch rejects C++ Functions,
// because it cannot see into their forward; this forward is only a redispatch below Autograd,
// like ATen's). It has no compiled_args, so compiled autograd cannot trace it: inputs with
// forward-mode tangents get the Function's node instead (see autograd_kernel).
// Edges: mat_a, mat_b, then bias if given.
struct GroupedMMBackward : public torch::autograd::Node {
  std::string name() const override { return "GroupedMmBackward"; }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool need_bias = has_bias && task_should_compute_output(2);
    variable_list out(has_bias ? 3 : 2);
    if (!grads[0].defined()) return out;
    const Tensor off = offs_.unpack();
    const std::optional<Tensor> offs = off.defined() ? std::optional<Tensor>(off) : std::nullopt;
    auto [d_a, d_b, d_bias] = gradients(saved, a_.unpack(), b_.unpack(), offs, grads[0], task_should_compute_output(0),
                                        task_should_compute_output(1), need_bias);
    out[0] = d_a;
    out[1] = d_b;
    if (has_bias) out[2] = d_bias;
    return out;
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    a_.reset_data();
    b_.reset_data();
    offs_.reset_data();
  }

  Saved saved{};
  bool has_bias = false;
  torch::autograd::SavedVariable a_, b_, offs_;
};

// A new node in the pointer type this torch's autograd edges hold: std::shared_ptr<Node> up to
// torch 2.11 (checked against its headers), c10::intrusive_ptr<Node> in 2.13. Decided from
// Edge::function's type, so the module builds against either (the GPU machines lent to this
// project carry torch 2.11).
template <class T>
auto make_node() {
  using NodePtr = decltype(torch::autograd::Edge::function);
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<T>();
  } else {
    return c10::make_intrusive<T>();
  }
}

Tensor with_node(c10::DispatchKeySet ks, const Tensor& a, const Tensor& b, const std::optional<Tensor>& offs,
                 const std::optional<Tensor>& bias, std::optional<at::ScalarType> out_dtype) {
  const bool has_bias = bias.has_value() && bias->defined();
  auto node = make_node<GroupedMMBackward>();
  node->set_next_edges(has_bias ? torch::autograd::collect_next_edges(a, b, *bias)
                                : torch::autograd::collect_next_edges(a, b));
  node->saved = saved_of(a, b, bias);
  node->has_bias = has_bias;
  if (b.requires_grad()) node->a_ = torch::autograd::SavedVariable(a, false);
  if (a.requires_grad()) node->b_ = torch::autograd::SavedVariable(b, false);
  if (offs.has_value() && offs->defined()) node->offs_ = torch::autograd::SavedVariable(*offs, false);
  Tensor out = below_autograd(ks, a, b, offs, bias, out_dtype);
  torch::autograd::set_history(out, node);
  return out;
}

// Whether a torch.func transform is active: functorch keeps its two dynamic-layer keys in the
// thread's included set while its layer stack is not empty (the test torch._C.
// _are_functorch_transforms_active makes; ATen/functorch/DynamicLayer.h is not usable from an
// extension, it includes a header torch does not ship).
bool functorch_active() {
  const auto included = c10::impl::tls_local_dispatch_key_set().included_;
  return included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
         included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode);
}

bool has_tangent(const Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); }

// The output's forward-mode tangent: the op is bilinear in (mat_a, mat_b) and adds bias per
// group, so it is op(t_a, b, bias=t_bias) + op(a, t_b), the bias tangent landing on exactly the
// rows the bias does; bf16/fp16 sum the two terms in fp32 and round once. Computed on the
// primals without their tangents (as ATen's kernels do), through the op, so the tangent itself
// is differentiable.
Tensor tangent_of(const Tensor& a, const Tensor& b, const std::optional<Tensor>& offs, const std::optional<Tensor>& bias,
                  at::ScalarType out_type) {
  const auto& op = grouped_mm_op();
  const Tensor a_p = a._fw_primal(0), b_p = b._fw_primal(0);
  const Tensor& t_a_raw = a._fw_grad(0);
  const Tensor& t_b = b._fw_grad(0);
  const Tensor t_bias_raw = bias.has_value() && bias->defined() ? bias->_fw_grad(0) : Tensor();
  const std::optional<Tensor> t_bias = t_bias_raw.defined() ? std::optional<Tensor>(t_bias_raw) : std::nullopt;
  const Tensor t_a = t_a_raw.defined() || !t_bias ? t_a_raw : at::zeros_like(a_p);
  const bool low = a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf;
  const std::optional<at::ScalarType> acc = low ? std::optional<at::ScalarType>(at::kFloat) : std::nullopt;
  Tensor tangent;
  if (t_a.defined()) tangent = op.call(t_a, b_p, offs, t_bias, acc);
  if (t_b.defined()) {
    const Tensor term = op.call(a_p, t_b, offs, std::nullopt, acc);
    tangent = tangent.defined() ? tangent + term : term;
  }
  return tangent.to(out_type);
}

Tensor autograd_kernel(c10::DispatchKeySet ks, const Tensor& a, const Tensor& b, const std::optional<Tensor>& offs,
                       const std::optional<Tensor>& bias, std::optional<at::ScalarType> out_dtype) {
  const bool has_bias = bias.has_value() && bias->defined();
  const bool tangents = has_tangent(a) || has_tangent(b) || (has_bias && has_tangent(*bias));
  Tensor out;
  if (!(at::GradMode::is_enabled() && (a.requires_grad() || b.requires_grad() || (has_bias && bias->requires_grad())))) {
    out = below_autograd(ks, a, b, offs, bias, out_dtype);
  } else if (functorch_active()) {
    out = with_node(ks, a, b, offs, bias, out_dtype);
  } else if (tangents) {
    // The Function's node, so compiled autograd can trace it (the hand-built one has no
    // compiled_args), made with forward-mode AD off: a C++ Function refuses inputs with
    // tangents (it has no jvp). The tangent is set below; the saved inputs keep theirs.
    c10::AutoFwGradMode no_tangents(false);
    out = GroupedMM::apply(a, b, offs, bias, out_dtype, ks);
  } else {
    return GroupedMM::apply(a, b, offs, bias, out_dtype, ks);
  }
  if (tangents) {
    Tensor tangent = tangent_of(a, b, offs, bias, out.scalar_type());
    // A tangent batched by jacfwd's vmap comes out of the batching rule with its batch dimension
    // inside (e.g. [M, B, N]), so its per-sample strides differ from the contiguous output's and
    // _set_fw_grad copies it through _new_zeros_with_same_feature_meta, whose meta kernel fails
    // on symbolic sizes (jacfwd under torch.compile(dynamic=True) raised). contiguous() moves the
    // batch to the front (functorch's clone rule), which is the copy _set_fw_grad made anyway.
    if (out.is_contiguous()) tangent = tangent.contiguous();
    out._set_fw_grad(tangent, /*level=*/0, /*is_inplace_op=*/false);
  }
  return out;
}

// The registration; deleting it removes the kernel from the dispatch table. Never deleted at
// exit: the dispatcher may be gone by then.
torch::Library* registration = nullptr;

PyObject* register_kernel(PyObject*, PyObject*) {
  try {
    if (!registration) {
      grouped_mm_op();  // the schema lookup: fails here if the op is not defined
      auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "moe", c10::DispatchKey::Autograd,
                                                  __FILE__, __LINE__);
      lib->impl("grouped_mm", TORCH_FN(autograd_kernel));
      registration = lib.release();
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* deregister_kernel(PyObject*, PyObject*) {
  delete registration;
  registration = nullptr;
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"register_kernel", register_kernel, METH_NOARGS,
     "Registers the C++ Autograd kernel of moe::grouped_mm (the op must be defined; idempotent)."},
    {"deregister_kernel", deregister_kernel, METH_NOARGS, "Removes it from the dispatch table again."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace
}  // namespace moe_autograd

extern "C" PyObject* PyInit__autograd(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_autograd",
                                   "The C++ Autograd kernel of moe::grouped_mm", -1, moe_autograd::methods};
  if (!moe_ops_guard::same_torch("moe_ops._autograd")) return nullptr;
  return PyModule_Create(&def);
}
