// The eager fast path in C++: compiled CuTe kernels (TVM-FFI function objects that the
// Python layer compiles and hands over) launched without Python, and autograd nodes whose
// backward runs in the autograd engine's thread without the GIL. A Python autograd node
// and its launch code cost more host time than torch's whole training step of a small
// norm (benchmarks/NOTES.md, "Host time"); every decision (configs, grids, kernels)
// stays in Python, which registers a plan here once per key (rms_norm / layer_norm:
// ops/norm.py, softmax / log_softmax: ops/softmax.py, each in _native_plan).

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <array>
#include <map>
#include <optional>
#include <string>

namespace quack_kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A compiled kernel: a TVM-FFI function handle. Registration takes a reference that is
// never given back: plans live as long as the process, as the Python compile cache.
TVMFFIObjectHandle kernel_from_handle(int64_t handle) {
  auto kernel = reinterpret_cast<TVMFFIObjectHandle>(handle);
  if (kernel != nullptr) {
    TVMFFIObjectIncRef(kernel);
  }
  return kernel;
}

DLDataType dl_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return {kDLFloat, 32, 1};
    case at::kHalf: return {kDLFloat, 16, 1};
    case at::kBFloat16: return {kDLBfloat, 16, 1};
    case at::kInt: return {kDLInt, 32, 1};
    case at::kLong: return {kDLInt, 64, 1};
    default: TORCH_CHECK(false, "quack_kernels: no DLPack dtype for ", dtype);
  }
}

[[noreturn]] void throw_raised_error() {
  TVMFFIObjectHandle error = nullptr;
  TVMFFIErrorMoveFromRaised(&error);
  std::string message = "quack_kernels: kernel launch failed";
  if (error != nullptr) {
    const TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(error);
    message = std::string(cell->kind.data, cell->kind.size) + ": " +
              std::string(cell->message.data, cell->message.size);
    TVMFFIObjectDecRef(error);
  }
  TORCH_CHECK(false, message);
}

// The arguments of one kernel call, in the compiled signature's order: tensors as DLTensor
// views (contiguous rows as (M, N), per-row and per-column vectors as 1-D) held for the
// call, None, floats and integers. run() launches on torch's current stream, which the
// kernels read from TVM-FFI's environment as they do when Python calls them.
class Call {
 public:
  explicit Call(TVMFFIObjectHandle kernel) : kernel_(kernel) {}

  // A contiguous (..., n_cols) tensor as (M, n_cols); undefined: None.
  Call& rows(const at::Tensor& t, int64_t n_cols) {
    if (!t.defined()) return none();
    return tensor(t, {t.numel() / n_cols, n_cols}, {n_cols, 1}, 2);
  }
  // A (M, n_cols) view of row stride ``row_stride`` starting ``first_col`` columns in.
  Call& strided_rows(const at::Tensor& t, int64_t n_cols, int64_t row_stride,
                     int64_t first_col) {
    return tensor(t, {t.size(0), n_cols}, {row_stride, 1}, 2, first_col);
  }
  // A contiguous tensor as 1-D; undefined: None.
  Call& vector(const at::Tensor& t) {
    if (!t.defined()) return none();
    return tensor(t, {t.numel(), 0}, {1, 0}, 1);
  }
  Call& none() {
    TVMFFIAny& arg = next();
    arg.type_index = kTVMFFINone;
    return *this;
  }
  Call& real(double value) {
    TVMFFIAny& arg = next();
    arg.type_index = kTVMFFIFloat;
    arg.v_float64 = value;
    return *this;
  }
  Call& integer(int64_t value) {
    TVMFFIAny& arg = next();
    arg.type_index = kTVMFFIInt;
    arg.v_int64 = value;
    return *this;
  }

