/* specserve CPU kernels, fp32 and bf16: paged attention, KV write, RMSNorm, rotary
 * embedding, SiLU-and-multiply, bf16 Linear layers, and the logits mask of structured output.
 *
 * Built at first use by engine/kernels/cpu.py with the system C compiler
 * (-O3 -march=native -ffast-math -fopenmp) and called through ctypes. The OpenMP
 * runtime is the one torch already loaded (same soname), so these kernels and torch's
 * own ops share one thread pool.
 *
 * Every kernel reads and writes plain row-major buffers of one element type; strides
 * are in elements. Each has an fp32 entry point (specserve_<name>) and a bf16 one
 * (specserve_<name>_bf16), generated from one body by the macros below with
 * the element type's load / store / round helpers (`S` is the suffix f32 or bf16).
 * bf16 is stored as uint16_t (the top half of an fp32) and computed in fp32: values are
 * widened on load, every sum (dot products, softmax, P.V, sum of squares) accumulates
 * in fp32, and results are rounded to nearest-even where torch's bf16 ops round, so
 * the bf16 norm, rotary and SiLU match torch's bf16 results (see cpu.py). Portable C:
 * the conversions are shifts that compile for any -march (x86-64-v2 included), and
 * vectorise where the target has the instructions.
 *
 * -ffast-math is safe here because no kernel relies on inf or NaN: attention never
 * scores a masked key (loop bounds stop at each query's causal limit) and the running
 * maximum starts at a large finite negative number. A NaN or Inf in the inputs still
 * reaches every output float math sends it to, and no other (a model that makes NaN
 * must not make plausible tokens from it; tests/engine/test_kernel_nonfinite.py): the
 * arithmetic propagates it, and where fast-math could lose it (max, isnan, a masked
 * key weighted 0) the kernels test bits or skip the key instead.
 *
 * Paged KV layout per layer: K and V each [num_blocks, block_size, num_kv_heads, head_dim].
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NEG_BIG (-1.0e30f)

/* Row-wise kernels go parallel from this many rows. Below it they run on the calling
 * thread with no OpenMP region at all: a 1-thread region between torch's 2-thread ones
 * makes libgomp release and re-dock its worker, which cost 25-50 us per call (more
 * than the work) on SmolLM2's 32-row decode. */
#define PARALLEL_MIN_ROWS 64
#define PARALLEL_MIN_VALUES 16384

#define INLINE static inline __attribute__((always_inline))

/* Query tokens per paged-attention work item (see PAGED_ATTENTION). */
#define Q_TILE 32

/* Cache blocks per key chunk of paged attention (see PAGED_ATTENTION): 128 keys at the
 * default block size. */
#define SPLIT_BLOCKS 8
/* Paged attention splits a call's items by key chunk when it has fewer than this many
 * items a thread, and the chunks' partial results fit in SPLIT_MAX_BYTES. */
#define SPLIT_ITEMS_PER_THREAD 4
#define SPLIT_MAX_BYTES ((int64_t)32 << 20)
/* Paged attention off the vdpbf16ps path makes a work item of every KV head of a tile at
 * once (reading each cache block front to back) when no tile has more query tokens than
 * this. */
#define ALL_HEADS_MAX_TOKENS 8

/* ---- a team: one OpenMP region's threads running many kernels in turn ----
 *
 * The one-call float32 decoder runs every kernel of every layer inside one parallel
 * region, its threads meeting at this barrier between kernels, instead of opening a
 * region per kernel. On the 2-vCPU Zen 3 (KVM) libgomp's fork and join cost 2.3-3.0 us
 * a region and its barrier 1.0 us; this barrier 0.12 us. A batch-1 step of the default
 * model opens 150-odd regions. The waiting threads spin TEAM_SPINS pauses (tens of
 * microseconds: a kernel of the step is shorter), then yield the CPU at each look, so a
 * machine with fewer free CPUs than threads still makes progress. */
#include <omp.h>
int sched_yield(void); /* <sched.h> declares it only outside strict ISO C (-std=c11) */
#define TEAM_SPINS 4096
#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#else
#define CPU_RELAX() ((void)0)
#endif
struct team {
    int count __attribute__((aligned(64))); /* threads at the barrier */
    int gen __attribute__((aligned(64)));   /* barriers passed */
    int64_t next[2] __attribute__((aligned(64))); /* dynamic phases' counters, in turn */
};

/* Every thread of the team (nt of them) calls it; none returns before all have. */
INLINE void team_barrier(struct team *tm, int nt) {
    if (nt <= 1) return;
    const int gen = __atomic_load_n(&tm->gen, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&tm->count, 1, __ATOMIC_ACQ_REL) == nt) {
        __atomic_store_n(&tm->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&tm->gen, gen + 1, __ATOMIC_RELEASE);
        return;
    }
    for (int spins = 0; __atomic_load_n(&tm->gen, __ATOMIC_ACQUIRE) == gen; spins++) {
        if (spins < TEAM_SPINS) CPU_RELAX();
        else sched_yield();
    }
}

/* Dynamic phase `phase` (counted alike by every thread; barriers between phases): the
 * next item for the calling thread. The counter of the phase after it is cleared here,
 * by thread 0, while no thread can be using it. */
INLINE void team_phase(struct team *tm, int tid, int phase) {
    if (tid == 0) __atomic_store_n(&tm->next[(phase + 1) & 1], 0, __ATOMIC_RELAXED);
}
/* the counter of dynamic phase `phase` (team_take's, for a loop that takes its own) */
INLINE int64_t *team_counter(struct team *tm, int phase) { return &tm->next[phase & 1]; }
INLINE int64_t team_take(struct team *tm, int phase) {
    return __atomic_fetch_add(team_counter(tm, phase), 1, __ATOMIC_RELAXED);
}

/* Thread tid's share [*lo, *hi) of n items split evenly in order, as schedule(static). */
INLINE void team_range(int64_t n, int tid, int nt, int64_t *lo, int64_t *hi) {
    *lo = n * tid / nt;
    *hi = n * (tid + 1) / nt;
}

/* ---- AMX tiles: Linux lends a process the tile registers on request ----
 * (arch_prctl ARCH_REQ_XCOMP_PERM), once; refused, the kernels that would use them run
 * on AVX-512 (the quantized Linear's tdpbssd path, the bf16 Linear's tdpbf16ps one).
 *
 * AMX_TILE, AMX_INT8 and AMX_BF16 say which tile instructions this build compiles: the
 * CPU's (-mamx-*), or, in a test build (SPECSERVE_AMX_EMULATE, the emulated level of
 * engine/kernels/build.py), all three run by the C below on a CPU without them. */
#if defined(SPECSERVE_AMX_EMULATE) && !defined(__AMX_TILE__) && defined(__AVX512BF16__) &&   \
    defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define AMX_EMULATED 1
#define AMX_TILE 1
#define AMX_INT8 1
#define AMX_BF16 1
#else
#if defined(__AMX_TILE__)
#define AMX_TILE 1
#endif
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define AMX_INT8 1
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMX_BF16 1
#endif
#endif

/* The 64-byte operand of ldtilecfg, palette 1. */
struct amx_tilecfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

#if defined(AMX_EMULATED)
/* The emulated tile unit (test builds only; never a level a CPU is served with: a tile
 * instruction here takes microseconds). The AMX paths compile as on a Sapphire Rapids,
 * and each tile instruction runs on the calling thread's eight tile registers in
 * memory, so the tests run those paths' logic (tile configurations, strides, row and
 * tail counts, what each thread takes, the int8 paths' bits) on any AVX512-BF16 CPU.
 * tdpbssd is exact integer arithmetic, as on the tile unit. tdpbf16ps follows the
 * instruction's definition (Intel SDM): for each row m, pair k in order and output n,
 * C[m][n] += A[m][2k] * B[k][2n], then += A[m][2k + 1] * B[k][2n + 1], each a fused
 * multiply-add rounded to nearest even, subnormal inputs read as zero and subnormal
 * results flushed to zero. What the hardware faults on stops the process with one line
 * on stderr: a tile used before a configuration or after its release, a configuration
 * past palette 1's 8 tiles of 16 rows of 64 bytes (or with reserved bytes set), shapes
 * that do not fit, a tile named twice in one product. */
#include <immintrin.h>
#include <stdio.h>
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbssd
#undef _tile_dpbf16ps
#define _tile_loadconfig(cfg) amx_emu_loadconfig(cfg)
#define _tile_release() amx_emu_release()
#define _tile_loadd(t, base, stride) amx_emu_loadd(t, base, stride)
#define _tile_stored(t, base, stride) amx_emu_stored(t, base, stride)
#define _tile_zero(t) amx_emu_zero(t)
#define _tile_dpbssd(c, a, b) amx_emu_dpbssd(c, a, b)
#define _tile_dpbf16ps(c, a, b) amx_emu_dpbf16ps(c, a, b)

struct amx_emu_unit {
    uint8_t tile[8][16 * 64] __attribute__((aligned(64)));
    uint8_t rows[8];
    uint16_t colsb[8];
    int configured;
};
static _Thread_local struct amx_emu_unit amx_emu;

static __attribute__((noreturn, cold)) void amx_emu_fault(const char *what, int t) {
    fprintf(stderr, "specserve AMX emulation: %s (tile %d): the tile unit would fault\n", what,
            t);
    abort();
}
static void amx_emu_loadconfig(const void *cfg) {
    const struct amx_tilecfg *c = cfg;
    memset(&amx_emu, 0, sizeof amx_emu);
    if (c->palette == 0) return; /* palette 0: the tiles' initial state */
    if (c->palette != 1) amx_emu_fault("a palette other than 1", -1);
    for (int i = 0; i < 14; i++)
        if (c->reserved[i]) amx_emu_fault("reserved bytes of the configuration not zero", -1);
    for (int t = 0; t < 16; t++) {
        if (t >= 8 && (c->rows[t] || c->colsb[t])) amx_emu_fault("palette 1 has 8 tiles", t);
        if (t >= 8) continue;
        if (c->rows[t] > 16 || c->colsb[t] > 64 || (c->rows[t] == 0) != (c->colsb[t] == 0))
            amx_emu_fault("a tile past 16 rows of 64 bytes, or half configured", t);
        amx_emu.rows[t] = c->rows[t], amx_emu.colsb[t] = c->colsb[t];
    }
    amx_emu.configured = 1;
}
static void amx_emu_release(void) { memset(&amx_emu, 0, sizeof amx_emu); }
static void amx_emu_use(int t) {
    if (!amx_emu.configured) amx_emu_fault("no tile configuration loaded", t);
    if (t < 0 || t >= 8 || amx_emu.rows[t] == 0) amx_emu_fault("a tile not configured", t);
}
/* Rows past the configured ones and bytes past a row's colsb read as zero, as loaded. */
static void amx_emu_loadd(int t, const void *base, int64_t stride) {
    amx_emu_use(t);
    memset(amx_emu.tile[t], 0, sizeof amx_emu.tile[t]);
    for (int r = 0; r < amx_emu.rows[t]; r++)
        memcpy(amx_emu.tile[t] + r * 64, (const uint8_t *)base + r * stride, amx_emu.colsb[t]);
}
static void amx_emu_stored(int t, void *base, int64_t stride) {
    amx_emu_use(t);
    for (int r = 0; r < amx_emu.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, amx_emu.tile[t] + r * 64, amx_emu.colsb[t]);
}
static void amx_emu_zero(int t) {
    amx_emu_use(t);
    memset(amx_emu.tile[t], 0, sizeof amx_emu.tile[t]);
}
/* C (m rows x n dwords) += A (m rows x k dwords) . B (k rows x n dwords): the shapes
 * the tile unit accepts. */
static void amx_emu_shapes(int c, int a, int b) {
    amx_emu_use(c), amx_emu_use(a), amx_emu_use(b);
    if (c == a || c == b || a == b) amx_emu_fault("a tile named twice in one product", c);
    if (amx_emu.colsb[c] % 4 || amx_emu.colsb[a] % 4 || amx_emu.colsb[b] != amx_emu.colsb[c] ||
        amx_emu.rows[a] != amx_emu.rows[c] || amx_emu.rows[b] != amx_emu.colsb[a] / 4)
        amx_emu_fault("shapes that do not fit: C m x n, A m x k, B k x n (in dwords)", c);
}
static void amx_emu_dpbssd(int c, int a, int b) {
    amx_emu_shapes(c, a, b);
    const int m = amx_emu.rows[c], n = amx_emu.colsb[c] / 4, k = amx_emu.colsb[a] / 4;
    for (int i = 0; i < m; i++) {
        const int8_t *ar = (const int8_t *)(amx_emu.tile[a] + i * 64);
        uint8_t *cr = amx_emu.tile[c] + i * 64;
        for (int j = 0; j < n; j++) {
            int32_t v;
            memcpy(&v, cr + 4 * j, 4);
            for (int p = 0; p < k; p++) {
                const int8_t *br = (const int8_t *)(amx_emu.tile[b] + p * 64 + 4 * j);
                int32_t dot = 0; /* at most 4 x 128 x 128: no overflow */
                for (int q = 0; q < 4; q++) dot += (int32_t)ar[4 * p + q] * (int32_t)br[q];
                v = (int32_t)((uint32_t)v + (uint32_t)dot); /* the unit's wrap-around */
            }
            memcpy(cr + 4 * j, &v, 4);
        }
    }
}
/* fp32 lanes with a subnormal made zero (its sign kept). */
INLINE __m512 amx_emu_flush(__m512i v) {
    const __mmask16 zero_exp = _mm512_testn_epi32_mask(v, _mm512_set1_epi32(0x7f800000));
    return _mm512_castsi512_ps(
        _mm512_mask_and_epi32(v, zero_exp, v, _mm512_set1_epi32((int)0x80000000u)));
}
/* bf16 halves of each dword (lo: the even element, hi: the odd) as fp32, subnormals
 * read as zero. */
INLINE __m512 amx_emu_bf16_half(__m512i pairs, int hi) {
    return amx_emu_flush(hi ? _mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u))
                            : _mm512_slli_epi32(pairs, 16));
}
/* acc + x * y rounded once, a subnormal result flushed to zero. */
INLINE __m512 amx_emu_fma_ftz(__m512 x, __m512 y, __m512 acc) {
    return amx_emu_flush(_mm512_castps_si512(_mm512_fmadd_ps(x, y, acc)));
}
static void amx_emu_dpbf16ps(int c, int a, int b) {
    amx_emu_shapes(c, a, b);
    const int m = amx_emu.rows[c], n = amx_emu.colsb[c] / 4, k = amx_emu.colsb[a] / 4;
    const __mmask16 lanes = (__mmask16)((1u << n) - 1u);
    for (int i = 0; i < m; i++) {
        float *cr = (float *)(amx_emu.tile[c] + i * 64);
        __m512 acc = _mm512_maskz_loadu_ps(lanes, cr);
        for (int p = 0; p < k; p++) {
            int32_t pair;
            memcpy(&pair, amx_emu.tile[a] + i * 64 + 4 * p, 4);
            const __m512i x = _mm512_set1_epi32(pair);
            const __m512i w = _mm512_maskz_loadu_epi32(lanes, amx_emu.tile[b] + p * 64);
            acc = amx_emu_fma_ftz(amx_emu_bf16_half(x, 0), amx_emu_bf16_half(w, 0), acc);
            acc = amx_emu_fma_ftz(amx_emu_bf16_half(x, 1), amx_emu_bf16_half(w, 1), acc);
        }
        _mm512_mask_storeu_ps(cr, lanes, acc);
    }
}
#endif /* AMX_EMULATED */

#if defined(AMX_TILE) && defined(__linux__)
#define HAVE_AMX_TILES 1
#if defined(AMX_EMULATED)
INLINE int amx_ready(void) { return 1; } /* nothing for Linux to lend */
int32_t specserve_amx_emulated(void) { return 1; }
#else
#include <sys/syscall.h>
#include <unistd.h>
/* unistd.h declares syscall only outside strict ISO C (the kernels build with
 * -std=c11), and GCC 14 refuses an implicit declaration: declared here, as glibc and
 * musl define it. */
long syscall(long number, ...);

static int amx_state = 0; /* 0: not asked yet, 1: granted, -1: refused */

static inline __attribute__((always_inline)) int amx_ready(void) {
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state == 0) {
        state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                        18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
        __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
    }
    return state > 0;
}
int32_t specserve_amx_emulated(void) { return 0; }
#endif

/* 2: built with AMX and the tiles are lent; 1: built with AMX, Linux refused them. */
int32_t specserve_amx_tiles(void) { return amx_ready() ? 2 : 1; }
#else
/* 0: built without AMX. */
int32_t specserve_amx_tiles(void) { return 0; }
int32_t specserve_amx_emulated(void) { return 0; }
#endif

/* ---- element types: load as fp32, store from fp32, round to the storage precision ---- */

typedef uint16_t bf16;
union f32_bits {
    float f;
    uint32_t u;
};

/* bf16 -> fp32 is exact: the bits shifted up. fp32 -> bf16 rounds to nearest, ties to
 * even, like torch's c10::BFloat16. No NaN case: the carry of the rounding reaches the
 * exponent only for NaN payloads from 0x7fff8000 up, and x86 makes only the default
 * NaN 0xffc00000 (which stays a NaN); a NaN from torch stays a NaN. */
#define BITS_TO_F32(bits) (((union f32_bits){.u = (bits)}).f)
#define F32_TO_BITS(x) (((union f32_bits){.f = (x)}).u)
/* +Inf, and a quiet NaN. |x|'s bits (x & 0x7fffffff) are >= F32_INF_BITS
 * exactly when x is Inf or NaN: -ffast-math may fold isnan() and isinf() away. */
#define F32_INF_BITS 0x7f800000u
#define BITS_NAN(bits) (((bits) & 0x7fffffffu) > F32_INF_BITS) /* x's bits: x is a NaN */
#define F32_NAN_BITS 0x7fc00000u
#define BF16_ROUNDED_BITS(bits) ((bits) + 0x7fffu + (((bits) >> 16) & 1u))
#define BF16_TO_F32(h) BITS_TO_F32((uint32_t)(h) << 16)
#define F32_TO_BF16(x) ((bf16)(BF16_ROUNDED_BITS(F32_TO_BITS(x)) >> 16))
/* Load p[i] as fp32, store v (fp32) to p[i], and round v where a torch op on tensors
 * of the type rounds its result. */
#define LD_f32(p, i) ((p)[i])
#define LD_bf16(p, i) BF16_TO_F32((p)[i])
#define ST_f32(p, i, v) ((p)[i] = (v))
#define ST_bf16(p, i, v) ((p)[i] = F32_TO_BF16(v))
#define RND_f32(v) (v)
#define RND_bf16(v) BITS_TO_F32(BF16_ROUNDED_BITS(F32_TO_BITS(v)) & 0xffff0000u)

INLINE float ld_f32(const float *p, int64_t i) { return LD_f32(p, i); }
INLINE float ld_bf16(const bf16 *p, int64_t i) { return LD_bf16(p, i); }
INLINE void st_f32(float *p, int64_t i, float v) { ST_f32(p, i, v); }
INLINE void st_bf16(bf16 *p, int64_t i, float v) { ST_bf16(p, i, v); }
INLINE float rnd_f32(float v) { return RND_f32(v); }
INLINE float rnd_bf16(float v) { return RND_bf16(v); }

