/* What this machine can do at most, for the benchmarks' tables
 * (engine/benchmarks/bounds.py, `specserve bench bounds`): the read bandwidth of
 * memory and the multiply-add peak of the instructions the kernels use. Each peak is a
 * register-only loop of independent chains of one instruction on every thread, so it
 * is what the core's execution ports allow, with no loads; a kernel's share of it says
 * how much is left to gain.
 *
 * Part of the kernels' single translation unit (build.py, read_source). */

#include <time.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

static double bounds_now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Reads `bytes` of `buf` (a multiple of 64) on `num_threads` threads, `reps` times;
 * returns the best GB/s. The sum is returned through `sink` so the reads stay. */
double specserve_read_gbps(const uint64_t *buf, int64_t bytes, int32_t reps,
                           int32_t num_threads, uint64_t *sink) {
    const int64_t words = bytes / 8;
    double best = 0.0;
    for (int32_t r = 0; r < reps; r++) {
        uint64_t total = 0;
        const double t0 = bounds_now_s();
#pragma omp parallel for num_threads(num_threads) reduction(+ : total) schedule(static)
        for (int64_t i = 0; i < words; i += 8) {
            total += buf[i] + buf[i + 1] + buf[i + 2] + buf[i + 3] + buf[i + 4] + buf[i + 5] +
                     buf[i + 6] + buf[i + 7];
        }
        const double t = bounds_now_s() - t0;
        *sink += total;
        if (t > 0 && (double)bytes / t / 1e9 > best) best = (double)bytes / t / 1e9;
    }
    return best;
}

#define BOUNDS_CHAINS 24 /* independent accumulators: more than latency x ports */

/* Multiply-adds per second (G) of one instruction on `num_threads` threads, best of
 * three: kind 0 fp32 FMA (vfmadd, 1 multiply-add per fp32 lane), 1 bf16 vdpbf16ps (2
 * per fp32 lane), 2 int8 vpdpbusd (4 per int32 lane; the 256-bit form where it is
 * faster; on AVX2 without VNNI the quantized kernel's vpmaddubsw + vpmaddwd pair), 4
 * int8 AMX tdpbssd (tiles of 16 x 16 x 64, where the build and Linux allow AMX). -1
 * when this build's target lacks the instruction. */
