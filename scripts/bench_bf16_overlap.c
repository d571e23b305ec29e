/* Does the bf16-tile path's dequantization overlap its tile products on this CPU?
 *
 *     .venv/bin/python -c "from engine.kernels.build import read_source; \
 *         open('/tmp/k_all.c', 'wb').write(read_source())"
 *     gcc -O3 -march=native -ffast-math -fopenmp -std=c11 -include /tmp/k_all.c \
 *         scripts/bench_bf16_overlap.c -o /tmp/bf16_overlap -lmvec -lm && /tmp/bf16_overlap
 *
 * Built on the kernels' own source (the path of `--no-batch-invariance`,
 * engine/kernels/quant_kernels.c), so it times the code as shipped: a group's Q4_1 block
 * (two tiles of 16 outputs x 32 inputs) made tiles B in 8 steps (q_bf16_step), and a
 * block's products for 32 rows (q_bf16_block: 4 tile loads, 4 tdpbf16ps). Printed, TSC
 * cycles a block over 1,728 blocks (a [1536, 576] layer's), 20 times, three runs:
 * the dequantization alone; the products alone; both one after the other (the path
 * before the steps were interleaved); and the next block's steps between the current
 * block's tile instructions (as shipped). Single thread; random quants, small scales.
 * Needs a CPU with AMX-BF16 and Linux 5.16 or later. */
#include <stdio.h>
#include <stdlib.h>

#if !defined(QPATH_AMX_BF16)
int main(void) {
    puts("this CPU's build of the kernels has no bf16-tile path (no AMX-BF16)");
    return 1;
}
#else
static uint64_t tsc(void) {
    unsigned lo, hi;
    __asm__ volatile("rdtsc" : "=a"(lo), "=d"(hi));
    return ((uint64_t)hi << 32) | lo;
}

#define NB 1728
#define REPS 20

int main(void) {
    if (!amx_ready()) {
        puts("Linux lent no AMX tiles");
        return 1;
    }
    const int32_t fmt = QFMT_Q4_1;
    const int64_t tb = q_tile_block_bytes(fmt);
    /* two tiles' blocks side by side: group[0] block b at w + 2b tb, group[1] after it */
    uint8_t *w = aligned_alloc(64, (size_t)(2 * NB * tb));
    srand(1);
    for (int64_t i = 0; i < 2 * NB * tb; i++) w[i] = (uint8_t)rand();
    for (int64_t b = 0; b < 2 * NB; b++) { /* fp16 d and m: small, finite */
        uint16_t *h = (uint16_t *)(w + b * tb);
        for (int j = 0; j < 32; j++) h[j] = (uint16_t)(0x2c00 + (rand() & 0xff));
    }
    const uint8_t *group[QTILES] = {w, w + NB * tb};
    bf16 *bt = aligned_alloc(64, sizeof(bf16) * 2 * QTILES * 512);
    bf16 *x = aligned_alloc(64, sizeof(bf16) * 2 * 512);
    memset(bt, 0, sizeof(bf16) * 2 * QTILES * 512);
    memset(x, 0, sizeof(bf16) * 2 * 512);
    q_bf16_config();
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    struct q_bf16_src src;
    for (int run = 0; run < 3; run++) {
        uint64_t t[5];
        t[0] = tsc();
        for (int r = 0; r < REPS; r++)
            for (int64_t b = 0; b < NB; b++) {
                q_bf16_src_at(&src, fmt, group, b);
                for (int s = 0; s < 4 * QTILES; s++) q_bf16_step(fmt, &src, bt, s);
            }
        t[1] = tsc();
        for (int r = 0; r < REPS; r++)
            for (int64_t b = 0; b < NB; b++) q_bf16_block(bt, x, x + 512, 1, fmt, &src, NULL);
        t[2] = tsc();
        for (int r = 0; r < REPS; r++)
            for (int64_t b = 0; b < NB; b++) {
                q_bf16_src_at(&src, fmt, group, b);
                for (int s = 0; s < 4 * QTILES; s++) q_bf16_step(fmt, &src, bt, s);
                q_bf16_block(bt, x, x + 512, 1, fmt, &src, NULL);
            }
        t[3] = tsc();
        for (int r = 0; r < REPS; r++)
            for (int64_t b = 0; b < NB; b++) {
                bf16 *cur = bt + (b & 1) * QTILES * 512, *next = bt + (~b & 1) * QTILES * 512;
                q_bf16_src_at(&src, fmt, group, (b + 1) % NB);
                q_bf16_block(cur, x, x + 512, 1, fmt, &src, next);
            }
        t[4] = tsc();
        const double per = (double)REPS * NB;
        printf("TSC cycles a block: dequantization %.1f, products %.1f, one after the other "
               "%.1f, interleaved %.1f\n",
               (double)(t[1] - t[0]) / per, (double)(t[2] - t[1]) / per,
               (double)(t[3] - t[2]) / per, (double)(t[4] - t[3]) / per);
    }
    float c[256] __attribute__((aligned(64)));
    _tile_stored(0, c, 64);
    _tile_release();
    return c[0] == 12345.0f; /* keeps the work */
}
#endif