/* 1 / sqrt(mean_sq + eps). fp32 as it always was (fast-math may use rsqrt + a Newton
 * step: fp32 rounding). bf16 in double, correctly rounded in practice like torch's
 * rsqrt, so the rounding to bf16 that follows lands where torch's does. */
INLINE float inv_rms_f32(float sq, int64_t hidden, float eps) {
    /* An infinite sum of squares (an Inf in the row, or squares past FLT_MAX): 0, as
     * torch's exact rsqrt gives; the rsqrt's Newton step would make it inf * 0 = NaN,
     * and so NaN of the row's finite elements. */
    if (F32_TO_BITS(sq) == F32_INF_BITS) return 0.0f;
    return 1.0f / sqrtf(sq / (float)hidden + eps);
}
INLINE float inv_rms_bf16(float sq, int64_t hidden, float eps) {
    return (float)(1.0 / sqrt((double)(sq / (float)hidden + eps)));
}

/* ---- paged attention ---- */

/* A row's running maximum and sum after a block of weights summing to block_sum
 * (relative to new_max, the larger of the two maxima); returns the factor acc is to be
 * rescaled by. It is exp(0) = 1 where the maximum stays (most blocks after the first
 * few), and exp(NEG_BIG - new_max) = 0 for a row's first keys (its sum and acc are
 * still 0): neither is computed, the same bits without a call to expf a block (or its
 * underflow path). */
INLINE float fold_max_sum(float new_max, float block_sum, float *restrict row_max,
                          float *restrict row_sum) {
    if (new_max == *row_max) {
        *row_sum += block_sum;
        return 1.0f;
    }
    const float rescale = *row_max == NEG_BIG ? 0.0f : expf(*row_max - new_max);
    *row_max = new_max;
    *row_sum = *row_sum * rescale + block_sum;
    return rescale;
}

/* Fold the scores [0, n) of one cache block (scaled dot products; block_max their
 * maximum) into a row's streaming softmax: the scores become weights relative to the
 * new running maximum, to which the running sum and acc are rescaled. */
INLINE void softmax_fold(float *restrict scores, int n, float block_max, float *restrict row_max,
                         float *restrict row_sum, float *restrict acc, int head_dim) {
    const float new_max = block_max > *row_max ? block_max : *row_max;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < n; t++) {
        scores[t] = expf(scores[t] - new_max);
        sum += scores[t];
    }
    const float rescale = fold_max_sum(new_max, sum, row_max, row_sum);
    if (rescale != 1.0f) { /* acc * 1 is acc: no pass over it */
#pragma omp simd
        for (int d = 0; d < head_dim; d++) acc[d] *= rescale;
    }
}

/* A query row's dot product with a key of n values (fp32, or bf16 read as fp32). */
INLINE float dot_f32(const float *restrict a, const float *restrict b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
INLINE float dot_bf16(const float *restrict a, const bf16 *restrict b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * ld_bf16(b, i);
    return s;
}

/* bf16 rows of even length are read two values at a time: a 32-bit word holds
 * elements 2i (low half) and 2i + 1 (high half), each an fp32 after one shift or one
 * mask. The query row and the accumulators are kept deinterleaved (the even elements,
 * then the odd ones), so 32 values of a key or a value cost one load, two integer ops
 * and two FMAs: no widening of each value on its own, which made bf16 attention 1.7x
 * slower than fp32 on cached keys. */
typedef uint32_t bf16x2 __attribute__((may_alias, aligned(2)));
#define EVEN_F32(w) BITS_TO_F32((w) << 16)
#define ODD_F32(w) BITS_TO_F32((w) & 0xffff0000u)

INLINE float dot_pairs(const float *restrict q, const bf16x2 *restrict k, int half) {
    const float *qe = q, *qo = q + half;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < half; i++) {
        const uint32_t w = k[i];
        s += qe[i] * EVEN_F32(w) + qo[i] * ODD_F32(w);
    }
    return s;
}


/* fp32 dot products in one fixed order, so that a score is the same bits whether it is
 * taken alone (dot_row_f32, decode steps) or with seven other keys' (dot8_rows_f32, a
 * prompt's tile): lane l of 8 sums q[d] * k[d] over d = l mod 8 in order, one FMA
 * chain (with AVX-512: 16 lanes, lane l + 8 then added to lane l), the tail of
 * head_dim loaded masked, as zeros; then the lanes are summed ((0 + 1) + (2 + 3)) +
 * ((4 + 5) + (6 + 7)). Eight keys' lanes are summed by one transpose (six vhaddps,
 * two vperm2f128, one add) instead of a horizontal sum each: a prompt's forward took
 * 0.93x the time at 512 tokens, 0.90x at 1,024, on a Zen 4 at the AVX2 and AVX-512
 * levels (docs/benchmarks.md, "A Zen 4, an eighth time"). The FMAs and vhaddps are
 * builtins, which -ffast-math does not reassociate, and each vaddps adds a value to a
 * shuffle of it (or two shuffles): no chain of adds to reorder. */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DOT8_F32 1
INLINE __m256 dot_lanes_f32(const float *q, const float *k, int n) {
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    int d = 0;
    for (; d + 16 <= n; d += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc);
    if (d < n) {
        const __mmask16 m = (__mmask16)((1u << (n - d)) - 1u);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + d), _mm512_maskz_loadu_ps(m, k + d),
                              acc);
    }
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
    return _mm256_add_ps(_mm512_castps512_ps256(acc), hi);
#else
    __m256 acc = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= n; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), acc);
    if (d < n) {
        const __m256i m =
            _mm256_cmpgt_epi32(_mm256_set1_epi32(n - d), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        acc = _mm256_fmadd_ps(_mm256_maskload_ps(q + d, m), _mm256_maskload_ps(k + d, m), acc);
    }
    return acc;
#endif
}
INLINE float dot_lanes_sum(__m256 v) {
    __m256 h = _mm256_add_ps(v, _mm256_permute_ps(v, 0xb1)); /* lanes 0: 0+1, 2: 2+3, ... */
    h = _mm256_add_ps(h, _mm256_permute_ps(h, 0x4e));        /* 0: (0+1)+(2+3), 4: (4+5)+.. */
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
/* scores[0..7] = the dot products of q with the keys at k, k + stride, ..., times scale */
INLINE void dot8_rows_f32(float *scores, const float *q, const float *k, int64_t stride,
                          int n, float scale) {
    __m256 v[8];
    for (int t = 0; t < 8; t++) v[t] = dot_lanes_f32(q, k + t * stride, n);
    const __m256 g0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20),
                                     _mm256_permute2f128_ps(g0, g1, 0x31));
    _mm256_storeu_ps(scores, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
}
#endif

/* Cache blocks ahead of use are asked for into L2 (prefetcht1), not L1: see
 * prefetch_block_<S> below. */
#define PREFETCH_LOCALITY 2
/* Ask for values [0, width) of token t of a block at p (tokens kv_stride apart) into L2,
 * one request per 64-byte line. */
#define PREFETCH_TOKEN(p, t, kv_stride, width)                                                 \
    for (int64_t d_ = 0; d_ < (width); d_ += 64 / (int64_t)sizeof(*(p)))                      \
    __builtin_prefetch((p) + (t) * (kv_stride) + d_, 0, PREFETCH_LOCALITY)

/* ---- bf16 attention on AVX512-BF16: a KV head's query rows over 16 keys at a time ----
 *
 * For head sizes 32, 64 and 128, in place of the row-at-a-time loop above (which sums
 * each dot product across a vector on its own, and widens each value once per query
 * row):
 * - a row's dot products with 16 keys are vdpbf16ps on the bf16 words as stored (exact
 *   products, fp32 sums), and one transposing reduction turns the 16 vectors of partial
 *   sums into one vector of 16 scores;
 * - P.V runs key by key over up to 4 rows at once: each value is widened once for all
 *   of them, and their accumulators stay in registers.
 * The softmax is softmax_fold's in registers, with exp_lanes for expf; the order in
 * which a dot product is summed and the exponential (within 1.23 ulp) differ from the loop
 * above, and each head size takes one path or the other, whatever the call. A row
 * still depends on its own query and keys alone:
 * the same result whatever the batch, the tile or the other rows
 * (tests/engine/test_cpu_kernels.py). The default model's 32-request decode step spent
 * 6.4-6.5 ms in attention before (the loop above, prefetching into L1), 4.3-5.0 ms on
 * this with the prefetch into L2 below. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define KEYS_PER_PASS 16

/* lane t = the sum of the 16 lanes of v[t] */
INLINE __m512 sum_lanes16(const __m512 v[KEYS_PER_PASS]) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3 */
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: that lane's sum of 4 vectors */
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++) /* 128-bit lanes 0+1, 2+3 of each of two */
        y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88),
                         _mm512_shuffle_f32x4(y[0], y[1], 0xdd));
}

/* A query row's scaled scores against keys [0, n) (n <= 16) in lanes [0, n); the other
 * lanes are NEG_BIG. chunks = head_dim / 32. With whole = 1 all 16 keys are read (they
 * are in the block whatever n is: slots not yet written hold stale values or zeros),
 * which keeps the 16 sums in registers; lane t depends on key t alone, and the lanes
 * past n are replaced. */
INLINE __m512 row_scores(const bf16 *q, const bf16 *kb, int64_t kv_stride, int n, float scale,
                         int chunks, int whole) {
    __m512bh qc[4];
    for (int c = 0; c < chunks; c++) qc[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
    __m512 v[KEYS_PER_PASS];
    for (int t = 0; t < KEYS_PER_PASS; t++) {
        v[t] = _mm512_setzero_ps();
        if (whole || t < n)
            for (int c = 0; c < chunks; c++)
                v[t] = _mm512_dpbf16_ps(
                    v[t], (__m512bh)_mm512_loadu_si512(kb + t * kv_stride + 32 * c), qc[c]);
    }
    const __m512 s = _mm512_mul_ps(sum_lanes16(v), _mm512_set1_ps(scale));
    return _mm512_mask_blend_ps((__mmask16)((1u << n) - 1u), _mm512_set1_ps(NEG_BIG), s);
}

/* e^x in each lane, within 1.23 ulp of e^x from -87 to 0 (every 64th float, against
 * exp in double): x = n ln 2 + r (|r| <= ln 2 / 2, ln 2 in two parts), e^r by Cephes'
 * polynomial, times 2^n by vscalefps (0 below e^-110; NaN stays NaN; e^0 is 1).
 * Inline, so the rows of a pass overlap their softmaxes, where a call to libmvec's
 * expf per row ended each row's chain of work. */
INLINE __m512 exp_lanes(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-110.0f), x); /* second operand: a NaN x stays */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 one_r = _mm512_add_ps(r, _mm512_set1_ps(1.0f));
    const __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, one_r);
    return _mm512_scalef_ps(y, n);
}

/* acc[r] = acc[r] * rescale[r] + sum over keys t < seen[r] of p[r][t] * value t, for
 * `rows` (<= ROWS) rows; acc in the deinterleaved layout (even elements, then odd), p
 * rows KEYS_PER_PASS apart; n = the largest seen[r]. A key past a row's seen is
 * skipped, not weighted 0: 0 times a NaN or Inf value is NaN, which a query that does
 * not see the key (an earlier token of the same prompt) must not get. pf_k / pf_v
 * (NULL: none): a later block's keys and values, token t's asked for as value t is
 * read (see attend_rows_chunks). */
INLINE void rows_pv(float *acc, const float *p, const float *rescale, int rows, const bf16 *vb,
                    int64_t kv_stride, const int *seen, int n, int chunks, int64_t head_dim,
                    const bf16 *pf_k, const bf16 *pf_v) {
    enum { ROWS = 4, MAX_CHUNKS = 4 };
    __m512 a[ROWS][2 * MAX_CHUNKS];
    const int64_t half = head_dim / 2;
    for (int r = 0; r < rows; r++) {
        const __m512 w = _mm512_set1_ps(rescale[r]);
        for (int c = 0; c < chunks; c++) {
            a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * head_dim + 16 * c), w);
            const float *odd = acc + r * head_dim + half + 16 * c;
            a[r][chunks + c] = _mm512_mul_ps(_mm512_loadu_ps(odd), w);
        }
    }
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int t = 0; t < n; t++) {
        if (pf_k) {
            PREFETCH_TOKEN(pf_k, t, kv_stride, head_dim);
            PREFETCH_TOKEN(pf_v, t, kv_stride, head_dim);
        }
        __m512 even[MAX_CHUNKS], odd[MAX_CHUNKS];
        for (int c = 0; c < chunks; c++) {
            const __m512i w = _mm512_loadu_si512(vb + t * kv_stride + 32 * c);
            even[c] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
            odd[c] = _mm512_castsi512_ps(_mm512_and_si512(w, high));
        }
        for (int r = 0; r < rows; r++) {
            if (t >= seen[r]) continue;
            const __m512 pr = _mm512_set1_ps(p[r * KEYS_PER_PASS + t]);
            for (int c = 0; c < chunks; c++) {
                a[r][c] = _mm512_fmadd_ps(pr, even[c], a[r][c]);
                a[r][chunks + c] = _mm512_fmadd_ps(pr, odd[c], a[r][chunks + c]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chunks; c++) {
            _mm512_storeu_ps(acc + r * head_dim + 16 * c, a[r][c]);
            _mm512_storeu_ps(acc + r * head_dim + half + 16 * c, a[r][chunks + c]);
        }
}

#define ROW_PASS_CASE(R, C)                                                                    \
    case R:                                                                                    \
        rows_pv(acc + r0 * head_dim, probs, rescale, R, vp, kv_stride, seen, n_max, C,         \
                head_dim, r0 ? NULL : pf_k, r0 ? NULL : pf_v);                                 \
        break;

/* Every query row of a tile (rows: query head of the KV head's group major, query
 * token minor, as in PAGED_ATTENTION) over one cache block, keys first_key ..; the
 * query of tl tokens ends at seq_len. CHUNKS (a constant at each call) = head_dim / 32.
 * A pass's rows go through each stage together (their scores, then their softmaxes,
 * then P.V), so one row's chain of dependent steps overlaps the others'. The softmax
 * is softmax_fold's in registers: the block's maximum, its weights e^(s - max) (exp_lanes),
 * their sum, and the rescale of the row's sum and acc, which rows_pv applies as it
 * loads acc.
 * pf_k / pf_v (NULL: none): the keys and values of the block PREFETCH_BLOCKS ahead (the
 * same KV head), asked for one token at a time in the first pass's P.V, as the fp32
 * rows' block_rows_of_<R> does: asked for all at once as the block began (64 requests
 * for SmolLM2), they filled the core's miss queue ahead of this block's loads. On a Zen
 * 5, one layer's attention from memory (scripts/bench_attention_kernel.c, HUGE=1
 * LAYERS=30, 2 threads) took 113-119 us against 138-146 at 32 sequences x 100 tokens,
 * 285-300 against 358-386 x 300, and the one-call decoder's bf16 step of 32 x 100
 * 0.954x the time (0.940-0.964, scripts/bench_kernel_ab.py; docs/benchmarks.md, "A Zen
 * 5"). */
INLINE void attend_rows_chunks(const bf16 *q, int64_t q_token_stride, int64_t q_start,
                               int64_t first_head, int64_t group, int64_t tl,
                               int64_t head_dim, const bf16 *kb, const bf16 *vb,
                               int64_t kv_stride, int64_t block_size, int64_t seq_len,
                               int64_t first_key, float scale, float *row_max, float *row_sum,
                               float *acc, const bf16 *pf_k, const bf16 *pf_v, int chunks) {
    /* rows per P.V pass: 2 * chunks accumulators each, 16 of the 32 registers in all */
    const int per_pass = chunks == 4 ? 2 : 4;
    const int64_t rows = group * tl;
    float probs[4 * KEYS_PER_PASS] __attribute__((aligned(64)));
    float rescale[4];
    int seen[4];
    for (int64_t k0 = 0; k0 < block_size; k0 += KEYS_PER_PASS) {
        const int64_t in_block = block_size - k0 < KEYS_PER_PASS ? block_size - k0 : KEYS_PER_PASS;
        const bf16 *kp = kb + k0 * kv_stride, *vp = vb + k0 * kv_stride;
        for (int64_t r0 = 0; r0 < rows; r0 += per_pass) {
            const int rn = (int)(rows - r0 < per_pass ? rows - r0 : per_pass);
            __m512 s[4];
            int n_max = 0;
            for (int i = 0; i < rn; i++) {
                const int64_t r = r0 + i, hl = r / tl, j = r % tl;
                /* keys first_key + k0 .. seq_len - tl + j are visible to query j */
                const int64_t visible = seq_len - tl + j + 1 - (first_key + k0);
                const int n = (int)(visible < in_block ? (visible > 0 ? visible : 0) : in_block);
                seen[i] = n;
                if (n == 0) continue;
                const bf16 *qr = q + (q_start + j) * q_token_stride + (first_head + hl) * head_dim;
                s[i] = in_block == KEYS_PER_PASS
                           ? row_scores(qr, kp, kv_stride, n, scale, chunks, 1)
                           : row_scores(qr, kp, kv_stride, n, scale, chunks, 0);
                n_max = n > n_max ? n : n_max;
            }
            if (n_max == 0) continue;
            for (int i = 0; i < rn; i++) {
                const int n = seen[i];
                rescale[i] = 1.0f;
                if (n == 0) continue;
                const float block_max = _mm512_reduce_max_ps(s[i]);
                const float new_max = block_max > row_max[r0 + i] ? block_max : row_max[r0 + i];
                const __m512 p = exp_lanes(_mm512_sub_ps(s[i], _mm512_set1_ps(new_max)));
                _mm512_store_ps(probs + i * KEYS_PER_PASS, p);
                const float block_sum =
                    _mm512_reduce_add_ps(_mm512_maskz_mov_ps((__mmask16)((1u << n) - 1u), p));
                rescale[i] = fold_max_sum(new_max, block_sum, row_max + r0 + i, row_sum + r0 + i);
            }
            switch (rn) {
                ROW_PASS_CASE(1, chunks)
                ROW_PASS_CASE(2, chunks)
                ROW_PASS_CASE(3, chunks)
                ROW_PASS_CASE(4, chunks)
            }
        }
    }
}

/* head_dim / 32 where the path above applies, else 0 */
INLINE int dot_chunks_bf16(int64_t head_dim) {
    return head_dim == 32 ? 1 : head_dim == 64 ? 2 : head_dim == 128 ? 4 : 0;
}

INLINE void attend_rows_bf16(const bf16 *q, int64_t q_token_stride, int64_t q_start,
                             int64_t first_head, int64_t group, int64_t tl, int64_t head_dim,
                             const bf16 *kb, const bf16 *vb, int64_t kv_stride,
                             int64_t block_size, int64_t seq_len, int64_t first_key,
                             float scale, float *row_max, float *row_sum, float *acc,
                             const bf16 *pf_k, const bf16 *pf_v) {
#define ROWS_ARGS                                                                              \
    q, q_token_stride, q_start, first_head, group, tl, head_dim, kb, vb, kv_stride,            \
        block_size, seq_len, first_key, scale, row_max, row_sum, acc, pf_k, pf_v
    switch (dot_chunks_bf16(head_dim)) {
        case 1: attend_rows_chunks(ROWS_ARGS, 1); break;
        case 2: attend_rows_chunks(ROWS_ARGS, 2); break;
        case 4: attend_rows_chunks(ROWS_ARGS, 4); break;
    }
#undef ROWS_ARGS
}
#else
INLINE int dot_chunks_bf16(int64_t head_dim) { return (void)head_dim, 0; }
INLINE void attend_rows_bf16(const bf16 *q, int64_t q_token_stride, int64_t q_start,
                             int64_t first_head, int64_t group, int64_t tl, int64_t head_dim,
                             const bf16 *kb, const bf16 *vb, int64_t kv_stride,
                             int64_t block_size, int64_t seq_len, int64_t first_key,
                             float scale, float *row_max, float *row_sum, float *acc,
                             const bf16 *pf_k, const bf16 *pf_v) {
    (void)q, (void)q_token_stride, (void)q_start, (void)first_head, (void)group, (void)tl;
    (void)head_dim, (void)kb, (void)vb, (void)kv_stride, (void)block_size, (void)seq_len;
    (void)first_key, (void)scale, (void)row_max, (void)row_sum, (void)acc, (void)pf_k;
    (void)pf_v;
}
#endif

/* fp32 has no such path */
INLINE int dot_chunks_f32(int64_t head_dim) { return (void)head_dim, 0; }
INLINE void attend_rows_f32(const float *q, int64_t q_token_stride, int64_t q_start,
                            int64_t first_head, int64_t group, int64_t tl, int64_t head_dim,
                            const float *kb, const float *vb, int64_t kv_stride,
                            int64_t block_size, int64_t seq_len, int64_t first_key,
                            float scale, float *row_max, float *row_sum, float *acc,
                            const float *pf_k, const float *pf_v) {
    (void)q, (void)q_token_stride, (void)q_start, (void)first_head, (void)group, (void)tl;
    (void)head_dim, (void)kb, (void)vb, (void)kv_stride, (void)block_size, (void)seq_len;
    (void)first_key, (void)scale, (void)row_max, (void)row_sum, (void)acc, (void)pf_k;
    (void)pf_v;
}

/* A query row as fp32, in the layout block_rows_<S> reads it in (fp32 rows are read in
 * place and never copied). */
INLINE void load_query_f32(float *restrict dst, const float *restrict src, int64_t head_dim) {
    memcpy(dst, src, sizeof(float) * (size_t)head_dim);
}
INLINE void load_query_bf16(float *restrict dst, const bf16 *restrict src, int64_t head_dim) {
    if (head_dim % 2) {
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) dst[d] = ld_bf16(src, d);
        return;
    }
    const int64_t half = head_dim / 2;
    const bf16x2 *w = (const bf16x2 *)src;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        dst[i] = EVEN_F32(w[i]);
        dst[half + i] = ODD_F32(w[i]);
    }
}

