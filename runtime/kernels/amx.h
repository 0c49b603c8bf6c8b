// AMX-BF16 tiles for the kernels that use them (extend attention, extend_tiles.h): whether they can run here, and
// each thread's tile configuration. Linux hands a process the tiles' state only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a tile instruction without it faults.

#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SWA_AMX_BF16 1
#include <immintrin.h>
#endif

#include <cstdint>

namespace swa {

// Whether AMX-BF16 tiles can run here: built with them and granted by the OS (asked once).
bool amx_granted();

#if defined(SWA_AMX_BF16)
// This thread's tiles for as long as it lives: palette 1, eight tiles of 16 rows of 64 bytes; released at the end
// (a thread holding tile state makes every context switch save it).
class TileScope {
 public:
  TileScope();
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};
#endif

}  // namespace swa
