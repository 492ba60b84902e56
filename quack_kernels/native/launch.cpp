// The eager fast path in C++: compiled CuTe kernels (TVM-FFI function objects that the
// Python layer compiles and hands over) launched without Python, and autograd nodes whose
// backward runs in the autograd engine's thread without the GIL. A Python autograd node
// and its launch code cost more host time than torch's whole training step of a small
// norm (benchmarks/NOTES.md, twenty-fourth session); every decision (configs, grids,
// kernels) stays in Python, which registers a plan here once per key (rms_norm /
// layer_norm: ops/norm.py, softmax / log_softmax: ops/softmax.py, the cross-entropy
// training step: ops/cross_entropy.py, each in _native_plan).

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/utils/pybind.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <dlfcn.h>

#include <array>
#include <cstring>
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

// The error a kernel call raised, as the Python exception its kind names (TypeError and
// ValueError as on the Python path, which gets them from the same argument checks).
[[noreturn]] void throw_raised_error() {
  TVMFFIObjectHandle error = nullptr;
  TVMFFIErrorMoveFromRaised(&error);
  std::string kind, message = "quack_kernels: kernel launch failed";
  if (error != nullptr) {
    const TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(error);
    kind = std::string(cell->kind.data, cell->kind.size);
    message = kind + ": " + std::string(cell->message.data, cell->message.size);
    TVMFFIObjectDecRef(error);
  }
  TORCH_CHECK_TYPE(kind != "TypeError", message);
  TORCH_CHECK_VALUE(kind != "ValueError", message);
  TORCH_CHECK(false, message);
}

// torch's current CUDA stream on ``device`` (null off CUDA).
void* current_stream(const c10::Device& device) {
  if (!device.is_cuda()) return nullptr;
  c10::impl::VirtualGuardImpl guard(device.type());
  return guard.getStream(device).native_handle();
}