/* o = acc * inv, acc in block_rows_<S>'s layout. */
INLINE void store_row_f32(float *restrict o, const float *restrict acc, float inv,
                          int64_t head_dim) {
#pragma omp simd
    for (int64_t d = 0; d < head_dim; d++) o[d] = acc[d] * inv;
}
INLINE void store_row_bf16(bf16 *restrict o, const float *restrict acc, float inv,
                           int64_t head_dim) {
    if (head_dim % 2) {
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) st_bf16(o, d, acc[d] * inv);
        return;
    }
    const int64_t half = head_dim / 2;
    bf16x2 *w = (bf16x2 *)o;
#pragma omp simd
    for (int64_t i = 0; i < half; i++)
        w[i] = (uint32_t)F32_TO_BF16(acc[i] * inv) | (uint32_t)F32_TO_BF16(acc[half + i] * inv)
                                                         << 16;
}

/* fp32 query rows over a bf16 cache (--kv-cache-dtype bfloat16 on a float32 model):
 * block_rows_bf16 reads the cache, so a row is loaded into its layout (the even elements,
 * then the odd ones, for an even head size) and stored back from it; no attend_rows
 * path (it takes bf16 rows). */
INLINE int dot_chunks_f32_bf16kv(int64_t head_dim) { return (void)head_dim, 0; }
INLINE void attend_rows_f32_bf16kv(const float *q, int64_t q_token_stride, int64_t q_start,
                                   int64_t first_head, int64_t group, int64_t tl,
                                   int64_t head_dim, const bf16 *kb, const bf16 *vb,
                                   int64_t kv_stride, int64_t block_size, int64_t seq_len,
                                   int64_t first_key, float scale, float *row_max,
                                   float *row_sum, float *acc, const bf16 *pf_k,
                                   const bf16 *pf_v) {
    (void)q, (void)q_token_stride, (void)q_start, (void)first_head, (void)group, (void)tl;
    (void)head_dim, (void)kb, (void)vb, (void)kv_stride, (void)block_size, (void)seq_len;
    (void)first_key, (void)scale, (void)row_max, (void)row_sum, (void)acc, (void)pf_k;
    (void)pf_v;
}
INLINE void load_query_f32_bf16kv(float *restrict dst, const float *restrict src,
                                  int64_t head_dim) {
    if (head_dim % 2) {
        memcpy(dst, src, sizeof(float) * (size_t)head_dim);
        return;
    }
    const int64_t half = head_dim / 2;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        dst[i] = src[2 * i];
        dst[half + i] = src[2 * i + 1];
    }
}
INLINE void store_row_f32_bf16kv(float *restrict o, const float *restrict acc, float inv,
                                 int64_t head_dim) {
    if (head_dim % 2) {
        store_row_f32(o, acc, inv, head_dim);
        return;
    }
    const int64_t half = head_dim / 2;
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        o[2 * i] = acc[i] * inv;
        o[2 * i + 1] = acc[half + i] * inv;
    }
}

/* Ask for `width` values of each slot of cache block `block` (from `offset`), keys and
 * values, ahead of their use: blocks are anywhere in the cache, so the hardware
 * prefetchers cannot guess the next one. Into L2 (prefetcht1), not L1: the 64 requests
 * of a bf16 block into L1 held up the loads of the block in use. The default model's
 * 32-request decode step spent 4.3-5.0 ms in attention with L2, 5.8-6.6 with L1 (bf16),
 * and 6.8-7.8 against 8.8-9.5 ms in fp32. The vdpbf16ps path asks for its blocks two
 * ahead (PREFETCH_BLOCKS), which the faster loop of attend_rows_chunks needs: with the
 * two together the one-call decoder's step of 32 sequences x 300 tokens of context took
 * 0.924-0.960x the time, x 100 tokens 0.988-0.994x, against 0.973-0.978 and 0.987-0.992
 * with the loop alone (scripts/bench_kernel_ab.py, bf16, on the Xeon with AMX). That
 * path now asks for a key chunk's first PREFETCH_BLOCKS blocks here, and for each later
 * one token by token while the block PREFETCH_BLOCKS before it is read
 * (attend_rows_chunks). */
#define PREFETCH_BLOCKS 2 /* blocks asked for ahead of the one in use */
#define PREFETCH_BLOCK(T, S)                                                                   \
    INLINE void prefetch_block_##S(const T *k_cache, const T *v_cache, int64_t block,          \
                                   int64_t block_size, int64_t kv_stride, int64_t offset,      \
                                   int64_t width) {                                            \
        const int64_t line = 64 / (int64_t)sizeof(T);                                          \
        const int64_t base = block * block_size * kv_stride + offset;                          \
        for (int64_t t = 0; t < block_size; t++)                                               \
            for (int64_t d = 0; d < width; d += line) {                                        \
                __builtin_prefetch(k_cache + base + t * kv_stride + d, 0, PREFETCH_LOCALITY);  \
                __builtin_prefetch(v_cache + base + t * kv_stride + d, 0, PREFETCH_LOCALITY);  \
            }                                                                                  \
    }
PREFETCH_BLOCK(float, f32)
PREFETCH_BLOCK(bf16, bf16)

/* 0 when every selected sequence fits the buffers passed; else 3 when a sequence id, a
 * length or a block id is out of range, or 2 when a sequence has more query rows than
 * max_rows. Checked before any work, so a refused call writes nothing and its status
 * does not depend on thread timing. 64-bit arithmetic: no sum or product of the int32
 * inputs can wrap. */
static int check_sequences(
    const int32_t *block_tables, int64_t block_table_stride, int64_t table_width,
    const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs,
    int64_t num_tokens, const int32_t *seq_ids, int64_t num_selected, int64_t group,
    int64_t block_size, int64_t num_cache_blocks, int64_t max_rows) {
    int status = 0;
    for (int64_t i = 0; i < num_selected; i++) {
        const int64_t seq = seq_ids[i];
        if (seq < 0 || seq >= num_seqs) return 3;
        const int64_t q_start = query_start_loc[seq];
        const int64_t q_len = (int64_t)query_start_loc[seq + 1] - q_start;
        const int64_t seq_len = seq_lens[seq];
        const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
        if (q_len < 1 || q_len > seq_len || num_blocks > table_width || q_start < 0 ||
            q_start + q_len > num_tokens)
            return 3;
        const int32_t *table = block_tables + seq * block_table_stride;
        for (int64_t b = 0; b < num_blocks; b++)
            if (table[b] < 0 || table[b] >= num_cache_blocks) return 3;
        if (group * q_len > max_rows) status = 2;
    }
    return status;
}

/* Token trees. A sequence verifying a token tree feeds [verified tokens, tree nodes]
 * in one step; tree_masks[token] says which of the step's fed tokens that token sees
 * (bit b: fed token b; -1: every earlier one, plain causal; b >= 64 always seen), on
 * top of the causal rule and of the whole context before the step. Such a row is
 * computed exactly as plain decoding computes the same query: its visible keys, in
 * order, are a virtual sequence (the context, then the fed tokens it sees) split into
 * blocks at the same boundaries as a plain sequence of that length, each folded into
 * the streaming softmax by the same call; a virtual block whose keys are not where
 * its real block keeps them is gathered into scratch first. So a node's output equals
 * the output of decoding its path token by token, bit for bit. */
INLINE int tile_has_tree(const int64_t *masks, int64_t tl) {
    for (int64_t j = 0; j < tl; j++)
        if (masks[j] != -1) return 1;
    return 0;
}

/* The fed tokens query jj sees (bits of `mask` among 0 .. min(jj, 63)), ascending, into
 * `seen`; returns how many. Fed tokens 64 .. jj are seen too and not listed. */
INLINE int tree_seen(uint64_t mask, int64_t jj, int *seen) {
    int count = 0;
    const int64_t top = jj < 63 ? jj : 63;
    for (int64_t b = 0; b <= top; b++)
        if (mask >> b & 1) seen[count++] = (int)b;
    return count;
}

/* The real key of virtual key v (>= step_start) of a row that lists `num_seen` fed
 * tokens in `seen`. */
INLINE int64_t tree_real_key(int64_t v, int64_t step_start, const int *seen, int num_seen) {
    const int64_t u = v - step_start;
    return step_start + (u < num_seen ? seen[u] : 64 + (u - num_seen));
}

/* A key chunk's streaming softmax state, per row: its maximum, its sum of weights and
 * its weighted values (acc, head_dim a row). */
INLINE void chunk_reset(int64_t rows, int64_t head_dim, float *restrict row_max,
                        float *restrict row_sum, float *restrict acc) {
    for (int64_t r = 0; r < rows; r++) {
        row_max[r] = NEG_BIG;
        row_sum[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(rows * head_dim));
}

/* Fold a chunk's state into the rows' total (the same form), each side rescaled to the
 * larger maximum. The first chunk into a reset total is a copy (its weight is exp(0),
 * the total's exp(NEG_BIG - m) = 0); a chunk a row sees no key of leaves it as it was. */
INLINE void chunk_merge(int64_t rows, int64_t head_dim, const float *restrict c_max,
                        const float *restrict c_sum, const float *restrict c_acc,
                        float *restrict t_max, float *restrict t_sum, float *restrict t_acc) {
    for (int64_t r = 0; r < rows; r++) {
        const float m = c_max[r] > t_max[r] ? c_max[r] : t_max[r];
        const float wt = expf(t_max[r] - m), wc = expf(c_max[r] - m);
        t_max[r] = m;
        t_sum[r] = t_sum[r] * wt + c_sum[r] * wc;
        float *restrict ta = t_acc + r * head_dim;
        const float *restrict ca = c_acc + r * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) ta[d] = ta[d] * wt + ca[d] * wc;
    }
}

/* ---- one cache block, many query rows, key by key ----
 *
 * Rows [0, rows) of a work item against one cache block: row r is the fp32 query qv[r]
 * (a bf16 row widened into qf first), its KV head's keys and values at kb + off[r] and
 * vb + off[r] (token t kv_stride further), its visible keys nv[r] (0 .. block_size; 0
 * leaves the row as it was). Each row takes its scaled dot products in key order, their
 * maximum, softmax_fold, then P.V in key order. Key t is used by every row before key
 * t + 1, so a block of an item that covers every KV head is read front to back, a
 * token's keys of all heads (768 bytes for SmolLM2's fp32 cache) one stretch. Read that
 * way a decode step's scattered 12 KB blocks came from memory at 11.8-14.0 GB/s on one
 * Zen 3 core, against 8.5-10.1 GB/s one head's 256 bytes of each 768 at a time (a loop
 * that only reads the same layout: scripts/bench_kv_layout_read.c).
 * pf_k / pf_v: the next block's keys and values (pf_width values of each token, from
 * the item's first head), asked for into L2 one token at a time as this block's token
 * is read, the requests spread out (a whole block's 64-384 requests at once fill the
 * core's miss queue ahead of the loads in use). NULL: none.
 *
 * Every row off the vdpbf16ps path (an item of one KV head or of all, a token tree's
 * rows, the one-call decoder) runs these functions, one copy each, not inlined: the
 * compiler vectorizes each copy's dot products on its own, and a row's bits must not
 * depend on which path took it. noclone keeps gcc from specializing one for a caller's
 * constant arguments.
 *
 * The Linear kernels' tile loops (dp_tiles_bf16, lf_tiles_*, q_groups_*) and the
 * attention's items (attn_item_*, attn_merge_*) are one copy each too, called by the
 * layer-by-layer kernels and by the one-call decoder's team alike. Inlined into each
 * caller, every team's parallel region carried its own copy of all of them: 951 KB of
 * code, 62 s of gcc -O3 for an AVX-512 Xeon; one copy each, 426 KB and 20 s. A call per
 * tile or item costs nothing beside the work it does. */
#if defined(__clang__)
#define ONE_COPY __attribute__((noinline))
#else
#define ONE_COPY __attribute__((noinline, noclone))
#endif
/* One row's dot product with a key, and p times a value added to its acc, for each key
 * type and row layout: fp32; bf16 of an even head size, read two at a time with the
 * row in the deinterleaved layout (dot_pairs); bf16 of an odd one. */
INLINE float dot_row_f32(const float *q, const float *k, int head_dim) {
#if defined(DOT8_F32)
    return dot_lanes_sum(dot_lanes_f32(q, k, head_dim));
#else
    return dot_f32(q, k, head_dim);
#endif
}
INLINE float dot_row_pairs(const float *q, const bf16 *k, int head_dim) {
    return dot_pairs(q, (const bf16x2 *)k, head_dim / 2);
}
INLINE float dot_row_bf16odd(const float *q, const bf16 *k, int head_dim) {
    return dot_bf16(q, k, head_dim);
}
INLINE void pv_row_f32(float *restrict acc, float p, const float *restrict v, int head_dim) {
#pragma omp simd
    for (int d = 0; d < head_dim; d++) acc[d] += p * v[d];
}
INLINE void pv_row_pairs(float *restrict acc, float p, const bf16 *restrict v, int head_dim) {
    const bf16x2 *vt = (const bf16x2 *)v;
    float *ae = acc, *ao = acc + head_dim / 2;
#pragma omp simd
    for (int i = 0; i < head_dim / 2; i++) {
        const uint32_t w = vt[i];
        ae[i] += p * EVEN_F32(w);
        ao[i] += p * ODD_F32(w);
    }
}
INLINE void pv_row_bf16odd(float *restrict acc, float p, const bf16 *restrict v, int head_dim) {
#pragma omp simd
    for (int d = 0; d < head_dim; d++) acc[d] += p * ld_bf16(v, d);
}

/* Floats of a row's attention sums that block_rows_of_* keeps in registers across a
 * block's tokens: half the vector registers (16 ymm with AVX, 32 zmm with AVX-512); 0
 * on SSE, where the sums would spill (a prompt's forward took 1.03x as long so). */
#if defined(__AVX512F__)
#define PV_REG_FLOATS 128
#elif defined(__AVX__)
#define PV_REG_FLOATS 64
#else
#define PV_REG_FLOATS 0
#endif

/* A prompt's tile (rows of one KV head, fp32 keys): each row's scores eight keys at a
 * time (dot8_rows_f32), the rest one by one, the same bits (see dot_lanes_f32); the
 * next block's keys asked for one token a row, as the token loop below asks for them.
 * 0 for key types without this path (the caller's token loop then runs). */
#if defined(DOT8_F32)
INLINE int scores_of_one_head_f32(int64_t rows, const float *const *qv, const int64_t *off,
                                  const int *nv, const float *kb, int64_t kv_stride,
                                  int head_dim, float scale, int64_t score_stride,
                                  float *scores, int n_max, const float *pf_k,
                                  int64_t pf_width) {
    const float *k0 = kb + off[0];
    for (int64_t r = 0; r < rows; r++) {
        if (pf_k && r < n_max) PREFETCH_TOKEN(pf_k, r, kv_stride, pf_width);
        float *sr = scores + r * score_stride;
        int t = 0;
        for (; t + 8 <= nv[r]; t += 8)
            dot8_rows_f32(sr + t, qv[r], k0 + t * kv_stride, kv_stride, head_dim, scale);
        for (; t < nv[r]; t++) sr[t] = dot_row_f32(qv[r], k0 + t * kv_stride, head_dim) * scale;
    }
    if (pf_k)
        for (int64_t t = rows; t < n_max; t++) PREFETCH_TOKEN(pf_k, t, kv_stride, pf_width);
    return 1;
}
#define SCORES_OF_ONE_HEAD_f32 scores_of_one_head_f32
#else
#define SCORES_OF_ONE_HEAD_f32(...) 0
#endif
#define SCORES_OF_ONE_HEAD_pairs(...) 0
#define SCORES_OF_ONE_HEAD_bf16odd(...) 0

