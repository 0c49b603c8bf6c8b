// The query rows of one extend-attention tile and the keys they see, shared by the bfloat16 tiles
// (extend_tiles.h) and the float32 ones (extend_tiles_f32.h).

#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

namespace swa {
namespace attention {

constexpr int64_t kMaxTileRows = 16;  // the most query rows any tile holds

// Row r = token (r / G) of the tile, query head (r % G); lo..hi its keys (indices into the request's staged keys),
// none (hi <= lo) for a row that sees no key.
struct TileRows {
  int64_t count = 0;  // real rows
  int64_t lo[kMaxTileRows], hi[kMaxTileRows];

  // The keys rows r0..r1 see together: lo..hi, hi 0 where none sees any.
  void keys_of(int64_t r0, int64_t r1, int64_t& first, int64_t& end) const {
    first = std::numeric_limits<int64_t>::max();
    end = 0;
    for (int64_t r = r0; r < r1; ++r) {
      if (hi[r] <= lo[r]) continue;
      first = std::min(first, lo[r]);
      end = std::max(end, hi[r]);
    }
  }
};

}  // namespace attention
}  // namespace swa