double specserve_peak_gmacs(int32_t kind, int64_t iters, int32_t num_threads) {
    double best = -1.0;
    for (int32_t r = 0; r < 3; r++) {
        double macs_per_iter = 0.0, t0 = bounds_now_s();
        int32_t ran = 0;
        float fsink = 0.0f;
        int32_t isink = 0;
        (void)fsink, (void)isink;
        switch (kind) {
#if defined(__AVX512F__)
        case 0: {
            macs_per_iter = 16.0 * BOUNDS_CHAINS;
            ran = 1;
#pragma omp parallel num_threads(num_threads) reduction(+ : fsink)
            {
                __m512 a[BOUNDS_CHAINS];
                for (int c = 0; c < BOUNDS_CHAINS; c++) a[c] = _mm512_set1_ps((float)c);
                __m512 u = _mm512_set1_ps(1.0001f), v = _mm512_set1_ps(0.999f);
                __asm__ volatile("" : "+v"(u), "+v"(v));
                for (int64_t it = 0; it < iters; it++) {
#pragma GCC unroll 24
                    for (int c = 0; c < BOUNDS_CHAINS; c++) a[c] = _mm512_fmadd_ps(a[c], u, v);
                }
                for (int c = 0; c < BOUNDS_CHAINS; c++) fsink += _mm512_reduce_add_ps(a[c]);
            }
            break;
        }
#elif defined(__FMA__)
        case 0: {
            macs_per_iter = 8.0 * BOUNDS_CHAINS;
            ran = 1;
#pragma omp parallel num_threads(num_threads) reduction(+ : fsink)
            {
                __m256 a[BOUNDS_CHAINS];
                for (int c = 0; c < BOUNDS_CHAINS; c++) a[c] = _mm256_set1_ps((float)c);
                __m256 u = _mm256_set1_ps(1.0001f), v = _mm256_set1_ps(0.999f);
                __asm__ volatile("" : "+x"(u), "+x"(v));
                for (int64_t it = 0; it < iters; it++) {
#pragma GCC unroll 24
                    for (int c = 0; c < BOUNDS_CHAINS; c++) a[c] = _mm256_fmadd_ps(a[c], u, v);
                }
                float lanes[8];
                for (int c = 0; c < BOUNDS_CHAINS; c++) {
                    _mm256_storeu_ps(lanes, a[c]);
                    fsink += lanes[0];
                }
            }
            break;
        }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
        case 1: {
            macs_per_iter = 32.0 * BOUNDS_CHAINS;
            ran = 1;
#pragma omp parallel num_threads(num_threads) reduction(+ : fsink)
            {
                __m512 a[BOUNDS_CHAINS];
                for (int c = 0; c < BOUNDS_CHAINS; c++) a[c] = _mm512_set1_ps((float)c);
                __m512bh u = (__m512bh)_mm512_set1_epi32(0x3f803f80), v = u;
                __asm__ volatile("" : "+v"(u), "+v"(v));
                for (int64_t it = 0; it < iters; it++) {
#pragma GCC unroll 24
                    for (int c = 0; c < BOUNDS_CHAINS; c++) a[c] = _mm512_dpbf16_ps(a[c], u, v);
                }
                for (int c = 0; c < BOUNDS_CHAINS; c++) fsink += _mm512_reduce_add_ps(a[c]);
            }
            break;
        }
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
        case 2: {
            macs_per_iter = 64.0 * BOUNDS_CHAINS;
            ran = 1;
#pragma omp parallel num_threads(num_threads) reduction(+ : isink)
            {
                __m512i a[BOUNDS_CHAINS];
                for (int c = 0; c < BOUNDS_CHAINS; c++) a[c] = _mm512_set1_epi32(c);
                __m512i u = _mm512_set1_epi8(3), v = _mm512_set1_epi8(5);
                __asm__ volatile("" : "+v"(u), "+v"(v));
                for (int64_t it = 0; it < iters; it++) {
#pragma GCC unroll 24
                    for (int c = 0; c < BOUNDS_CHAINS; c++) a[c] = _mm512_dpbusd_epi32(a[c], u, v);
                }
                for (int c = 0; c < BOUNDS_CHAINS; c++) isink += _mm512_reduce_add_epi32(a[c]);
            }
            break;
        }
        case 3: { /* vpdpbusd on 256-bit registers (AVX512-VL) */
#if defined(__AVX512VL__)
            macs_per_iter = 32.0 * BOUNDS_CHAINS;
            ran = 1;
#pragma omp parallel num_threads(num_threads) reduction(+ : isink)
            {
                __m256i a[BOUNDS_CHAINS];
                for (int c = 0; c < BOUNDS_CHAINS; c++) a[c] = _mm256_set1_epi32(c);
                __m256i u = _mm256_set1_epi8(3), v = _mm256_set1_epi8(5);
                __asm__ volatile("" : "+v"(u), "+v"(v));
                for (int64_t it = 0; it < iters; it++) {
#pragma GCC unroll 24
                    for (int c = 0; c < BOUNDS_CHAINS; c++) a[c] = _mm256_dpbusd_epi32(a[c], u, v);
                }
                int32_t lanes[8];
                for (int c = 0; c < BOUNDS_CHAINS; c++) {
                    _mm256_storeu_si256((__m256i *)lanes, a[c]);
                    isink += lanes[0];
                }
            }
#endif
            break;
        }
#elif defined(__AVXVNNI__)
        case 2: {
            macs_per_iter = 32.0 * BOUNDS_CHAINS;
            ran = 1;
#pragma omp parallel num_threads(num_threads) reduction(+ : isink)
            {
                __m256i a[BOUNDS_CHAINS];
                for (int c = 0; c < BOUNDS_CHAINS; c++) a[c] = _mm256_set1_epi32(c);
                __m256i u = _mm256_set1_epi8(3), v = _mm256_set1_epi8(5);
                __asm__ volatile("" : "+x"(u), "+x"(v));
                for (int64_t it = 0; it < iters; it++) {
#pragma GCC unroll 24
                    for (int c = 0; c < BOUNDS_CHAINS; c++)
                        a[c] = _mm256_dpbusd_avx_epi32(a[c], u, v);
                }
                int32_t lanes[8];
                for (int c = 0; c < BOUNDS_CHAINS; c++) {
                    _mm256_storeu_si256((__m256i *)lanes, a[c]);
                    isink += lanes[0];
                }
            }
            break;
        }
#elif defined(__AVX2__)
        case 2: { /* AVX2 without VNNI: the quantized kernel's vpmaddubsw + vpmaddwd + vpaddd */
            macs_per_iter = 32.0 * BOUNDS_CHAINS;
            ran = 1;
#pragma omp parallel num_threads(num_threads) reduction(+ : isink)
            {
                __m256i a[BOUNDS_CHAINS];
                for (int c = 0; c < BOUNDS_CHAINS; c++) a[c] = _mm256_set1_epi32(c);
                __m256i u = _mm256_set1_epi8(3), v = _mm256_set1_epi8(5);
                const __m256i ones = _mm256_set1_epi16(1);
                __asm__ volatile("" : "+x"(u), "+x"(v));
                for (int64_t it = 0; it < iters; it++) {
#pragma GCC unroll 24
                    for (int c = 0; c < BOUNDS_CHAINS; c++)
                        a[c] = _mm256_add_epi32(
                            a[c], _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), ones));
                }
                int32_t lanes[8];
                for (int c = 0; c < BOUNDS_CHAINS; c++) {
                    _mm256_storeu_si256((__m256i *)lanes, a[c]);
                    isink += lanes[0];
                }
            }
            break;
        }
#endif
#if defined(QPATH_AMX)
        case 4: { /* AMX tdpbssd: 4 C tiles, 16 x 16 int32 each, K = 64 bytes */
            if (!q_amx_ready()) break;
            macs_per_iter = 4.0 * 16 * 16 * 64;
            ran = 1;
#pragma omp parallel num_threads(num_threads) reduction(+ : isink)
            {
                struct q_tilecfg cfg;
                memset(&cfg, 0, sizeof cfg);
                cfg.palette = 1;
                for (int t = 0; t < 6; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
                _tile_loadconfig(&cfg);
                int8_t src[16 * 64] __attribute__((aligned(64)));
                int32_t out[16 * 16] __attribute__((aligned(64)));
                for (int i = 0; i < 16 * 64; i++) src[i] = (int8_t)(i % 7 - 3);
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                _tile_loadd(4, src, 64);
                _tile_loadd(5, src, 64);
                for (int64_t it = 0; it < iters; it++) {
                    _tile_dpbssd(0, 4, 5);
                    _tile_dpbssd(1, 4, 5);
                    _tile_dpbssd(2, 4, 5);
                    _tile_dpbssd(3, 4, 5);
                }
                _tile_stored(0, out, 64);
                isink += out[0];
                _tile_release();
            }
            break;
        }
#endif
        default:
            break;
        }
        if (!ran) return -1.0;
        const double t = bounds_now_s() - t0;
        const double g = macs_per_iter * (double)iters * (double)num_threads / t / 1e9;
        if (g > best && fsink != 12345.0f && isink != 12345) best = g;
    }
    return best;
}
