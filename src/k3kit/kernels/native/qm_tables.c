/* qm_tables.c: the lookup tables, defined once (qm.h declares them): the IQ grids and sign masks,
 * which init_tables() fills from gguf-py's data, and MXFP4's scales, which init_e8m0() computes
 * at import. A file of their own so that no kernel file owns state another one reads. */
#include "qm.h"

uint64_t IQ2XXS_GRID[256];   /* iq2xxs_grid: 8 bytes 0x08/0x19/0x2b per entry */
uint64_t IQ2XS_GRID[512];    /* iq2xs_grid */
uint32_t IQ3XXS_GRID[256];   /* iq3xxs_grid: 4 bytes per entry */
uint64_t IQ1S_GRID8[2048];   /* iq1s_grid (-1, 0, 1) times 8, as int8 bytes */
uint64_t SIGN_MASK[128];     /* ksigns_iq2xs[i]: byte j = 0xFF where bit j is set */
int tables_ready = 0;

float E8M0_HALF[256];

void init_e8m0(void) {
    for (int e = 0; e < 256; e++) {
        uint32_t bits = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
        memcpy(&E8M0_HALF[e], &bits, sizeof bits);
    }
}
