// DTensorImpl: a storage-less TensorImpl holding this rank's shard (a plain
// at::Tensor) and the spec of the whole. See docs/architecture.md, "DTensor as
// an at::Tensor", for why each piece below is there.
#pragma once

#include "dtensor/pending_local.h"
#include "dtp/dtensor_spec.h"

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>

#include <memory>
#include <vector>

namespace dtp {

class DTensorImpl : public c10::TensorImpl {
 public:
  DTensorImpl(at::Tensor local, SpecPtr spec);
  // A DTensor whose shard an async redistribution still computes; its
  // metadata (sizes, strides, dtype, device) is known now.
  DTensorImpl(std::shared_ptr<PendingLocal> pending, SpecPtr spec);

  // This rank's shard. Of a pending DTensor, it waits for the collective
  // first, once (NOTE: [Async redistribution]): every op, to_local,
  // full_tensor and redistribute read the shard through here.
  const at::Tensor& local() const {
    if (C10_UNLIKELY(pending_ != nullptr)) resolve();
    return local_;
  }
  // Whether the shard is still being computed (no wait).
  bool pending() const { return pending_ != nullptr; }
  const DTensorSpec& spec() const { return *spec_; }
  const SpecPtr& spec_ptr() const { return spec_; }
  // Replaces shard and spec together (set_data, in-place redistribution).
  void set(at::Tensor local, SpecPtr spec);

  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      const c10::VariableVersion& version_counter,
      bool allow_tensor_metadata_change) const override;
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      c10::VariableVersion&& version_counter,
      bool allow_tensor_metadata_change) const override;
  void shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) override;

 private:
  const char* tensorimpl_type_name() const override { return "DTensorImpl"; }
  void refreshStrides();
  void resolve() const;
  mutable at::Tensor local_;
  SpecPtr spec_;
  mutable std::shared_ptr<PendingLocal> pending_;  // null once the shard is here
};

inline bool isDTensor(const at::Tensor& t) {
  return t.defined() && t.unsafeGetTensorImpl()->key_set().has(c10::DispatchKey::PrivateUse1);
}
inline DTensorImpl* unsafeGetDTensorImpl(const at::Tensor& t) {
  return static_cast<DTensorImpl*>(t.unsafeGetTensorImpl());
}
inline DTensorImpl* maybeGetDTensorImpl(const at::Tensor& t) {
  return isDTensor(t) ? unsafeGetDTensorImpl(t) : nullptr;
}
// The DTensorImpl of `t`; a user error naming `fn` for a plain tensor.
const DTensorImpl& checkedDTensorImpl(const at::Tensor& t, const char* fn);
// The strides of a dense tensor of `sizes` whose dims lie in memory in the
// order of `layout`'s strides; a stride-0 (broadcast) dim keeps 0.
std::vector<int64_t> dense_strides_like(c10::IntArrayRef sizes, c10::IntArrayRef layout);
// A tensor sharing `t`'s memory and version counter, without autograd history:
// detach() without a dispatch (to_local and from_local run once per module
// and step).
at::Tensor detached_alias(const at::Tensor& t);
// Wraps `local` (this rank's shard of `spec`); checks the shard's shape.
at::Tensor makeDTensor(at::Tensor local, SpecPtr spec);
// A DTensor of `spec` whose shard `pending` computes.
at::Tensor makeDTensor(std::shared_ptr<PendingLocal> pending, SpecPtr spec);
// Whether `t` is a DTensor that nothing else can observe: no other handle on
// it, on its shard or on the shard's memory (views, autograd's saved copies).
// A redistribution may then reduce the shard in place.
bool solely_owned(const at::Tensor& t);

}  // namespace dtp