#define BLOCK_ROWS_OF(R, KT)                                                                   \
    INLINE void block_rows_of_##R(int64_t rows, const float *const *qv, const int64_t *off,    \
                                  const int *nv, const KT *kb, const KT *vb,                   \
                                  int64_t kv_stride, const int head_dim, float scale,          \
                                  int64_t score_stride, float *scores, float *row_max,         \
                                  float *row_sum, float *acc, const KT *pf_k, const KT *pf_v,  \
                                  int64_t pf_width) {                                          \
        int n_max = 0;                                                                         \
        for (int64_t r = 0; r < rows; r++) n_max = nv[r] > n_max ? nv[r] : n_max;              \
        /* rows of one KV head: a prompt's tile (decode steps' items hold every KV head) */    \
        const int one_head = rows > 1 && off[0] == off[rows - 1];                              \
        if (!(one_head && SCORES_OF_ONE_HEAD_##R(rows, qv, off, nv, kb, kv_stride, head_dim,   \
                                                 scale, score_stride, scores, n_max, pf_k,     \
                                                 pf_width))) {                                 \
            for (int t = 0; t < n_max; t++) {                                                  \
                if (pf_k) PREFETCH_TOKEN(pf_k, t, kv_stride, pf_width);                        \
                const KT *kt = kb + t * kv_stride;                                             \
                for (int64_t r = 0; r < rows; r++)                                             \
                    if (t < nv[r])                                                             \
                        scores[r * score_stride + t] =                                         \
                            dot_row_##R(qv[r], kt + off[r], head_dim) * scale;                 \
            }                                                                                  \
        }                                                                                      \
        for (int64_t r = 0; r < rows; r++) {                                                   \
            if (nv[r] <= 0) continue;                                                          \
            float *sr = scores + r * score_stride;                                             \
            float block_max = NEG_BIG;                                                         \
            for (int t = 0; t < nv[r]; t++) block_max = sr[t] > block_max ? sr[t] : block_max; \
            softmax_fold(sr, nv[r], block_max, row_max + r, row_sum + r, acc + r * head_dim,   \
                         head_dim);                                                            \
        }                                                                                      \
        if (head_dim <= PV_REG_FLOATS && one_head) {                                           \
            /* One KV head's rows (a prompt's tile): each row's sums held in registers over  \
             * the block's tokens instead of loaded and stored at each, the same additions \
             * in the same order as below, so the same bits. A prompt's forward on an AVX2  \
             * Zen 3 took 0.97x the time at 256-512 tokens, 0.90-0.98x at 1,024           \
             * (docs/benchmarks.md, "An AVX2-only Zen 3 again"). Decode steps (rows of     \
             * every KV head) keep the token-major order: it reads the cache in order. */  \
            for (int64_t r = 0; r < rows; r++) {                                               \
                float a[head_dim];                                                             \
                memcpy(a, acc + r * head_dim, sizeof a);                                       \
                for (int t = 0; t < nv[r]; t++) {                                              \
                    if (r == 0 && pf_v) PREFETCH_TOKEN(pf_v, t, kv_stride, pf_width);          \
                    pv_row_##R(a, scores[r * score_stride + t], vb + t * kv_stride + off[r],   \
                               head_dim);                                                      \
                }                                                                              \
                memcpy(acc + r * head_dim, a, sizeof a);                                       \
            }                                                                                  \
            if (pf_v)                                                                          \
                for (int t = nv[0] > 0 ? nv[0] : 0; t < n_max; t++)                            \
                    PREFETCH_TOKEN(pf_v, t, kv_stride, pf_width);                              \
            return;                                                                            \
        }                                                                                      \
        for (int t = 0; t < n_max; t++) {                                                      \
            if (pf_v) PREFETCH_TOKEN(pf_v, t, kv_stride, pf_width);                            \
            const KT *vt = vb + t * kv_stride;                                                 \
            for (int64_t r = 0; r < rows; r++)                                                 \
                if (t < nv[r])                                                                 \
                    pv_row_##R(acc + r * head_dim, scores[r * score_stride + t], vt + off[r],  \
                               head_dim);                                                      \
        }                                                                                      \
    }
BLOCK_ROWS_OF(f32, float)
BLOCK_ROWS_OF(pairs, bf16)
BLOCK_ROWS_OF(bf16odd, bf16)

#define BLOCK_ROWS_ARGS(KT)                                                                    \
    int64_t rows, const float *const *qv, const int64_t *off, const int *nv, const KT *kb,     \
        const KT *vb, int64_t kv_stride, int64_t head_dim, float scale, int64_t score_stride,  \
        float *scores, float *row_max, float *row_sum, float *acc, const KT *pf_k,             \
        const KT *pf_v, int64_t pf_width
#define BLOCK_ROWS_CALL(R, HD)                                                                 \
    block_rows_of_##R(rows, qv, off, nv, kb, vb, kv_stride, HD, scale, score_stride, scores,   \
                      row_max, row_sum, acc, pf_k, pf_v, pf_width)
static ONE_COPY void block_rows_f32(BLOCK_ROWS_ARGS(float)) {
    if (head_dim == 64)
        BLOCK_ROWS_CALL(f32, 64);
    else if (head_dim == 128)
        BLOCK_ROWS_CALL(f32, 128);
    else
        BLOCK_ROWS_CALL(f32, (int)head_dim);
}
/* bf16 keys and values, fp32 rows in load_query_bf16's layout */
static ONE_COPY void block_rows_bf16(BLOCK_ROWS_ARGS(bf16)) {
    if (head_dim % 2)
        BLOCK_ROWS_CALL(bf16odd, (int)head_dim);
    else if (head_dim == 64)
        BLOCK_ROWS_CALL(pairs, 64);
    else if (head_dim == 128)
        BLOCK_ROWS_CALL(pairs, 128);
    else
        BLOCK_ROWS_CALL(pairs, (int)head_dim);
}
#undef BLOCK_ROWS_CALL
#undef BLOCK_ROWS_ARGS

/* Fold cache blocks [b0, b1) of a tile's context (num_blocks blocks in all) into its
 * rows' chunk state: query head major, query token minor; row j of a head sees keys up
 * to seq_len - tl + j. The rows are `heads` query heads from first_head: one KV head's
 * group (kv_head's), or off the vdpbf16ps path several KV heads' groups from kv_head on
 * (an item of all KV heads, see PAGED_ATTENTION). qf: the query rows as fp32 (bf16 rows
 * off the attend_rows path). rq, roff, rn: room for each row's query, head offset and
 * visible keys (block_rows_<KS>). next_off: the first PREFETCH_BLOCKS blocks of the item
 * this thread runs next (attn_item_start), asked for in place of blocks past the last. */
#define FOLD_BLOCKS(T, KT, KS, V)                                                              \
    INLINE void fold_blocks_##V(                                                               \
        const T *q, int64_t q_token_stride, int64_t q_start, int64_t first_head,               \
        int64_t group, int64_t heads, int64_t tl, int64_t head_dim, const KT *k_cache,         \
        const KT *v_cache, const int32_t *table, int64_t kv_head, int64_t kv_stride,           \
        int64_t block_size, int64_t seq_len, int64_t b0, int64_t b1, int64_t num_blocks,       \
        int chunks, float scale, const float *qf, float *scores, float *row_max,               \
        float *row_sum, float *acc, const float **rq, int64_t *roff, int *rn,                  \
        const int64_t *next_off) {                                                             \
        /* fp32 rows over an fp32 cache: read in place, never copied */ \
        const int is_f32 = sizeof(T) == sizeof(float) && sizeof(KT) == sizeof(float);          \
        if (!chunks) {                                                                         \
            const int64_t rows = heads * tl;                                                   \
            for (int64_t hl = 0; hl < heads; hl++)                                             \
                for (int64_t j = 0; j < tl; j++) {                                             \
                    const int64_t head = first_head + hl, r = hl * tl + j;                     \
                    rq[r] = is_f32 ? (const float *)q + (q_start + j) * q_token_stride +       \
                                         head * head_dim                                       \
                                   : qf + r * head_dim;                                        \
                    roff[r] = head / group * head_dim;                                         \
                }                                                                              \
            /* the item's KV heads, a stretch of each token's keys */                         \
            const int64_t first = kv_head * head_dim, width = heads / group * head_dim;        \
            for (int64_t b = b0; b < b1; b++) {                                                \
                const int64_t first_key = b * block_size;                                      \
                for (int64_t hl = 0; hl < heads; hl++)                                         \
                    for (int64_t j = 0; j < tl; j++) {                                         \
                        const int64_t visible = seq_len - tl + j + 1 - first_key;              \
                        rn[hl * tl + j] = (int)(visible <= 0          ? 0                      \
                                                : visible < block_size ? visible               \
                                                                       : block_size);          \
                    }                                                                          \
                const int64_t base = (int64_t)table[b] * block_size * kv_stride;               \
                const int64_t next = b + 1 < num_blocks                                        \
                                         ? (int64_t)table[b + 1] * block_size * kv_stride +    \
                                               first                                           \
                                         : next_off[0];                                        \
                block_rows_##KS(rows, rq, roff, rn, k_cache + base, v_cache + base, kv_stride,  \
                                head_dim, scale, block_size, scores, row_max, row_sum, acc,    \
                                next < 0 ? NULL : k_cache + next,                              \
                                next < 0 ? NULL : v_cache + next, width);                      \
            }                                                                                  \
            return;                                                                            \
        }                                                                                      \
        /* bf16 rows by vdpbf16ps (attend_rows_bf16), one KV head's group */                  \
        (void)heads, (void)rq, (void)roff, (void)rn, (void)qf;                                 \
        for (int64_t b = b0; b < b1 && b < b0 + PREFETCH_BLOCKS; b++)                          \
            prefetch_block_##KS(k_cache, v_cache, table[b], block_size, kv_stride,             \
                               kv_head * head_dim, head_dim);                                  \
        for (int64_t b = b0; b < b1; b++) {                                                    \
            const int64_t base =                                                               \
                (int64_t)table[b] * block_size * kv_stride + kv_head * head_dim;               \
            const int64_t first_key = b * block_size;                                          \
            /* the block PREFETCH_BLOCKS ahead (past the last, the next item's first ones),  \
             * asked for token by token as this one's values are read */                     \
            const int64_t ahead = b + PREFETCH_BLOCKS < num_blocks                             \
                                      ? (int64_t)table[b + PREFETCH_BLOCKS] * block_size *     \
                                                kv_stride +                                    \
                                            kv_head * head_dim                                 \
                                      : next_off[b + PREFETCH_BLOCKS - num_blocks];            \
            attend_rows_##V(q, q_token_stride, q_start, first_head, group, tl, head_dim,       \
                            k_cache + base, v_cache + base, kv_stride, block_size, seq_len,    \
                            first_key, scale, row_max, row_sum, acc,                           \
                            ahead < 0 ? NULL : k_cache + ahead,                                \
                            ahead < 0 ? NULL : v_cache + ahead);                               \
        }                                                                                      \
    }
FOLD_BLOCKS(float, float, f32, f32)
FOLD_BLOCKS(bf16, bf16, bf16, bf16)
FOLD_BLOCKS(float, bf16, bf16, f32_bf16kv)

#define TREE_ROWS(T, KT, KS, V)                                                                \
    INLINE void tree_rows_##V(                                                                 \
        T *out, int64_t out_token_stride, const T *q, int64_t q_token_stride,                  \
        const KT *k_cache, const KT *v_cache, const int32_t *table, const int64_t *tree_masks, \
        int64_t step_start, int64_t q_start, int64_t j0, int64_t tl, int64_t kv_head,          \
        int64_t group, int64_t head_dim, int64_t block_size, int64_t kv_stride, int chunks,    \
        float scale, float *row_max, float *row_sum, float *acc, float *t_max, float *t_sum,   \
        float *t_acc, float *scores, float *qf, KT *kv_scratch, const float **rq,              \
        int64_t *roff, int *rn) {                                                              \
        /* fp32 rows over an fp32 cache: read in place, never copied */ \
        const int is_f32 = sizeof(T) == sizeof(float) && sizeof(KT) == sizeof(float);          \
        const int64_t first_head = kv_head * group;                                            \
        KT *k_scr = kv_scratch, *v_scr = kv_scratch + block_size * head_dim;                   \
        int seen[64];                                                                          \
        for (int64_t j = 0; j < tl; j++) {                                                     \
            const int64_t token = q_start + j, jj = j0 + j;                                    \
            const int64_t mask = tree_masks[token];                                            \
            int num_seen;                                                                      \
            int64_t len; /* keys this row sees: the virtual sequence's length */               \
            int identity; /* fed tokens seen: 0 .. k-1 only, as plain causal */                \
            if (mask == -1) {                                                                  \
                num_seen = 0;                                                                  \
                len = step_start + jj + 1;                                                     \
                identity = 1;                                                                  \
            } else {                                                                           \
                num_seen = tree_seen((uint64_t)mask, jj, seen);                                \
                len = step_start + num_seen + (jj >= 64 ? jj - 63 : 0);                        \
                identity = 1;                                                                  \
                for (int i = 0; i < num_seen; i++) identity &= seen[i] == i;                   \
                identity &= jj < 64 || num_seen == 64;                                         \
            }                                                                                  \
            for (int64_t hl = 0; hl < group; hl++) {                                           \
                if (!is_f32 && !chunks)                                                        \
                    load_query_##V(qf + hl * head_dim,                                         \
                                   q + token * q_token_stride + (first_head + hl) * head_dim,  \
                                   head_dim);                                                  \
            }                                                                                  \
            chunk_reset(group, head_dim, row_max, row_sum, acc);                               \
            chunk_reset(group, head_dim, t_max, t_sum, t_acc);                                 \
            const int64_t num_blocks = (len + block_size - 1) / block_size;                    \
            for (int64_t b = 0; b < num_blocks; b++) {                                         \
                const int64_t first_key = b * block_size;                                      \
                const int64_t end = len - first_key < block_size ? len : first_key + block_size; \
                const KT *kb, *vb;                                                             \
                int64_t stride;                                                                \
                if (identity || end <= step_start) {                                           \
                    const int64_t base =                                                       \
                        (int64_t)table[b] * block_size * kv_stride + kv_head * head_dim;       \
                    kb = k_cache + base, vb = v_cache + base, stride = kv_stride;              \
                } else {                                                                       \
                    for (int64_t v = first_key; v < end; v++) {                                \
                        const int64_t key =                                                    \
                            v < step_start ? v : tree_real_key(v, step_start, seen, num_seen); \
                        const int64_t src = (int64_t)table[key / block_size] * block_size *    \
                                                kv_stride +                                    \
                                            (key % block_size) * kv_stride +                   \
                                            kv_head * head_dim;                                \
                        memcpy(k_scr + (v - first_key) * head_dim, k_cache + src,              \
                               sizeof(KT) * (size_t)head_dim);                                 \
                        memcpy(v_scr + (v - first_key) * head_dim, v_cache + src,              \
                               sizeof(KT) * (size_t)head_dim);                                 \
                    }                                                                          \
                    kb = k_scr, vb = v_scr, stride = head_dim;                                 \
                }                                                                              \
                if (chunks) {                                                                  \
                    attend_rows_##V(q, q_token_stride, token, first_head, group, 1, head_dim,  \
                                    kb, vb, stride, block_size, len, first_key, scale,         \
                                    row_max, row_sum, acc, NULL, NULL);                        \
                } else { /* the plain rows' function (block_rows_<KS>) */                     \
                    for (int64_t hl = 0; hl < group; hl++) {                                   \
                        rq[hl] = is_f32 ? (const float *)q + token * q_token_stride +           \
                                              (first_head + hl) * head_dim                     \
                                        : qf + hl * head_dim;                                  \
                        roff[hl] = 0;                                                          \
                        rn[hl] = (int)(end - first_key);                                       \
                    }                                                                          \
                    block_rows_##KS(group, rq, roff, rn, kb, vb, stride, head_dim, scale,      \
                                    block_size, scores, row_max, row_sum, acc, NULL, NULL, 0); \
                }                                                                              \
                /* key chunks end where the plain rows' do (see PAGED_ATTENTION) */            \
                if ((b + 1) % SPLIT_BLOCKS == 0 || b + 1 == num_blocks) {                      \
                    chunk_merge(group, head_dim, row_max, row_sum, acc, t_max, t_sum, t_acc);  \
                    chunk_reset(group, head_dim, row_max, row_sum, acc);                       \
                }                                                                              \
            }                                                                                  \
            for (int64_t hl = 0; hl < group; hl++)                                             \
                store_row_##V(out + token * out_token_stride + (first_head + hl) * head_dim,   \
                              t_acc + hl * head_dim, 1.0f / t_sum[hl], head_dim);              \
        }                                                                                      \
    }
TREE_ROWS(float, float, f32, f32)
TREE_ROWS(bf16, bf16, bf16, bf16)
TREE_ROWS(float, bf16, bf16, f32_bf16kv)

/* Tile t's query: its sequence, the sequence's query tokens q_len, the tile's first
 * token j0 and its tl tokens from q_start, the context its last token sees (seq_len: what
 * a query of tl tokens sees) and that context's cache blocks. */
#define TILE_INFO(t)                                                                           \
    const int64_t seq = seq_ids[tile_sel[(t)]];                                                \
    const int64_t q_len = (int64_t)query_start_loc[seq + 1] - query_start_loc[seq];            \
    const int64_t j0 = tile_j0[(t)];                                                           \
    const int64_t tl = q_len - j0 < Q_TILE ? q_len - j0 : Q_TILE;                              \
    const int64_t q_start = query_start_loc[seq] + j0;                                         \
    const int64_t seq_len = seq_lens[seq] - (q_len - j0 - tl);                                 \
    const int64_t num_blocks = (seq_len + block_size - 1) / block_size

/* The item's rows over the key chunk from block b0, into a fresh chunk state */
#define FOLD_CHUNK(S, b0)                                                                      \
    do {                                                                                       \
        const int64_t from_ = (b0), to_ = from_ + SPLIT_BLOCKS < num_blocks                    \
                                              ? from_ + SPLIT_BLOCKS                           \
                                              : num_blocks;                                    \
        chunk_reset(rows, head_dim, row_max, row_sum, acc);                                    \
        fold_blocks_##S(q, q_token_stride, q_start, first_head, group, heads, tl, head_dim,    \
                        k_cache, v_cache, table, kv_head, kv_stride, block_size, seq_len,      \
                        from_, to_, num_blocks, chunks, scale, qf, scores, row_max, row_sum,   \
                        acc, rq, roff, rn, next_off);                                          \
    } while (0)

/* Split mode: the (max, sum, acc) of tile t's chunk c for KV head h, its group * tl rows */
#define PARTIAL(t, c, h)                                                                       \
    (partials + tile_off[(t)] + ((c) * num_kv_heads + (h)) * group * tl * (head_dim + 2))

/* out rows of the item's tile and KV head from the total t_* */
#define STORE_ROWS(S)                                                                          \
    for (int64_t hl = 0; hl < heads; hl++)                                                     \
        for (int64_t j = 0; j < tl; j++) {                                                     \
            const int64_t r = hl * tl + j;                                                     \
            store_row_##S(out + (q_start + j) * out_token_stride + (first_head + hl) * head_dim, \
                          t_acc + r * head_dim, 1.0f / t_sum[r], head_dim);                    \
        }

/* A paged-attention call's arguments; out, q and the caches of its instance's types. */
struct attn_args {
    void *out;
    int64_t out_token_stride;
    const void *q;
    int64_t q_token_stride;
    const void *k_cache, *v_cache;
    const int32_t *block_tables;
    int64_t block_table_stride, table_width;
    const int32_t *seq_lens, *query_start_loc;
    int64_t num_seqs, num_tokens;
    const int32_t *seq_ids;
    int64_t num_selected, num_heads, num_kv_heads, head_dim, block_size, num_cache_blocks;
    float scale;
    int64_t max_rows;
    const int64_t *tree_masks;
};

