/* What every AMX kernel of kernels/csrc needs: whether this build has the tiles, the process's permission to use
 * them, and the one tile configuration they all use. Included by skinny_gemm_cpu.c and awq_gemm_cpu.c. */
#ifndef MINIVLLM_AMX_TILES_H
#define MINIVLLM_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

/* 1 when this process may use the tiles (Linux hands out AMX state on request), else 0. */
static inline int amx_request_permission(void) {
#if HAVE_AMX
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

#if HAVE_AMX
typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Eight tiles of 16 rows x 64 bytes (accumulators of 16 x 16 float32 or int32, operands of 16 x 32 bf16 or
 * 16 x 64 int8): the one shape every kernel here uses. */
static inline void configure_tiles(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}
#endif

#endif
