/* The bf16 paged-attention kernel (F32=1: the fp32 one, on the same values widened)
 * alone, called from C (no Python wrapper, no torch): one decode step of `seqs`
 * sequences of `ctx` tokens, the default model's shape (9 query heads, 3 KV heads,
 * head size 64, 16-token blocks scattered in random order).
 *
 *     gcc -O2 scripts/bench_attention_kernel.c -o /tmp/attn $LIB -fopenmp -Wl,-rpath,$(dirname $LIB)
 *     /tmp/attn 8 150 1      # seqs, ctx, threads
 *
 * with LIB the built kernels (`ls -t ~/.cache/specserve/kernels/cpu_kernels-*.so | head -1`
 * after any specserve run). Prints the best of 5 loops of 2000 calls: us a call and G
 * multiply-adds/s (Q.K and P.V). SEQUENTIAL=1 lays each sequence's blocks out in order.
 * BF16KV=1 times fp32 query rows over the bf16 cache (--kv-cache-dtype bfloat16).
 * LAYERS=30 gives each call in turn its own cache, one of 30 (the model's layers), so
 * the keys and values come from memory as they do in a decode step, not from L2/L3.
 * HUGE=1 advises the caches onto 2 MB pages (MADV_HUGEPAGE) before they are first
 * touched, as the engine's KV cache is (engine/attention: allocate_kv_caches).
 * MIXED=1 gives the sequences lengths drawn from 1 .. 2 x ctx (the same draw every run),
 * as a step of requests at different points of their answers has them. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>
/* declared here: the build is plain gcc -O2, no _GNU_SOURCE */
int madvise(void *addr, size_t length, int advice);
int posix_memalign(void **ptr, size_t alignment, size_t size);
/* n bytes; with HUGE=1, 2 MB-aligned and advised onto 2 MB pages (MADV_HUGEPAGE = 14) */
static void *cache_alloc(size_t n) {
    if (!getenv("HUGE")) return malloc(n);
    const size_t huge = (size_t)2 << 20, rounded = (n + huge - 1) / huge * huge;
    void *p = NULL;
    if (posix_memalign(&p, huge, rounded)) return NULL;
    madvise(p, rounded, 14);
    return p;
}
typedef uint16_t bf16;
/* the kernels' entry points: bf16, fp32, and fp32 rows over a bf16 cache */
#define PAGED_ATTENTION(NAME, T)                                                               \
    int NAME(T *out, int64_t out_token_stride, const T *q, int64_t q_token_stride,             \
             const T *k_cache, const T *v_cache, const int32_t *block_tables,                  \
             int64_t block_table_stride, int64_t table_width, const int32_t *seq_lens,         \
             const int32_t *query_start_loc, int64_t num_seqs, int64_t num_tokens,             \
             const int32_t *seq_ids, int64_t num_selected, int64_t num_heads,                  \
             int64_t num_kv_heads, int64_t head_dim, int64_t block_size,                       \
             int64_t num_cache_blocks, float scale, int64_t max_rows, int32_t num_threads,     \
             const int64_t *tree_masks);
PAGED_ATTENTION(specserve_paged_attention_bf16, bf16)
PAGED_ATTENTION(specserve_paged_attention, float)
int specserve_paged_attention_f32_bf16kv(float *out, int64_t out_token_stride, const float *q, int64_t q_token_stride,
             const bf16 *k_cache, const bf16 *v_cache, const int32_t *block_tables,
             int64_t block_table_stride, int64_t table_width, const int32_t *seq_lens,
             const int32_t *query_start_loc, int64_t num_seqs, int64_t num_tokens,
             const int32_t *seq_ids, int64_t num_selected, int64_t num_heads,
             int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
             int64_t num_cache_blocks, float scale, int64_t max_rows, int32_t num_threads,
             const int64_t *tree_masks);