/* A call's work: tile t covers query tokens tile_j0[t] .. +Q_TILE of sequence
 * seq_ids[tile_sel[t]]. Split mode (partials non-NULL): a unit is a key chunk of a tile
 * (a tree tile is one unit, computed whole), an item a unit's KV head; tile t's units
 * are tile_unit0[t] .. [t + 1], their chunk states from partials + tile_off[t] (PARTIAL).
 * Else a unit is a tile. An item covers item_heads KV heads of its unit: 1, or all of
 * them (see PAGED_ATTENTION); num_items = num_units * num_kv_heads / item_heads. It
 * depends on the sequences alone, not on q, out or the caches: the one-call decoder
 * plans once for all its layers. */
struct attn_plan {
    int64_t num_tiles, num_units, num_items, item_heads;
    int64_t *tile_sel, *tile_j0, *tile_unit0, *tile_off, *unit_tile;
    float *partials;
};

static void attn_plan_free(struct attn_plan *p) {
    free(p->tile_sel), free(p->tile_j0), free(p->tile_unit0), free(p->unit_tile);
    free(p->partials);
    memset(p, 0, sizeof *p);
}

/* 0, or the call's status (see PAGED_ATTENTION: 1, 2 or 3), with nothing allocated. */
static int attn_plan_make(struct attn_plan *p, const struct attn_args *c, int32_t num_threads,
                          int all_heads) {
    memset(p, 0, sizeof *p);
    /* The wrapper checks these; checked again because C must not divide by zero or
     * truncate a size whatever it is given. */
    if (c->num_kv_heads < 1 || c->num_heads < 0 || c->num_heads % c->num_kv_heads ||
        c->head_dim < 1 || c->head_dim > INT32_MAX || c->block_size < 1 ||
        c->block_size > INT32_MAX || c->max_rows < 1)
        return 3;
    const int64_t group = c->num_heads / c->num_kv_heads, head_dim = c->head_dim;
    const int64_t num_kv_heads = c->num_kv_heads, block_size = c->block_size;
    const int32_t *seq_ids = c->seq_ids, *query_start_loc = c->query_start_loc;
    const int32_t *seq_lens = c->seq_lens;
    const int64_t *tree_masks = c->tree_masks;
    const int failed = check_sequences(c->block_tables, c->block_table_stride, c->table_width,
                                       seq_lens, query_start_loc, c->num_seqs, c->num_tokens,
                                       seq_ids, c->num_selected, group, block_size,
                                       c->num_cache_blocks, c->max_rows);
    if (failed) return failed;
    int64_t num_tiles = 0;
    for (int64_t i = 0; i < c->num_selected; i++) {
        const int64_t s = seq_ids[i];
        const int64_t len = (int64_t)query_start_loc[s + 1] - query_start_loc[s];
        num_tiles += len > 0 ? (len + Q_TILE - 1) / Q_TILE : 1;
    }
    p->num_tiles = num_tiles;
    const size_t tiles_bytes = sizeof(int64_t) * (size_t)(num_tiles > 0 ? num_tiles : 1);
    int64_t *tile_sel = p->tile_sel = malloc(tiles_bytes);
    int64_t *tile_j0 = p->tile_j0 = malloc(tiles_bytes);
    if (!tile_sel || !tile_j0) {
        attn_plan_free(p);
        return 1;
    }
    for (int64_t i = 0, t = 0; i < c->num_selected; i++) {
        const int64_t s = seq_ids[i];
        const int64_t len = (int64_t)query_start_loc[s + 1] - query_start_loc[s];
        int64_t j0 = 0;
        do {
            tile_sel[t] = i;
            tile_j0[t++] = j0;
            j0 += Q_TILE;
        } while (j0 < len);
    }
    p->num_units = num_tiles;
    if (num_threads > 1 && num_tiles * num_kv_heads < SPLIT_ITEMS_PER_THREAD * num_threads) {
        int64_t *tile_unit0 = p->tile_unit0 =
            malloc(sizeof(int64_t) * (size_t)(2 * num_tiles + 1));
        if (!tile_unit0) {
            attn_plan_free(p);
            return 1;
        }
        int64_t *tile_off = p->tile_off = tile_unit0 + num_tiles + 1;
        tile_unit0[0] = 0;
        int64_t floats = 0;
        for (int64_t t = 0; t < num_tiles; t++) {
            TILE_INFO(t);
            const int64_t chunks_seen = (num_blocks + SPLIT_BLOCKS - 1) / SPLIT_BLOCKS;
            const int64_t n = !tl || (tree_masks && tile_has_tree(tree_masks + q_start, tl)) ||
                                      chunks_seen < 1
                                  ? 1
                                  : chunks_seen;
            tile_unit0[t + 1] = tile_unit0[t] + n;
            tile_off[t] = floats;
            floats += n * num_kv_heads * group * tl * (head_dim + 2);
        }
        if (tile_unit0[num_tiles] > num_tiles &&
            floats * (int64_t)sizeof(float) <= SPLIT_MAX_BYTES) {
            int64_t *unit_tile = p->unit_tile =
                malloc(sizeof(int64_t) * (size_t)tile_unit0[num_tiles]);
            p->partials = malloc(sizeof(float) * (size_t)floats);
            if (!unit_tile || !p->partials) {
                attn_plan_free(p);
                return 1;
            }
            for (int64_t t = 0; t < num_tiles; t++)
                for (int64_t u = tile_unit0[t]; u < tile_unit0[t + 1]; u++) unit_tile[u] = t;
            p->num_units = tile_unit0[num_tiles];
        }
    }
    /* items of every KV head: off the vdpbf16ps path (all_heads), tiles of a few query
     * tokens, and a unit for each thread at least (a lone short decode is 1 unit: one thread
     * would read it while the others wait) */
    p->item_heads = 1;
    int small = all_heads && num_kv_heads > 1 && p->num_units >= num_threads;
    for (int64_t t = 0; small && t < num_tiles; t++) {
        TILE_INFO(t);
        (void)seq_len, (void)num_blocks, (void)q_start;
        small = tl <= ALL_HEADS_MAX_TOKENS;
    }
    if (small) p->item_heads = num_kv_heads;
    p->num_items = p->num_units * (num_kv_heads / p->item_heads);
    return 0;
}

/* A thread's scratch: a key chunk's state (row_max, row_sum, acc) and the rows' total
 * (t_*); qf, the query rows as fp32 (rows other than fp32 rows over an fp32 cache); a
 * token tree's rows' visible keys, gathered one block at a time (kv_scratch). */
struct attn_scratch {
    float *acc, *row_max, *row_sum, *t_acc, *t_max, *t_sum, *scores, *qf;
    void *kv_scratch;
    const float **rq; /* block_rows_<S>'s rows: query, head offset, visible keys */
    int64_t *roff;
    int *rn;
};

static void attn_scratch_free(struct attn_scratch *s) {
    free(s->acc), free(s->row_max), free(s->row_sum), free(s->t_acc), free(s->t_max);
    free(s->t_sum), free(s->scores), free(s->qf), free(s->kv_scratch);
    free(s->rq), free(s->roff), free(s->rn);
    memset(s, 0, sizeof *s);
}

/* 0, or 1 (all freed) when out of memory. */
static int attn_scratch_alloc(struct attn_scratch *s, const struct attn_args *c, int need_qf,
                              size_t kv_value_size) {
    /* rows of one KV head's group (max_rows), or of every head (an item of all KV heads) */
    const size_t all = (size_t)c->num_heads * ALL_HEADS_MAX_TOKENS;
    const size_t rows = (size_t)c->max_rows > all ? (size_t)c->max_rows : all;
    const size_t head_dim = (size_t)c->head_dim;
    s->acc = malloc(sizeof(float) * rows * head_dim);
    s->row_max = malloc(sizeof(float) * rows);
    s->row_sum = malloc(sizeof(float) * rows);
    s->t_acc = malloc(sizeof(float) * rows * head_dim);
    s->t_max = malloc(sizeof(float) * rows);
    s->t_sum = malloc(sizeof(float) * rows);
    s->scores = malloc(sizeof(float) * rows * (size_t)c->block_size);
    s->rq = malloc(sizeof(float *) * rows);
    s->roff = malloc(sizeof(int64_t) * rows);
    s->rn = malloc(sizeof(int) * rows);
    s->qf = need_qf ? malloc(sizeof(float) * rows * head_dim) : NULL;
    s->kv_scratch = c->tree_masks ? calloc(2 * (size_t)c->block_size * head_dim, kv_value_size)
                                  : NULL;
    if (!s->acc || !s->row_max || !s->row_sum || !s->t_acc || !s->t_max || !s->t_sum ||
        !s->scores || !s->rq || !s->roff || !s->rn || (need_qf && !s->qf) ||
        (c->tree_masks && !s->kv_scratch)) {
        attn_scratch_free(s);
        return 1;
    }
    return 0;
}

/* The locals the macros above read, from a call's arguments, plan and scratch. */
#define ATTN_LOCALS(T, KT)                                                                     \
    T *out = c->out;                                                                           \
    const T *q = c->q;                                                                         \
    const KT *k_cache = c->k_cache, *v_cache = c->v_cache;                                     \
    const int64_t out_token_stride = c->out_token_stride, q_token_stride = c->q_token_stride;  \
    const int32_t *block_tables = c->block_tables, *seq_lens = c->seq_lens;                    \
    const int32_t *query_start_loc = c->query_start_loc, *seq_ids = c->seq_ids;                \
    const int64_t block_table_stride = c->block_table_stride;                                  \
    const int64_t num_kv_heads = c->num_kv_heads, head_dim = c->head_dim;                      \
    const int64_t block_size = c->block_size, group = c->num_heads / num_kv_heads;             \
    const int64_t kv_stride = num_kv_heads * head_dim;                                         \
    const float scale = c->scale;                                                              \
    const int64_t *tree_masks = c->tree_masks;                                                 \
    const int64_t *tile_sel = p->tile_sel, *tile_j0 = p->tile_j0;                              \
    const int64_t *tile_unit0 = p->tile_unit0, *tile_off = p->tile_off;                        \
    const int64_t *unit_tile = p->unit_tile;                                                   \
    float *partials = p->partials;                                                             \
    float *acc = s->acc, *row_max = s->row_max, *row_sum = s->row_sum;                         \
    float *t_acc = s->t_acc, *t_max = s->t_max, *t_sum = s->t_sum;                             \
    float *scores = s->scores, *qf = s->qf;                                                    \
    KT *kv_scratch = s->kv_scratch;                                                            \
    const float **rq = s->rq;                                                                  \
    int64_t *roff = s->roff;                                                                   \
    int *rn = s->rn;                                                                           \
    (void)block_tables, (void)block_table_stride, (void)tile_unit0, (void)tile_off;            \
    (void)unit_tile, (void)partials, (void)acc, (void)row_max, (void)row_sum, (void)scores;    \
    (void)qf, (void)kv_scratch, (void)k_cache, (void)v_cache, (void)q, (void)q_token_stride,   \
        (void)scale, (void)kv_stride, (void)rq, (void)roff, (void)rn

/* Whether a call's threads take their next item ahead: not in split mode, whose few
 * items (a lone decode's key chunks) would leave one thread with two while the other
 * waits; the others have SPLIT_ITEMS_PER_THREAD items a thread or more. */
#define ATTN_TAKES_AHEAD(p) (!(p)->partials)

/* The cache offsets (the block's, plus its first KV head's values) of the first
 * PREFETCH_BLOCKS blocks that item `item` reads, -1 past its last and for none (item < 0,
 * or a token tree's tile, whose rows gather their keys). A thread takes the item it runs
 * next before it runs the current one and asks for these as the current one's last
 * blocks are read (fold_blocks_<V>), so an item's first blocks do not start from memory
 * with the core idle. */
static void attn_item_start(const struct attn_args *c, const struct attn_plan *p, int64_t item,
                            int64_t off[PREFETCH_BLOCKS]) {
    for (int i = 0; i < PREFETCH_BLOCKS; i++) off[i] = -1;
    if (item < 0) return;
    const int64_t block_size = c->block_size, per_unit = c->num_kv_heads / p->item_heads;
    const int64_t unit = item / per_unit, kv_head = item % per_unit * p->item_heads;
    const int64_t *tile_sel = p->tile_sel, *tile_j0 = p->tile_j0;
    const int32_t *seq_ids = c->seq_ids, *query_start_loc = c->query_start_loc;
    const int32_t *seq_lens = c->seq_lens;
    const int64_t tile = p->partials ? p->unit_tile[unit] : unit;
    TILE_INFO(tile);
    if (c->tree_masks && tile_has_tree(c->tree_masks + q_start, tl)) return;
    const int64_t first = p->partials ? (unit - p->tile_unit0[tile]) * SPLIT_BLOCKS : 0;
    const int32_t *table = c->block_tables + seq * c->block_table_stride;
    const int64_t kv_stride = c->num_kv_heads * c->head_dim;
    for (int64_t i = 0; i < PREFETCH_BLOCKS && first + i < num_blocks; i++)
        off[i] = (int64_t)table[first + i] * block_size * kv_stride + kv_head * c->head_dim;
}

/* Attention of the query tokens of the selected sequences over their paged context,
 * causal with offset: sequence `seq` adds q_len tokens and holds seq_lens[seq] after
 * the step, so its query j sits at position seq_len - q_len + j and sees keys
 * 0 .. seq_len - q_len + j (the new tokens' K/V must already be in the cache).
 *
 * A work item is one (sequence, KV head, tile of up to Q_TILE query tokens): every
 * query row of that KV head in the tile (its group of query heads x the tile's tokens)
 * is folded over each cache block in turn with a streaming softmax, so each K/V block
 * is read from memory once per tile, and only the blocks the tile's last token sees.
 * Decode and verification queries are one tile. A long prefill chunk is many: a lone
 * prompt would otherwise be as many items as KV heads (SmolLM2: 3, for 2 threads).
 * Each row is computed the same whatever its tile and the other rows, so results do
 * not depend on how a prompt was chunked or what else is in the batch. Where
 * attend_rows_bf16 does not apply, the bf16 kernel widens each query row to fp32 once
 * per item (into `qf`), the keys and values as it reads them.
 *
 * Items of every KV head (every kernel off the vdpbf16ps path): the cache keeps a
 * token's keys of all KV heads together ([block, token, KV head, dim]), so an item of
 * one KV head reads a third of each 768 bytes (SmolLM2's fp32 cache), which the hardware
 * prefetchers follow badly. When every tile has at most ALL_HEADS_MAX_TOKENS query
 * tokens (decode and verification steps) and the call has a unit of work for each
 * thread, an item is a unit's every KV head, its rows' blocks read front to back by
 * block_rows_<S>; each row runs the same copy of the arithmetic either way, so the
 * choice changes no bits. One layer's batch-1 decode attention at 300 tokens of
 * context, the cache in memory (scripts/bench_attention_kernel.c, F32=1 HUGE=1
 * LAYERS=150, 2 threads, Zen 3, five alternated pairs) took 25.6-32.2 us against
 * 36.5-45.8 us; 32 sequences x 100 tokens (LAYERS=30) 252.7-306.7 against 373.5-456.7 us
 * (docs/benchmarks.md, "Attention items of every KV head"). With the cache in L2
 * (LAYERS=1) the same batch
 * runs 1.1x slower: each dot product reloads its query row, where a row of one head ran
 * over a block's 16 keys at once; key steps of 4-16 tokens per row won that back hot
 * and lost the gain from memory, so the step is one key. (Earlier, items of a whole
 * sequence read head by head within each block measured slower: 1.7x on the
 * row-at-a-time loop, 1.3x on the vdpbf16ps one, which keeps items of one head. Timed
 * again on a Xeon with AVX512-BF16, each block's KV heads in turn on vdpbf16ps: 28.8 us
 * against 24.8 at 1 x 300 tokens, 412 against 411 at 32 x 150, medians of five pairs;
 * docs/benchmarks.md, "The Xeon with AMX again".)
 *
 * Key chunks: a row's keys are folded SPLIT_BLOCKS cache blocks at a time, each chunk
 * into a streaming softmax of its own, merged into the row's total at the chunk's end in
 * key order (chunk_merge; a token tree's rows the same, at the same blocks). A call of
 * fewer than SPLIT_ITEMS_PER_THREAD items a thread, a lone decode for one (3 items for
 * 2 threads, or for 16), then makes each chunk of each tile its own work item: the
 * threads share one sequence's keys, each chunk's state is kept, and a second pass
 * merges them in the same order, so every row has the same bits split or not, whatever
 * the thread count and the batch. A batch-1 decode step of SmolLM2 on a 2-thread Zen 3
 * (scripts/bench_kernel_ab.py: the one-call decoder, both builds alternated in one
 * process) took 0.959x the time at 300 tokens of context and 0.920x at 900 (medians of
 * five runs); one layer's attention with the cache in memory
 * (scripts/bench_attention_kernel.c, LAYERS=150) 39.5-40.2 us against 46.3-47.6. A tree
 * tile is never split (its rows gather keys of their own).
 *
 * out[token, head, :] is written for every query token of the selected sequences.
 * Returns 0; 1 when scratch memory could not be allocated, 2 when a sequence has more
 * than max_rows / (num_heads / num_kv_heads) query tokens, 3 when a sequence id, a
 * block id or a length does not fit the buffers passed, or a size is out of range
 * (nothing is read out of bounds in any case, and for 2 and 3 nothing is written).
 * attn_item_V and attn_merge_V are a call's two passes, one item at a time: the
 * one-call decoder runs them on its own team of threads. attn_item_V's `next` is the
 * item the thread runs after it (-1: none; see attn_item_start). */
