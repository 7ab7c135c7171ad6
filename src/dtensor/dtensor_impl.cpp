#include "dtensor/dtensor_impl.h"

#include <c10/core/DispatchKeySet.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/SmallVector.h>

#include <algorithm>

namespace dtp {
namespace {

// PrivateUse1 is the highest backend bit, so every op on a DTensor reaches the
// dtp fallback even though the key set also carries the local tensor's
// backend key; that key keeps is_cpu()/is_cuda() truthful in 1.13.
c10::DispatchKeySet keysFor(const at::Tensor& local) {
  return c10::DispatchKeySet({c10::DispatchKey::PrivateUse1, c10::DispatchKey::AutogradPrivateUse1,
                              c10::DispatchKey::ADInplaceOrView}) |
         c10::DispatchKeySet(local.key_set().highestBackendKey());
}

}  // namespace

std::vector<int64_t> dense_strides_like(c10::IntArrayRef sizes, c10::IntArrayRef layout) {
  const int64_t nd = static_cast<int64_t>(sizes.size());
  c10::SmallVector<int64_t, 6> order;  // dims from innermost out
  for (int64_t d = 0; d < nd; ++d)
    if (layout[d] != 0) order.push_back(d);
  std::sort(order.begin(), order.end(),  // equal strides (size-1 dims): the later dim inside
            [&](int64_t a, int64_t b) { return layout[a] != layout[b] ? layout[a] < layout[b] : a > b; });
  std::vector<int64_t> strides(nd, 0);
  int64_t step = 1;
  for (int64_t d : order) {
    strides[d] = step;
    step *= std::max<int64_t>(sizes[d], 1);
  }
  return strides;
}

// NOTE: [DTensor strides]
// A DTensor's strides are those of a dense tensor of the global shape whose
// dimensions lie in memory in the order of its shard's (a broadcast dim keeps
// stride 0). Autograd formulas pick layouts from them: mm's backward returns
// a column-major gradient for a column-major operand, so a linear weight's
// gradient (through weight.t()) comes back contiguous, as for a plain tensor.
// A contiguous shard gives contiguous strides, which AccumulateGrad's layout
// contract compares with the parameter's.
void DTensorImpl::refreshStrides() {
  if (local_.is_contiguous()) return set_sizes_contiguous(spec_->shape);
  set_sizes_and_strides(spec_->shape, dense_strides_like(spec_->shape, local_.strides()));
}

DTensorImpl::DTensorImpl(at::Tensor local, SpecPtr spec)
    : c10::TensorImpl(keysFor(local), local.dtype(), local.device()),
      local_(std::move(local)),
      spec_(std::move(spec)) {
  set_storage_access_should_throw();
  refreshStrides();
}

void DTensorImpl::set(at::Tensor local, SpecPtr spec) {
  local_ = std::move(local);
  spec_ = std::move(spec);
  refreshStrides();
}

c10::intrusive_ptr<c10::TensorImpl> DTensorImpl::shallow_copy_and_detach(
    const c10::VariableVersion& version_counter, bool allow_tensor_metadata_change) const {
  auto impl = c10::make_intrusive<DTensorImpl>(local_, spec_);
  copy_tensor_metadata(this, impl.get(), version_counter, allow_tensor_metadata_change);
  return impl;
}

c10::intrusive_ptr<c10::TensorImpl> DTensorImpl::shallow_copy_and_detach(
    c10::VariableVersion&& version_counter, bool allow_tensor_metadata_change) const {
  auto impl = c10::make_intrusive<DTensorImpl>(local_, spec_);
  copy_tensor_metadata(this, impl.get(), std::move(version_counter),
                       allow_tensor_metadata_change);
  return impl;
}

void DTensorImpl::shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) {
  auto* other = dynamic_cast<DTensorImpl*>(impl.get());
  TORCH_CHECK(other != nullptr,
              "dtp: cannot set the data of a DTensor from a plain tensor. Wrap it first with "
              "dtp::from_local or dtp::distribute_tensor.");
  copy_tensor_metadata(other, this, version_counter(), allow_tensor_metadata_change());
  local_ = other->local_;
  spec_ = other->spec_;
}

const DTensorImpl& checkedDTensorImpl(const at::Tensor& t, const char* fn) {
  auto* impl = maybeGetDTensorImpl(t);
  TORCH_CHECK(impl != nullptr, "dtp::", fn, ": expected a DTensor, got a plain tensor of shape ",
              t.sizes(), ". Create one with dtp::distribute_tensor or dtp::from_local.");
  return *impl;
}

at::Tensor detached_alias(const at::Tensor& t) {
  auto* impl = t.unsafeGetTensorImpl();
  return at::Tensor(impl->shallow_copy_and_detach(impl->version_counter(), /*allow_tensor_metadata_change=*/true));
}

bool solely_owned(const at::Tensor& t) {
  auto* impl = maybeGetDTensorImpl(t);
  return impl != nullptr && t.use_count() == 1 && impl->local().use_count() == 1 &&
         impl->local().storage().use_count() == 1;
}

at::Tensor makeDTensor(at::Tensor local, SpecPtr spec) {
  TORCH_INTERNAL_ASSERT(!isDTensor(local), "makeDTensor: local shard is itself a DTensor");
  TORCH_INTERNAL_ASSERT(local.sizes() == c10::IntArrayRef(spec->local_sizes),
                        "makeDTensor: local shard ", local.sizes(), " does not match ",
                        spec->str(), " whose local shape here is ",
                        c10::IntArrayRef(spec->local_sizes));
  // A DTensor is an inference tensor iff its shard is: a view of a normal
  // DTensor taken under InferenceMode stays normal, as a plain view does
  // (autograd's view tracking refuses an inference view of a normal base).
  if (c10::InferenceMode::is_enabled() && !local.is_inference()) {
    const c10::InferenceMode normal(/*enabled=*/false);
    return at::detail::make_tensor<DTensorImpl>(std::move(local), std::move(spec));
  }
  return at::detail::make_tensor<DTensorImpl>(std::move(local), std::move(spec));
}

}  // namespace dtp
