// Decode's weights in one buffer of 2 MB pages, in the order a step reads them (runtime/layers/weight_arena.py).

#include <cstdlib>

#include "quant.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace swa {

namespace {

constexpr int64_t kHugePage = int64_t{2} << 20;
constexpr int64_t kLine = 64;

int64_t line_up(int64_t n) { return (n + kLine - 1) / kLine * kLine; }

// `t` (contiguous) copied into arena[offset...] and returned as a view of it with t's dtype and shape.
at::Tensor move_into(const at::Tensor& t, at::Tensor& arena, int64_t& offset) {
  const int64_t bytes = t.numel() * t.element_size();
  TORCH_CHECK(offset + bytes <= arena.numel(), "the arena holds ", arena.numel(), " bytes, ", offset + bytes,
              " needed");
  auto view = arena.narrow(0, offset, bytes).view(t.scalar_type()).view(t.sizes());
  view.copy_(t.contiguous());
  offset = line_up(offset + bytes);
  return view;
}

}  // namespace

// Fresh pages from the kernel (an allocator could hand back memory already touched in 4 kB pages, which a later
// madvise does not turn into 2 MB ones), 2 MB aligned: mapped with 2 MB to spare, the ends cut off.
at::Tensor weight_arena(int64_t nbytes, bool huge_pages) {
  TORCH_CHECK(nbytes > 0, "an arena of ", nbytes, " bytes");
  const int64_t size = (nbytes + kHugePage - 1) / kHugePage * kHugePage;
#if defined(__linux__)
  void* mapped = mmap(nullptr, size + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(mapped != MAP_FAILED, "could not map ", size, " bytes for the weights");
  char* base = static_cast<char*>(mapped);
  char* p = base + (kHugePage - reinterpret_cast<uintptr_t>(base) % kHugePage) % kHugePage;
  if (p > base) munmap(base, p - base);
  if (p + size < base + size + kHugePage) munmap(p + size, base + size + kHugePage - (p + size));
#if defined(MADV_HUGEPAGE)
  if (huge_pages) madvise(p, size, MADV_HUGEPAGE);  // a hint: where the kernel has no such pages, 4 kB ones serve
#endif
  return at::from_blob(p, {size}, [size](void* q) { munmap(q, size); }, at::TensorOptions().dtype(at::kByte));
#else
  void* p = nullptr;
  TORCH_CHECK(posix_memalign(&p, kHugePage, size) == 0, "could not allocate ", size, " bytes for the weights");
  return at::from_blob(p, {size}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kByte));
#endif
}

int64_t Projection::placed_bytes() const {
  return line_up(packed_.numel() * packed_.element_size()) + line_up(scales_.numel() * scales_.element_size());
}

int64_t Projection::place(at::Tensor& arena, int64_t offset, bool huge_pages) {
  TORCH_CHECK(arena.scalar_type() == at::kByte && arena.dim() == 1 && arena.is_contiguous() && arena.device().is_cpu(),
              "the arena must be a contiguous uint8 CPU buffer");
  TORCH_CHECK(offset >= 0 && offset % kLine == 0, "offset must be a non-negative multiple of 64, got ", offset);
  packed_ = move_into(packed_, arena, offset);
  scales_ = move_into(scales_, arena, offset);
  huge_pages_ = huge_pages;
  return offset;
}

}  // namespace swa
