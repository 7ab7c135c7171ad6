// See NOTE: [Bounded box IO] in include/dtp/io/box_io.h.
#include "dtp/io/box_io.h"

#include "io/file_util.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <vector>

namespace dtp::io {
namespace {

// A box [start, start + size) of a row-major tensor of `shape` is a set of
// runs: the box covers whole trailing dimensions from `k + 1` on, so for each
// index of the dims before k one run of size[k] * inner elements is
// contiguous. `visit(file_elem, box_elem, n)` is called for each run, in
// the box's row-major order.
template <class Visit>
void forEachRun(c10::IntArrayRef shape, c10::IntArrayRef start, c10::IntArrayRef size, Visit visit) {
  const int64_t nd = static_cast<int64_t>(shape.size());
  if (nd == 0) {
    visit(0, 0, 1);
    return;
  }
  int64_t k = nd - 1, inner = 1;
  while (k > 0 && size[k] == shape[k]) inner *= shape[k--];
  std::vector<int64_t> stride(nd, 1);
  for (int64_t d = nd - 2; d >= 0; --d) stride[d] = stride[d + 1] * shape[d + 1];
  const int64_t run = size[k] * inner;
  std::vector<int64_t> idx(k, 0);  // over dims [0, k)
  for (int64_t boxElem = 0;; boxElem += run) {
    int64_t fileElem = start[k] * stride[k];
    for (int64_t d = 0; d < k; ++d) fileElem += (start[d] + idx[d]) * stride[d];
    visit(fileElem, boxElem, run);
    int64_t d = k - 1;
    for (; d >= 0; --d) {
      if (++idx[d] < size[d]) break;
      idx[d] = 0;
    }
    if (d < 0) break;
  }
}

// Calls `leaf(start, narrowed_view)` on parts of the box no larger than
// `buffer_bytes`, splitting along the outermost dimension of size > 1.
template <class Leaf>
void splitBox(std::vector<int64_t> start, const at::Tensor& view, uint64_t elem, uint64_t buffer_bytes, Leaf leaf) {
  if (view.numel() == 0) return;
  if (static_cast<uint64_t>(view.numel()) * elem <= buffer_bytes || view.numel() == 1) {
    leaf(start, view);
    return;
  }
  int64_t d = 0;
  while (view.size(d) == 1) ++d;
  const int64_t half = view.size(d) / 2;
  splitBox(start, view.narrow(d, 0, half), elem, buffer_bytes, leaf);
  start[d] += half;
  splitBox(start, view.narrow(d, half, view.size(d) - half), elem, buffer_bytes, leaf);
}

void checkBox(const std::string& what, const StoredTensor& stored, c10::IntArrayRef start, c10::IntArrayRef size) {
  bool inside = start.size() == stored.shape.size() && size.size() == stored.shape.size();
  for (size_t d = 0; inside && d < start.size(); ++d) {
    inside = start[d] >= 0 && size[d] >= 0 && start[d] + size[d] <= stored.shape[d];
  }
  TORCH_CHECK(inside, what, ": box start ", start, " size ", size, " is outside tensor '", stored.name,
              "' of shape ", c10::IntArrayRef(stored.shape), ". Give a start and a tensor whose extent lies inside "
              "the stored shape, one entry per dimension.");
}

}  // namespace

void read_box(const SafetensorsFile& file, const StoredTensor& stored, c10::IntArrayRef start, at::Tensor dst,
              uint64_t buffer_bytes) {
  checkBox("read_box", stored, start, dst.sizes());
  const uint64_t elem = c10::elementSize(stored.dtype);
  std::vector<char> buffer;
  splitBox(start.vec(), dst, elem, buffer_bytes, [&](const std::vector<int64_t>& at, const at::Tensor& part) {
    buffer.resize(std::max<uint64_t>(buffer.size(), part.numel() * elem));
    at::Tensor raw = at::from_blob(buffer.data(), part.sizes(), at::TensorOptions().dtype(stored.dtype));
    char* base = buffer.data();
    forEachRun(stored.shape, at, part.sizes(), [&](int64_t fileElem, int64_t boxElem, int64_t n) {
      file.read(stored.begin + fileElem * elem, base + boxElem * elem, n * elem);
    });
    part.copy_(raw);
  });
}

void write_box(int fd, const std::string& path, const StoredTensor& stored, c10::IntArrayRef start,
               const at::Tensor& src, uint64_t buffer_bytes) {
  checkBox("write_box", stored, start, src.sizes());
  const uint64_t elem = c10::elementSize(stored.dtype);
  std::vector<char> buffer;
  splitBox(start.vec(), src, elem, buffer_bytes, [&](const std::vector<int64_t>& at, const at::Tensor& part) {
    buffer.resize(std::max<uint64_t>(buffer.size(), part.numel() * elem));
    at::from_blob(buffer.data(), part.sizes(), at::TensorOptions().dtype(stored.dtype)).copy_(part);
    const char* base = buffer.data();
    forEachRun(stored.shape, at, part.sizes(), [&](int64_t fileElem, int64_t boxElem, int64_t n) {
      TORCH_CHECK(pwrite_all(fd, base + boxElem * elem, n * elem, stored.begin + fileElem * elem),
                  "write_box: writing tensor '", stored.name, "' into '", path, "' failed: ", errno_text(),
                  ". Check free disk space and permissions.");
    });
  });
}

}  // namespace dtp::io
