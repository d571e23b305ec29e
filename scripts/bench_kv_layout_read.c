/* How fast one thread reads a decode step's keys and values in the KV cache's layout,
 * with no arithmetic: the access orders paged attention can use. SmolLM2's fp32 cache,
 * 300 tokens of context a layer (19 blocks of keys, 19 of values, each 16 tokens x 3 KV
 * heads x 64 values = 12 KB, scattered in a 512 MB cache on 2 MB pages as the engine's
 * is), every layer's blocks in memory (the cache is far larger than the L3).
 *
 *     gcc -O2 -mavx2 scripts/bench_kv_layout_read.c -o /tmp/kvread && /tmp/kvread
 *
 * Orders: "one head at a time" reads KV head 0's 256 bytes of every token of every
 * block, then head 1's, then head 2's (work items of one KV head); "blocks, head by head"
 * each block in turn, its heads one after another; "blocks, front to back" each block
 * as one stretch (items of every KV head, token by token); "front to back + next block"
 * the same, asking for the next block's line into L2 as each line is read (what
 * block_rows_f32 does). Prints the best of 5 passes over all layers: us a layer, GB/s. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int madvise(void *addr, size_t length, int advice);
int posix_memalign(void **ptr, size_t alignment, size_t size);

enum { BLOCK = 12288, TOKEN = 768, HEAD = 256, TOKENS = 16, HEADS = 3, PER_LAYER = 19 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static __m256 read_head(__m256 s, const char *p) { /* one head's 256 bytes of 16 tokens */
    for (int t = 0; t < TOKENS; t++)
        for (int k = 0; k < HEAD; k += 32) s = _mm256_add_ps(s, _mm256_load_ps((const float *)(p + t * TOKEN + k)));
    return s;
}

int main(void) {
    const size_t bytes = (size_t)512 << 20, blocks = bytes / BLOCK;
    char *cache = NULL;
    if (posix_memalign((void **)&cache, (size_t)2 << 20, bytes)) return 1;
    madvise(cache, bytes, 14); /* MADV_HUGEPAGE */
    for (size_t i = 0; i < bytes / 4; i++) ((float *)cache)[i] = (float)(i & 1023);
    int *order = malloc(blocks * sizeof(int)); /* a busy cache's blocks: any order */
    for (size_t i = 0; i < blocks; i++) order[i] = (int)i;
    for (size_t i = blocks - 1; i > 0; i--) {
        const size_t j = (size_t)rand() % (i + 1);
        const int t = order[i];
        order[i] = order[j], order[j] = t;
    }
    const size_t layers = blocks / (2 * PER_LAYER);
    const char *names[4] = {"one head at a time", "blocks, head by head", "blocks, front to back",
                            "front to back + next block"};
    for (int mode = 0; mode < 4; mode++) {
        double best = 1e9;
        __m256 s = _mm256_setzero_ps();
        for (int pass = 0; pass < 5; pass++) {
            const double t0 = now();
            for (size_t l = 0; l < layers; l++) {
                const int *b = order + l * 2 * PER_LAYER; /* block i: keys b[2i], values b[2i+1] */
                for (int h = 0; h < (mode == 0 ? HEADS : 1); h++)
                    for (int i = 0; i < PER_LAYER; i++)
                        for (int kv = 0; kv < 2; kv++) {
                            const char *p = cache + (size_t)b[2 * i + kv] * BLOCK;
                            const char *next =
                                i + 1 < PER_LAYER ? cache + (size_t)b[2 * (i + 1) + kv] * BLOCK : p;
                            if (mode == 0)
                                s = read_head(s, p + h * HEAD);
                            else if (mode == 1)
                                for (int hh = 0; hh < HEADS; hh++) s = read_head(s, p + hh * HEAD);
                            else
                                for (int k = 0; k < BLOCK; k += 64) {
                                    if (mode == 3) _mm_prefetch(next + k, _MM_HINT_T1);
                                    s = _mm256_add_ps(s, _mm256_load_ps((const float *)(p + k)));
                                    s = _mm256_add_ps(s, _mm256_load_ps((const float *)(p + k + 32)));
                                }
                        }
            }
            const double t = (now() - t0) / layers;
            if (t < best) best = t;
        }
        float sink[8];
        _mm256_storeu_ps(sink, s);
        printf("%-28s %5.1f us a layer (%d KB), %5.1f GB/s%s\n", names[mode], best * 1e6,
               2 * PER_LAYER * BLOCK / 1024, 2.0 * PER_LAYER * BLOCK / best / 1e9,
               sink[0] == -1.0f ? " " : "");
    }
    return 0;
}
