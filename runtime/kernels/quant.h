// Low-bit projections on AVX512-VNNI or AVX2: int8 per-channel weights, int8 with a scale per block of 32 or 128,
// exactly-4-bit weights with a float32 scale and offset per group of 32. See quant.cpp for the layouts and why.

#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "common.h"

namespace swa {

constexpr int64_t kBlock = 32;   // activation values per quantisation block; int4 weights per (scale, offset)
constexpr int64_t kWideBlock = 128;  // the same for the wide format (kInt8Wide): prefill's tiles
// A paired kInt8Wide copy (`Projection::paired`): the four weights of a row whose products one 16-bit sum of the AVX2
// tiles holds (values 8i + {0, 1, 4, 5} and 8i + {2, 3, 6, 7}) add up to at most this in magnitude, so that against
// activations within -127..127 the sum stays within 32767 (= 258 * 127 + 1).
constexpr int64_t kPairBudget = 258;
// A narrow kInt8Block copy (`Projection::narrow`): every weight within -16..16 (a GGUF's Q5_0 values, -16..15), so that
// the AVX2 kernels can take w + 16 (0..32) unsigned and add four lines' products, 8 to a 16-bit sum, within 32767
// (8 * 32 * 127 = 32512).
constexpr int64_t kNarrowMax = 16;
constexpr int64_t kMaxRows = 8;  // rows the streaming kernel takes (it keeps a row's sums in registers)
// Packed bytes from which a weight in 2 MB pages streams as one long read-ahead stream a thread on Zen 4 (an LM head:
// 84-170 MB; a layer's projections, at most 2.8 MB, keep four streams; quant_kernels.cpp, `vnni_vendor`).
constexpr int64_t kLongStream = int64_t{16} << 20;

// The instructions the low-bit kernels run on (quant_kernels.cpp): AVX512-VNNI's `vpdpbusd`, else AVX2's
// `vpmaddubsw` (quant_avx2.h), else none (the Python side then keeps torch's kernels).
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define SWA_LOW_BIT_AVX512 1
constexpr const char* kLowBitIsa = "avx512_vnni";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SWA_LOW_BIT_AVX2 1
constexpr const char* kLowBitIsa = "avx2";
#else
constexpr const char* kLowBitIsa = "";
#endif
constexpr bool kHasLowBit = kLowBitIsa[0] != '\0';

#if defined(SWA_LOW_BIT_AVX2)
// How the AVX2 kernels find a line's bytes ready (quant_avx2.h, `half_line`), so that no instruction a line goes to
// undoing how it is stored. On a 2-core Zen 1 EPYC an add or an absolute value a line took issue slots from the
// multiplies: a tile's loop 3-8% faster alone, the model's prefill projections 2-6% (docs/performance.md):
// - a narrow kInt8Block copy stores w + 16 (0..32), the unsigned operand as it is, not w + 128;
// - a kInt8Wide copy stores each line twice, its magnitudes |w| then its values w (int8), 128 bytes a line.
constexpr int kNarrowStored = kNarrowMax;
constexpr bool kWideMagnitudes = true;
#else
constexpr int kNarrowStored = 128;
constexpr bool kWideMagnitudes = false;
#endif

// Activations (M, K) quantised per block of 32 (or 128) values: symmetric int8 with one float scale a block (as
// llama.cpp's Q8 blocks), the int32 sum of each block's quantised values (the int8 format's +128 comes back
// out through it) and the float sum of each block's own values (int4's offsets multiply it).
struct QuantizedRows {
  int64_t M = 0, K = 0, block = kBlock;
  std::vector<int8_t> q;
  std::vector<float> scale, sum;
  std::vector<int32_t> qsum;

  // `column_mul` (cols,), or null: each row multiplied by it value by value before it is quantised (a smoothed
  // copy's activations, `Projection::int8_wide`).
  template <typename T>
  void quantize(const T* x, int64_t rows, int64_t cols, int64_t block_values = kBlock,
                const float* column_mul = nullptr);
  // The rows `which` of these, in that order (a refine's rows taken apart).
  QuantizedRows rows(const std::vector<int64_t>& which) const;
};

// kInt8: int8 with one scale a row; kInt8Block: int8 with one scale per row and block of 32 (a GGUF's Q5_0 and Q8_0
// tensors, exactly); kInt4: 16 levels with a step and an offset per row and block; kInt4Half: the same with the
// step and offset rounded to float16 (a screen's coarse copy: 2 bytes a scale instead of 4 take a sixth off its
// size); kInt8Wide: int8 with one float32 scale per row and block of 128, its activations quantised per 128 too
// (prefill's tiles: a quarter of the per-block scaling, quant.cpp).
enum class Format : int64_t { kInt8 = 0, kInt4 = 1, kInt8Block = 2, kInt4Half = 3, kInt8Wide = 4 };

constexpr bool is_int4(Format f) { return f == Format::kInt4 || f == Format::kInt4Half; }
// Values a block of activations holds (one scale a block), and 64-byte lines of weights per 16 rows and block.
constexpr int64_t block_values(Format f) { return f == Format::kInt8Wide ? kWideBlock : kBlock; }
constexpr int64_t block_lines(Format f) { return is_int4(f) ? 4 : block_values(f) / 4; }

// One weight (N, K) in a kernel's packed layout: y (M, N) = x (M, K) @ W^T; optionally a second copy (`tiles`)
// that takes the rows past kMaxRows.
class Projection {
 public:
  // int8 (N, K) with float32 scales (N,): W = q * scale per row; or (N, K / 32): W = q * scale per block of 32.
  static Projection int8(const at::Tensor& q, const at::Tensor& scales);
  // int8 (N, K) with float32 scales (N, K / 128): W = q * scale per block of 128 (kInt8Wide). With `smooth` (K,)
  // float32, positive: q * scale holds W * smooth column by column, and the activations are divided by it (multiplied
  // by its reciprocal) before they are quantised, so that the product is unchanged and a few large activation columns
  // no longer set their blocks' scales alone.
  static Projection int8_wide(const at::Tensor& q, const at::Tensor& scales,
                              const std::optional<at::Tensor>& smooth = std::nullopt);
  // q (N, K) in 0..15 (uint8 or int32), step and low (N, K / 32) float32: W = low + step * q per group of 32.
  // With `half_scales`, step and low are kept rounded to float16 (kInt4Half).
  static Projection int4(const at::Tensor& q, const at::Tensor& step, const at::Tensor& low, bool half_scales = false);

