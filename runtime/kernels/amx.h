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

// Whether extend attention's tiles run on AMX: built with AMX-BF16, granted by the OS, and not switched off.
bool amx_attention_on();
// Switches it on or off (tests and benchmarks compare it with the AVX512-BF16 tiles); returns the previous setting.
// Off where it cannot run.
bool set_amx_attention(bool on);

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