  void run(const c10::Device& device) {
    TVMFFIStreamHandle previous = nullptr;
    if (device.is_cuda()) {
      c10::impl::VirtualGuardImpl guard(device.type());
      TVMFFIEnvSetStream(kDLCUDA, device.index(), guard.getStream(device).native_handle(),
                         &previous);
    }
    TVMFFIAny result{};
    result.type_index = kTVMFFINone;
    int status = TVMFFIFunctionCall(kernel_, args_.data(), count_, &result);
    if (device.is_cuda()) {
      TVMFFIEnvSetStream(kDLCUDA, device.index(), previous, nullptr);
    }
    if (status != 0) throw_raised_error();
    if (result.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(result.v_obj);
  }

 private:
  static constexpr int kMaxArgs = 16;

  TVMFFIAny& next() {
    TORCH_CHECK(count_ < kMaxArgs, "quack_kernels: too many kernel arguments");
    TVMFFIAny& arg = args_[count_++];
    arg = TVMFFIAny{};
    return arg;
  }

  Call& tensor(const at::Tensor& t, std::array<int64_t, 2> shape,
               std::array<int64_t, 2> strides, int ndim, int64_t offset = 0) {
    int index = count_;
    DLTensor& dl = tensors_[index];
    dl.data = static_cast<char*>(t.data_ptr()) + offset * t.element_size();
    dl.device = {t.is_cuda() ? kDLCUDA : kDLCPU,
                 static_cast<int32_t>(t.is_cuda() ? t.get_device() : 0)};
    dl.ndim = ndim;
    dl.dtype = dl_dtype(t.scalar_type());
    shapes_[index] = shape;
    strides_[index] = strides;
    dl.shape = shapes_[index].data();
    dl.strides = strides_[index].data();
    dl.byte_offset = 0;
    TVMFFIAny& arg = next();
    arg.type_index = kTVMFFIDLTensorPtr;
    arg.v_ptr = &dl;
    return *this;
  }

  TVMFFIObjectHandle kernel_;
  std::array<TVMFFIAny, kMaxArgs> args_;
  std::array<DLTensor, kMaxArgs> tensors_;
  std::array<std::array<int64_t, 2>, kMaxArgs> shapes_;
  std::array<std::array<int64_t, 2>, kMaxArgs> strides_;
  int count_ = 0;
};

bool needs_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }

int64_t alignment(const at::Tensor& t) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16);
}

// An upstream gradient as the plans' backward kernels read it: as ``output`` was written
// (its dtype, contiguous, 16-byte aligned), copied only where it is not.
at::Tensor as_written(const at::Tensor& grad, const at::Tensor& output) {
  if (grad.scalar_type() == output.scalar_type() && grad.is_contiguous() &&
      alignment(grad) == 0) {
    return grad;
  }
  return at::empty_like(output, at::MemoryFormat::Contiguous).copy_(grad);
}

int64_t dtype_code(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.scalar_type()) : -1;
}

int64_t device_code(const at::Tensor& t) { return t.is_cuda() ? t.get_device() : -1; }

// ------------------------------------------------------------------------ norms
// What a plan was decided from (ops/norm.py, _native_plan): the row length, dtypes,
// alignments and device of x, weight and bias (-1: absent), and which gradients the
// backward computes.
using NormKey = std::array<int64_t, 12>;

struct NormPlan {
  TVMFFIObjectHandle forward = nullptr;
  TVMFFIObjectHandle backward = nullptr;    // null without a gradient
  TVMFFIObjectHandle column_sum = nullptr;  // null without dweight / dbias
  bool rms = true;
  bool need_dx = false, need_dweight = false, need_dbias = false;
  int64_t rows_per_block = 1;
  int64_t resident_row_blocks = 1;
  int64_t sum_width = 0;   // partial sums per row block: dweight | dbias side by side
  int64_t sum_padded = 0;  // where dbias starts from the end of a partial row
};

std::map<NormKey, NormPlan>& norm_plans() {
  static std::map<NormKey, NormPlan> plans;
  return plans;
}

bool vector_fits(const at::Tensor& t, const at::Tensor& x, int64_t n_cols) {
  return !t.defined() || (t.dim() == 1 && t.size(0) == n_cols && t.is_contiguous() &&
                          t.device() == x.device());
}

// The key of a call, or nothing where the fast path does not apply (the Python path then
// handles, or rejects, the call).
std::optional<NormKey> norm_key(const at::Tensor& x, const at::Tensor& weight,
                                const at::Tensor& bias, bool rms) {
  if (x.dim() < 1 || x.numel() == 0 || !x.is_contiguous()) return std::nullopt;
  int64_t n_cols = x.size(-1);
  if (!vector_fits(weight, x, n_cols) || !vector_fits(bias, x, n_cols)) return std::nullopt;
  bool grad = at::GradMode::is_enabled();
  auto align = [](const at::Tensor& t) { return t.defined() ? alignment(t) : -1; };
  return NormKey{rms, n_cols, dtype_code(x), dtype_code(weight), dtype_code(bias), align(x),
                 align(weight), align(bias), device_code(x),
                 grad && needs_grad(x), grad && needs_grad(weight), grad && needs_grad(bias)};
}

// (y, [mean,] rstd) of the forward kernel.
variable_list norm_forward(const NormPlan& plan, const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& bias, double eps, double weight_offset) {
  int64_t n_cols = x.size(-1);
  auto stats_shape = x.sizes().slice(0, x.dim() - 1);
  auto stats_options = x.options().dtype(at::kFloat);
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor rstd = at::empty(stats_shape, stats_options);
  at::Tensor mean = plan.rms ? at::Tensor() : at::empty(stats_shape, stats_options);
  Call(plan.forward)
      .rows(x, n_cols).none().vector(weight).vector(bias).rows(y, n_cols).none()
      .vector(mean).vector(rstd).real(eps).real(weight_offset)
      .run(x.device());
  return plan.rms ? variable_list{y, rstd} : variable_list{y, mean, rstd};
}

