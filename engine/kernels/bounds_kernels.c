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

/* One register-only peak loop (a case of specserve_peak_gmacs): every thread runs 12
 * independent chains of acc = INSN(acc, u, v) on vectors of type VT, written out in asm
 * (AT&T operand order: INSN v, u, acc): more chains than the instruction's latency
 * times its ports, and with u and v 14 registers, which AVX2's 16 hold. In C (a loop
 * over an array of 24 accumulators) gcc spilled them: until the twenty-seventh session
 * `bench bounds` timed the spills beside the instructions and printed `vpdpbusd` at
 * 186-250 G/s on a Zen 4 whose units do 449, and the AVX2 build's FMA at 90 of 115.
 * R: the register constraint ("v" for AVX-512 builds, "x" for AVX2). Each chain's
 * LANE(acc) goes into `sink` so none is dead. MACS: multiply-adds per instruction. */
#define BOUNDS_STEP(insn, i) insn " %13, %12, %" #i "\n\t"
#define BOUNDS_STEPS(insn)                                                                     \
    BOUNDS_STEP(insn, 0) BOUNDS_STEP(insn, 1) BOUNDS_STEP(insn, 2) BOUNDS_STEP(insn, 3)         \
    BOUNDS_STEP(insn, 4) BOUNDS_STEP(insn, 5) BOUNDS_STEP(insn, 6) BOUNDS_STEP(insn, 7)     \
    BOUNDS_STEP(insn, 8) BOUNDS_STEP(insn, 9) BOUNDS_STEP(insn, 10) BOUNDS_STEP(insn, 11)
#define BOUNDS_PEAK(MACS, VT, ACC0, U0, V0, R, INSN, LANE)                                     \
    do {                                                                                       \
        macs_per_iter = (MACS) * 12;                                                           \
        ran = 1;                                                                               \
        _Pragma("omp parallel num_threads(num_threads) reduction(+ : sink)") {                 \
            VT a0 = (ACC0), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;     \
            VT a8 = a0, a9 = a0, a10 = a0, a11 = a0;                                           \
            const VT u = (U0), v = (V0);                                                       \
            for (int64_t it = 0; it < iters; it++)                                             \
                __asm__ volatile(BOUNDS_STEPS(INSN)                                            \
                                 : "+" R(a0), "+" R(a1), "+" R(a2), "+" R(a3), "+" R(a4),      \
                                   "+" R(a5), "+" R(a6), "+" R(a7), "+" R(a8), "+" R(a9),      \
                                   "+" R(a10), "+" R(a11)                                      \
                                 : R(u), R(v));                                                \
            sink += (double)LANE(a0) + (double)LANE(a1) + (double)LANE(a2) +                   \
                    (double)LANE(a3) + (double)LANE(a4) + (double)LANE(a5) +                   \
                    (double)LANE(a6) + (double)LANE(a7) + (double)LANE(a8) +                   \
                    (double)LANE(a9) + (double)LANE(a10) + (double)LANE(a11);                  \
        }                                                                                      \
    } while (0)
/* The AVX2 quantized kernel's int8 step without VNNI, as its Q4 blocks take it: vpmaddubsw,
 * its products added in int16 (vpaddw; one vpmaddwd widens a block's eight sums). Q8_0
 * widens each product (a vpmaddwd and a vpaddd more), so its peak is about half this.
 * Written out in asm, 6 chains of 16 registers: in C the compiler computed the product
 * of u and v once, before the loop, and timed only the adds, spilled (until the
 * twenty-seventh session, which found the AVX2 build's Q4 Linear above this "peak" on a
 * Zen 4: 176 against 147-169 G/s). Sets macs_per_iter and ran. */
