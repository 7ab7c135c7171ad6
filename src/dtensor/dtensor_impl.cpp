#include "dtensor/dtensor_impl.h"

#include "comm/compat.h"
#include "comm/error_text.h"

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
// A pending shard (NOTE: [Async redistribution]) takes the layout its
// collective will give it: that of `like` when like_layout (an all_reduce,
// in place), else contiguous; the local steps after the collective (a
// chunk, zeros) keep the order of strides.
void DTensorImpl::refreshStrides() {
  const bool contiguous = pending_ ? !pending_->like_layout() || pending_->like().is_contiguous() : local_.is_contiguous();
  if (contiguous) return set_sizes_contiguous(spec_->shape);
  const at::Tensor& layout = pending_ ? pending_->like() : local_;
  set_sizes_and_strides(spec_->shape, dense_strides_like(spec_->shape, layout.strides()));
}

DTensorImpl::DTensorImpl(at::Tensor local, SpecPtr spec)
    : c10::TensorImpl(keysFor(local), local.dtype(), local.device()),
      local_(std::move(local)),
      spec_(std::move(spec)) {
  set_storage_access_should_throw();
  refreshStrides();
}

DTensorImpl::DTensorImpl(std::shared_ptr<PendingLocal> pending, SpecPtr spec)
    : c10::TensorImpl(keysFor(pending->like()), pending->like().dtype(), pending->like().device()),
      spec_(std::move(spec)),
      pending_(std::move(pending)) {
  set_storage_access_should_throw();
  refreshStrides();
}

void DTensorImpl::resolve() const {
  local_ = pending_->get();  // a failure throws here and leaves it pending: every later use throws it again
  pending_.reset();
  TORCH_INTERNAL_ASSERT(local_.sizes() == c10::IntArrayRef(spec_->local_sizes), "async redistribution to ",
                        spec_->str(), " gave a local shard of ", local_.sizes(), ", expected ",
                        c10::IntArrayRef(spec_->local_sizes));
}

void DTensorImpl::set(at::Tensor local, SpecPtr spec) {
  local_ = std::move(local);
  spec_ = std::move(spec);
  pending_.reset();
  refreshStrides();
}

// A pending DTensor's aliases share its PendingLocal: whichever is used
// first waits, once, for all of them.
c10::intrusive_ptr<c10::TensorImpl> DTensorImpl::shallow_copy_and_detach(
    const c10::VariableVersion& version_counter, bool allow_tensor_metadata_change) const {
  auto impl = pending_ ? c10::make_intrusive<DTensorImpl>(pending_, spec_) : c10::make_intrusive<DTensorImpl>(local_, spec_);
  copy_tensor_metadata(this, impl.get(), version_counter, allow_tensor_metadata_change);
  return impl;
}

c10::intrusive_ptr<c10::TensorImpl> DTensorImpl::shallow_copy_and_detach(
    c10::VariableVersion&& version_counter, bool allow_tensor_metadata_change) const {
  auto impl = pending_ ? c10::make_intrusive<DTensorImpl>(pending_, spec_) : c10::make_intrusive<DTensorImpl>(local_, spec_);
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
  pending_ = other->pending_;
}

const at::Tensor& PendingLocal::get() {
  std::lock_guard<std::mutex> lock(mu_);
  if (error_) std::rethrow_exception(error_);
  if (!done_) {
    try {
      at::Tensor t = work_.wait();
      result_ = finish_ ? finish_(std::move(t)) : std::move(t);
    } catch (const std::exception& e) {
      error_ = std::make_exception_ptr(compat::error_without_backtrace(
          c10::str("dtp: redistribute ", src_->str(), " -> (", to_string(dst_), ") with async_op=true failed; its ",
                   "result was first used here: ", error_text(e))));
      std::rethrow_exception(error_);
    }
    done_ = true;
    work_ = Work();
    finish_ = nullptr;
    like_ = at::Tensor();
  }
  return result_;
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

at::Tensor makeDTensor(std::shared_ptr<PendingLocal> pending, SpecPtr spec) {
  if (c10::InferenceMode::is_enabled() && !pending->like().is_inference()) {  // as makeDTensor above
    const c10::InferenceMode normal(/*enabled=*/false);
    return at::detail::make_tensor<DTensorImpl>(std::move(pending), std::move(spec));
  }
  return at::detail::make_tensor<DTensorImpl>(std::move(pending), std::move(spec));
}

}  // namespace dtp