struct NormFunction : public torch::autograd::Function<NormFunction> {
  // (weight and bias optional: an undefined tensor would be taken for an input variable)
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               const std::optional<at::Tensor>& optional_weight,
                               const std::optional<at::Tensor>& optional_bias, double eps,
                               double weight_offset, int64_t plan_address) {
    const auto& plan = *reinterpret_cast<const NormPlan*>(plan_address);
    at::Tensor weight = optional_weight.value_or(at::Tensor());
    at::Tensor bias = optional_bias.value_or(at::Tensor());
    variable_list outputs = norm_forward(plan, x, weight, bias, eps, weight_offset);
    at::Tensor rstd = outputs.back();
    at::Tensor mean = plan.rms ? at::Tensor() : outputs[1];
    ctx->mark_non_differentiable(variable_list(outputs.begin() + 1, outputs.end()));
    ctx->save_for_backward({x, weight, mean, rstd});
    ctx->saved_data["plan"] = plan_address;
    ctx->saved_data["weight_offset"] = weight_offset;
    ctx->saved_data["bias_dtype"] = dtype_code(bias);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& plan = *reinterpret_cast<const NormPlan*>(ctx->saved_data["plan"].toInt());
    variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &mean = saved[2], &rstd = saved[3];
    int64_t bias_dtype = ctx->saved_data["bias_dtype"].toInt();
    bool need_dx = plan.need_dx, need_dweight = plan.need_dweight, need_dbias = plan.need_dbias;
    at::Tensor dy = as_written(grads[0], x);  // y is written as x is laid out
    int64_t n_cols = x.size(-1);
    int64_t num_rows = x.numel() / n_cols;
    // as config.loop_grid_rows
    int64_t grid_rows = std::max<int64_t>(
        1, std::min((num_rows + plan.rows_per_block - 1) / plan.rows_per_block,
                    plan.resident_row_blocks));
    at::Tensor dx = need_dx ? at::empty_like(x, at::MemoryFormat::Contiguous) : at::Tensor();
    at::Tensor partial, dweight, dbias;
    if (plan.column_sum != nullptr) {
      partial = at::empty({grid_rows * plan.rows_per_block, plan.sum_width},
                          x.options().dtype(at::kFloat));
    }
    Call call(plan.backward);
    call.rows(x, n_cols).rows(dy, n_cols).vector(weight).vector(mean).vector(rstd).none()
        .rows(dx, n_cols).none();
    if (need_dweight) {
      call.strided_rows(partial, n_cols, plan.sum_width, 0);
      dweight = at::empty({n_cols}, weight.options());
    } else {
      call.none();
    }
    if (need_dbias) {
      call.strided_rows(partial, n_cols, plan.sum_width, plan.sum_width - plan.sum_padded);
      dbias = at::empty({n_cols}, x.options().dtype(static_cast<at::ScalarType>(bias_dtype)));
    } else {
      call.none();
    }
    call.real(ctx->saved_data["weight_offset"].toDouble()).integer(grid_rows).run(x.device());
    if (plan.column_sum != nullptr) {
      Call sums(plan.column_sum);
      sums.rows(partial, plan.sum_width);
      if (need_dweight) sums.vector(dweight);
      if (need_dbias) sums.vector(dbias);
      if (!(need_dweight && need_dbias)) sums.none();
      sums.run(x.device());
    }
    return {dx, dweight, dbias, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// (y, [mean,] rstd), with an autograd node where a gradient is needed; None where no plan
// holds for these inputs (register_norm_plan, then call again) or the fast path does not
// apply.
std::optional<variable_list> norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                  const std::optional<at::Tensor>& bias, double eps,
                                  double weight_offset, bool rms) {
  at::Tensor w = weight.value_or(at::Tensor()), b = bias.value_or(at::Tensor());
  auto key = norm_key(x, w, b, rms);
  if (!key) return std::nullopt;
  auto found = norm_plans().find(*key);
  if (found == norm_plans().end()) return std::nullopt;
  const NormPlan& plan = found->second;
  if (plan.backward == nullptr) {
    at::NoGradGuard no_grad;
    return norm_forward(plan, x, w, b, eps, weight_offset);
  }
  return NormFunction::apply(x, weight, bias, eps, weight_offset,
                             reinterpret_cast<int64_t>(&plan));
}

// Whether these inputs can take the fast path at all (contiguous, per-column vectors of
// the row's length on x's device, at least one row).
bool norm_eligible(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                   const std::optional<at::Tensor>& bias) {
  return norm_key(x, weight.value_or(at::Tensor()), bias.value_or(at::Tensor()), true)
      .has_value();
}

void register_norm_plan(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                        const std::optional<at::Tensor>& bias, bool rms, int64_t forward,
                        int64_t backward, int64_t column_sum, int64_t rows_per_block,
                        int64_t resident_row_blocks, int64_t sum_width, int64_t sum_padded) {
  auto key = norm_key(x, weight.value_or(at::Tensor()), bias.value_or(at::Tensor()), rms);
  TORCH_CHECK(key.has_value(), "quack_kernels: these inputs take no native plan");
  if (norm_plans().count(*key)) return;
  const NormKey& k = *key;
  norm_plans()[k] = NormPlan{kernel_from_handle(forward), kernel_from_handle(backward),
                             kernel_from_handle(column_sum), rms, k[9] != 0, k[10] != 0,
                             k[11] != 0, rows_per_block, resident_row_blocks, sum_width,
                             sum_padded};
}

// ---------------------------------------------------------------------- softmax
// What a plan was decided from (ops/softmax.py, _native_plan): row length, dtype,
// alignment and device of x, log or not, and whether a gradient is needed.
using SoftmaxKey = std::array<int64_t, 6>;

struct SoftmaxPlan {
  TVMFFIObjectHandle forward = nullptr;
  TVMFFIObjectHandle backward = nullptr;  // null without a gradient
};

std::map<SoftmaxKey, SoftmaxPlan>& softmax_plans() {
  static std::map<SoftmaxKey, SoftmaxPlan> plans;
  return plans;
}

std::optional<SoftmaxKey> softmax_key(const at::Tensor& x, bool log) {
  if (x.dim() < 1 || x.numel() == 0 || !x.is_contiguous()) return std::nullopt;
  return SoftmaxKey{x.size(-1), dtype_code(x), alignment(x), device_code(x), log,
                    at::GradMode::is_enabled() && x.requires_grad()};
}

at::Tensor softmax_forward(const SoftmaxPlan& plan, const at::Tensor& x) {
  int64_t n_cols = x.size(-1);
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  Call(plan.forward).rows(x, n_cols).rows(y, n_cols).run(x.device());
  return y;
}

struct SoftmaxFunction : public torch::autograd::Function<SoftmaxFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t plan_address) {
    const auto& plan = *reinterpret_cast<const SoftmaxPlan*>(plan_address);
    at::Tensor y = softmax_forward(plan, x);
    ctx->save_for_backward({y});
    ctx->saved_data["plan"] = plan_address;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto& plan = *reinterpret_cast<const SoftmaxPlan*>(ctx->saved_data["plan"].toInt());
    at::Tensor y = ctx->get_saved_variables()[0];
    at::Tensor dy = as_written(grads[0], y);
    at::Tensor dx = at::empty_like(y, at::MemoryFormat::Contiguous);
    int64_t n_cols = y.size(-1);
    Call(plan.backward).rows(y, n_cols).rows(dy, n_cols).rows(dx, n_cols).run(y.device());
    return {dx, at::Tensor()};
  }
};

