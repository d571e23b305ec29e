/* Does the AMX tile unit's work overlap the AVX-512 scaling of its sums on this CPU?
 *
 *     gcc -O3 -march=native scripts/bench_amx_overlap.c -o /tmp/amx_overlap && /tmp/amx_overlap
 *
 * One "tile op" is what the quantized Linear's AMX path does per 32-input block and
 * 16 rows (engine/kernels/quant_kernels.c): load tile B (8 x 64 bytes of weights) and
 * tile A (16 x 32 bytes of activations), zero C, tdpbssd, store C (16 x 16 int32). The
 * scaling is its vector work per block: per row, load 16 sums, convert, multiply the
 * weight scales by the row's scale, fused multiply-add into 16 accumulators. Printed:
 * ns per block for each alone and for both in one loop, on independent data (so any
 * difference from the larger of the two alone is the core not overlapping them).
 * Then the tile op's instructions one at a time, added in turn: tdpbssd on a zeroed C,
 * then with the load of A, of B, the store of C (each instruction's share).
 * Single thread; the weights of 96 tiles x 18 blocks stream from L2 as in a
 * [1536, 576] layer. Needs a CPU with AMX-INT8 and Linux 5.16 or later. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

struct tilecfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

#define NB 18
#define TILES 96
#define TB (16 * 34) /* one Q8_0 block of a 16-output tile */
static int8_t act[16 * 576] __attribute__((aligned(64)));
static uint8_t weights[TILES * NB * TB] __attribute__((aligned(64)));
static int32_t sums[2][256] __attribute__((aligned(64)));
static int32_t other[2][256] __attribute__((aligned(64)));
static float row_scale[16 * NB];

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static inline void tile_op(const uint8_t *blk, int b, int32_t *c) {
    _tile_loadd(2, blk + 32, 64);
    _tile_loadd(1, act + b * 32, 576);
    _tile_zero(0);
    _tile_dpbssd(0, 1, 2);
    _tile_stored(0, c, 64);
}

static inline void scale(__m512 *acc, const int32_t *c, const uint8_t *blk, int b) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    for (int r = 0; r < 16; r++) {
        const __m512 s = _mm512_mul_ps(d, _mm512_set1_ps(row_scale[r * NB + b]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + r * 16)), s, acc[r]);
    }
}

int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) != 0) {
        fprintf(stderr, "the kernel lends this process no AMX tiles\n");
        return 1;
    }
    struct tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = 16, cfg.colsb[0] = 64;
    cfg.rows[1] = 16, cfg.colsb[1] = 32;
    cfg.rows[2] = 8, cfg.colsb[2] = 64;
    _tile_loadconfig(&cfg);
    for (int i = 0; i < 16 * NB; i++) row_scale[i] = 1e-3f * (float)(i % 7 + 1);
    for (int i = 0; i < 256; i++) other[0][i] = other[1][i] = i - 128; /* not known zeros */
    for (size_t i = 0; i < sizeof weights; i++) weights[i] = (uint8_t)(i * 131 + 7);
    for (int i = 0; i < 16 * 576; i++) act[i] = (int8_t)(i % 255 - 127);
    const char *names[3] = {"tile ops alone", "scaling alone", "both, independent data"};
    const int reps = 1500;
    for (int mode = 0; mode < 3; mode++) {
        __m512 acc[16];
        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        const double start = now();
        for (int rep = 0; rep < reps; rep++)
            for (int t = 0; t < TILES; t++)
                for (int b = 0; b < NB; b++) {
                    const uint8_t *blk = weights + ((size_t)t * NB + b) * TB;
                    if (mode != 1) tile_op(blk, b, sums[b & 1]);
                    if (mode != 0) scale(acc, other[b & 1], blk, b);
                }
        const double ns = (now() - start) / ((double)reps * TILES * NB) * 1e9;
        __m512 all = acc[0];
        for (int r = 1; r < 16; r++) all = _mm512_add_ps(all, acc[r]);
        float sink[16]; /* every accumulator is used: none of the scaling is dead code */
        _mm512_storeu_ps(sink, all);
        printf("%-24s %5.1f ns per block%s\n", names[mode], ns, sink[0] == 12345.0f ? " " : "");
    }
    const char *parts[4] = {"tdpbssd (C zeroed)", "+ load of A", "+ load of B", "+ store of C"};
    _tile_loadd(1, act, 576);
    _tile_loadd(2, weights + 32, 64);
    for (int part = 0; part < 4; part++) {
        const double start = now();
        for (int rep = 0; rep < reps; rep++)
            for (int t = 0; t < TILES; t++)
                for (int b = 0; b < NB; b++) {
                    const uint8_t *blk = weights + ((size_t)t * NB + b) * TB;
                    if (part >= 2) _tile_loadd(2, blk + 32, 64);
                    if (part >= 1) _tile_loadd(1, act + b * 32, 576);
                    _tile_zero(0);
                    _tile_dpbssd(0, 1, 2);
                    if (part >= 3) _tile_stored(0, sums[b & 1], 64);
                }
        const double ns = (now() - start) / ((double)reps * TILES * NB) * 1e9;
        printf("%-24s %5.1f ns per block\n", parts[part], ns);
    }
    _tile_release();
    return 0;
}