#define PAGED_ATTENTION(T, KT, V, NAME)                                                        \
    static ONE_COPY void attn_item_##V(const struct attn_args *c,                              \
                                       const struct attn_plan *p, struct attn_scratch *s,      \
                                       int64_t item, int64_t next) {                           \
        ATTN_LOCALS(T, KT);                                                                    \
        int64_t next_off[PREFETCH_BLOCKS];                                                     \
        attn_item_start(c, p, next, next_off);                                                 \
        /* fp32 rows over an fp32 cache: read in place, never copied */                       \
        const int is_f32 = sizeof(T) == sizeof(float) && sizeof(KT) == sizeof(float);          \
        const int chunks = dot_chunks_##V(head_dim);                                           \
        /* the item's KV heads: kv_head .. + item_heads */                                    \
        const int64_t item_heads = p->item_heads, per_unit = num_kv_heads / item_heads;        \
        const int64_t unit = item / per_unit;                                                  \
        const int64_t kv_head = item % per_unit * item_heads;                                  \
        TILE_INFO(partials ? unit_tile[unit] : unit);                                          \
        /* rows: query head (of the item's KV heads' groups) major, query token minor */      \
        const int64_t heads = item_heads * group, rows = heads * tl;                           \
        const int32_t *table = block_tables + seq * block_table_stride;                        \
        if (tree_masks && tile_has_tree(tree_masks + q_start, tl)) {                           \
            for (int64_t h = kv_head; h < kv_head + item_heads; h++)                           \
                tree_rows_##V(out, out_token_stride, q, q_token_stride, k_cache, v_cache,      \
                              table, tree_masks, seq_lens[seq] - q_len, q_start, j0, tl, h,    \
                              group, head_dim, block_size, kv_stride, chunks, scale, row_max,  \
                              row_sum, acc, t_max, t_sum, t_acc, scores, qf, kv_scratch, rq,   \
                              roff, rn);                                                       \
            return;                                                                            \
        }                                                                                      \
        const int64_t first_head = kv_head * group;                                            \
        if (!is_f32 && !chunks) {                                                              \
            for (int64_t hl = 0; hl < heads; hl++)                                             \
                for (int64_t j = 0; j < tl; j++)                                               \
                    load_query_##V(qf + (hl * tl + j) * head_dim,                              \
                                   q + (q_start + j) * q_token_stride +                        \
                                       (first_head + hl) * head_dim,                           \
                                   head_dim);                                                  \
        }                                                                                      \
        if (partials) { /* one key chunk, its state left for the merge pass */                \
            const int64_t chunk = unit - tile_unit0[unit_tile[unit]];                          \
            FOLD_CHUNK(V, chunk * SPLIT_BLOCKS);                                               \
            /* copied out once: the partials of two threads' items share lines */             \
            const int64_t hr = group * tl; /* a KV head's rows */                             \
            for (int64_t h = 0; h < item_heads; h++) {                                         \
                float *p_max = PARTIAL(unit_tile[unit], chunk, kv_head + h);                   \
                memcpy(p_max, row_max + h * hr, sizeof(float) * (size_t)hr);                   \
                memcpy(p_max + hr, row_sum + h * hr, sizeof(float) * (size_t)hr);              \
                memcpy(p_max + 2 * hr, acc + h * hr * head_dim,                                \
                       sizeof(float) * (size_t)(hr * head_dim));                               \
            }                                                                                  \
            return;                                                                            \
        }                                                                                      \
        chunk_reset(rows, head_dim, t_max, t_sum, t_acc);                                      \
        for (int64_t b0 = 0; b0 < num_blocks; b0 += SPLIT_BLOCKS) {                            \
            FOLD_CHUNK(V, b0);                                                                 \
            chunk_merge(rows, head_dim, row_max, row_sum, acc, t_max, t_sum, t_acc);           \
        }                                                                                      \
        STORE_ROWS(V);                                                                         \
    }                                                                                          \
    /* a thread's share of the first pass: items as it takes them from *counter, each the \
     * one taken ahead of it where ATTN_TAKES_AHEAD (attn_item_start); *failed set (NULL: \
     * never), taken but not run */                                                       \
    static ONE_COPY void attn_items_##V(const struct attn_args *c, const struct attn_plan *p, \
                                        struct attn_scratch *s, int64_t *counter,              \
                                        const int *failed) {                                   \
        int64_t item = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);                       \
        while (item < p->num_items) {                                                          \
            const int64_t next =                                                               \
                ATTN_TAKES_AHEAD(p) ? __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED) : -1;   \
            if (!failed || !__atomic_load_n(failed, __ATOMIC_RELAXED))                         \
                attn_item_##V(c, p, s, item, next < p->num_items ? next : -1);                 \
            item = next >= 0 ? next : __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);        \
        }                                                                                      \
    }                                                                                          \
    /* split mode's second pass, item tile * num_kv_heads + kv_head: a tile's chunks merged \
     * in key order, as the first pass does unsplit */                                        \
    static ONE_COPY void attn_merge_##V(const struct attn_args *c,                             \
                                        const struct attn_plan *p, struct attn_scratch *s,     \
                                        int64_t item) {                                        \
        ATTN_LOCALS(T, KT);                                                                    \
        const int64_t tile = item / num_kv_heads, kv_head = item % num_kv_heads;               \
        TILE_INFO(tile);                                                                       \
        if (tree_masks && tile_has_tree(tree_masks + q_start, tl)) return;                     \
        const int64_t heads = group, rows = group * tl, first_head = kv_head * group;          \
        (void)num_blocks, (void)seq_len;                                                       \
        chunk_reset(rows, head_dim, t_max, t_sum, t_acc);                                      \
        for (int64_t ch = 0; ch < tile_unit0[tile + 1] - tile_unit0[tile]; ch++) {             \
            const float *p_max = PARTIAL(tile, ch, kv_head);                                   \
            chunk_merge(rows, head_dim, p_max, p_max + rows, p_max + 2 * rows, t_max, t_sum,   \
                        t_acc);                                                                \
        }                                                                                      \
        STORE_ROWS(V);                                                                         \
    }                                                                                          \
    int NAME(T *out, int64_t out_token_stride, const T *q, int64_t q_token_stride,             \
             const KT *k_cache, const KT *v_cache, const int32_t *block_tables,                \
             int64_t block_table_stride, int64_t table_width, const int32_t *seq_lens,         \
             const int32_t *query_start_loc, int64_t num_seqs, int64_t num_tokens,             \
             const int32_t *seq_ids, int64_t num_selected, int64_t num_heads,                  \
             int64_t num_kv_heads, int64_t head_dim, int64_t block_size,                       \
             int64_t num_cache_blocks, float scale, int64_t max_rows, int32_t num_threads,     \
             const int64_t *tree_masks) {                                                      \
        const struct attn_args args = {                                                        \
            out, out_token_stride, q, q_token_stride, k_cache, v_cache, block_tables,          \
            block_table_stride, table_width, seq_lens, query_start_loc, num_seqs, num_tokens,  \
            seq_ids, num_selected, num_heads, num_kv_heads, head_dim, block_size,              \
            num_cache_blocks, scale, max_rows, tree_masks};                                    \
        struct attn_plan plan;                                                                 \
        int failed = attn_plan_make(&plan, &args, num_threads, !dot_chunks_##V(head_dim));     \
        if (failed) return failed;                                                             \
        const int need_qf = !(sizeof(T) == sizeof(float) && sizeof(KT) == sizeof(float));      \
        int64_t taken = 0; /* items handed out, one at a time, each thread one ahead */       \
        _Pragma("omp parallel num_threads(num_threads)") {                                     \
            struct attn_scratch scratch;                                                       \
            if (attn_scratch_alloc(&scratch, &args, need_qf, sizeof(KT))) {                    \
                _Pragma("omp atomic write") failed = 1;                                        \
            }                                                                                  \
            attn_items_##V(&args, &plan, &scratch, &taken, &failed);                           \
            if (plan.partials) {                                                               \
                _Pragma("omp barrier")                                                         \
                _Pragma("omp for schedule(dynamic, 1)") for (                                  \
                    int64_t item = 0; item < plan.num_tiles * num_kv_heads; item++) {          \
                    int stop;                                                                  \
                    _Pragma("omp atomic read") stop = failed;                                  \
                    if (!stop) attn_merge_##V(&args, &plan, &scratch, item);                   \
                }                                                                              \
            }                                                                                  \
            attn_scratch_free(&scratch);                                                       \
        }                                                                                      \
        attn_plan_free(&plan);                                                                 \
        return failed;                                                                         \
    }

PAGED_ATTENTION(float, float, f32, specserve_paged_attention)
PAGED_ATTENTION(bf16, bf16, bf16, specserve_paged_attention_bf16)
PAGED_ATTENTION(float, bf16, f32_bf16kv, specserve_paged_attention_f32_bf16kv)

/* ---- row-wise kernels ---- */

/* Run ROW(i) for i in [0, num_rows): on OpenMP threads from PARALLEL_MIN_ROWS rows, or
 * from PARALLEL_MIN_VALUES values in all (row_size each). */
#define FOR_ROWS(num_rows, num_threads, ROW) FOR_ROWS_OF(num_rows, 0, num_threads, ROW)
#define FOR_ROWS_OF(num_rows, row_size, num_threads, ROW)                                      \
    do {                                                                                       \
        if (((num_rows) >= PARALLEL_MIN_ROWS ||                                                \
             ((num_rows) > 1 && (num_rows) * (row_size) >= PARALLEL_MIN_VALUES)) &&            \
            (num_threads) > 1) {                                                               \
            _Pragma("omp parallel for num_threads(num_threads) schedule(static)") for (        \
                int64_t i = 0; i < (num_rows); i++) ROW(i);                                    \
        } else {                                                                               \
            for (int64_t i = 0; i < (num_rows); i++) ROW(i);                                   \
        }                                                                                      \
    } while (0)

/* out = RMSNorm(x) * weight, row by row. With `residual` non-NULL, first
 * residual = x + residual (written back), then out = RMSNorm(residual) * weight:
 * the residual stream and the next sub-layer's input in one pass. Rounding as torch's
 * bf16 path (layers.RMSNorm): the sum rounded, normalised in fp32 and rounded, then
 * times the weight and rounded. */
#define RMS_NORM(T, S, NAME)                                                                   \
    INLINE void rms_norm_row_##S(T *restrict out, const T *restrict x, T *restrict residual,   \
                                 const T *restrict weight, int64_t hidden, float eps) {        \
        const T *src = x;                                                                      \
        if (residual) {                                                                        \
            _Pragma("omp simd") for (int64_t d = 0; d < hidden; d++) st_##S(                   \
                residual, d, ld_##S(residual, d) + ld_##S(x, d));                              \
            src = residual;                                                                    \
        }                                                                                      \
        float sq = 0.0f;                                                                       \
        _Pragma("omp simd reduction(+ : sq)") for (int64_t d = 0; d < hidden; d++) {           \
            const float v = ld_##S(src, d);                                                    \
            sq += v * v;                                                                       \
        }                                                                                      \
        const float inv = inv_rms_##S(sq, hidden, eps);                                        \
        _Pragma("omp simd") for (int64_t d = 0; d < hidden; d++) st_##S(                       \
            out, d, rnd_##S(ld_##S(src, d) * inv) * ld_##S(weight, d));                        \
    }                                                                                          \
                                                                                               \
    void NAME(T *out, const T *x, T *residual, const T *weight, int64_t num_rows,              \
              int64_t hidden, float eps, int32_t num_threads) {                                \
        FOR_ROWS_OF(num_rows, hidden, num_threads, RMS_ROW_##S);                               \
    }

#define RMS_ROW_f32(i)                                                                         \
    rms_norm_row_f32(out + (i) * hidden, x + (i) * hidden,                                     \
                     residual ? residual + (i) * hidden : NULL, weight, hidden, eps)
#define RMS_ROW_bf16(i)                                                                        \
    rms_norm_row_bf16(out + (i) * hidden, x + (i) * hidden,                                    \
                      residual ? residual + (i) * hidden : NULL, weight, hidden, eps)

RMS_NORM(float, f32, specserve_rms_norm)
RMS_NORM(bf16, bf16, specserve_rms_norm_bf16)

/* Rotate-half rotary embedding, in place, of the first `num_rotated` heads of each
 * row of `x` (a fused qkv buffer: the q heads then the k heads come first).
 * cos_sin: [num_positions, 2, head_dim / 2] (cos then sin), of x's type. Each product
 * and sum rounded as torch's bf16 ops round them (layers.apply_rope). Returns 1,
 * changing nothing, when a position is outside the table. */
#define ROPE(T, S, NAME)                                                                       \
    INLINE void rope_row_##S(T *restrict row, const T *restrict cos_sin, int64_t num_rotated,  \
                             int64_t head_dim) {                                               \
        const int64_t half = head_dim / 2;                                                     \
        const T *c = cos_sin, *s = cos_sin + half;                                             \
        for (int64_t h = 0; h < num_rotated; h++) {                                            \
            T *x1 = row + h * head_dim;                                                        \
            T *x2 = x1 + half;                                                                 \
            _Pragma("omp simd") for (int64_t d = 0; d < half; d++) {                           \
                const float a = ld_##S(x1, d), b = ld_##S(x2, d);                              \
                const float cd = ld_##S(c, d), sd = ld_##S(s, d);                              \
                st_##S(x1, d, rnd_##S(a * cd) - rnd_##S(b * sd));                              \
                st_##S(x2, d, rnd_##S(b * cd) + rnd_##S(a * sd));                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    int NAME(T *x, int64_t row_stride, int64_t num_tokens, const int64_t *positions,           \
             const T *cos_sin, int64_t num_positions, int64_t num_rotated, int64_t head_dim,   \
             int32_t num_threads) {                                                            \
        for (int64_t i = 0; i < num_tokens; i++) {                                             \
            if (positions[i] < 0 || positions[i] >= num_positions) return 1;                   \
        }                                                                                      \
        FOR_ROWS(num_tokens, num_threads, ROPE_ROW_##S);                                       \
        return 0;                                                                              \
    }

#define ROPE_ROW_f32(i) \
    rope_row_f32(x + (i) * row_stride, cos_sin + positions[i] * head_dim, num_rotated, head_dim)
#define ROPE_ROW_bf16(i) \
    rope_row_bf16(x + (i) * row_stride, cos_sin + positions[i] * head_dim, num_rotated, head_dim)

ROPE(float, f32, specserve_rope)
ROPE(bf16, bf16, specserve_rope_bf16)

/* Copy each token's K and V row (`width` = num_kv_heads * head_dim values) into its
 * cache slot; slot < 0 is padding and is skipped. Returns 1, writing nothing, when a
 * slot is past the cache. A copy: K/V and the cache share one type. */
#define WRITE_KV(T, NAME)                                                                      \
    int NAME(const T *key, int64_t key_row_stride, const T *value, int64_t value_row_stride,   \
             int64_t num_tokens, int64_t width, T *k_cache, T *v_cache, const int64_t *slots,  \
             int64_t num_slots) {                                                              \
        for (int64_t i = 0; i < num_tokens; i++) {                                             \
            if (slots[i] >= num_slots) return 1;                                               \
        }                                                                                      \
        for (int64_t i = 0; i < num_tokens; i++) {                                             \
            const int64_t slot = slots[i];                                                     \
            if (slot < 0) continue;                                                            \
            memcpy(k_cache + slot * width, key + i * key_row_stride, sizeof(T) * (size_t)width); \
            memcpy(v_cache + slot * width, value + i * value_row_stride,                       \
                   sizeof(T) * (size_t)width);                                                 \
        }                                                                                      \
        return 0;                                                                              \
    }

WRITE_KV(float, specserve_write_kv)
WRITE_KV(bf16, specserve_write_kv_bf16)

/* fp32 K/V rows into a bf16 cache (--kv-cache-dtype bfloat16): each value rounded to
 * the nearest bf16, ties to even, as torch's .to(torch.bfloat16) rounds; a NaN stays a
 * quiet NaN of its sign (rounding its bits could carry into the sign or make an
 * infinity). Returns 1, writing nothing, when a slot is past the cache. */
INLINE bf16 f32_to_bf16_nan_safe(float x) {
    const uint32_t bits = F32_TO_BITS(x);
    if (BITS_NAN(bits)) return (bf16)((bits >> 16) | 0x0040u);
    return (bf16)(BF16_ROUNDED_BITS(bits) >> 16);
}
int specserve_write_kv_f32_bf16kv(const float *key, int64_t key_row_stride, const float *value,
                                  int64_t value_row_stride, int64_t num_tokens, int64_t width,
                                  bf16 *k_cache, bf16 *v_cache, const int64_t *slots,
                                  int64_t num_slots) {
    for (int64_t i = 0; i < num_tokens; i++) {
        if (slots[i] >= num_slots) return 1;
    }
    for (int64_t i = 0; i < num_tokens; i++) {
        const int64_t slot = slots[i];
        if (slot < 0) continue;
        const float *k = key + i * key_row_stride, *v = value + i * value_row_stride;
        bf16 *kc = k_cache + slot * width, *vc = v_cache + slot * width;
#pragma omp simd
        for (int64_t d = 0; d < width; d++) {
            kc[d] = f32_to_bf16_nan_safe(k[d]);
            vc[d] = f32_to_bf16_nan_safe(v[d]);
        }
    }
    return 0;
}

/* out[i, :] = silu(x[i, :inter]) * x[i, inter:] for x [num_rows, 2 * inter]; silu
 * rounded, then the product rounded (torch: F.silu(gate) * up). fast-math divides by
 * a reciprocal estimate and a Newton step, which put silu(5.9375), within 1e-6 of a
 * bf16 tie, on the other side of it from torch's exact division; the bf16 kernel
 * corrects the quotient by its exact residual where there is FMA. */
#define SILU_DIV_f32(g, d) ((g) / (d))
#ifdef __FMA__
INLINE float div_corrected(float g, float d) {
    const float q = g / d;
    const float r = fmaf(-q, d, g);
    return r == 0.0f ? q : fmaf(r, 1.0f / d, q); /* keeps silu(-0) = -0 */
}
#define SILU_DIV_bf16(g, d) div_corrected(g, d)
#else
#define SILU_DIV_bf16(g, d) ((g) / (d))
#endif
#define SILU_AND_MUL(T, S, NAME)                                                               \
    INLINE void silu_and_mul_row_##S(T *restrict out, const T *restrict gate,                  \
                                     const T *restrict up, int64_t inter) {                    \
        _Pragma("omp simd") for (int64_t d = 0; d < inter; d++) {                              \
            /* exp(-g) clamped below overflow: inf would turn into NaN under fast-math */     \
            const float g = ld_##S(gate, d);                                                   \
            const float e = expf(fminf(-g, 80.0f));                                            \
            st_##S(out, d, rnd_##S(SILU_DIV_##S(g, 1.0f + e)) * ld_##S(up, d));                \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    void NAME(T *out, const T *x, int64_t num_rows, int64_t inter, int32_t num_threads) {      \
        FOR_ROWS_OF(num_rows, inter, num_threads, SILU_ROW_##S);                               \
    }

#define SILU_ROW_f32(i) \
    silu_and_mul_row_f32(out + (i) * inter, x + (i) * 2 * inter, x + (i) * 2 * inter + inter, inter)
#define SILU_ROW_bf16(i) \
    silu_and_mul_row_bf16(out + (i) * inter, x + (i) * 2 * inter, x + (i) * 2 * inter + inter, inter)

SILU_AND_MUL(float, f32, specserve_silu_and_mul)
SILU_AND_MUL(bf16, bf16, specserve_silu_and_mul_bf16)

#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* ---- structured output: logits masked to the tokens a constraint allows ----
 *
 * words: one bitmask per row, ceil(vocab / 32) words, bit t % 32 of word t / 32 set when
 * token t is allowed. A token stays when its bit is set and its logit is finite; every
 * other logit becomes -inf. dead[r] is 1 when row r keeps nothing. Works on the bit
 * patterns (finite: exponent not all ones), as -ffast-math may fold isfinite() away.
 * Returns -1 when the words cannot cover the vocabulary. */
int64_t specserve_mask_logits(float *logits, int64_t rows, int64_t vocab, int64_t stride,
                              const int32_t *words, int64_t num_words, uint8_t *dead,
                              int32_t num_threads) {
    if (num_words * 32 < vocab) return -1;
#pragma omp parallel for num_threads(num_threads) if (rows * vocab >= (1 << 20))
    for (int64_t r = 0; r < rows; r++) {
        uint32_t *row = (uint32_t *)(logits + r * stride);
        const uint32_t *w = (const uint32_t *)(words + r * num_words);
        uint32_t any = 0;
        int64_t i = 0;
#ifdef __AVX512F__
        const __m512i exponent = _mm512_set1_epi32(0xff), neg_inf = _mm512_set1_epi32((int)0xff800000u);
        for (; i + 16 <= vocab; i += 16) { /* a word's 16-bit half is the lane mask */
            const __mmask16 bits = (__mmask16)(w[i >> 5] >> (i & 16));
            const __m512i v = _mm512_loadu_si512(row + i);
            const __mmask16 finite = _mm512_cmpneq_epi32_mask(
                _mm512_and_si512(_mm512_srli_epi32(v, 23), exponent), exponent);
            const __mmask16 keep = bits & finite;
            _mm512_storeu_si512(row + i, _mm512_mask_blend_epi32(keep, neg_inf, v));
            any |= keep;
        }
#endif
        for (; i < vocab; i++) {
            const uint32_t keep = ((w[i >> 5] >> (i & 31)) & 1u) & (((row[i] >> 23) & 0xffu) != 0xffu);
            row[i] = keep ? row[i] : 0xff800000u; /* -inf */
            any |= keep;
        }
        dead[r] = !any;
    }
    return 0;
}

/* Greedy sampling's argmax: out[r] = the first index of row r's maximum, or of its first
 * NaN when it has one (a NaN counts as maximal), as torch's max(dim) and argmax give;
 * -0.0 and +0.0 are equal. One vectorised pass finds the maximum and whether the row
 * holds a NaN (bits: -ffast-math may fold isnan() away), a second the first index
 * equal to it, 64 values at a time. */
INLINE int64_t row_argmax_f32(const float *x, int64_t n) {
    float m = x[0];
    uint32_t nan = 0;
    for (int64_t i = 0; i < n; i++) {
        m = x[i] > m ? x[i] : m;
        nan |= BITS_NAN(F32_TO_BITS(x[i]));
    }
    if (nan) {
        for (int64_t i = 0; i < n; i++)
            if (BITS_NAN(F32_TO_BITS(x[i]))) return i;
    }
    for (int64_t i0 = 0; i0 < n; i0 += 64) {
        const int64_t end = n - i0 < 64 ? n : i0 + 64;
        int hit = 0;
        for (int64_t i = i0; i < end; i++) hit |= x[i] == m;
        if (hit)
            for (int64_t i = i0; i < end; i++)
                if (x[i] == m) return i;
    }
    return 0; /* not reached: x[i] == m for some i */
}

/* Rows of x [rows, n] (row r at x + r * stride); n >= 1. */
void specserve_row_argmax_f32(int64_t *out, const float *x, int64_t rows, int64_t n,
                              int64_t stride, int32_t num_threads) {
#define ARGMAX_ROW(r) (out[r] = row_argmax_f32(x + (r) * stride, n))
    FOR_ROWS_OF(rows, n, num_threads, ARGMAX_ROW);
#undef ARGMAX_ROW
}

/* The check before sampling (engine/core/llm_engine.py): flags[r] = 1 where row r of x
 * [rows, n] (row r at x + r * stride) holds a NaN or +Inf, else 0; returns how many
 * rows do. -Inf is a token of probability 0, not an error. Bits, not comparisons
 * (-ffast-math may fold isnan() away): a NaN's magnitude bits are above +Inf's. One
 * pass over rows the head has just written, still in cache: a sum over them in torch,
 * its threads asleep after the model's call, took about 70 us of a batch-1 step. */
INLINE int32_t row_nonfinite_f32(const float *x, int64_t n) {
    uint32_t bad = 0;
#pragma omp simd reduction(| : bad)
    for (int64_t i = 0; i < n; i++) {
        const uint32_t u = F32_TO_BITS(x[i]);
        bad |= ((u & 0x7FFFFFFFu) > 0x7F800000u) | (u == 0x7F800000u);
    }
    return bad != 0;
}

int64_t specserve_rows_nonfinite_f32(int32_t *flags, const float *x, int64_t rows, int64_t n,
                                     int64_t stride, int32_t num_threads) {
#define NONFINITE_ROW(r) (flags[r] = row_nonfinite_f32(x + (r) * stride, n))
    FOR_ROWS_OF(rows, n, num_threads, NONFINITE_ROW);
#undef NONFINITE_ROW
    int64_t count = 0;
    for (int64_t r = 0; r < rows; r++) count += flags[r];
    return count;
}

/* Exp(1) noise for sampling's exponential race (a row's token is argmax p / E; the
 * sampler divides and takes it), a row per 64-bit key: out[r][t] = -log(U), U = 2 - d
 * with d in [1, 2) the double whose 52 mantissa bits are the top of z, z = SplitMix64's
 * output t + 1 from state keys[r] (z = mix(key + (t + 1) * golden gamma)): U in
 * [2^-52, 1] is exact, and log takes it to double precision where U is near 1 (small
 * E, the draws that win races). E = 0 (U = 1, once in 2^52 draws) is stored as 2^-60,
 * so a token of probability 0 scores 0, never 0 / 0. A seeded row's key is
 * position_seed(seed, position) and its noise is a function of that key and t alone
 * (engine/sample/sampler.py). torch's exponential_ took 37.3 ms on [32, 49,152], more
 * than the decode step it served; this takes 2.0 (docs/benchmarks.md, "Sampling's
 * noise and argmax"). */
union f64_bits {
    double d;
    uint64_t u;
};
INLINE uint64_t splitmix64_mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
INLINE void exponential_row(float *restrict out, uint64_t key, int64_t n) {
#pragma omp simd
    for (int64_t t = 0; t < n; t++) {
        const uint64_t z = splitmix64_mix(key + (uint64_t)(t + 1) * 0x9E3779B97F4A7C15ull);
        const double d = ((union f64_bits){.u = 0x3FF0000000000000ull | (z >> 12)}).d;
        const double e = -log(2.0 - d);
        out[t] = (float)(e > 0x1.0p-60 ? e : 0x1.0p-60);
    }
}

/* Rows of out [rows, n] (row r at out + r * stride), row r from keys[r]. */
void specserve_exponential_rows(float *out, int64_t rows, int64_t n, int64_t stride,
                                const uint64_t *keys, int32_t num_threads) {
#define EXPONENTIAL_ROW(r) exponential_row(out + (r) * stride, keys[r], n)
    FOR_ROWS_OF(rows, n, num_threads, EXPONENTIAL_ROW);
#undef EXPONENTIAL_ROW
}

/* Inverse-CDF sampling, for rows no draft is coupled to (rejection sampling's
 * recovered and bonus tokens): out[r] = the first t whose running sum p_0 + .. + p_t
 * exceeds u[r] * (the row's sum), sums in double; p >= 0 and finite, u in [0, 1). A
 * token of probability 0 is never taken (the running sum does not grow there); should
 * rounding leave the target at or past the last running sum, the last token of
 * positive probability is. Blocks of SAMPLE_BLOCK values are summed vectorised, then the
 * block that crosses the target is walked value by value: one pass over the row and
 * part of another, where the race needs a draw, a log and a division a value. */
#define SAMPLE_BLOCK 256
INLINE double block_sum_f32(const float *p, int64_t n) {
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += (double)p[i];
    return s;
}
INLINE int64_t sample_row_f32(const float *p, int64_t n, double u) {
    double total = 0.0;
    for (int64_t b = 0; b < n; b += SAMPLE_BLOCK)
        total += block_sum_f32(p + b, n - b < SAMPLE_BLOCK ? n - b : SAMPLE_BLOCK);
    const double target = u * total;
    double run = 0.0;
    for (int64_t b = 0; b < n; b += SAMPLE_BLOCK) {
        const int64_t len = n - b < SAMPLE_BLOCK ? n - b : SAMPLE_BLOCK;
        const double next = run + block_sum_f32(p + b, len);
        if (next > target) {
            for (int64_t i = b; i < b + len; i++) {
                run += (double)p[i];
                if (run > target && p[i] > 0.0f) return i;
            }
        }
        run = next;
    }
    for (int64_t i = n - 1; i > 0; i--)
        if (p[i] > 0.0f) return i;
    return 0;
}

/* Rows of p [rows, n] (row r at p + r * stride), row r at u[r]. */
void specserve_sample_rows_f32(int64_t *out, const float *p, int64_t rows, int64_t n,
                               int64_t stride, const double *u, int32_t num_threads) {
#define SAMPLE_ROW(r) (out[r] = sample_row_f32(p + (r) * stride, n, u[r]))
    FOR_ROWS_OF(rows, n, num_threads, SAMPLE_ROW);
#undef SAMPLE_ROW
}

/* ---- bf16 linear layers: out = x @ W^T (+ bias), on AVX512-BF16 ----
 *
 * torch's oneDNN bf16 GEMM streams the weights at about half this machine's memory
 * bandwidth for the few rows of a decode step, and a token's cost is its weights read
 * once. This one reads them as one sequential stream and multiplies pairs of bf16
 * values with vdpbf16ps (fp32 accumulation), several rows of x per load of W.
 *
 * Batch invariance, by construction: each output is one fp32 accumulator running over
 * k in order, from zero, whatever the number of rows, the row block it falls in or the
 * thread that computes it; then bias added and rounded to bf16 once. So a request's
 * logits do not depend on what else is in the batch (greedy output with and without
 * speculation, seeded output alone and in a crowd).
 *
 * Weights are packed once at load (engine/kernels/cpu.py, pack_linear_weight) as
 * [ceil(n / 32)][ceil(k / 2)][32][2]: for each tile of 32 outputs, for each pair of
 * input columns, the 32 outputs' two weights side by side (zeros past n and k). A tile
 * of 32 outputs is two registers of 16 fp32 accumulators per row of x. */
#define LINEAR_TILE 32
#define LINEAR_ROWS 12 /* rows of x per register block: 24 accumulators */

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define HAVE_DP_LINEAR 1

INLINE __m512bh x_pair(const bf16 *x, int64_t p) {
    int32_t bits;
    memcpy(&bits, x + 2 * p, 4);
    return (__m512bh)_mm512_set1_epi32(bits);
}

INLINE void store_outputs(bf16 *out, __m512 lo, __m512 hi, const bf16 *bias, int64_t cols) {
    if (bias != NULL) {
        bf16 b[LINEAR_TILE] = {0};
        memcpy(b, bias, sizeof(bf16) * (size_t)cols);
        const __m512i b16 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)b));
        const __m512i b32 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + 16)));
        lo = _mm512_add_ps(lo, _mm512_castsi512_ps(_mm512_slli_epi32(b16, 16)));
        hi = _mm512_add_ps(hi, _mm512_castsi512_ps(_mm512_slli_epi32(b32, 16)));
    }
    const __m256i lo16 = (__m256i)_mm512_cvtneps_pbh(lo); /* round to nearest even */
    const __m256i hi16 = (__m256i)_mm512_cvtneps_pbh(hi);
    if (cols == LINEAR_TILE) {
        _mm256_storeu_si256((__m256i *)out, lo16);
        _mm256_storeu_si256((__m256i *)(out + 16), hi16);
    } else {
        bf16 tmp[LINEAR_TILE];
        _mm256_storeu_si256((__m256i *)tmp, lo16);
        _mm256_storeu_si256((__m256i *)(tmp + 16), hi16);
        memcpy(out, tmp, sizeof(bf16) * (size_t)cols);
    }
}