// softmax (log_softmax) of x over its last dimension, with an autograd node where a
// gradient is needed; None as for norm().
std::optional<at::Tensor> softmax(const at::Tensor& x, bool log) {
  auto key = softmax_key(x, log);
  if (!key) return std::nullopt;
  auto found = softmax_plans().find(*key);
  if (found == softmax_plans().end()) return std::nullopt;
  const SoftmaxPlan& plan = found->second;
  if (plan.backward == nullptr) {
    at::NoGradGuard no_grad;
    return softmax_forward(plan, x);
  }
  return SoftmaxFunction::apply(x, reinterpret_cast<int64_t>(&plan));
}

bool softmax_eligible(const at::Tensor& x) { return softmax_key(x, false).has_value(); }

void register_softmax_plan(const at::Tensor& x, bool log, int64_t forward, int64_t backward) {
  auto key = softmax_key(x, log);
  TORCH_CHECK(key.has_value(), "quack_kernels: these inputs take no native plan");
  if (softmax_plans().count(*key)) return;
  softmax_plans()[*key] = SoftmaxPlan{kernel_from_handle(forward), kernel_from_handle(backward)};
}

}  // namespace
}  // namespace quack_kernels

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("norm", &quack_kernels::norm);
  m.def("norm_eligible", &quack_kernels::norm_eligible);
  m.def("register_norm_plan", &quack_kernels::register_norm_plan);
  m.def("softmax", &quack_kernels::softmax);
  m.def("softmax_eligible", &quack_kernels::softmax_eligible);
  m.def("register_softmax_plan", &quack_kernels::register_softmax_plan);
}