#define BOUNDS_MB(a, t) "vpmaddubsw %13, %12, %" #t "\n\tvpaddw %" #t ", %" #a ", %" #a "\n\t"
#define BOUNDS_MB_6                                                                            \
    BOUNDS_MB(0, 6) BOUNDS_MB(1, 7) BOUNDS_MB(2, 8) BOUNDS_MB(3, 9) BOUNDS_MB(4, 10)          \
    BOUNDS_MB(5, 11)
#define BOUNDS_MB_12 BOUNDS_MB_6 BOUNDS_MB_6
#define BOUNDS_MADDUBS_PEAK()                                                                  \
    do {                                                                                       \
        macs_per_iter = 32.0 * 12;                                                             \
        ran = 1;                                                                               \
        _Pragma("omp parallel num_threads(num_threads) reduction(+ : sink)") {                 \
            __m256i a0 = _mm256_set1_epi16(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;    \
            __m256i t0, t1, t2, t3, t4, t5;                                                    \
            const __m256i u = _mm256_set1_epi8(3), v = _mm256_set1_epi8(5);                    \
            for (int64_t it = 0; it < iters; it++)                                             \
                __asm__ volatile(BOUNDS_MB_12                                                  \
                                 : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), \
                                   "=&x"(t0), "=&x"(t1), "=&x"(t2), "=&x"(t3), "=&x"(t4),      \
                                   "=&x"(t5)                                                   \
                                 : "x"(u), "x"(v));                                            \
            sink += (double)_mm256_cvtsi256_si32(                                              \
                _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(a0, a1), a2),               \
                                 _mm256_add_epi16(_mm256_add_epi16(a3, a4), a5)));             \
        }                                                                                      \
    } while (0)

#if defined(HAVE_AMX_TILES) && !defined(AMX_EMULATED) /* an emulated unit has no peak */
/* One AMX instruction DP (tile C += A . B, K inputs of type IN_T a row, C of OUT_T) on 4
 * C tiles in a register-only loop on every thread; sets macs_per_iter and ran (nothing
 * when Linux refuses the tiles). Source values: INIT of i. */