/* `rows` (a constant after inlining) rows of x against one tile of W. */
INLINE void linear_tile(bf16 *out, int64_t n, const bf16 *x, int64_t x_stride,
                        const bf16 *tile, const bf16 *bias, int64_t k, int rows, int64_t cols) {
    __m512 acc[LINEAR_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t pairs = k / 2;
    for (int64_t p = 0; p < pairs; p++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(tile + p * 2 * LINEAR_TILE);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(tile + p * 2 * LINEAR_TILE + 32);
        for (int r = 0; r < rows; r++) {
            const __m512bh xr = x_pair(x + r * x_stride, p);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xr);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xr);
        }
    }
    if (k % 2) { /* an odd k's last column, paired with a zero (so is its weight) */
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(tile + pairs * 2 * LINEAR_TILE);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(tile + pairs * 2 * LINEAR_TILE + 32);
        for (int r = 0; r < rows; r++) {
            const __m512bh xr = (__m512bh)_mm512_set1_epi32(x[r * x_stride + k - 1]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xr);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xr);
        }
    }
    for (int r = 0; r < rows; r++) store_outputs(out + r * n, acc[r][0], acc[r][1], bias, cols);
}

#define LINEAR_CASE(R)                                                                         \
    case R:                                                                                    \
        linear_tile(o, n, xr, x_stride, tile, b, k, R, cols);                                  \
        break;

/* Tiles [t0, t1) of LINEAR_TILE outputs of out [m, n] (dense; a team thread's share);
 * x [m, k], rows x_stride apart; packed as above; bias [n] or NULL. */
static ONE_COPY void dp_tiles_bf16(bf16 *out, const bf16 *x, int64_t x_stride,
                                   const bf16 *packed, const bf16 *bias, int64_t m, int64_t n,
                                   int64_t k, int64_t t0, int64_t t1) {
    const int64_t tile_size = (k + 1) / 2 * 2 * LINEAR_TILE;
    for (int64_t t = t0; t < t1; t++) {
        const bf16 *tile = packed + t * tile_size;
        const bf16 *b = bias == NULL ? NULL : bias + t * LINEAR_TILE;
        const int64_t cols = n - t * LINEAR_TILE < LINEAR_TILE ? n - t * LINEAR_TILE : LINEAR_TILE;
        for (int64_t r0 = 0; r0 < m; r0 += LINEAR_ROWS) {
            bf16 *o = out + r0 * n + t * LINEAR_TILE;
            const bf16 *xr = x + r0 * x_stride;
            switch (m - r0 < LINEAR_ROWS ? m - r0 : LINEAR_ROWS) {
                LINEAR_CASE(1) LINEAR_CASE(2) LINEAR_CASE(3) LINEAR_CASE(4) LINEAR_CASE(5)
                LINEAR_CASE(6) LINEAR_CASE(7) LINEAR_CASE(8) LINEAR_CASE(9) LINEAR_CASE(10)
                LINEAR_CASE(11) LINEAR_CASE(12)
            }
        }
    }
}

/* The tiles over the threads. */
static void dp_linear_bf16(bf16 *out, const bf16 *x, int64_t x_stride, const bf16 *packed,
                           const bf16 *bias, int64_t m, int64_t n, int64_t k,
                           int32_t num_threads) {
    const int64_t tiles = (n + LINEAR_TILE - 1) / LINEAR_TILE;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)") for (int64_t t = 0;
                                                                               t < tiles; t++)
        dp_tiles_bf16(out, x, x_stride, packed, bias, m, n, k, t, t + 1);
}
#endif

/* ---- float Linear layers on FMA: out = x @ W^T (+ bias), x fp32 or bf16 ----
 *
 * The kernel of float32 models on every CPU with FMA (AVX2 and up), and of bf16 models
 * where it outpaces the vdpbf16ps kernel above (specserve_linear_bf16 below): the
 * one-call decoder runs float models on it (oneDNN's GEMM cannot be called from C), and
 * the layer-by-layer forward does too, so both compute the same bits.
 *
 * Batch invariance, by construction: each output is one fp32 accumulator running
 * acc = fma(w[j], x[j], acc) over j = 0..k-1 in order, from zero, then + bias (then,
 * for bf16 outputs, rounded to bf16 once, to nearest even): the same bits whatever the
 * number of rows, the row block or the thread, and at every instruction-set level
 * (AVX2 and AVX512 builds agree bit for bit). bf16 values widen to fp32 exactly, so a
 * bf16 x or weight enters the same arithmetic.
 *
 * Two weight storages, one arithmetic. fp32: [ceil(n / T)][k][T], each tile's T outputs
 * side by side for every input column. bf16: [ceil(n / T)][ceil(k / 2)][T][2], the
 * vdpbf16ps kernel's pair layout (the same packed weights serve both bf16 kernels on
 * AVX512); a pair widens to fp32 by a shift and a mask, so a float32 weight whose
 * values are bf16 numbers gives the same outputs from half the bytes: where a decode
 * step is bound by the weight stream, twice the speed. The padding of an odd k is never
 * multiplied (0 * Inf would be NaN). T = 32 with AVX512 (two zmm of accumulators per
 * row), 16 with AVX2 (two ymm). A software prefetch LF_AHEAD columns ahead keeps the
 * stream going while several rows' FMAs run (the 49k-row head at 4-32 rows was 0.84x
 * oneDNN without it). */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define HAVE_LF_LINEAR 1
#if defined(__AVX512F__)
#define LF_LANES 16
#define LF_ROWS 12 /* 24 accumulators of 32 registers */
typedef __m512 lf_vec;
#define LF_ZERO() _mm512_setzero_ps()
#define LF_SET1(v) _mm512_set1_ps(v)
#define LF_LOAD(p) _mm512_loadu_ps(p)
#define LF_STORE(p, v) _mm512_storeu_ps(p, v)
#define LF_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define LF_ADD(a, b) _mm512_add_ps(a, b)
INLINE void lf_pairs(const bf16 *p, lf_vec *even, lf_vec *odd) {
    const __m512i v = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}
/* LF_LANES fp32 -> bf16, rounded to nearest even as F32_TO_BF16 does */
INLINE void lf_store_bf16(bf16 *p, lf_vec v) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}
INLINE lf_vec lf_load_bf16(const bf16 *p) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
#else
#define LF_LANES 8
#define LF_ROWS 6 /* 12 accumulators of 16 registers */
typedef __m256 lf_vec;
#define LF_ZERO() _mm256_setzero_ps()
#define LF_SET1(v) _mm256_set1_ps(v)
#define LF_LOAD(p) _mm256_loadu_ps(p)
#define LF_STORE(p, v) _mm256_storeu_ps(p, v)
#define LF_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define LF_ADD(a, b) _mm256_add_ps(a, b)
INLINE void lf_pairs(const bf16 *p, lf_vec *even, lf_vec *odd) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}
INLINE void lf_store_bf16(bf16 *p, lf_vec v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(lo, hi));
}
INLINE lf_vec lf_load_bf16(const bf16 *p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
#endif
#define LF_TILE (2 * LF_LANES)
#ifndef LF_AHEAD
#define LF_AHEAD 32
#endif

/* One row's tile of outputs (+ bias), of type T: fp32 as is, bf16 rounded once. */
#define LF_STORE_ROW(T, XS, LOAD, STORE)                                                       \
    INLINE void lf_store_##XS(T *out, lf_vec lo, lf_vec hi, const T *bias, int64_t cols) {     \
        if (bias != NULL) {                                                                    \
            T b[LF_TILE] = {0};                                                                \
            memcpy(b, bias, sizeof(T) * (size_t)cols);                                         \
            lo = LF_ADD(lo, LOAD(b));                                                          \
            hi = LF_ADD(hi, LOAD(b + LF_LANES));                                               \
        }                                                                                      \
        T tmp[LF_TILE];                                                                        \
        T *o = cols == LF_TILE ? out : tmp;                                                    \
        STORE(o, lo);                                                                          \
        STORE(o + LF_LANES, hi);                                                               \
        if (o == tmp) memcpy(out, tmp, sizeof(T) * (size_t)cols);                              \
    }
LF_STORE_ROW(float, f32, LF_LOAD, LF_STORE)
LF_STORE_ROW(bf16, bf16x, lf_load_bf16, lf_store_bf16)
#define LF_X_f32(x, i) ((x)[i])
#define LF_X_bf16x(x, i) ((x)[i]) /* x widened to fp32 by the caller, out and bias bf16 */

/* `rows` (a constant after inlining) rows of fp32 x against one tile of fp32 weights,
 * outputs (and bias) of type OT: lf_tile_w32_<XS>. bf16 x is widened into a scratch
 * copy first: broadcasting a bf16 value costs a shift and a move to a vector register
 * per row and column, which starved the FMAs (1.06x vdpbf16ps instead of 1.4x). */