/* dst[i] = src[i] as fp32 (a bf16 is the top half of its fp32) */
static void widen(float *dst, const bf16 *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const uint32_t w = (uint32_t)src[i] << 16;
        memcpy(&dst[i], &w, 4);
    }
}
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    int seqs = atoi(argv[1]), ctx = atoi(argv[2]), threads = atoi(argv[3]);
    const int mixed = getenv("MIXED") != NULL;
    int heads = 9, kvh = 3, hd = 64, bs = 16, per = (mixed ? 2 * ctx : ctx) / bs + 2;
    int64_t nblocks = (int64_t)seqs * per + 1;
    const int layers = getenv("LAYERS") ? atoi(getenv("LAYERS")) : 1;
    const int64_t layer_size = nblocks * bs * kvh * hd, cache_size = layer_size * layers;
    bf16 *kc = cache_alloc(cache_size * 2), *vc = cache_alloc(cache_size * 2);
    for (int64_t i = 0; i < cache_size; i++) kc[i] = vc[i] = 0x3f80 + (rand() % 64);
    bf16 *q = malloc(seqs * heads * hd * 2), *out = malloc(seqs * heads * hd * 2);
    for (int i = 0; i < seqs * heads * hd; i++) q[i] = 0x3c00 + rand() % 256;
    const int f32 = getenv("F32") != NULL; /* the same values widened to fp32 */
    /* BF16KV=1: fp32 query rows over the bf16 cache (--kv-cache-dtype bfloat16) */
    const int bf16kv = getenv("BF16KV") != NULL;
    float *kf = NULL, *vf = NULL, *qf = NULL, *outf = NULL;
    if (f32 || bf16kv) {
        qf = malloc(seqs * heads * hd * 4), outf = malloc(seqs * heads * hd * 4);
        widen(qf, q, (int64_t)seqs * heads * hd);
    }
    if (f32) {
        kf = cache_alloc(cache_size * 4), vf = cache_alloc(cache_size * 4);
        widen(kf, kc, cache_size);
        widen(vf, vc, cache_size);
    }
    int32_t *tables = malloc(seqs * per * 4), *lens = malloc(seqs * 4), *starts = malloc((seqs + 1) * 4), *ids = malloc(seqs * 4);
    for (int i = 0; i < seqs * per; i++) tables[i] = 1 + i;
    if (!getenv("SEQUENTIAL")) /* blocks in random order, as a busy cache has them */
        for (int i = seqs * per - 1; i > 0; i--) { int j = rand() % (i + 1); int t = tables[i]; tables[i] = tables[j]; tables[j] = t; }
    double total = 0; /* keys all sequences' rows see */
    for (int i = 0; i < seqs; i++) {
        lens[i] = mixed ? 1 + rand() % (2 * ctx) : ctx, ids[i] = i;
        total += lens[i];
    }
    for (int i = 0; i <= seqs; i++) starts[i] = i;
    int iters = 2000;
    double best = 1e9;
    for (int r = 0; r < 5; r++) {
        double t0 = now();
        for (int it = 0; it < iters; it++) {
            const int64_t at = (it % layers) * layer_size;
            if (bf16kv)
                specserve_paged_attention_f32_bf16kv(outf, heads * hd, qf, heads * hd, kc + at, vc + at, tables, per, per, lens, starts, seqs, seqs, ids, seqs, heads, kvh, hd, bs, nblocks, 0.125f, heads / kvh, threads, NULL);
            else if (f32)
                specserve_paged_attention(outf, heads * hd, qf, heads * hd, kf + at, vf + at, tables, per, per, lens, starts, seqs, seqs, ids, seqs, heads, kvh, hd, bs, nblocks, 0.125f, heads / kvh, threads, NULL);
            else
                specserve_paged_attention_bf16(out, heads * hd, q, heads * hd, kc + at, vc + at, tables, per, per, lens, starts, seqs, seqs, ids, seqs, heads, kvh, hd, bs, nblocks, 0.125f, heads / kvh, threads, NULL);
        }
        double t = (now() - t0) / iters;
        if (t < best) best = t;
    }
    double macs = total * heads * hd * 2;
    printf("%s, %d seqs x %d ctx%s, %d layers, %d threads: %.1f us a call, %.1f G MAC/s\n", bf16kv ? "fp32 over bf16 KV" : f32 ? "fp32" : "bf16", seqs, ctx, mixed ? " (mixed: 1 .. 2 x ctx)" : "", layers, threads, best * 1e6, macs / best / 1e9);
    return 0;
}