#define BOUNDS_AMX_PEAK(K, IN_T, OUT_T, INIT, DP)                                              \
    do {                                                                                       \
        if (!amx_ready()) break;                                                               \
        macs_per_iter = 4.0 * 16 * 16 * (K);                                                   \
        ran = 1;                                                                               \
        _Pragma("omp parallel num_threads(num_threads) reduction(+ : sink)") {                 \
            struct amx_tilecfg cfg;                                                            \
            memset(&cfg, 0, sizeof cfg);                                                       \
            cfg.palette = 1;                                                                   \
            for (int t = 0; t < 6; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;                   \
            _tile_loadconfig(&cfg);                                                            \
            IN_T src[16 * (K)] __attribute__((aligned(64)));                                   \
            OUT_T out[16 * 16] __attribute__((aligned(64)));                                   \
            for (int i = 0; i < 16 * (K); i++) src[i] = INIT;                                  \
            _tile_zero(0);                                                                     \
            _tile_zero(1);                                                                     \
            _tile_zero(2);                                                                     \
            _tile_zero(3);                                                                     \
            _tile_loadd(4, src, 64);                                                           \
            _tile_loadd(5, src, 64);                                                           \
            for (int64_t it = 0; it < iters; it++) {                                           \
                DP(0, 4, 5);                                                                   \
                DP(1, 4, 5);                                                                   \
                DP(2, 4, 5);                                                                   \
                DP(3, 4, 5);                                                                   \
            }                                                                                  \
            _tile_stored(0, out, 64);                                                          \
            sink += out[0];                                                                    \
            _tile_release();                                                                   \
        }                                                                                      \
    } while (0)
#endif

/* Multiply-adds per second (G) of one instruction on `num_threads` threads, best of
 * three: kind 0 fp32 FMA (vfmadd, 1 multiply-add per fp32 lane), 1 bf16 vdpbf16ps (2
 * per fp32 lane), 2 int8 vpdpbusd (4 per int32 lane; the 256-bit form where it is
 * faster; on AVX2 without VNNI the quantized kernel's vpmaddubsw + vpaddw pair), 4
 * int8 AMX tdpbssd (tiles of 16 x 16 x 64, where the build and Linux allow AMX), 5 bf16
 * AMX tdpbf16ps (16 x 16 x 32, likewise). -1 when this build's target lacks the
 * instruction. */
double specserve_peak_gmacs(int32_t kind, int64_t iters, int32_t num_threads) {
    double best = -1.0;
    for (int32_t r = 0; r < 3; r++) {
        double macs_per_iter = 0.0, t0 = bounds_now_s();
        int32_t ran = 0;
        double sink = 0.0;
        switch (kind) {
#if defined(__AVX512F__)
        case 0:
            BOUNDS_PEAK(16.0, __m512, _mm512_setzero_ps(), _mm512_set1_ps(1.0001f),
                        _mm512_set1_ps(0.999f), "v", "vfmadd231ps", _mm512_reduce_add_ps);
            break;
#elif defined(__FMA__)
        case 0:
            BOUNDS_PEAK(8.0, __m256, _mm256_setzero_ps(), _mm256_set1_ps(1.0001f),
                        _mm256_set1_ps(0.999f), "x", "vfmadd231ps", _mm256_cvtss_f32);
            break;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
        case 1:
            BOUNDS_PEAK(32.0, __m512, _mm512_setzero_ps(),
                        _mm512_castsi512_ps(_mm512_set1_epi32(0x3f803f80)),
                        _mm512_castsi512_ps(_mm512_set1_epi32(0x3f803f80)), "v", "vdpbf16ps",
                        _mm512_reduce_add_ps);
            break;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
        case 2:
            BOUNDS_PEAK(64.0, __m512i, _mm512_setzero_si512(), _mm512_set1_epi8(3),
                        _mm512_set1_epi8(5), "v", "vpdpbusd", _mm512_reduce_add_epi32);
            break;
        case 3: /* vpdpbusd on 256-bit registers (AVX512-VL) */
#if defined(__AVX512VL__)
            BOUNDS_PEAK(32.0, __m256i, _mm256_setzero_si256(), _mm256_set1_epi8(3),
                        _mm256_set1_epi8(5), "v", "vpdpbusd", _mm256_cvtsi256_si32);
#endif
            break;
#elif defined(__AVXVNNI__)
        case 2:
            BOUNDS_PEAK(32.0, __m256i, _mm256_setzero_si256(), _mm256_set1_epi8(3),
                        _mm256_set1_epi8(5), "x", "%{vex%} vpdpbusd", _mm256_cvtsi256_si32);
            break;
#elif defined(__AVX2__)
        case 2: /* AVX2 without VNNI: the quantized kernel's vpmaddubsw + vpaddw */
            BOUNDS_MADDUBS_PEAK();
            break;
#endif
#if defined(QPATH_AMX) && !defined(AMX_EMULATED)
        case 4: /* AMX tdpbssd: 4 C tiles, 16 x 16 int32 each, K = 64 bytes */
            BOUNDS_AMX_PEAK(64, int8_t, int32_t, (int8_t)(i % 7 - 3), _tile_dpbssd);
            break;
#endif
#if defined(HAVE_AMX_LINEAR) && !defined(AMX_EMULATED)
        case 5: /* AMX tdpbf16ps: 4 C tiles, 16 x 16 fp32 each, 32 bf16 inputs (~1) */
            BOUNDS_AMX_PEAK(32, bf16, float, (bf16)(0x3f80 + i % 3), _tile_dpbf16ps);
            break;
#endif
        default:
            break;
        }
        if (!ran) return -1.0;
        const double t = bounds_now_s() - t0;
        const double g = macs_per_iter * (double)iters * (double)num_threads / t / 1e9;
        if (g > best && sink != 12345.0) best = g;
    }
    return best;
}