#define LF_TILE_W32(OT, XS)                                                                    \
    INLINE void lf_tile_w32_##XS(OT *out, int64_t n, const float *x, int64_t x_stride,         \
                                 const float *tile, const OT *bias, int64_t k, int rows,       \
                                 int64_t cols) {                                               \
        lf_vec acc[LF_ROWS][2];                                                                \
        for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = LF_ZERO();                      \
        for (int64_t j = 0; j < k; j++) {                                                      \
            const lf_vec w0 = LF_LOAD(tile + j * LF_TILE);                                     \
            const lf_vec w1 = LF_LOAD(tile + j * LF_TILE + LF_LANES);                          \
            _mm_prefetch((const char *)(tile + (j + LF_AHEAD) * LF_TILE), _MM_HINT_T0);        \
            _mm_prefetch((const char *)(tile + (j + LF_AHEAD) * LF_TILE + 16), _MM_HINT_T0);   \
            for (int r = 0; r < rows; r++) {                                                   \
                const lf_vec xr = LF_SET1(LF_X_##XS(x, r * x_stride + j));                     \
                acc[r][0] = LF_FMA(w0, xr, acc[r][0]);                                         \
                acc[r][1] = LF_FMA(w1, xr, acc[r][1]);                                         \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < rows; r++)                                                         \
            lf_store_##XS(out + r * n, acc[r][0], acc[r][1], bias, cols);                      \
    }

/* The same against one tile of bf16 weights in pairs: column 2p, then 2p + 1. */
#define LF_TILE_W16(OT, XS)                                                                    \
    INLINE void lf_tile_w16_##XS(OT *out, int64_t n, const float *x, int64_t x_stride,         \
                                 const bf16 *tile, const OT *bias, int64_t k, int rows,        \
                                 int64_t cols) {                                               \
        lf_vec acc[LF_ROWS][2];                                                                \
        for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = LF_ZERO();                      \
        const int64_t pairs = k / 2;                                                           \
        for (int64_t p = 0; p < pairs; p++) {                                                  \
            lf_vec e0, o0, e1, o1;                                                             \
            lf_pairs(tile + p * 2 * LF_TILE, &e0, &o0);                                        \
            lf_pairs(tile + p * 2 * LF_TILE + 2 * LF_LANES, &e1, &o1);                         \
            _mm_prefetch((const char *)(tile + (p + LF_AHEAD / 2) * 2 * LF_TILE), _MM_HINT_T0); \
            _mm_prefetch((const char *)(tile + (p + LF_AHEAD / 2) * 2 * LF_TILE + 32),         \
                         _MM_HINT_T0);                                                         \
            for (int r = 0; r < rows; r++) {                                                   \
                const lf_vec xe = LF_SET1(LF_X_##XS(x, r * x_stride + 2 * p));                 \
                const lf_vec xo = LF_SET1(LF_X_##XS(x, r * x_stride + 2 * p + 1));             \
                acc[r][0] = LF_FMA(o0, xo, LF_FMA(e0, xe, acc[r][0]));                         \
                acc[r][1] = LF_FMA(o1, xo, LF_FMA(e1, xe, acc[r][1]));                         \
            }                                                                                  \
        }                                                                                      \
        if (k % 2) { /* an odd k's last column: the even halves only */                        \
            lf_vec e0, o0, e1, o1;                                                             \
            lf_pairs(tile + pairs * 2 * LF_TILE, &e0, &o0);                                    \
            lf_pairs(tile + pairs * 2 * LF_TILE + 2 * LF_LANES, &e1, &o1);                     \
            (void)o0, (void)o1;                                                                \
            for (int r = 0; r < rows; r++) {                                                   \
                const lf_vec xe = LF_SET1(LF_X_##XS(x, r * x_stride + k - 1));                 \
                acc[r][0] = LF_FMA(e0, xe, acc[r][0]);                                         \
                acc[r][1] = LF_FMA(e1, xe, acc[r][1]);                                         \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < rows; r++)                                                         \
            lf_store_##XS(out + r * n, acc[r][0], acc[r][1], bias, cols);                      \
    }
LF_TILE_W32(float, f32)
LF_TILE_W16(float, f32)
LF_TILE_W16(bf16, bf16x)

#define LF_CASE(W, XS, R)                                                                      \
    case R:                                                                                    \
        lf_tile_##W##_##XS(o, n, xr, x_stride, tile, b, k, R, cols);                           \
        break;
#define LF_CASES(W, XS)                                                                        \
    LF_CASE(W, XS, 1) LF_CASE(W, XS, 2) LF_CASE(W, XS, 3) LF_CASE(W, XS, 4)                    \
    LF_CASE(W, XS, 5) LF_CASE(W, XS, 6)
#if LF_ROWS > 6
#define LF_CASES_MORE(W, XS)                                                                   \
    LF_CASE(W, XS, 7) LF_CASE(W, XS, 8) LF_CASE(W, XS, 9) LF_CASE(W, XS, 10)                   \
    LF_CASE(W, XS, 11) LF_CASE(W, XS, 12)
#else
#define LF_CASES_MORE(W, XS)
#endif

/* One (weight storage, output type)'s loop: tiles [t0, t1), LF_ROWS rows of x at a time
 * per tile; and the tiles over the threads. */
#define LF_LINEAR(W, WT, OT, XS)                                                               \
    static ONE_COPY void lf_tiles_##W##_##XS(OT *out, const float *x, int64_t x_stride,        \
                                             const WT *packed, const OT *bias, int64_t m,      \
                                             int64_t n, int64_t k, int64_t t0, int64_t t1) {   \
        const int64_t tile_size = (sizeof(WT) == 2 ? (k + 1) / 2 * 2 : k) * LF_TILE;           \
        for (int64_t t = t0; t < t1; t++) {                                                    \
            const WT *tile = packed + t * tile_size;                                           \
            const OT *b = bias == NULL ? NULL : bias + t * LF_TILE;                            \
            const int64_t cols = n - t * LF_TILE < LF_TILE ? n - t * LF_TILE : LF_TILE;        \
            for (int64_t r0 = 0; r0 < m; r0 += LF_ROWS) {                                      \
                OT *o = out + r0 * n + t * LF_TILE;                                            \
                const float *xr = x + r0 * x_stride;                                           \
                switch (m - r0 < LF_ROWS ? m - r0 : LF_ROWS) {                                 \
                    LF_CASES(W, XS)                                                            \
                    LF_CASES_MORE(W, XS)                                                       \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    static void lf_linear_##W##_##XS(OT *out, const float *x, int64_t x_stride,                \
                                     const WT *packed, const OT *bias, int64_t m, int64_t n,   \
                                     int64_t k, int32_t num_threads) {                         \
        const int64_t tiles = (n + LF_TILE - 1) / LF_TILE;                                     \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                  \
        for (int64_t t = 0; t < tiles; t++)                                                    \
            lf_tiles_##W##_##XS(out, x, x_stride, packed, bias, m, n, k, t, t + 1);            \
    }
LF_LINEAR(w32, float, float, f32)
LF_LINEAR(w16, bf16, float, f32)
LF_LINEAR(w16, bf16, bf16, bf16x)

int32_t specserve_linear_tile_f32(void) { return LF_TILE; }

/* The float32 Linear's tiles [t0, t1) of LF_TILE outputs (a team thread's share). */
INLINE void linear_f32_tiles(float *out, const float *x, int64_t x_stride, const void *packed,
                             int32_t storage_bf16, const float *bias, int64_t m, int64_t n,
                             int64_t k, int64_t t0, int64_t t1) {
    if (storage_bf16)
        lf_tiles_w16_f32(out, x, x_stride, (const bf16 *)packed, bias, m, n, k, t0, t1);
    else
        lf_tiles_w32_f32(out, x, x_stride, (const float *)packed, bias, m, n, k, t0, t1);
}

/* out [m, n] (dense); x [m, k], rows x_stride apart; packed as above, bf16-stored when
 * storage_bf16; bias [n] or NULL. */
void specserve_linear_f32(float *out, const float *x, int64_t x_stride, const void *packed,
                          int32_t storage_bf16, const float *bias, int64_t m, int64_t n,
                          int64_t k, int32_t num_threads) {
    if (storage_bf16)
        lf_linear_w16_f32(out, x, x_stride, (const bf16 *)packed, bias, m, n, k, num_threads);
    else
        lf_linear_w32_f32(out, x, x_stride, (const float *)packed, bias, m, n, k, num_threads);
}
#else
/* Built without FMA: float32 Linear layers stay on torch's GEMMs (tile 0 says so). */
int32_t specserve_linear_tile_f32(void) { return 0; }
void specserve_linear_f32(float *out, const float *x, int64_t x_stride, const void *packed,
                          int32_t storage_bf16, const float *bias, int64_t m, int64_t n,
                          int64_t k, int32_t num_threads) {
    (void)out, (void)x, (void)x_stride, (void)packed, (void)storage_bf16, (void)bias;
    (void)m, (void)n, (void)k, (void)num_threads;
    abort(); /* unreachable: the wrapper refuses when the tile is 0 */
}
#endif

/* ---- bf16 Linear on AMX tiles (tdpbf16ps) ----
 *
 * Where the CPU has AMX-BF16 (Sapphire Rapids and later) and Linux lends the tiles: the
 * same packed pair layout as the FMA kernel (tile of 32 outputs, [ceil(k / 2)][32][2]),
 * read straight into tile B (16 pairs x 16 outputs x 2, rows 128 bytes apart), 16 rows
 * of x at a time in tile A (a zero-padded copy: rows to a multiple of 16, an odd k's
 * pair completed with 0), two C tiles of 16 x 16 fp32 per 32 outputs, 32 inputs per
 * tdpbf16ps. The tile unit sums each output's pair products in fp32 in its own fixed
 * order (and flushes subnormals): not the FMA kernel's bits, so a process runs one or
 * the other for every call whatever its rows (batch invariance: a row's outputs depend
 * on its own x alone; rows of zeros pad the last tile of rows). Bias is added to the
 * fp32 sum and the result rounded once, as in the FMA kernel. */
#if defined(HAVE_AMX_TILES) && defined(AMX_BF16) && defined(HAVE_LF_LINEAR) && LF_TILE == 32
#define HAVE_AMX_LINEAR 1
#define AMX_PAIRS 16 /* pairs of inputs per tdpbf16ps */

INLINE void amx_bf16_config(int tail_pairs) {
    struct amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 5; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    /* 0, 1: C (outputs 0-15, 16-31 of the weight tile); 2: A (16 rows x 32 inputs);
     * 3, 4: B (16 pairs x 16 outputs); 5-7: A and B for the last tail_pairs pairs */
    if (tail_pairs) {
        cfg.rows[5] = 16, cfg.colsb[5] = (uint16_t)(4 * tail_pairs);
        cfg.rows[6] = cfg.rows[7] = (uint8_t)tail_pairs, cfg.colsb[6] = cfg.colsb[7] = 64;
    }
    _tile_loadconfig(&cfg);
}

static int64_t amx_linear_calls = 0; /* calls that ran on tiles: tests check the path ran */
int64_t specserve_linear_amx_calls(void) {
    return __atomic_load_n(&amx_linear_calls, __ATOMIC_RELAXED);
}

/* Returns 0, or 3 when the padded copy of x cannot be allocated. */
static int amx_linear_bf16(bf16 *out, const bf16 *x, int64_t x_stride, const bf16 *packed,
                           const bf16 *bias, int64_t m, int64_t n, int64_t k,
                           int32_t num_threads) {
    const int64_t pairs = (k + 1) / 2, full = pairs / AMX_PAIRS, tail = pairs % AMX_PAIRS;
    const int64_t kp = pairs * 2, mp = (m + 15) / 16 * 16;
    const size_t bytes = ((size_t)(mp * kp) * sizeof(bf16) + 63) / 64 * 64;
    bf16 *xs = aligned_alloc(64, bytes > 0 ? bytes : 64);
    if (xs == NULL) return 3;
    for (int64_t r = 0; r < mp; r++) {
        if (r < m) {
            memcpy(xs + r * kp, x + r * x_stride, sizeof(bf16) * (size_t)k);
            if (kp > k) xs[r * kp + k] = 0;
        } else {
            memset(xs + r * kp, 0, sizeof(bf16) * (size_t)kp);
        }
    }
    const int64_t tiles = (n + LF_TILE - 1) / LF_TILE, tile_size = pairs * 2 * LF_TILE;
    const int64_t row_bytes = kp * (int64_t)sizeof(bf16);
#pragma omp parallel num_threads(num_threads)
    {
        amx_bf16_config((int)tail);
        float c[2][16 * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const bf16 *w = packed + t * tile_size;
            const bf16 *b = bias == NULL ? NULL : bias + t * LF_TILE;
            const int64_t cols = n - t * LF_TILE < LF_TILE ? n - t * LF_TILE : LF_TILE;
            for (int64_t r0 = 0; r0 < mp; r0 += 16) {
                const bf16 *xr = xs + r0 * kp;
                _tile_zero(0);
                _tile_zero(1);
                /* group g of 16 pairs: x into tile A, the two 16-output halves of the
                 * weights into tiles B0 and B1, both products into C tiles 0 and 1 (tile
                 * ids are immediates: the tail group's tiles, 5-7, are configured for
                 * its fewer pairs) */
#define AMX_BF16_GROUP(g, A, B0, B1)                                                           \
    do {                                                                                       \
        const bf16 *wg = w + (g) * AMX_PAIRS * 2 * LF_TILE;                                    \
        _tile_loadd(A, xr + (g) * 2 * AMX_PAIRS, row_bytes);                                   \
        _tile_loadd(B0, wg, 4 * LF_TILE);                                                      \
        _tile_loadd(B1, wg + LF_TILE, 4 * LF_TILE);                                            \
        _tile_dpbf16ps(0, A, B0);                                                              \
        _tile_dpbf16ps(1, A, B1);                                                              \
    } while (0)
                for (int64_t g = 0; g < full; g++) AMX_BF16_GROUP(g, 2, 3, 4);
                if (tail) AMX_BF16_GROUP(full, 5, 6, 7);
#undef AMX_BF16_GROUP
                _tile_stored(0, c[0], 64);
                _tile_stored(1, c[1], 64);
                const int64_t rows = m - r0 < 16 ? m - r0 : 16;
                for (int64_t r = 0; r < rows; r++)
                    lf_store_bf16x(out + (r0 + r) * n + t * LF_TILE, LF_LOAD(c[0] + r * 16),
                                   LF_LOAD(c[1] + r * 16), b, cols);
            }
        }
        _tile_release();
    }
    free(xs);
    __atomic_fetch_add(&amx_linear_calls, 1, __ATOMIC_RELAXED);
    return 0;
}
#else
int64_t specserve_linear_amx_calls(void) { return 0; }
#endif

/* Rows [r0, r1) of x (rows x_stride apart) widened to fp32, exactly, into wide (rows k
 * apart): the FMA kernel's input for a bf16 Linear, here and on the decoder's team. */
INLINE void widen_rows_bf16(float *wide, const bf16 *x, int64_t x_stride, int64_t k,
                            int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
        for (int64_t j = 0; j < k; j++) wide[r * k + j] = BF16_TO_F32(x[r * x_stride + j]);
}

/* ---- the bf16 Linear entry points: AMX tiles, vdpbf16ps, or widen + FMA ----
 *
 * Three kernels compute a bf16 model's Linear layers, each batch invariant, in the same
 * packed layout on AVX512: AMX's tdpbf16ps (above), vdpbf16ps (AVX512-BF16; fp32
 * accumulation of bf16 pair products) and the FMA kernel above (bf16 x and weights
 * widened, exact, one fma per product; any CPU with FMA). Which multiplies faster
 * differs by CPU: the tiles where they are lent; else on the Zen 4 this project began on
 * vdpbf16ps retires twice the multiply-adds of fp32 FMA, on the Xeon with AMX half
 * (`specserve bench bounds`). The process picks one at start (engine/kernels/cpu.py:
 * AMX, else the measured peaks, or SPECSERVE_BF16_LINEAR) and keeps it: they give
 * different bits, so switching mid-run would break batch invariance. */
#define BF16_LINEAR_DP 1  /* vdpbf16ps */
#define BF16_LINEAR_FMA 2 /* widen + FMA */
#define BF16_LINEAR_AMX 4 /* tdpbf16ps on AMX tiles */
static int32_t bf16_linear_mode = 0;

/* The kernels this build has, a mask of the modes above. */
int32_t specserve_bf16_linear_modes(void) {
    int32_t modes = 0;
#if defined(HAVE_DP_LINEAR)
    modes |= BF16_LINEAR_DP;
#endif
#if defined(HAVE_LF_LINEAR)
    modes |= BF16_LINEAR_FMA;
#endif
#if defined(HAVE_AMX_LINEAR)
    if (amx_ready()) modes |= BF16_LINEAR_AMX;
#endif
    return modes;
}

/* Use `mode` from now on (one the build has); returns its tile of outputs, 0 if none. */
int32_t specserve_set_bf16_linear(int32_t mode) {
    if (!(mode & specserve_bf16_linear_modes()) ||
        (mode != BF16_LINEAR_DP && mode != BF16_LINEAR_FMA && mode != BF16_LINEAR_AMX))
        return 0;
    bf16_linear_mode = mode;
#if defined(HAVE_DP_LINEAR)
    if (mode == BF16_LINEAR_DP) return LINEAR_TILE;
#endif
#if defined(HAVE_LF_LINEAR)
    return LF_TILE;
#else
    return 0;
#endif
}

/* out [m, n] (dense); x [m, k], rows x_stride apart; packed in the pair layout of the
 * mode's tile; bias [n] or NULL. Returns 0, or 3 when the FMA kernel's widened copy of
 * x (the AMX kernel's padded one) cannot be allocated. */
int specserve_linear_bf16(bf16 *out, const bf16 *x, int64_t x_stride, const bf16 *packed,
                          const bf16 *bias, int64_t m, int64_t n, int64_t k,
                          int32_t num_threads) {
#if defined(HAVE_DP_LINEAR)
    if (bf16_linear_mode == BF16_LINEAR_DP) {
        dp_linear_bf16(out, x, x_stride, packed, bias, m, n, k, num_threads);
        return 0;
    }
#endif
#if defined(HAVE_AMX_LINEAR)
    if (bf16_linear_mode == BF16_LINEAR_AMX)
        return amx_linear_bf16(out, x, x_stride, packed, bias, m, n, k, num_threads);
#endif
#if defined(HAVE_LF_LINEAR)
    if (bf16_linear_mode == BF16_LINEAR_FMA) {
        float *wide = malloc(sizeof(float) * (size_t)(m * k > 0 ? m * k : 1));
        if (wide == NULL) return 3;
        widen_rows_bf16(wide, x, x_stride, k, 0, m);
        lf_linear_w16_bf16x(out, wide, k, packed, bias, m, n, k, num_threads);
        free(wide);
        return 0;
    }
#endif
    (void)out, (void)x, (void)x_stride, (void)packed, (void)bias, (void)m, (void)n, (void)k;
    (void)num_threads;
    abort(); /* unreachable: the wrapper refuses until a mode is set */
}
