#include "dtensor/dtensor_impl.h"

#include <c10/core/DispatchKeySet.h>

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

DTensorImpl::DTensorImpl(at::Tensor local, SpecPtr spec)
    : c10::TensorImpl(keysFor(local), local.dtype(), local.device()),
      local_(std::move(local)),
      spec_(std::move(spec)) {
  set_storage_access_should_throw();
  // Global, contiguous strides: AccumulateGrad's layout contract compares
  // them with the parameter's, and would otherwise clone the grad into a plain
  // tensor.
  set_sizes_contiguous(spec_->shape);
}

void DTensorImpl::set(at::Tensor local, SpecPtr spec) {
  local_ = std::move(local);
  spec_ = std::move(spec);
  set_sizes_contiguous(spec_->shape);
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
  return at::detail::make_tensor<DTensorImpl>(std::move(local), std::move(spec));
}

}  // namespace dtp
