#include "dlpack.h"

#include "vrange.h"

namespace kvcached {
namespace dl {

namespace {

// Everything one view needs, in one allocation: the tensor (either DLPack struct),
// its shape storage, and the reference that keeps the range alive.
template <typename Managed>
struct ViewCtx {
  Managed tensor{};
  std::int64_t shape[1] = {0};
  std::shared_ptr<RangeState> range;
};

template <typename Managed>
void delete_view(Managed* self) {
  auto* ctx = static_cast<ViewCtx<Managed>*>(self->manager_ctx);
  ctx->range->live_views.fetch_sub(1);
  delete ctx;  // may drop the last reference and free the reservation
}

template <typename Managed>
Managed* export_view(const std::shared_ptr<RangeState>& range, std::size_t offset, std::size_t nbytes) {
  auto* ctx = new ViewCtx<Managed>();
  ctx->range = range;
  ctx->shape[0] = static_cast<std::int64_t>(nbytes);
  DLTensor& t = ctx->tensor.dl_tensor;
  t.data = reinterpret_cast<void*>(range->address() + offset);
  t.device.device_type = range->dl_device_type();
  t.device.device_id = range->device_id();
  t.ndim = 1;
  t.dtype = DLDataType{kDLUInt, 8, 1};
  t.shape = ctx->shape;
  t.strides = nullptr;
  t.byte_offset = 0;
  ctx->tensor.manager_ctx = ctx;
  ctx->tensor.deleter = delete_view<Managed>;
  range->live_views.fetch_add(1);
  return &ctx->tensor;
}

}  // namespace

DLManagedTensor* export_bytes(const std::shared_ptr<RangeState>& range, std::size_t offset,
                              std::size_t nbytes) {
  return export_view<DLManagedTensor>(range, offset, nbytes);
}

DLManagedTensorVersioned* export_bytes_versioned(const std::shared_ptr<RangeState>& range,
                                                 std::size_t offset, std::size_t nbytes) {
  DLManagedTensorVersioned* t = export_view<DLManagedTensorVersioned>(range, offset, nbytes);
  t->version = DLPackVersion{1, 0};
  t->flags = 0;
  return t;
}

}  // namespace dl
}  // namespace kvcached