// Whether torch's current stream on ``device`` is capturing a CUDA graph (the driver's
// cuStreamIsCapturing, looked up at run time: this file builds without CUDA headers;
// where it cannot be found, assume so).
bool capturing(const c10::Device& device) {
  if (!device.is_cuda()) return false;
  using IsCapturing = int (*)(void*, int*);
  static IsCapturing is_capturing = [] {
    void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    return driver ? reinterpret_cast<IsCapturing>(dlsym(driver, "cuStreamIsCapturing"))
                  : nullptr;
  }();
  c10::DeviceGuard on_device(device);  // (the null stream is the current context's)
  int status = 1;
  return is_capturing == nullptr || is_capturing(current_stream(device), &status) != 0 ||
         status != 0;
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
    return tensor(contiguous(t), {t.numel() / n_cols, n_cols}, {n_cols, 1}, 2);
  }
  // A (M, n_cols) view of row stride ``row_stride`` starting ``first_col`` columns in.
  Call& strided_rows(const at::Tensor& t, int64_t n_cols, int64_t row_stride,
                     int64_t first_col) {
    return tensor(t, {t.size(0), n_cols}, {row_stride, 1}, 2, first_col);
  }
  // A contiguous tensor as 1-D; undefined: None.
  Call& vector(const at::Tensor& t) {
    if (!t.defined()) return none();
    return tensor(contiguous(t), {t.numel(), 0}, {1, 0}, 1);
  }
  // ``length`` elements of a contiguous tensor from element ``first`` on.
  Call& slice(const at::Tensor& t, int64_t first, int64_t length) {
    return tensor(contiguous(t), {length, 0}, {1, 0}, 1, first);
  }
  // Element ``index`` of a contiguous tensor seen ``length`` times (stride 0).
  Call& broadcast(const at::Tensor& t, int64_t index, int64_t length) {
    return tensor(t, {length, 0}, {0, 0}, 1, index);
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
    c10::OptionalDeviceGuard on_device;  // the launch goes to the current device's context
    TVMFFIStreamHandle previous = nullptr;
    if (device.is_cuda()) {
      on_device.reset_device(device);
      TVMFFIEnvSetStream(kDLCUDA, device.index(), current_stream(device), &previous);
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

  // The layout these views assume: what the plans' keys guarantee for the inputs, and
  // the outputs are made so; a saved tensor a saved_tensors_hooks unpack hook changed is
  // refused, not misread.
  static const at::Tensor& contiguous(const at::Tensor& t) {
    TORCH_CHECK(t.is_contiguous(), "quack_kernels: the C++ fast path expects a contiguous "
                "tensor (a saved tensor changed by an unpack hook?), got strides ",
                t.strides());
    return t;
  }

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

// An upstream gradient as the plans' backward kernels read it: in ``dtype`` with the
// layout of ``like`` (contiguous, 16-byte aligned), copied only where it is not.
at::Tensor as_written(const at::Tensor& grad, const at::Tensor& like, at::ScalarType dtype) {
  if (grad.scalar_type() == dtype && grad.is_contiguous() && alignment(grad) == 0) {
    return grad;
  }
  return at::empty_like(like, like.options().dtype(dtype), at::MemoryFormat::Contiguous)
      .copy_(grad);
}

int64_t dtype_code(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.scalar_type()) : -1;
}

int64_t device_code(const at::Tensor& t) { return t.is_cuda() ? t.get_device() : -1; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks of ``per_block`` items for ``count`` items, at least one and at most ``cap``:
// config.loop_grid_rows (row blocks of a looping grid, capped at the resident ones) and
// config.mean_denominator_ctas (CTAs of targets_per_cta targets); tests/test_native.py
// compares them.
int64_t capped_blocks(int64_t count, int64_t per_block, int64_t cap) {
  return std::max<int64_t>(1, std::min(ceil_div(count, per_block), cap));
}

// ------------------------------------------------------------------------ norms
// What a plan was decided from (ops/norm.py, _native_plan): the row length, dtypes,
// alignments and device of x, weight, bias and residual (-1: absent), the residual
// stream's dtype, whether it is stored and whether it is returned (prenorm: its own
// gradient may come back), and which gradients the backward computes.
using NormKey = std::array<int64_t, 18>;

// A backward variant: with or without the stored stream's own gradient (prenorm).
struct NormBackwardKernel {
  TVMFFIObjectHandle kernel = nullptr;
  int64_t rows_per_block = 1;
  int64_t resident_row_blocks = 1;
  int64_t shift_classes = 1;  // config.shift_classes: rows visited a class at a time
};

struct NormPlan {
  TVMFFIObjectHandle forward = nullptr;
  NormBackwardKernel backward;               // kernel null without a gradient
  NormBackwardKernel backward_with_stream;   // ... with the stream's gradient (prenorm)
  TVMFFIObjectHandle column_sum = nullptr;   // null without dweight / dbias
  bool rms = true, store = false;
  at::ScalarType h_dtype = at::kFloat;  // what the backward normalizes: x, or x + residual
  bool need_dx = false, need_dweight = false, need_dbias = false, need_dresidual = false;
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
// handles, or rejects, the call). The stream is stored where it is returned (prenorm) or
// the backward needs it.
std::optional<NormKey> norm_key(const at::Tensor& x, const at::Tensor& weight,
                                const at::Tensor& bias, const at::Tensor& residual,
                                std::optional<at::ScalarType> stream_dtype, bool rms,
                                bool prenorm) {
  if (x.dim() < 1 || x.numel() == 0 || !x.is_contiguous()) return std::nullopt;
  int64_t n_cols = x.size(-1);
  if (!vector_fits(weight, x, n_cols) || !vector_fits(bias, x, n_cols)) return std::nullopt;
  if (residual.defined() && (!residual.is_contiguous() || residual.sizes() != x.sizes() ||
                             residual.device() != x.device())) {
    return std::nullopt;
  }
  bool grad = at::GradMode::is_enabled();
  bool need_dx = grad && needs_grad(x), need_dweight = grad && needs_grad(weight),
       need_dbias = grad && needs_grad(bias), need_dresidual = grad && needs_grad(residual);
  bool store = residual.defined() &&
               (prenorm || need_dx || need_dweight || need_dbias || need_dresidual);
  auto align = [](const at::Tensor& t) { return t.defined() ? alignment(t) : -1; };
  int64_t stream = residual.defined()
      ? static_cast<int64_t>(stream_dtype.value_or(residual.scalar_type())) : -1;
  return NormKey{rms, n_cols, dtype_code(x), dtype_code(weight), dtype_code(bias),
                 dtype_code(residual), align(x), align(weight), align(bias), align(residual),
                 device_code(x), stream, store, need_dx, need_dweight, need_dbias,
                 need_dresidual, residual.defined() && prenorm};
}

// (y, [h,] [mean,] rstd) of the forward kernel: h, the stream x + residual, where the
// plan stores it.
variable_list norm_forward(const NormPlan& plan, const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& bias, const at::Tensor& residual, double eps,
                           double weight_offset) {
  int64_t n_cols = x.size(-1);
  auto stats_shape = x.sizes().slice(0, x.dim() - 1);
  auto stats_options = x.options().dtype(at::kFloat);
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor h = plan.store ? at::empty(x.sizes(), x.options().dtype(plan.h_dtype))
                            : at::Tensor();
  at::Tensor rstd = at::empty(stats_shape, stats_options);
  at::Tensor mean = plan.rms ? at::Tensor() : at::empty(stats_shape, stats_options);
  Call(plan.forward)
      .rows(x, n_cols).rows(residual, n_cols).vector(weight).vector(bias).rows(y, n_cols)
      .rows(h, n_cols).vector(mean).vector(rstd).real(eps).real(weight_offset)
      .run(x.device());
  variable_list outputs{y};
  if (plan.store) outputs.push_back(h);
  if (!plan.rms) outputs.push_back(mean);
  outputs.push_back(rstd);
  return outputs;
}

struct NormFunction : public torch::autograd::Function<NormFunction> {
  // (weight, bias and residual optional: an undefined tensor would be taken for an input
  // variable)
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               const std::optional<at::Tensor>& optional_weight,
                               const std::optional<at::Tensor>& optional_bias,
                               const std::optional<at::Tensor>& optional_residual, double eps,
                               double weight_offset, int64_t plan_address) {
    const auto& plan = *reinterpret_cast<const NormPlan*>(plan_address);
    at::Tensor weight = optional_weight.value_or(at::Tensor());
    at::Tensor bias = optional_bias.value_or(at::Tensor());
    at::Tensor residual = optional_residual.value_or(at::Tensor());
    variable_list outputs = norm_forward(plan, x, weight, bias, residual, eps, weight_offset);
    at::Tensor rstd = outputs.back();
    at::Tensor mean = plan.rms ? at::Tensor() : outputs[outputs.size() - 2];
    ctx->mark_non_differentiable(plan.rms ? variable_list{rstd} : variable_list{mean, rstd});
    // no zeros made for the statistics' gradients, which are never used (a zeros_like
    // and its fill kernel per statistic and step: 30-50 us of host time on the H200's)
    ctx->set_materialize_grads(false);
    // the backward reads the normalized stream: x itself, or the stored x + residual
    ctx->save_for_backward({plan.store ? outputs[1] : x, weight, mean, rstd});
    ctx->saved_data["plan"] = plan_address;
    ctx->saved_data["weight_offset"] = weight_offset;
    ctx->saved_data["bias_dtype"] = dtype_code(bias);
    ctx->saved_data["residual_dtype"] = dtype_code(residual);
    ctx->saved_data["x_dtype"] = dtype_code(x);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list gradients(7);
    const auto& plan = *reinterpret_cast<const NormPlan*>(ctx->saved_data["plan"].toInt());
    at::Tensor dy = grads[0];
    at::Tensor dh = plan.store ? grads[1] : at::Tensor();  // prenorm's h, where used
    if (!dy.defined() && !dh.defined()) return gradients;  // nothing flows back
    variable_list saved = ctx->get_saved_variables();
    const at::Tensor &h = saved[0], &weight = saved[1], &mean = saved[2], &rstd = saved[3];
    auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    // the kernels read dy as y was written (x's dtype, h's layout) and dh as h was
    dy = dy.defined() ? as_written(dy, h, x_dtype)
                      : at::zeros_like(h, h.options().dtype(x_dtype));
    if (dh.defined()) dh = as_written(dh, h, plan.h_dtype);
    const NormBackwardKernel& variant = dh.defined() ? plan.backward_with_stream
                                                     : plan.backward;
    // (h is returned, and its gradient can come back, only with prenorm)
    TORCH_CHECK(variant.kernel != nullptr, "quack_kernels: a gradient of the residual "
                "stream reached a norm called without prenorm");
    int64_t n_cols = h.size(-1);
    int64_t num_rows = h.numel() / n_cols;
    int64_t grid_rows = capped_blocks(num_rows, variant.rows_per_block,
                                       variant.resident_row_blocks);
    at::Tensor dx, dresidual, partial, dweight, dbias;
    if (plan.need_dx) dx = at::empty_like(h, h.options().dtype(x_dtype));
    if (plan.need_dresidual) {
      auto residual_dtype =
          static_cast<at::ScalarType>(ctx->saved_data["residual_dtype"].toInt());
      dresidual = at::empty_like(h, h.options().dtype(residual_dtype));
    }
    if (plan.column_sum != nullptr) {
      // config.partial_sum_rows: a row per CTA and class of rows it visits
      partial = at::empty({grid_rows * variant.rows_per_block + variant.shift_classes - 1,
                           plan.sum_width},
                          h.options().dtype(at::kFloat));
    }
    Call call(variant.kernel);
    call.rows(h, n_cols).rows(dy, n_cols).vector(weight).vector(mean).vector(rstd)
        .rows(dh, n_cols).rows(dx, n_cols).rows(dresidual, n_cols);
    if (plan.need_dweight) {
      call.strided_rows(partial, n_cols, plan.sum_width, 0);
      dweight = at::empty({n_cols}, weight.options());
    } else {
      call.none();
    }
    if (plan.need_dbias) {
      call.strided_rows(partial, n_cols, plan.sum_width, plan.sum_width - plan.sum_padded);
      auto bias_dtype = static_cast<at::ScalarType>(ctx->saved_data["bias_dtype"].toInt());
      dbias = at::empty({n_cols}, h.options().dtype(bias_dtype));
    } else {
      call.none();
    }
    call.real(ctx->saved_data["weight_offset"].toDouble()).integer(grid_rows).run(h.device());
    if (plan.column_sum != nullptr) {
      Call sums(plan.column_sum);
      sums.rows(partial, plan.sum_width);
      if (plan.need_dweight) sums.vector(dweight);
      if (plan.need_dbias) sums.vector(dbias);
      if (!(plan.need_dweight && plan.need_dbias)) sums.none();
      sums.run(h.device());
    }
    gradients[0] = dx;
    gradients[1] = dweight;
    gradients[2] = dbias;
    gradients[3] = dresidual;
    return gradients;
  }
};

// (y, [h,] [mean,] rstd), with an autograd node where a gradient is needed; None where no
// plan holds for these inputs (register_norm_plan, then call again) or the fast path does
// not apply.
std::optional<variable_list> norm(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                  const std::optional<at::Tensor>& bias,
                                  const std::optional<at::Tensor>& residual,
                                  std::optional<at::ScalarType> stream_dtype, double eps,
                                  double weight_offset, bool rms, bool prenorm) {
  at::Tensor w = weight.value_or(at::Tensor()), b = bias.value_or(at::Tensor()),
             r = residual.value_or(at::Tensor());
  auto key = norm_key(x, w, b, r, stream_dtype, rms, prenorm);
  if (!key) return std::nullopt;
  auto found = norm_plans().find(*key);
  if (found == norm_plans().end()) return std::nullopt;
  const NormPlan& plan = found->second;
  if (plan.backward.kernel == nullptr) {
    at::NoGradGuard no_grad;
    return norm_forward(plan, x, w, b, r, eps, weight_offset);
  }
  return NormFunction::apply(x, weight, bias, residual, eps, weight_offset,
                             reinterpret_cast<int64_t>(&plan));
}

// Whether these inputs can take the fast path at all (contiguous, per-column vectors of
// the row's length on x's device, a residual of x's shape, at least one row).
bool norm_eligible(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                   const std::optional<at::Tensor>& bias,
                   const std::optional<at::Tensor>& residual) {
  return norm_key(x, weight.value_or(at::Tensor()), bias.value_or(at::Tensor()),
                  residual.value_or(at::Tensor()), std::nullopt, true, false)
      .has_value();
}

// ``backward`` and ``backward_with_stream``: (kernel handle, rows per block, resident row
// blocks, shift classes), zeros where absent; ``sums``: (column-sum handle, width,
// padded).
void register_norm_plan(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                        const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual,
                        std::optional<at::ScalarType> stream_dtype, bool rms, bool prenorm,
                        int64_t forward, std::vector<int64_t> backward,
                        std::vector<int64_t> backward_with_stream, std::vector<int64_t> sums) {
  auto key = norm_key(x, weight.value_or(at::Tensor()), bias.value_or(at::Tensor()),
                      residual.value_or(at::Tensor()), stream_dtype, rms, prenorm);
  TORCH_CHECK(key.has_value() && backward.size() == 4 && backward_with_stream.size() == 4 &&
                  sums.size() == 3,
              "quack_kernels: these inputs take no native plan");
  if (norm_plans().count(*key)) return;
  const NormKey& k = *key;
  auto variant = [](const std::vector<int64_t>& v) {
    return NormBackwardKernel{kernel_from_handle(v[0]), v[1], v[2], std::max<int64_t>(v[3], 1)};
  };
  NormPlan plan;
  plan.forward = kernel_from_handle(forward);
  plan.backward = variant(backward);
  plan.backward_with_stream = variant(backward_with_stream);
  plan.column_sum = kernel_from_handle(sums[0]);
  plan.sum_width = sums[1];
  plan.sum_padded = sums[2];
  plan.rms = rms;
  bool has_residual = k[5] >= 0;
  plan.h_dtype = static_cast<at::ScalarType>(has_residual ? k[11] : k[2]);
  plan.store = k[12] != 0;
  plan.need_dx = k[13] != 0;
  plan.need_dweight = k[14] != 0;
  plan.need_dbias = k[15] != 0;
  plan.need_dresidual = k[16] != 0;
  norm_plans()[k] = plan;
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
    at::Tensor dy = as_written(grads[0], y, y.scalar_type());
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

// ----------------------------------------------------------------- cross-entropy
// The training step of a reduced loss ("mean" or "sum"; no class weights, 16-bit brain
// float or fp32 logits whose gradient the forward computes; ops/cross_entropy.py,
// _native_plan): the mean's denominator, the loss + gradient kernel with the loss
// reduced in its grid, and a node whose backward rescales the gradient's rows only
// where the upstream gradient is not the 1 the forward assumed (CrossEntropyFunction
// there: the same kernels from Python).
// Key: row length, dtypes of logits and target, alignment and device of the logits,
// mean or sum, smoothing and z-loss on or off, the softcap's bits (0: none).
using CrossEntropyKey = std::array<int64_t, 9>;

struct CrossEntropyPlan {
  TVMFFIObjectHandle denominator = nullptr;  // null for a sum
  TVMFFIObjectHandle forward = nullptr;
  TVMFFIObjectHandle rescale = nullptr;
  at::Tensor unit;  // fp32 1 on the device: the upstream gradient the gradient assumes
  // forward grid: row blocks of rows_per_block rows; a looping grid of at most
  // resident_row_blocks (0: one row block per CTA); its grid sum's words per row block
  // and fixed words (config.grid_sum_slots times the summed values)
  int64_t rows_per_block = 1, resident_row_blocks = 0, words_per_block = 0, fixed_words = 0;
  // the denominator's CTAs (one per targets_per_cta targets, at most max_ctas) and words
  int64_t targets_per_cta = 1, max_ctas = 1, denominator_fixed_words = 0;
  // the rescale's looping grid
  int64_t rescale_rows_per_block = 1, rescale_resident_row_blocks = 1;
};

std::map<CrossEntropyKey, CrossEntropyPlan>& cross_entropy_plans() {
  static std::map<CrossEntropyKey, CrossEntropyPlan> plans;
  return plans;
}

// The zeroed int64 words the grid sums of launches on the current stream add into (each
// launch's gathering CTA zeroes its words again), grown as needed; one buffer per
// device and stream (never used while a graph is captured: such calls take the Python
// path, whose capture gets its own).
at::Tensor grid_partials(const at::Tensor& like, int64_t words) {
  static std::map<std::pair<int64_t, void*>, at::Tensor> buffers;
  auto& buffer = buffers[{device_code(like), current_stream(like.device())}];
  if (!buffer.defined() || buffer.numel() < words) {
    buffer = at::zeros({words}, like.options().dtype(at::kLong));
  }
  return buffer;
}

std::optional<CrossEntropyKey> cross_entropy_key(const at::Tensor& logits,
                                                 const at::Tensor& target, bool mean,
                                                 double smoothing, double zloss,
                                                 double softcap) {
  if (logits.dim() != 2 || logits.size(0) == 0 || !logits.is_contiguous() ||
      !target.is_contiguous() || target.dim() != 1 || target.size(0) != logits.size(0) ||
      target.device() != logits.device() || capturing(logits.device())) {
    return std::nullopt;
  }
  int64_t softcap_bits;
  std::memcpy(&softcap_bits, &softcap, sizeof softcap_bits);
  return CrossEntropyKey{logits.size(1), dtype_code(logits), dtype_code(target),
                         device_code(logits), alignment(logits), mean, smoothing != 0.0,
                         zloss != 0.0, softcap_bits};
}

struct CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits,
                               const at::Tensor& target, int64_t ignore_index,
                               double smoothing, double zloss, double softcap,
                               int64_t plan_address) {
    const auto& plan = *reinterpret_cast<const CrossEntropyPlan*>(plan_address);
    int64_t num_rows = logits.size(0);
    auto fp32 = logits.options().dtype(at::kFloat);
    at::Tensor held_from = plan.unit;  // element 0: the gradient's scale, every row
    int64_t held_index = 0;
    if (plan.denominator != nullptr) {  // a mean: (D, 1 / D)
      at::Tensor scales = at::empty({2}, fp32);
      int64_t ctas = capped_blocks(num_rows, plan.targets_per_cta, plan.max_ctas);
      Call(plan.denominator)
          .vector(target).vector(scales).vector(scales)
          .vector(grid_partials(logits, ctas + plan.denominator_fixed_words))
          .integer(ignore_index).integer(ctas).run(logits.device());
      held_from = scales;
      held_index = 1;
    }
    at::Tensor stats = at::empty({2, num_rows}, fp32);  // losses, row weights
    at::Tensor lse = at::empty({num_rows}, fp32);
    at::Tensor reduced = at::empty({}, fp32);
    at::Tensor grad = at::empty_like(logits, at::MemoryFormat::Contiguous);
    bool loops = plan.resident_row_blocks > 0;
    int64_t grid_rows = loops ? capped_blocks(num_rows, plan.rows_per_block,
                                               plan.resident_row_blocks)
                              : num_rows;  // (ignored by one row block per CTA)
    int64_t row_blocks = loops ? grid_rows : ceil_div(num_rows, plan.rows_per_block);
    Call(plan.forward)
        .rows(logits, logits.size(1)).vector(target)
        .slice(stats, 0, num_rows)  // (no class weights: a vector the kernel does not read)
        .slice(stats, 0, num_rows).slice(stats, num_rows, num_rows).vector(lse)
        .rows(grad, logits.size(1)).broadcast(held_from, held_index, num_rows)
        .vector(reduced)
        .vector(grid_partials(logits, row_blocks * plan.words_per_block + plan.fixed_words))
        .integer(ignore_index).real(smoothing).real(zloss)
        .real(softcap != 0.0 ? std::abs(softcap) : 1.0).integer(grid_rows)
        .run(logits.device());
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({grad, target});
    ctx->saved_data["plan"] = plan_address;
    ctx->saved_data["ignore_index"] = ignore_index;
    return {reduced, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list none(7);
    const at::Tensor& dout = grads[0];
    if (!dout.defined()) return none;
    const auto& plan =
        *reinterpret_cast<const CrossEntropyPlan*>(ctx->saved_data["plan"].toInt());
    variable_list saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0];
    const at::Tensor& target = saved[1];
    // a graph that runs backward again keeps its saved gradient: rescale a copy
    if (torch::autograd::get_current_graph_task_keep_graph()) grad = grad.clone();
    at::Tensor dloss = dout.to(at::kFloat);
    int64_t num_rows = grad.size(0);
    Call(plan.rescale)
        .rows(grad, grad.size(1)).rows(grad, grad.size(1)).vector(target)
        .broadcast(dloss, 0, num_rows).broadcast(plan.unit, 0, num_rows)
        .integer(ctx->saved_data["ignore_index"].toInt())
        .integer(capped_blocks(num_rows, plan.rescale_rows_per_block,
                                plan.rescale_resident_row_blocks))
        .run(grad.device());
    if (at::GradMode::is_enabled()) {
      // create_graph: the first-order gradient, and an error if it is differentiated
      // again, as Python's once_differentiable gives (the fused gradient has no graph)
      auto error = std::make_shared<torch::autograd::DelayedError>(
          "trying to differentiate twice a function that was marked with "
          "@once_differentiable (quack_kernels' fused cross-entropy gradient)", 1);
      grad = (*error)({grad.detach().requires_grad_()})[0];
    }
    none[0] = grad;
    return none;
  }
};

// (the loss reduced over the rows, lse) of (M, C) logits that require grad, the node
// holding the gradient; None as for norm().
std::optional<variable_list> cross_entropy(const at::Tensor& logits, const at::Tensor& target,
                                           int64_t ignore_index, double smoothing,
                                           double zloss, double softcap, bool mean) {
  auto key = cross_entropy_key(logits, target, mean, smoothing, zloss, softcap);
  if (!key) return std::nullopt;
  auto found = cross_entropy_plans().find(*key);
  if (found == cross_entropy_plans().end()) return std::nullopt;
  return CrossEntropyFunction::apply(logits, target, ignore_index, smoothing, zloss, softcap,
                                     reinterpret_cast<int64_t>(&found->second));
}

bool cross_entropy_eligible(const at::Tensor& logits, const at::Tensor& target) {
  return cross_entropy_key(logits, target, true, 0.0, 0.0, 0.0).has_value();
}

void register_cross_entropy_plan(const at::Tensor& logits, const at::Tensor& target,
                                 bool mean, double smoothing, double zloss, double softcap,
                                 int64_t denominator, int64_t forward, int64_t rescale,
                                 const at::Tensor& unit, std::vector<int64_t> sizes) {
  auto key = cross_entropy_key(logits, target, mean, smoothing, zloss, softcap);
  TORCH_CHECK(key.has_value() && sizes.size() == 9,
              "quack_kernels: these inputs take no native plan");
  if (cross_entropy_plans().count(*key)) return;
  cross_entropy_plans()[*key] = CrossEntropyPlan{
      kernel_from_handle(denominator), kernel_from_handle(forward), kernel_from_handle(rescale),
      unit, sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], sizes[5], sizes[6], sizes[7],
      sizes[8]};
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
  m.def("cross_entropy", &quack_kernels::cross_entropy);
  m.def("cross_entropy_eligible", &quack_kernels::cross_entropy_eligible);
  m.def("register_cross_entropy_plan", &quack_kernels::register_cross_entropy_plan);
  m.def("capped_blocks", &quack_kernels::capped_blocks);
}