  // (M, K) -> (M, N) in x's dtype or float32: up to kMaxRows rows streamed (`run`), more in tiles (`run_tiled`),
  // on the `tiles` copy where there is one.
  at::Tensor matmul(const at::Tensor& x, bool float_out) const;
  // y (rows, N) = x (rows, K) @ W^T as `matmul` computes it, quantising x into `xq`.
  template <typename T, typename Y>
  void apply(const T* x, int64_t rows, Y* y, QuantizedRows& xq) const;
  // The copy that takes rows past kMaxRows instead of this one (same shape); see `apply`.
  void set_tiles(const Projection& tiles);
  void drop_tiles() { tiles_.reset(); }
  bool has_tiles() const { return tiles_ != nullptr; }
  template <typename T>
  void run(const QuantizedRows& x, T* y) const;  // y (x.M <= 8, N), threads from ATen's pool
  template <typename T>
  void run_tiled(const QuantizedRows& x, T* y) const;  // y (x.M, N): prefill's many rows
  // y (M, N) float32 holds a screen's approximate sums of x @ W^T (a coarser copy of this weight): in each row, every
  // group of 16 columns with a value within `margin` of that row's largest is recomputed here exactly, as `matmul`
  // computes it (on this copy, not a tiles' one). Returns the number of groups recomputed, all rows' together. For
  // int8 weights, any number of rows.
  int64_t refine(const at::Tensor& x, const at::Tensor& y, double margin) const;
  int64_t refine_groups(const QuantizedRows& x, float* y, float margin) const;

  int64_t out_features() const { return N_; }
  int64_t in_features() const { return K_; }
  int64_t nbytes() const {  // this copy's
    return packed_.numel() + scales_.numel() * scales_.element_size() + column_mul_.numel() * sizeof(float);
  }
  Format format() const { return format_; }
  // Bytes `place` takes: the streamed weights and their scales, each from a 64-byte boundary (weight_arena.cpp).
  int64_t placed_bytes() const;
  // Moves the streamed weights and scales (not the tiles' copy) into `arena` (uint8, from `weight_arena`) at
  // `offset` (a multiple of 64) and on; returns the offset past them. `huge_pages`: the arena is in 2 MB pages (the
  // streaming kernel then reads a long weight as one stream a thread). Copies of this Projection made before (a
  // decode stack's) keep the old buffers.
  int64_t place(at::Tensor& arena, int64_t offset, bool huge_pages);
  bool huge_pages() const { return huge_pages_; }
  // kInt8Wide within `kPairBudget`: the AVX2 tiles then add two lines' pair sums in 16 bits before widening them
  // (quant_avx2.h, `lines_in_16_bits`); AVX512-VNNI has no use for it.
  bool paired() const { return paired_; }
  // kInt8Block within `kNarrowMax`: the AVX2 kernels then add four lines' pair sums in 16 bits before one widening
  // (quant_avx2.h, `lines_in_16_bits`).
  bool narrow() const { return narrow_; }
  // Whether `rows` (at most kMaxRows) run in tiles rather than the streaming kernel: on AVX2, a narrow copy from 7
  // rows and an int4 one from 8. Their four lines' pair sums in 16 bits take a register a row beside each row's
  // integer and float sums, so the streaming kernel's eight rows spill on AVX2's 16 registers; a tile holds 4 (a
  // 2-core Zen 1 EPYC, docs/performance.md: tiles 1.10-1.34x the streaming kernel for narrow at 7-8 rows, 1.03-1.21x
  // for int4 at 8, and 0.73-0.98x at 2-6 rows).
  bool rows_in_tiles(int64_t rows) const;
  // whether it, or its tiles' copy, divides its activations by a smooth (`int8_wide`)
  bool smoothed() const { return column_mul_.defined() || (tiles_ != nullptr && tiles_->smoothed()); }

 private:
  Projection(at::Tensor packed, at::Tensor scales, int64_t N, int64_t K, Format format)
      : packed_(std::move(packed)), scales_(std::move(scales)), N_(N), K_(K), format_(format) {}
  const float* column_mul() const { return column_mul_.defined() ? column_mul_.data_ptr<float>() : nullptr; }
  at::Tensor packed_, scales_;
  at::Tensor column_mul_;  // (K,) float32, the activations' multipliers of a smoothed copy; undefined otherwise
  int64_t N_, K_;
  Format format_;
  bool huge_pages_ = false;  // placed in an arena of 2 MB pages (`place`)
  bool paired_ = false;  // kInt8Wide within kPairBudget (`paired`)
  bool narrow_ = false;  // kInt8Block within kNarrowMax (`narrow`)
  std::shared_ptr<const Projection> tiles_;
};

// A buffer of `nbytes` (rounded up to 2 MB) aligned to 2 MB, asked of the kernel in 2 MB pages where `huge_pages`
// (madvise; a hint): decode's weights placed there in read order (runtime/layers/weight_arena.py).
at::Tensor weight_arena(int64_t nbytes, bool huge_pages);

}  // namespace swa
