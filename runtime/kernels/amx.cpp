// AMX-BF16 tile state (amx.h).

#include "amx.h"

#if defined(SWA_AMX_BF16)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace swa {

namespace {

#if defined(SWA_AMX_BF16)
bool granted() {
  static const bool ok = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      bytes_per_row[t] = 64;
      rows[t] = 16;
    }
  }
};
#else
bool granted() { return false; }
#endif

}  // namespace

bool amx_granted() { return granted(); }

#if defined(SWA_AMX_BF16)
TileScope::TileScope() {
  static const TileConfig config;
  _tile_loadconfig(&config);
}
#endif

}  // namespace swa
