/* specserve CPU kernels, part 2 of 3 (after cpu_kernels.c, whose element types and
 * helpers it uses): Linear layers on 4- and 8-bit weights.
 *
 * Weights are GGUF's Q4_0, Q4_1 or Q8_0 (a 32-weight block: an fp16 scale d, Q4_1 an
 * fp16 minimum m too, and 32 quants: w = d * (q - 8), d * q + m, d * q), served as
 * stored; `--quantization int8` makes Q8_0 blocks of any model's weights.
 *
 * Activations are quantized once per call, per row and per 32-block, to int8 with an
 * fp32 scale (xd = max|x| / 127, xq = round(x / xd)) and the sum of the block's xq. A
 * block holding a NaN or an Inf gets xd = NaN, so every output of its row is NaN, as
 * in a float Linear (where it is NaN or +-Inf): int8 dot products would be finite.
 * A block's contribution to an output is then an exact integer dot product, scaled:
 *
 *     Q8_0:  d * xd * sum(q * xq)
 *     Q4_0:  d * xd * (sum(q * xq) - 8 * sum(xq))          q in 0..15
 *     Q4_1:  d * xd * sum(q * xq) + m * xd * sum(xq)
 *
 * Batch invariance, by construction: each output is one fp32 accumulator over the
 * blocks in order, from zero, and a row's quantized activations depend on that row
 * alone; the row block a row falls in, the rows beside it and the thread that runs it
 * change nothing. Bias is added once and the result rounded once to the output type.
 *
 * Packed layout (specserve_quant_pack, once at load): tiles of QLANES outputs, each
 * tile every block of its outputs in order; a block of a tile holds QLANES fp16 d, for
 * Q4_1 QLANES fp16 m, then the quants interleaved for the dot-product instructions:
 * Q8_0 in 8 groups of 4 inputs, each [QLANES][4] int8 (group g: inputs 4g..4g+3);
 * Q4 in 4 chunks, each [QLANES][4] bytes whose low nibbles are inputs 4c..4c+3 and
 * high nibbles inputs 16+4c..16+4c+3. A tile's block is as many bytes as QLANES GGUF
 * blocks: the weights stream at their stored size. Lanes past n are zero.
 *
 * Three paths, chosen at compile time (one library per CPU kind):
 *   avx512-vnni  16 lanes, vpdpbusd on zmm (u8 x s8); Q8_0's signed weights are made
 *                unsigned with +128 (an xor) and 128 * sum(xq) taken back off;
 *   avx2         8 lanes, vpmaddubsw + vpmaddwd, or vpdpbusd on ymm where the CPU has
 *                AVX-VNNI (or AVX512-VNNI with VL); Q8_0 by the sign trick
 *                |q| * sign(xq, q), which never saturates for |q| <= 128, |xq| <= 127;
 *   portable     8 lanes, plain C: any CPU (x86-64-v2, Arm).
 * Built with AMX-INT8 (-march=native on Sapphire Rapids and later, or the x86-64-v4-amx
 * level), the avx512-vnni path also runs Q8_0 calls of 9 rows or more on the tile unit
 * (tdpbssd), with the same bits (see q_tile_amx).
 */

#define QK 32
#define QFMT_Q4_0 2 /* GGML type ids */
#define QFMT_Q4_1 3
#define QFMT_Q8_0 8

typedef uint16_t f16;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QPATH_AVX512 1
#define QLANES 16
#define QTILES 2 /* tiles per pass: each activation broadcast feeds two dot products */
#define QROWS 6  /* rows of x per register block: 24 accumulators */
#define QPATH_NAME "avx512-vnni"
#elif defined(__AVX2__) && defined(__F16C__)
#define QPATH_AVX2 1
#define QLANES 8
#define QTILES 1
#define QROWS 4
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define QPATH_NAME "avx2+vnni"
#else
#define QPATH_NAME "avx2"
#endif
#else
#define QLANES 8
#define QTILES 1
#define QROWS 4
#define QPATH_NAME "portable"
#endif

#if defined(QPATH_AVX512) || defined(QPATH_AVX2)
#include <immintrin.h>
#endif

int32_t specserve_quant_lanes(void) { return QLANES; }
const char *specserve_quant_path(void) { return QPATH_NAME; }

INLINE int q_known(int32_t fmt) {
    return fmt == QFMT_Q4_0 || fmt == QFMT_Q4_1 || fmt == QFMT_Q8_0;
}
/* Bytes of one output's block as GGUF stores it, and of its scales in a tile. */
INLINE int64_t q_gguf_block_bytes(int32_t fmt) {
    return fmt == QFMT_Q8_0 ? 34 : fmt == QFMT_Q4_1 ? 20 : 18;
}
INLINE int64_t q_scale_bytes(int32_t fmt) { return fmt == QFMT_Q4_1 ? 4 : 2; }
INLINE int64_t q_tile_block_bytes(int32_t fmt) { return QLANES * q_gguf_block_bytes(fmt); }

/* IEEE half -> float, exact (normals, subnormals, inf, NaN). */
INLINE float f16_to_f32(f16 h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return BITS_TO_F32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0) return BITS_TO_F32(sign);
        const float sub = (float)man * (1.0f / 16777216.0f); /* man * 2^-24 */
        return sign ? -sub : sub;
    }
    return BITS_TO_F32(sign | ((exp + 112u) << 23) | (man << 13));
}

/* Packed bytes of an [n, k] weight of format fmt; -1 when fmt is unknown or k is not
 * a multiple of 32. */
int64_t specserve_quant_packed_bytes(int32_t fmt, int64_t n, int64_t k) {
    if (!q_known(fmt) || k <= 0 || k % QK || n <= 0) return -1;
    const int64_t tiles = (n + QLANES - 1) / QLANES;
    return tiles * (k / QK) * q_tile_block_bytes(fmt);
}

/* GGUF rows (n rows of k / 32 blocks, row_bytes apart) -> the packed layout above.
 * Returns 0, or 1 for an unknown format, a k that is not a multiple of 32, or rows
 * shorter than their blocks. */
int specserve_quant_pack(int32_t fmt, const uint8_t *src, int64_t row_bytes, int64_t n,
                         int64_t k, uint8_t *dst) {
    if (specserve_quant_packed_bytes(fmt, n, k) < 0 || row_bytes < k / QK * q_gguf_block_bytes(fmt))
        return 1;
    const int64_t nb = k / QK, gb = q_gguf_block_bytes(fmt), sb = q_scale_bytes(fmt);
    const int64_t tb = q_tile_block_bytes(fmt), tiles = (n + QLANES - 1) / QLANES;
    memset(dst, 0, (size_t)(tiles * nb * tb));
    _Pragma("omp parallel for schedule(static)") for (int64_t row = 0; row < n; row++) {
        const int64_t tile = row / QLANES, lane = row % QLANES;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *in = src + row * row_bytes + b * gb;
            uint8_t *out = dst + (tile * nb + b) * tb;
            memcpy(out + lane * 2, in, 2); /* d */
            if (fmt == QFMT_Q4_1) memcpy(out + QLANES * 2 + lane * 2, in + 2, 2); /* m */
            uint8_t *qs = out + QLANES * sb;
            const uint8_t *q = in + sb;
            if (fmt == QFMT_Q8_0) {
                for (int i = 0; i < QK; i++) qs[(i / 4) * QLANES * 4 + lane * 4 + i % 4] = q[i];
            } else { /* GGUF: byte j holds input j (low nibble) and input j + 16 (high) */
                for (int j = 0; j < 16; j++) qs[(j / 4) * QLANES * 4 + lane * 4 + j % 4] = q[j];
            }
        }
    }
    return 0;
}

/* ---- activations: one row to int8 blocks ---- */

/* max|x| is taken on the bits: |x| as an integer orders like |x| as a float, and unlike
 * fmaxf under -ffast-math (maxps drops a NaN in one operand) it cannot lose a NaN, which
 * is above +Inf. A block holding Inf or NaN gets xd = NaN (xq = 0): every output of its
 * row is NaN, where a float Linear gives NaN or +-Inf; int8 cannot say which. */
#define QUANTIZE_ROW(T, S)                                                                     \
    INLINE void quantize_row_##S(const T *restrict x, int64_t k, int8_t *restrict q,          \
                                 float *restrict d, int32_t *restrict s) {                     \
        for (int64_t b = 0; b < k / QK; b++) {                                                 \
            float v[QK];                                                                       \
            uint32_t amax_bits = 0;                                                            \
            for (int i = 0; i < QK; i++) {                                                     \
                v[i] = LD_##S(x, b * QK + i);                                                  \
                const uint32_t a = F32_TO_BITS(v[i]) & 0x7fffffffu;                            \
                amax_bits = a > amax_bits ? a : amax_bits;                                     \
            }                                                                                  \
            if (amax_bits >= F32_INF_BITS) {                                                   \
                memset(q + b * QK, 0, QK);                                                     \
                d[b] = BITS_TO_F32(F32_NAN_BITS);                                              \
                s[b] = 0;                                                                      \
                continue;                                                                      \
            }                                                                                  \
            const float amax = BITS_TO_F32(amax_bits);                                         \
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;                              \
            int32_t sum = 0;                                                                   \
            for (int i = 0; i < QK; i++) {                                                     \
                float r = nearbyintf(v[i] * inv);                                              \
                r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;                           \
                q[b * QK + i] = (int8_t)r;                                                     \
                sum += (int32_t)r;                                                             \
            }                                                                                  \
            d[b] = amax / 127.0f;                                                              \
            s[b] = sum;                                                                        \
        }                                                                                      \
    }
QUANTIZE_ROW(float, f32)
QUANTIZE_ROW(bf16, bf16)

/* The quantized activations of m rows: xq [m][k], xd and xs [m][k / 32]. */
struct qrows {
    int8_t *q;
    float *d;
    int32_t *s;
    float *ms; /* d * (float)s: Q4_1's minimum term, once per row and block, not per tile */
    int64_t k, nb;
    /* The AMX-BF16 path (q_bf16_takes) reads the rows as bf16 instead, in tile A's order:
     * [m / 16][nb][16 rows][32 inputs], rows past m zero (NULL when no call takes it). */
    uint16_t *xt;
    /* the bf16 rule (q_bf16_min_rows) when the rows were allocated: every choice of the
     * call (which rows it allocates, packs and reads) follows this one reading of it */
    int32_t bf16_rule;
    /* the decoder team's one reading of the AMX rule for its n rows, by format (Q8_0,
     * Q4): whether its calls run on tiles, so every thread splits them alike */
    uint8_t team_amx_q8, team_amx_q4;
};

/* Rows are allocated in multiples of Q_ROW_PAD, the rows past m zero: the AMX path
 * loads 16 rows at a time. */
#if defined(QPATH_AVX512) && defined(AMX_INT8) && defined(HAVE_AMX_TILES)
#define Q_ROW_PAD 16
#else
#define Q_ROW_PAD 1
#endif
#if Q_ROW_PAD == 16 && defined(AMX_BF16)
#define Q_HAS_XT 1
#else
#define Q_HAS_XT 0
#endif
#define Q_XT_BYTES(mp, k) (sizeof(uint16_t) * (size_t)((mp) * (k)))
/* What a call reads of its rows: the int8 quantization (QROWS_INT8), the bf16 tiles
 * (QROWS_BF16, q_bf16_at; nothing in builds without the path), or both (a team's
 * layers of two formats); only those buffers are allocated, the others NULL. */
#define QROWS_INT8 1
#define QROWS_BF16 2
INLINE int qrows_alloc(struct qrows *a, int64_t m, int64_t k, int reads, int32_t bf16_rule) {
    const int64_t mp = (m + Q_ROW_PAD - 1) / Q_ROW_PAD * Q_ROW_PAD;
    const int int8 = reads & QROWS_INT8, xt = Q_HAS_XT && (reads & QROWS_BF16);
    memset(a, 0, sizeof *a);
    a->k = k, a->nb = k / QK, a->bf16_rule = bf16_rule;
    if (int8) {
        a->q = malloc((size_t)(mp * k));
        a->d = malloc(sizeof(float) * (size_t)(mp * a->nb));
        a->s = malloc(sizeof(int32_t) * (size_t)(mp * a->nb));
        a->ms = malloc(sizeof(float) * (size_t)(mp * a->nb));
    }
    if (xt) a->xt = aligned_alloc(64, (Q_XT_BYTES(mp, k) + 63) / 64 * 64);
    if ((!int8 || (a->q && a->d && a->s && a->ms)) && (!xt || a->xt)) {
        if (xt && mp > m) /* rows past m: their sums are never stored, zero all the same */
            memset(a->xt + (m / 16) * 16 * k, 0, Q_XT_BYTES(mp - m / 16 * 16, k));
        if (int8 && mp > m) {
            memset(a->q + m * k, 0, (size_t)((mp - m) * k));
            memset(a->d + m * a->nb, 0, sizeof(float) * (size_t)((mp - m) * a->nb));
            memset(a->s + m * a->nb, 0, sizeof(int32_t) * (size_t)((mp - m) * a->nb));
            memset(a->ms + m * a->nb, 0, sizeof(float) * (size_t)((mp - m) * a->nb));
        }
        return 0;
    }
    free(a->q), free(a->d), free(a->s), free(a->ms), free(a->xt);
    return 3;
}
INLINE void qrows_free(struct qrows *a) {
    free(a->q), free(a->d), free(a->s), free(a->ms), free(a->xt);
}

/* ---- one tile of outputs for rows [r0, r0 + rows): per-path dot products ---- */

INLINE int32_t load_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Rows from r0 of a, as the tiles read them: through a local copy of the pointers, not
 * through a, which a store of a tile's sums (memory that might alias a's buffers) would
 * make the compiler reload every block. Row r's int8 values at q + r * k; its block b's
 * scale, sum and minimum term at d, s, ms [r * nb + b]. */
struct qrows_at {
    const int8_t *q;
    const float *d, *ms;
    const int32_t *s;
    int64_t k, nb;
};
INLINE struct qrows_at q_rows_at(const struct qrows *a, int64_t r0) {
    return (struct qrows_at){a->q + r0 * a->k, a->d + r0 * a->nb, a->ms + r0 * a->nb,
                             a->s + r0 * a->nb, a->k, a->nb};
}

#if defined(QPATH_AVX512)
typedef __m512 qacc; /* one row's QLANES fp32 accumulators */

/* `rows` rows against tiles [j0, j0 + nt) of a group of QTILES tiles of `fmt` (rows, fmt,
 * j0 and nt constants after inlining): acc[r * QTILES + j] is row r's outputs of tile j. */
INLINE void q_tile_span(qacc *acc, int32_t fmt, int rows, const uint8_t *const *tile,
                        const struct qrows *a, int64_t r0, int j0, int nt) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    const int64_t tb = q_tile_block_bytes(fmt), sb = q_scale_bytes(fmt);
    const struct qrows_at x = q_rows_at(a, r0);
    const int64_t k = x.k, nb = x.nb;
    qacc sum[QROWS * QTILES]; /* stored into acc once, at the end */
    for (int i = 0; i < rows * nt; i++) sum[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk[QTILES], *qs[QTILES];
        for (int j = 0; j < nt; j++) blk[j] = tile[j0 + j] + b * tb, qs[j] = blk[j] + QLANES * sb;
        __m512i dot[QROWS * QTILES];
        for (int i = 0; i < rows * nt; i++) dot[i] = _mm512_setzero_si512();
        if (fmt == QFMT_Q8_0) {
            for (int g = 0; g < 8; g++) {
                __m512i w[QTILES];
                for (int j = 0; j < nt; j++)
                    w[j] = _mm512_xor_si512(_mm512_loadu_si512(qs[j] + g * 64), flip);
                for (int r = 0; r < rows; r++) {
                    const int8_t *xr = x.q + r * k + b * QK + 4 * g;
                    const __m512i xb = _mm512_set1_epi32(load_i32(xr));
                    for (int j = 0; j < nt; j++)
                        dot[r * nt + j] = _mm512_dpbusd_epi32(dot[r * nt + j], w[j], xb);
                }
            }
        } else {
            for (int c = 0; c < 4; c++) {
                __m512i lo[QTILES], hi[QTILES];
                for (int j = 0; j < nt; j++) {
                    const __m512i v = _mm512_loadu_si512(qs[j] + c * 64);
                    lo[j] = _mm512_and_si512(v, low4);
                    hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                }
                for (int r = 0; r < rows; r++) {
                    const int8_t *xr = x.q + r * k + b * QK + 4 * c;
                    const __m512i xl = _mm512_set1_epi32(load_i32(xr));
                    const __m512i xh = _mm512_set1_epi32(load_i32(xr + 16));
                    for (int j = 0; j < nt; j++) {
                        __m512i *d = &dot[r * nt + j];
                        *d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(*d, lo[j], xl), hi[j], xh);
                    }
                }
            }
        }
        __m512 d[QTILES], m[QTILES];
        for (int j = 0; j < nt; j++) {
            d[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk[j]));
            m[j] = fmt == QFMT_Q4_1
                       ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk[j] + 32)))
                       : _mm512_setzero_ps();
        }
        for (int r = 0; r < rows; r++) {
            const int64_t i = r * nb + b;
            const __m512 vxd = _mm512_set1_ps(x.d[i]);
            const __m512i off = _mm512_set1_epi32((fmt == QFMT_Q8_0 ? 128 : 8) * x.s[i]);
            for (int j = 0; j < nt; j++) {
                __m512i total = dot[r * nt + j];
                if (fmt != QFMT_Q4_1) total = _mm512_sub_epi32(total, off);
                qacc *o = &sum[r * nt + j];
                *o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d[j], vxd), *o);
                if (fmt == QFMT_Q4_1) *o = _mm512_fmadd_ps(m[j], _mm512_set1_ps(x.ms[i]), *o);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < nt; j++) acc[r * QTILES + j0 + j] = sum[r * nt + j];
}

/* `rows` rows (a constant after inlining) against QTILES tiles of `fmt` (a constant
 * too): acc[r * QTILES + j] is row r's outputs of tile j. With `split` (a constant too)
 * the tiles are read one after the other, not side by side: the call of 1-6 rows that
 * streams its weights from memory once ran 1.4-1.5x as fast so on a Zen 4 (two tiles
 * side by side are two streams 16 outputs x k bytes apart), while passes over weights
 * in cache (the full passes of a call of more rows) ran 0.86-0.93x as fast, their
 * activations broadcast once a tile (docs/benchmarks.md, "A Zen 4, a fifth time"). Each
 * tile's sums are the same operations in the same order either way: the same bits. */
INLINE void q_tile(qacc *acc, int32_t fmt, int rows, int split, const uint8_t *const *tile,
                   const struct qrows *a, int64_t r0) {
    if (split) /* a group's last tile past n repeats the one before (never stored): skipped */
        for (int j = 0; j < QTILES && (j == 0 || tile[j] != tile[j - 1]); j++)
            q_tile_span(acc, fmt, rows, tile, a, r0, j, 1);
    else
        q_tile_span(acc, fmt, rows, tile, a, r0, 0, QTILES);
}

INLINE void q_acc_to_lanes(float *lanes, qacc v) { _mm512_storeu_ps(lanes, v); }

#if Q_ROW_PAD == 16
/* AMX (Sapphire Rapids and later): the same sums on the tile unit, for calls with
 * q_amx_min_rows rows or more. One tdpbssd per 32-input block multiplies 16 rows of
 * int8 activations (tile A: 16 x 32 bytes, straight from the quantized rows) by one
 * tile's 16 outputs of int8 weights (tile B: 8 x 64 bytes, the packed layout is
 * already the [input / 4][output][4] order tdpbssd reads: Q8_0 as stored, Q4 with
 * its nibbles split into 8 rows); C is the exact int32 block sum of each row and
 * output, sum(q * xq), signed against signed, so no +128 offset. It is then scaled
 * and accumulated exactly as the vpdpbusd path does, in the same order (Q4_0's
 * - 8 * sum(xq) first): every output is bit for bit the one the other path gives,
 * so which path a call takes (its row count) changes nothing, and q_groups takes it
 * inside the decoder's team as in a Linear call. On this project's Xeon VM the tile
 * unit's work and the vector scaling hardly overlap (scripts/bench_amx_overlap.c:
 * 10.7-11.0 and 6.7-6.8 ns a block alone, 15.5-21.5 together; 20 and 11, 34 on a slow
 * day), and each tile instruction (load, tdpbssd, store) takes 6-8 ns whatever else
 * runs, which bounds this path near twice vpdpbusd's rate. What the loop does about
 * it: Q4's nibbles are split once per tile for all its row blocks; the accumulators
 * are locals (through a pointer gcc kept them in memory, reloading the row scales'
 * pointers after every store); and each block's tile work is issued before the
 * previous block's sums are stored, those sums scaled a block later still, on A and B
 * tiles of its own, so no tile load waits on a store just issued (0.69-0.88x the time
 * of the loop before on Q4_1 from 32 rows, 0.84-0.97x on Q8_0: docs/benchmarks.md).
 * (Carrying 32 or 64 rows through each block with four C tiles and the accumulators in
 * memory measured slower.) Linux lends a process the tile registers on request
 * (arch_prctl ARCH_REQ_XCOMP_PERM); refused, the vpdpbusd path runs. */
#define QPATH_AMX 1
#define Q_AMX_ROWS 16

/* The fewest rows a call needs to take the AMX path: -1 picks by format what measured
 * faster (docs/benchmarks.md): Q8_0 from 9 rows (a [1536, 576] Linear alone is 1.1-2x
 * from 5 rows, but inside the decoder 5 rows came out slower; an int8 model's forward
 * over 17 and 33 tokens 1.15x, the default model's Q8_0 head 1.2-1.4x); Q4 from 128
 * rows, prompts (alone 1.13-1.28x from 32 rows but 0.73-0.94x at 9-16; in the
 * decoder's team at 32 and 64 sequences within the noise, 0.99-1.05x: its nibbles
 * must be split into a tile in memory first, and each block's scaling, the same work
 * as on vpdpbusd, bounds both paths; a prefill of 32 chat prompts, 1,264 tokens,
 * 0.94x the time, 201-209 against 217-218 ms). 0: never. */
static int32_t q_amx_min_rows = -1;

static int64_t q_amx_calls = 0; /* calls that ran on tiles: tests check the path ran */
int64_t specserve_quant_amx_calls(void) { return __atomic_load_n(&q_amx_calls, __ATOMIC_RELAXED); }

/* Sets the rule (rows >= -1) and returns it; rows < -1 only reads. */
int32_t specserve_quant_amx_min_rows(int32_t rows) {
    if (rows >= -1) q_amx_min_rows = rows;
    return q_amx_min_rows;
}

INLINE void q_amx_config(void) {
    struct amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = Q_AMX_ROWS, cfg.colsb[0] = 64; /* C: 16 rows x 16 int32 */
    cfg.rows[1] = Q_AMX_ROWS, cfg.colsb[1] = QK; /* A: 16 rows x 32 int8 */
    cfg.rows[2] = QK / 4, cfg.colsb[2] = 64;     /* B: 8 x (16 outputs x 4 int8) */
    cfg.rows[3] = Q_AMX_ROWS, cfg.colsb[3] = 64; /* the second C, A and B */
    cfg.rows[4] = Q_AMX_ROWS, cfg.colsb[4] = QK;
    cfg.rows[5] = QK / 4, cfg.colsb[5] = 64;
    _tile_loadconfig(&cfg);
}

/* Tile B of block 0 of a tile, the others wstride apart (q_amx_wstride): Q8_0's packed
 * quants as they are; Q4's nibbles split into wq (nb * 512 bytes, 64-byte aligned), once
 * per tile for all its row blocks. */
INLINE int64_t q_amx_wstride(int32_t fmt) {
    return fmt == QFMT_Q8_0 ? q_tile_block_bytes(fmt) : 512;
}
INLINE const uint8_t *q_amx_weights(int32_t fmt, const uint8_t *tile, int64_t nb,
                                    uint8_t *wq) {
    const int64_t tb = q_tile_block_bytes(fmt), sb = q_scale_bytes(fmt);
    if (fmt == QFMT_Q8_0) return tile + QLANES * sb;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *qs = tile + b * tb + QLANES * sb;
        uint8_t *bq = wq + b * 512;
        for (int ch = 0; ch < 4; ch++) {
            const __m512i v = _mm512_loadu_si512(qs + ch * 64);
            _mm512_store_si512(bq + ch * 64, _mm512_and_si512(v, low4));
            _mm512_store_si512(bq + (4 + ch) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
        }
    }
    return wq;
}

/* A thread's scratch, kept between calls (the threads are the OpenMP pool's and the
 * decoder team's, which live on): at least `bytes` of it, 64-byte aligned, grown as
 * needed; NULL when out of memory (the callers then take a path without it). */
struct q_scratch {
    void *buf;
    size_t bytes;
};
INLINE void *q_scratch_get(struct q_scratch *s, size_t bytes) {
    if (bytes > s->bytes) {
        free(s->buf);
        s->buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        s->bytes = s->buf == NULL ? 0 : bytes;
    }
    return s->buf;
}
/* Each thread's scratch for Q4's split nibbles. */
static _Thread_local struct q_scratch q_amx_wq = {NULL, 0};
INLINE uint8_t *q_amx_scratch(size_t bytes) { return q_scratch_get(&q_amx_wq, bytes); }

/* Block b's sums (c: 16 rows x 16 int32) scaled into the accumulators, as the
 * vpdpbusd path does. xd, xs and ms point at row r0's block b, a row nb apart. */
#define Q_AMX_SCALE(acc, fmt, rows, blk, xd, xs, ms, nb, c)                                    \
    do {                                                                                       \
        const __m256i *scales_ = (const __m256i *)(blk);                                       \
        const __m512 d_ = _mm512_cvtph_ps(_mm256_loadu_si256(scales_));                        \
        const __m512 m_ = (fmt) == QFMT_Q4_1                                                   \
                              ? _mm512_cvtph_ps(_mm256_loadu_si256(scales_ + 1))               \
                              : _mm512_setzero_ps();                                           \
        _Pragma("GCC unroll 16") for (int r = 0; r < (rows); r++) {                            \
            __m512i total = _mm512_load_si512((c) + r * 16);                                   \
            if ((fmt) == QFMT_Q4_0)                                                            \
                total = _mm512_sub_epi32(total, _mm512_set1_epi32(8 * (xs)[r * (nb)]));        \
            const __m512 scale_ = _mm512_mul_ps(d_, _mm512_set1_ps((xd)[r * (nb)]));           \
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), scale_, acc[r]);               \
            if ((fmt) == QFMT_Q4_1)                                                            \
                acc[r] = _mm512_fmadd_ps(m_, _mm512_set1_ps((ms)[r * (nb)]), acc[r]);          \
        }                                                                                      \
    } while (0)

/* out[r]: row r0 + r's 16 outputs of `tile`, whose tile B of block b is at w + b *
 * wstride (q_amx_weights); c (512 int32) is the caller's scratch, 64-byte aligned.
 * Even and odd blocks take turns on two sets of tiles (C, A, B), and step j issues
 * block j's products, then stores block j - 1's sums, then scales block j - 2's: no
 * tile load waits on the store before it, and no scaling on the store it reads. The
 * accumulators are locals, so they live in registers. */
INLINE void q_tile_amx(qacc *out, int32_t fmt, int rows, const uint8_t *tile,
                       const uint8_t *w, int64_t wstride, const struct qrows *a, int64_t r0,
                       int32_t *c) {
    const int64_t tb = q_tile_block_bytes(fmt), nb = a->nb, k = a->k;
    const int8_t *xq = a->q + r0 * k;
    const float *restrict xd = a->d + r0 * nb, *restrict ms = a->ms + r0 * nb;
    const int32_t *restrict xs = a->s + r0 * nb;
    __m512 acc[Q_AMX_ROWS];
    for (int r = 0; r < Q_AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
#define Q_AMX_ISSUE(T, TA, TB, b)                                                              \
    do {                                                                                       \
        _tile_zero(T);                                                                         \
        _tile_loadd(TA, xq + (b) * QK, k);                                                     \
        _tile_loadd(TB, w + (b) * wstride, 64);                                                \
        _tile_dpbssd(T, TA, TB);                                                               \
    } while (0)
#define Q_AMX_SCALE_BLOCK(b, cc)                                                               \
    Q_AMX_SCALE(acc, fmt, rows, tile + (b) * tb, xd + (b), xs + (b), ms + (b), nb, cc)
    /* Step j: block j onto the tile unit, block j - 1's sums stored, block j - 2's
     * scaled; even blocks in C tile 0 (A 1, B 2), odd ones in 3 (A 4, B 5). */
#define Q_AMX_STEP(j, T, TA, TB, PT)                                                           \
    do {                                                                                       \
        if ((j) < nb) Q_AMX_ISSUE(T, TA, TB, j);                                               \
        if ((j) >= 1 && (j) - 1 < nb) _tile_stored(PT, c + (((j) - 1) & 1) * 256, 64);         \
        if ((j) >= 2 && (j) - 2 < nb) Q_AMX_SCALE_BLOCK((j) - 2, c + (((j) - 2) & 1) * 256);   \
    } while (0)
    for (int64_t b = 0; b < nb + 2; b += 2) {
        Q_AMX_STEP(b, 0, 1, 2, 3);
        Q_AMX_STEP(b + 1, 3, 4, 5, 0);
    }
    for (int r = 0; r < rows; r++) out[r] = acc[r];
#undef Q_AMX_STEP
#undef Q_AMX_ISSUE
#undef Q_AMX_SCALE_BLOCK
}

#define Q_TILE_AMX_FMT(F)                                                                      \
    static __attribute__((noinline)) void q_tile_amx_##F(                                      \
        qacc *acc, int rows, const uint8_t *tile, const uint8_t *w, int64_t wstride,           \
        const struct qrows *a, int64_t r0, int32_t *c) {                                       \
        if (rows == Q_AMX_ROWS) q_tile_amx(acc, F, Q_AMX_ROWS, tile, w, wstride, a, r0, c);    \
        else q_tile_amx(acc, F, rows, tile, w, wstride, a, r0, c);                             \
    }
Q_TILE_AMX_FMT(QFMT_Q4_0)
Q_TILE_AMX_FMT(QFMT_Q4_1)
Q_TILE_AMX_FMT(QFMT_Q8_0)

INLINE void q_tile_amx_rows(qacc *acc, int32_t fmt, int rows, const uint8_t *tile,
                            const uint8_t *w, int64_t wstride, const struct qrows *a,
                            int64_t r0, int32_t *c) {
    if (fmt == QFMT_Q8_0) q_tile_amx_QFMT_Q8_0(acc, rows, tile, w, wstride, a, r0, c);
    else if (fmt == QFMT_Q4_1) q_tile_amx_QFMT_Q4_1(acc, rows, tile, w, wstride, a, r0, c);
    else q_tile_amx_QFMT_Q4_0(acc, rows, tile, w, wstride, a, r0, c);
}

/* The rows from which QUANT_LINEAR runs fmt on tiles (0: never), and whether it takes
 * the AMX path below for m rows of fmt. */
INLINE int64_t q_amx_rows(int32_t fmt) {
    return q_amx_min_rows >= 0 ? q_amx_min_rows : fmt == QFMT_Q8_0 ? 9 : 128;
}
INLINE int q_amx_takes(int32_t fmt, int64_t m) {
    const int64_t rows = q_amx_rows(fmt);
    return rows > 0 && m >= rows && amx_ready();
}

/* The AMX path of q_groups, for output type T (S its suffix), around its one loop over
 * the groups. Q_AMX_BEGIN: amx_end_, the rows the call runs on tiles: 0 when it does
 * not take the path (or, for Q4, has no scratch for the split nibbles: out of memory),
 * else every row block of 16 but a last one of fewer than q_amx_rows rows, which runs
 * on vpdpbusd with the group's other rows past amx_end_: the same bits either way.
 * Q_AMX_GROUP: group g's rows [0, amx_end_), each tile's weights made tile B once, then
 * its row blocks. Q_AMX_END: the tiles given back. */
#define Q_AMX_BEGIN                                                                            \
    int64_t amx_end_ = 0;                                                                      \
    uint8_t *wq_ = NULL;                                                                       \
    if (!bf16_ && q_amx_takes(fmt, m) &&                                                       \
        (fmt == QFMT_Q8_0 || (wq_ = q_amx_scratch((size_t)(a->nb * 512))) != NULL)) {          \
        __atomic_fetch_add(&q_amx_calls, 1, __ATOMIC_RELAXED);                                 \
        const int64_t full_ = m / Q_AMX_ROWS * Q_AMX_ROWS;                                     \
        amx_end_ = m - full_ >= q_amx_rows(fmt) ? m : full_;                                   \
        q_amx_config();                                                                        \
    }
#define Q_AMX_GROUP(T, S, g, group)                                                            \
    for (int j = 0; amx_end_ > 0 && j < QTILES && (g) * QTILES + j < tiles; j++) {             \
        int32_t c_[512] __attribute__((aligned(64)));                                          \
        qacc acc_[Q_AMX_ROWS];                                                                 \
        const int64_t c0 = ((g) * QTILES + j) * QLANES;                                        \
        const int64_t cols = n - c0 < QLANES ? n - c0 : QLANES;                                \
        const T *bb = bias == NULL ? NULL : bias + c0;                                         \
        const uint8_t *w_ = q_amx_weights(fmt, (group)[j], a->nb, wq_);                        \
        for (int64_t r0 = 0; r0 < amx_end_; r0 += Q_AMX_ROWS) {                                \
            const int rows = m - r0 < Q_AMX_ROWS ? (int)(m - r0) : Q_AMX_ROWS;                 \
            q_tile_amx_rows(acc_, fmt, rows, (group)[j], w_, q_amx_wstride(fmt), a, r0, c_);   \
            for (int r = 0; r < rows; r++)                                                     \
                q_store_##S(out + (r0 + r) * n + c0, acc_[r], bb, cols);                       \
        }                                                                                      \
    }
#define Q_AMX_END                                                                              \
    if (amx_end_ > 0) _tile_release();

#if defined(AMX_BF16)
/* Not batch invariant, and off unless asked (`--no-batch-invariance`): calls of
 * q_bf16_min_rows rows or more dequantize the weights to bf16 (each w = d * q (+ m)
 * in fp32, rounded once to bf16) and multiply them with the activations in bf16
 * (a float32 model's rows rounded to bf16) on the tile unit, tdpbf16ps, one fp32 C
 * tile per 16 rows and 16 outputs over all k. No activation quantization and no
 * per-block scaling: the sums stay in C from the first block to the last, where the
 * int8 paths store, convert and scale every 32-input block. A row's outputs still do
 * not depend on the rows beside it within this path, but they are not the int8
 * paths' bits, so a row gets other bits in a call under the rule's row count (a lone
 * decode step) than in one over it (a crowded one, a verification): greedy
 * speculation is then not token-identical to plain decoding. Tile B is a block of a
 * tile's 16 outputs, dequantized (16 pairs of inputs x 16 outputs x 2 bf16; pair p is
 * inputs 2p and 2p + 1), the same bits whenever and wherever it is made; tile A is 16
 * rows of x as bf16, packed once per call into a->xt in place of the int8 rows. */
#define QPATH_AMX_BF16 1
static int32_t q_bf16_min_rows = 0; /* 0: never; -1: by format (Q4 16 rows, Q8_0 32) */
static int64_t q_bf16_calls = 0;
/* Sets the rule (rows >= -1) and returns it; rows < -1 only reads. */
int32_t specserve_quant_bf16_min_rows(int32_t rows) {
    if (rows >= -1) __atomic_store_n(&q_bf16_min_rows, rows, __ATOMIC_RELAXED);
    return __atomic_load_n(&q_bf16_min_rows, __ATOMIC_RELAXED);
}
int64_t specserve_quant_bf16_calls(void) {
    return __atomic_load_n(&q_bf16_calls, __ATOMIC_RELAXED);
}
/* 1 when this process runs the path (its calls under the rule take it): built with it
 * and the tiles lent by Linux; 0 otherwise. */
int32_t specserve_quant_bf16_tiles(void) { return amx_ready() ? 1 : 0; }
INLINE int32_t q_bf16_rule(void) { return __atomic_load_n(&q_bf16_min_rows, __ATOMIC_RELAXED); }
/* Whether m rows of fmt take the path under rule (q_bf16_min_rows as read once). */
INLINE int q_bf16_at(int32_t rule, int32_t fmt, int64_t m) {
    const int64_t rows = rule >= 0 ? rule : fmt == QFMT_Q8_0 ? 32 : 16;
    return rows > 0 && m >= rows && amx_ready();
}

INLINE void q_bf16_config(void) {
    struct amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64; /* C 0-3, A 4-5, B 6-7 */
    _tile_loadconfig(&cfg);
}

/* Two fp32 vectors (16 outputs of inputs 2p and 2p + 1) as one row of tile B. */
INLINE void q_bf16_pair(bf16 *dst, __m512 even, __m512 odd) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                                25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19,
                                                3, 18, 2, 17, 1, 16, 0);
    const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(odd, even); /* even 0-15, odd 16-31 */
    _mm512_store_si512(dst, _mm512_permutexvar_epi16(interleave, w));
}

_Static_assert(QTILES == 2, "the bf16 tile path runs a group as two tiles B");

/* Block b of a group's QTILES packed tiles (16 outputs x 32 inputs each), to be made
 * tiles B in 4 * QTILES steps (q_bf16_step): its scales read once, as q_bf16_quant's
 * ds and c. */
struct q_bf16_src {
    __m512 ds[QTILES], c[QTILES]; /* 16 d and m - 16 d (Q4), 256 d and -384 d (Q8_0) */
    const uint8_t *qs[QTILES];
};
INLINE void q_bf16_src_at(struct q_bf16_src *s, int32_t fmt, const uint8_t *const *group,
                          int64_t b) {
    for (int j = 0; j < QTILES; j++) {
        const uint8_t *blk = group[j] + b * q_tile_block_bytes(fmt);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m256i *mh = (const __m256i *)(blk + 32);
        const __m512 m = fmt == QFMT_Q4_1   ? _mm512_cvtph_ps(_mm256_loadu_si256(mh))
                         : fmt == QFMT_Q4_0 ? _mm512_mul_ps(d, _mm512_set1_ps(-8.0f))
                                            : _mm512_setzero_ps();
        const float ds = fmt == QFMT_Q8_0 ? 256.0f : 16.0f, cs = fmt == QFMT_Q8_0 ? 384.0f : 16.0f;
        s->ds[j] = _mm512_mul_ps(d, _mm512_set1_ps(ds));
        s->c[j] = _mm512_fnmadd_ps(_mm512_set1_ps(cs), d, m);
        s->qs[j] = blk + QLANES * q_scale_bytes(fmt);
    }
}

/* The `width`-bit quant at bits sh .. of each lane of v as d * q + m in fp32, without
 * converting q: put in the top bits of the mantissa of 1.0 (a shift and one
 * vpternlogd), a Q4 nibble is 1 + q / 16, and fma(1 + q / 16, 16 d, m - 16 d) = d * q +
 * m; a Q8_0 byte, its sign bit flipped, is 1 + (q + 128) / 256, and fma(that, 256 d,
 * -384 d) = d * q. Each is rounded once, and m - 16 d and -384 d are exact (Q4_0's
 * m - 16 d is -24 d; Q4_1's unless its fp16 m and d lie more than 13 binades apart):
 * the bits of fma(q, d, m) and d * q, with one vector op fewer than a mask or a sign
 * extension and a conversion (the dequantization bounds this path: 0.88x the time of a
 * Q4_1 call of 32 rows). */
INLINE __m512 q_bf16_quant(__m512i v, int sh, int width, __m512 ds, __m512 c) {
    const int top = 23 - width; /* the quant's lowest bit in the mantissa */
    const __m512i at = sh <= top ? _mm512_slli_epi32(v, top - sh) : _mm512_srli_epi32(v, sh - top);
    /* 1.0's bits, with a signed byte's sign bit set to flip it (the quant's bits are
     * below the exponent, so xor is or there) */
    const uint32_t one = 0x3f800000u | (width == 8 ? 1u << 22 : 0u);
    const __m512i bits = _mm512_ternarylogic_epi32(
        at, _mm512_set1_epi32((int)(((1u << width) - 1u) << top)), _mm512_set1_epi32((int)one),
        0x6a); /* (at & mask) ^ one */
    return _mm512_fmadd_ps(_mm512_castsi512_ps(bits), ds, c);
}

/* Step t (0 .. 4 * QTILES - 1) of making src tiles B at bt (QTILES x 512 bf16, aligned):
 * tile t / 4, four of its 16 rows. Steps are small so that they can sit between the
 * tile instructions of the block before (q_bf16_block), where the vector units are
 * idle; their values do not depend on when they run. */
INLINE void q_bf16_step(int32_t fmt, const struct q_bf16_src *src, bf16 *bt, int t) {
    const int j = t / 4, q = t % 4;
    const __m512 ds = src->ds[j], c = src->c[j];
    bf16 *dst = bt + j * 512;
    if (fmt == QFMT_Q8_0) { /* group g: inputs 4g..4g+3, a byte each, signed; rows 4q.. */
        _Pragma("GCC unroll 2") for (int g = 2 * q; g < 2 * q + 2; g++) {
            const __m512i v = _mm512_loadu_si512(src->qs[j] + g * 64);
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++)
                q_bf16_pair(dst + (2 * g + h) * 32, q_bf16_quant(v, 16 * h, 8, ds, c),
                            q_bf16_quant(v, 16 * h + 8, 8, ds, c));
        }
        return;
    }
    /* Q4 chunk q: inputs 4q..4q+3 low nibbles, 16+4q..16+4q+3 high */
    const __m512i v = _mm512_loadu_si512(src->qs[j] + q * 64);
    _Pragma("GCC unroll 2") for (int nib = 0; nib < 2; nib++) {
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
            const int sh = 16 * h + 4 * nib;
            q_bf16_pair(dst + (8 * nib + 2 * q + h) * 32, q_bf16_quant(v, sh, 4, ds, c),
                        q_bf16_quant(v, sh + 8, 4, ds, c));
        }
    }
}

/* One 32-input block's products: C 0-1 += A (rows of x0) . B (w's two tiles), C 2-3 the
 * same for x1's rows where there are (two). With next, the steps of the block after
 * (src) made into next in between: the tile unit and the vector units work at once
 * (scripts/bench_bf16_overlap.c: on the Xeon a block costs about the larger of its
 * dequantization and its products this way, their sum one after the other). */
#define Q_BF16_NEXT(t)                                                                         \
    if (next != NULL) q_bf16_step(fmt, src, next, (t))
INLINE void q_bf16_block(const bf16 *w, const bf16 *x0, const bf16 *x1, int two, int32_t fmt,
                         const struct q_bf16_src *src, bf16 *next) {
    _tile_loadd(6, w, 64);
    Q_BF16_NEXT(0);
    _tile_loadd(4, x0, 64);
    Q_BF16_NEXT(1);
    _tile_dpbf16ps(0, 4, 6);
    Q_BF16_NEXT(2);
    _tile_loadd(7, w + 512, 64);
    Q_BF16_NEXT(3);
    _tile_dpbf16ps(1, 4, 7);
    Q_BF16_NEXT(4);
    if (two) {
        _tile_loadd(5, x1, 64);
        Q_BF16_NEXT(5);
        _tile_dpbf16ps(2, 5, 6);
        Q_BF16_NEXT(6);
        _tile_dpbf16ps(3, 5, 7);
    } else {
        Q_BF16_NEXT(5);
        Q_BF16_NEXT(6);
    }
    Q_BF16_NEXT(7);
}
#undef Q_BF16_NEXT

/* Each thread's scratch for a group's tiles B over all k (calls of more than 32 rows
 * dequantize a group once for all its passes of 32 rows). */
static _Thread_local struct q_scratch q_bf16_buf = {NULL, 0};
INLINE bf16 *q_bf16_scratch(size_t bytes) { return q_scratch_get(&q_bf16_buf, bytes); }

/* Q_BF16_BEGIN(S): bf16_, whether the call takes this path, and the scratch it needs;
 * Q_BF16_GROUP(S, g, group): group g's outputs for every row. */
#define Q_BF16_BEGIN(S)                                                                        \
    int bf16_ = 0;                                                                             \
    bf16 *bt_ = NULL;                                                                          \
    if (q_bf16_takes(a, fmt, m)) {                                                             \
        bf16_ = 1;                                                                             \
        if (m > 32) /* NULL when out of memory: every pass dequantizes, the same bits */      \
            bt_ = q_bf16_scratch(sizeof(bf16) * (size_t)(a->nb * QTILES * 512));               \
        __atomic_fetch_add(&q_bf16_calls, 1, __ATOMIC_RELAXED);                                \
        q_bf16_config();                                                                       \
    }
/* Each pass of 32 rows runs the blocks in order; the first (or, without a scratch, each)
 * makes block b + 1's tiles B while block b's products run: into the scratch, for the
 * passes after it, or into the half of ring_ block b does not use. */
#define Q_BF16_AT(b) (bt_ != NULL ? bt_ + (b) * QTILES * 512 : ring_[(b) & 1])
#define Q_BF16_GROUP(T, S, g, group)                                                           \
    do {                                                                                       \
        const int64_t nb_ = a->nb, k_ = a->k;  /* x's rows in a->xt, 16 x 32 to a tile A */   \
        bf16 ring_[2][QTILES * 512] __attribute__((aligned(64)));                              \
        float c_[4][256] __attribute__((aligned(64)));                                         \
        struct q_bf16_src src_;                                                                \
        for (int64_t r0 = 0; r0 < m; r0 += 32) {                                               \
            const int two = r0 + 16 < m, fresh = bt_ == NULL || r0 == 0;                       \
            const bf16 *x0 = a->xt + r0 * k_, *x1 = two ? x0 + 16 * k_ : x0;                    \
            if (fresh) { /* block 0 before the products start */                              \
                q_bf16_src_at(&src_, fmt, (group), 0);                                         \
                for (int t = 0; t < 4 * QTILES; t++) q_bf16_step(fmt, &src_, Q_BF16_AT(0), t);  \
            }                                                                                  \
            _tile_zero(0);                                                                     \
            _tile_zero(1);                                                                     \
            _tile_zero(2);                                                                     \
            _tile_zero(3);                                                                     \
            for (int64_t b = 0; b < nb_; b++) {                                                \
                bf16 *next_ = fresh && b + 1 < nb_ ? Q_BF16_AT(b + 1) : NULL;                  \
                if (next_ != NULL) q_bf16_src_at(&src_, fmt, (group), b + 1);                  \
                q_bf16_block(Q_BF16_AT(b), x0 + b * 512, x1 + b * 512, two, fmt, &src_, next_); \
            }                                                                                  \
            _tile_stored(0, c_[0], 64);                                                        \
            _tile_stored(1, c_[1], 64);                                                        \
            if (two) {                                                                         \
                _tile_stored(2, c_[2], 64);                                                    \
                _tile_stored(3, c_[3], 64);                                                    \
            }                                                                                  \
            for (int j = 0; j < QTILES && (g) * QTILES + j < tiles; j++) {                     \
                const int64_t c0 = ((g) * QTILES + j) * QLANES;                                \
                const int64_t cols = n - c0 < QLANES ? n - c0 : QLANES;                        \
                const T *bb = bias == NULL ? NULL : bias + c0;                                 \
                for (int64_t r = r0; r < m && r < r0 + 32; r++)                                \
                    q_store_##S(out + r * n + c0,                                              \
                                _mm512_load_ps(c_[(r - r0) / 16 * 2 + j] + (r - r0) % 16 * 16), \
                                bb, cols);                                                     \
            }                                                                                  \
        }                                                                                      \
    } while (0)
#define Q_BF16_END                                                                             \
    if (bf16_) _tile_release();
#endif /* AMX_BF16 */
#endif /* Q_ROW_PAD == 16 */

#elif defined(QPATH_AVX2)
typedef __m256 qacc;

#if defined(__AVXVNNI__)
#define DPBUSD8(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD8(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#else /* u8 * s8 pairs to i16 (no saturation for these ranges), then pairs of i16 to i32 */
#define Q_MADDUBS 1
#define DPBUSD8(acc, u, s)                                                                     \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#endif
#define Q_PF_AHEAD 4096 /* bytes: q_tile's non-temporal prefetch of the weights */

/* Keeps v in a register as is: the compiler may not reassociate the integer sums
 * across it. Without it gcc -O3 hoisted a block's 32 vpmaddubsw (4 rows) above their
 * adds and spilled 16 of them to the stack; with the sums in acc (memory that might
 * alias the rows) it also stored them and reloaded the row pointers every block. The
 * x86-64-v3 build's Linear at 4-32 rows took 1.3-1.5x as long on a Zen 4 so
 * (docs/benchmarks.md, "A Zen 4, a sixth time"). */
#define Q_KEEP(v) __asm__("" : "+x"(v))

INLINE void q_tile(qacc *acc, int32_t fmt, int rows, int split, const uint8_t *const *tiles,
                   const struct qrows *a, int64_t r0) {
    (void)split; /* one tile a group (QTILES 1) */
    const uint8_t *tile = tiles[0];
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const int64_t tb = q_tile_block_bytes(fmt), sb = q_scale_bytes(fmt);
    const struct qrows_at x = q_rows_at(a, r0);
    const int64_t k = x.k, nb = x.nb;
    qacc sum[QROWS]; /* stored into acc once, at the end */
    for (int r = 0; r < rows; r++) sum[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = tile + b * tb, *qs = blk + QLANES * sb;
        /* The weights 4 KB ahead asked for non-temporally: the AVX2 code's batch-1
         * decode step measured about 2% faster on a Zen 4, ahead by 2-16 KB alike, 1 KB
         * slower, into L2 (T1) no faster; the AVX512 tiles above measured 3-5% slower
         * with it (docs/benchmarks.md, "A Zen 4, a fourth time"). */
        for (int64_t o = 0; o < tb; o += 64)
            _mm_prefetch((const char *)blk + Q_PF_AHEAD + o, _MM_HINT_NTA);
        __m256i dot[QROWS];
        if (fmt == QFMT_Q8_0) {
            for (int g = 0; g < 8; g++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(qs + g * 32));
                const __m256i wabs = _mm256_sign_epi8(w, w);
                for (int r = 0; r < rows; r++) {
                    const int8_t *xr = x.q + r * k + b * QK + 4 * g;
                    const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xr)), w);
                    dot[r] = g ? DPBUSD8(dot[r], wabs, xs)
                               : DPBUSD8(_mm256_setzero_si256(), wabs, xs);
                    Q_KEEP(dot[r]);
                }
            }
        } else {
            /* Without VNNI (Q_MADDUBS): a nibble (<= 15) times an activation (|xq| <=
             * 127), two to a vpmaddubsw lane, is at most 3,810 in size, so a block's 8 of
             * them add in int16 (<= 30,480) and one vpmaddwd widens the sum: 16
             * instructions a row and block instead of 24. Integer sums: the same bits. */
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + c * 32));
                const __m256i lo = _mm256_and_si256(v, low4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                for (int r = 0; r < rows; r++) {
                    const int8_t *xr = x.q + r * k + b * QK + 4 * c;
                    const __m256i xl = _mm256_set1_epi32(load_i32(xr));
                    const __m256i xh = _mm256_set1_epi32(load_i32(xr + 16));
#if defined(Q_MADDUBS)
                    const __m256i pl = _mm256_maddubs_epi16(lo, xl);
                    const __m256i ph = _mm256_maddubs_epi16(hi, xh);
                    dot[r] = c ? _mm256_add_epi16(_mm256_add_epi16(dot[r], pl), ph)
                               : _mm256_add_epi16(pl, ph);
#else
                    dot[r] = c ? DPBUSD8(DPBUSD8(dot[r], lo, xl), hi, xh)
                               : DPBUSD8(DPBUSD8(_mm256_setzero_si256(), lo, xl), hi, xh);
#endif
                    Q_KEEP(dot[r]);
                }
            }
#if defined(Q_MADDUBS)
            for (int r = 0; r < rows; r++)
                dot[r] = _mm256_madd_epi16(dot[r], _mm256_set1_epi16(1));
#endif
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 m = fmt == QFMT_Q4_1
                             ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)))
                             : _mm256_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const int64_t i = r * nb + b;
            __m256i total = dot[r];
            if (fmt == QFMT_Q4_0) total = _mm256_sub_epi32(total, _mm256_set1_epi32(8 * x.s[i]));
            const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x.d[i]));
            sum[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), scale, sum[r]);
            if (fmt == QFMT_Q4_1) sum[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.ms[i]), sum[r]);
        }
    }
    for (int r = 0; r < rows; r++) acc[r] = sum[r];
}

INLINE void q_acc_to_lanes(float *lanes, qacc v) { _mm256_storeu_ps(lanes, v); }

#else /* portable */
typedef struct {
    float v[QLANES];
} qacc;

INLINE void q_tile(qacc *acc, int32_t fmt, int rows, int split, const uint8_t *const *tiles,
                   const struct qrows *a, int64_t r0) {
    (void)split; /* one tile a group (QTILES 1) */
    const uint8_t *tile = tiles[0];
    const int64_t tb = q_tile_block_bytes(fmt), sb = q_scale_bytes(fmt);
    for (int r = 0; r < rows; r++) memset(&acc[r], 0, sizeof(qacc));
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = tile + b * tb, *qs = blk + QLANES * sb;
        for (int lane = 0; lane < QLANES; lane++) {
            f16 dh, mh = 0;
            memcpy(&dh, blk + 2 * lane, 2);
            if (fmt == QFMT_Q4_1) memcpy(&mh, blk + 2 * QLANES + 2 * lane, 2);
            const float d = f16_to_f32(dh), m = f16_to_f32(mh);
            for (int r = 0; r < rows; r++) {
                const int8_t *x = a->q + (r0 + r) * a->k + b * QK;
                int32_t dot = 0;
                for (int i = 0; i < QK; i++) {
                    int32_t w;
                    if (fmt == QFMT_Q8_0) {
                        w = (int8_t)qs[(i / 4) * QLANES * 4 + lane * 4 + i % 4];
                    } else {
                        const int j = i % 16;
                        const uint8_t byte = qs[(j / 4) * QLANES * 4 + lane * 4 + j % 4];
                        w = i < 16 ? byte & 0x0f : byte >> 4;
                    }
                    dot += w * x[i];
                }
                const int64_t idx = (r0 + r) * a->nb + b;
                const float xd = a->d[idx];
                const int32_t xs = a->s[idx];
                if (fmt == QFMT_Q4_0) dot -= 8 * xs;
                acc[r].v[lane] = fmaf((float)dot, d * xd, acc[r].v[lane]);
                if (fmt == QFMT_Q4_1) acc[r].v[lane] = fmaf(m, a->ms[idx], acc[r].v[lane]);
            }
        }
    }
}

INLINE void q_acc_to_lanes(float *lanes, qacc v) { memcpy(lanes, v.v, sizeof(v.v)); }
#endif

/* ---- out = x @ W^T (+ bias) ---- */

#ifndef QPATH_AMX_BF16
#define Q_BF16_BEGIN(S) const int bf16_ = 0;
#define Q_BF16_GROUP(T, S, g, group)
#define Q_BF16_END
INLINE int32_t q_bf16_rule(void) { return 0; }
INLINE int q_bf16_at(int32_t rule, int32_t fmt, int64_t m) {
    return (void)rule, (void)fmt, (void)m, 0;
}
int32_t specserve_quant_bf16_min_rows(int32_t rows) { return (void)rows, 0; } /* no AMX-BF16 */
int64_t specserve_quant_bf16_calls(void) { return 0; }
int32_t specserve_quant_bf16_tiles(void) { return 0; }
#endif
/* Whether a call on rows a (allocated for it by qrows_alloc) runs m rows of fmt on the
 * bf16 tiles: by the rule as read when they were. */
INLINE int q_bf16_takes(const struct qrows *a, int32_t fmt, int64_t m) {
    return a->xt != NULL && q_bf16_at(a->bf16_rule, fmt, m);
}
#ifndef QPATH_AMX
#define Q_AMX_BEGIN const int64_t amx_end_ = 0;
#define Q_AMX_GROUP(T, S, g, group)
#define Q_AMX_END
INLINE int q_amx_takes(int32_t fmt, int64_t m) { return (void)fmt, (void)m, 0; }
int32_t specserve_quant_amx_min_rows(int32_t rows) { return (void)rows, 0; } /* no AMX */
int64_t specserve_quant_amx_calls(void) { return 0; }
#endif

/* Group g's outputs (its tiles in group) for rows [r_start, m) on the dot-product
 * instructions, QROWS rows at a time; inside q_groups. */
#define Q_GROUP_VNNI(T, S, g, group, r_start)                                                  \
    do {                                                                                       \
        qacc acc[QROWS * QTILES];                                                              \
        for (int64_t r0 = (r_start); r0 < m; r0 += QROWS) {                                    \
            const int rows = m - r0 < QROWS ? (int)(m - r0) : QROWS;                           \
            q_tile_rows(acc, fmt, rows, m > QROWS, group, a, r0);                              \
            for (int j = 0; j < QTILES && (g) * QTILES + j < tiles; j++) {                     \
                const int64_t c0 = ((g) * QTILES + j) * QLANES;                                \
                const int64_t cols = n - c0 < QLANES ? n - c0 : QLANES;                        \
                const T *b = bias == NULL ? NULL : bias + c0;                                  \
                for (int r = 0; r < rows; r++)                                                 \
                    q_store_##S(out + (r0 + r) * n + c0, acc[r * QTILES + j], b, cols);        \
            }                                                                                  \
        }                                                                                      \
    } while (0)

/* A tile's 16 outputs (+ bias) stored in one go on the AVX-512 path: the fp32 add and
 * the rounding of the scalar stores (ST_f32, ST_bf16: bf16 rounded on the bits, ties to
 * even, as the float Linear's lf_store_bf16 does), lane for lane, so the same bits. */
#if defined(QPATH_AVX512)
#define Q_STORE16 1
INLINE void q_store16_f32(float *out, __m512 v, const float *bias) {
    if (bias != NULL) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
    _mm512_storeu_ps(out, v);
}
INLINE void q_store16_bf16(bf16 *out, __m512 v, const bf16 *bias) {
    if (bias != NULL) v = _mm512_add_ps(v, lf_load_bf16(bias));
    lf_store_bf16(out, v);
}
#else
#define Q_STORE16 0
#define q_store16_f32(out, v, bias) ((void)0)
#define q_store16_bf16(out, v, bias) ((void)0)
#endif

/* An activation as bf16 bits: a float rounded as the float Linear rounds, bf16 as is. */
#define Q_BF16_BITS_f32(v) ((uint16_t)F32_TO_BF16(v))
#define Q_BF16_BITS_bf16(v) ((uint16_t)(v))

/* Groups of QTILES tiles of QLANES outputs in n outputs. */
INLINE int64_t q_groups_of(int64_t n) { return (n + QLANES * QTILES - 1) / (QLANES * QTILES); }

#define QUANT_LINEAR(T, S, NAME)                                                               \
    /* row i of x quantized into a (and d * s where Q4_1's scaling reads it) */              \
    INLINE void q_quantize_row_##S(const struct qrows *a, const T *x, int64_t x_stride,        \
                                   int32_t fmt, int64_t i) {                                   \
        quantize_row_##S(x + i * x_stride, a->k, a->q + i * a->k, a->d + i * a->nb,            \
                         a->s + i * a->nb);                                                    \
        if (fmt == QFMT_Q4_1) /* the only format whose scaling reads it */                    \
            for (int64_t j = i * a->nb; j < (i + 1) * a->nb; j++)                              \
                a->ms[j] = a->d[j] * (float)a->s[j];                                           \
    }                                                                                          \
    /* row i of x as bf16 into a->xt, in tile A's order (the AMX-BF16 path) */                \
    INLINE void q_pack_row_##S(const struct qrows *a, const T *x, int64_t x_stride, int64_t i) { \
        uint16_t *dst = a->xt + (i / 16) * 16 * a->k + (i % 16) * QK;                           \
        for (int64_t b = 0; b < a->nb; b++)                                                    \
            for (int j = 0; j < QK; j++)                                                       \
                dst[b * 16 * QK + j] = Q_BF16_BITS_##S(x[i * x_stride + b * QK + j]);          \
    }                                                                                          \
    INLINE void q_store_##S(T *out, qacc acc, const T *bias, int64_t cols) {                    \
        if (Q_STORE16 && cols == QLANES) { /* a whole tile's outputs: the same bits at once */ \
            q_store16_##S(out, acc, bias);                                                     \
            return;                                                                            \
        }                                                                                      \
        float lanes[QLANES];                                                                   \
        q_acc_to_lanes(lanes, acc);                                                            \
        for (int64_t c = 0; c < cols; c++)                                                     \
            ST_##S(out, c, bias == NULL ? lanes[c] : lanes[c] + LD_##S(bias, c));              \
    }                                                                                          \
    /* groups [g0, g1) of QTILES tiles of outputs, off x's rows quantized into a */           \
    static ONE_COPY void q_groups_##S(T *out, const struct qrows *a, const uint8_t *packed,    \
                                      int32_t fmt, const T *bias, int64_t m, int64_t n,        \
                                      int64_t g0, int64_t g1) {                                \
        const int64_t tiles = (n + QLANES - 1) / QLANES;                                       \
        const int64_t tile_bytes = a->nb * q_tile_block_bytes(fmt);                            \
        Q_BF16_BEGIN(S)                                                                        \
        Q_AMX_BEGIN                                                                            \
        for (int64_t g = g0; g < g1; g++) {                                                    \
            /* a last group short of tiles repeats its last one; its outputs are not kept */   \
            const uint8_t *group[QTILES];                                                      \
            for (int j = 0; j < QTILES; j++) {                                                 \
                const int64_t t = g * QTILES + j < tiles ? g * QTILES + j : tiles - 1;         \
                group[j] = packed + t * tile_bytes;                                            \
            }                                                                                  \
            if (bf16_) {                                                                       \
                Q_BF16_GROUP(T, S, g, group);                                                  \
                continue;                                                                      \
            }                                                                                  \
            Q_AMX_GROUP(T, S, g, group);                                                       \
            Q_GROUP_VNNI(T, S, g, group, amx_end_);                                            \
        }                                                                                      \
        Q_AMX_END                                                                              \
        Q_BF16_END                                                                             \
    }                                                                                          \
    /* out [m, n] (dense); x [m, k], rows x_stride apart; packed by specserve_quant_pack;    \
     * bias [n] or NULL. Returns 0, 1 for a bad fmt or k, 3 when out of memory. */           \
    int NAME(T *out, const T *x, int64_t x_stride, const uint8_t *packed, int32_t fmt,          \
             const T *bias, int64_t m, int64_t n, int64_t k, int32_t num_threads) {            \
        if (specserve_quant_packed_bytes(fmt, n, k) < 0) return 1;                             \
        if (m <= 0) return 0;                                                                  \
        struct qrows a;                                                                        \
        const int32_t rule_ = q_bf16_rule();                                                   \
        const int bf16_ = q_bf16_at(rule_, fmt, m);                                            \
        if (qrows_alloc(&a, m, k, bf16_ ? QROWS_BF16 : QROWS_INT8, rule_)) return 3;           \
        if (bf16_) FOR_ROWS_OF(m, k, num_threads, PACK_ONE_##S);                               \
        else FOR_ROWS_OF(m, k, num_threads, QUANTIZE_ONE_##S);                                 \
        const int64_t groups = q_groups_of(n);                                                 \
        /* one contiguous share of the groups a thread, as schedule(static) gives */           \
        _Pragma("omp parallel num_threads(num_threads)") {                                     \
            int64_t lo, hi;                                                                    \
            team_range(groups, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);         \
            if (lo < hi) q_groups_##S(out, &a, packed, fmt, bias, m, n, lo, hi);               \
        }                                                                                      \
        qrows_free(&a);                                                                        \
        return 0;                                                                              \
    }

#define PACK_ONE_f32(i) q_pack_row_f32(&a, x, x_stride, (i))
#define PACK_ONE_bf16(i) q_pack_row_bf16(&a, x, x_stride, (i))
#define QUANTIZE_ONE_f32(i) q_quantize_row_f32(&a, x, x_stride, fmt, (i))
#define QUANTIZE_ONE_bf16(i) q_quantize_row_bf16(&a, x, x_stride, fmt, (i))

/* q_tile with fmt and rows as constants, so each case compiles to its own loop; one
 * copy per format (not inlined into each output type's caller: compile time). The
 * tiles of a group are read one after the other (q_tile's split) but in the full passes
 * of a call of more than QROWS rows (`passes`): only those read their weights from
 * cache. */
#define Q_TILE_CASE(F, R)                                                                      \
    case R:                                                                                    \
        q_tile(acc, F, R, 1, tiles, a, r0);                                                    \
        break;
#define Q_TILE_FMT(F)                                                                          \
    static __attribute__((noinline)) void q_tile_##F(qacc *acc, int rows, int passes,         \
                                                     const uint8_t *const *tiles,             \
                                                     const struct qrows *a, int64_t r0) {     \
        if (QTILES > 1 && passes && rows == QROWS) q_tile(acc, F, QROWS, 0, tiles, a, r0);     \
        else switch (rows) { Q_TILE_CASES(F) }                                                 \
    }
#if QROWS == 6
#define Q_TILE_CASES(F)                                                                        \
    Q_TILE_CASE(F, 1) Q_TILE_CASE(F, 2) Q_TILE_CASE(F, 3) Q_TILE_CASE(F, 4) Q_TILE_CASE(F, 5) \
    Q_TILE_CASE(F, 6)
#else
#define Q_TILE_CASES(F) Q_TILE_CASE(F, 1) Q_TILE_CASE(F, 2) Q_TILE_CASE(F, 3) Q_TILE_CASE(F, 4)
#endif
Q_TILE_FMT(QFMT_Q4_0)
Q_TILE_FMT(QFMT_Q4_1)
Q_TILE_FMT(QFMT_Q8_0)

/* `passes`: the call has more than QROWS rows */
INLINE void q_tile_rows(qacc *acc, int32_t fmt, int rows, int passes,
                        const uint8_t *const *tiles, const struct qrows *a, int64_t r0) {
    if (fmt == QFMT_Q8_0) q_tile_QFMT_Q8_0(acc, rows, passes, tiles, a, r0);
    else if (fmt == QFMT_Q4_1) q_tile_QFMT_Q4_1(acc, rows, passes, tiles, a, r0);
    else q_tile_QFMT_Q4_0(acc, rows, passes, tiles, a, r0);
}

QUANT_LINEAR(float, f32, specserve_quant_linear)
QUANT_LINEAR(bf16, bf16, specserve_quant_linear_bf16)

/* The quantized Linear as a team's parts (the one-call decoder): rows [r0, r1) of x
 * quantized into a (buffers for m rows of a->k or more, a->nb = a->k / QK), then, once
 * every row is, groups [g0, g1) of outputs (q_groups_f32, q_groups_bf16). The same calls
 * on the same values as specserve_quant_linear(_bf16) where that does not take the AMX
 * path (q_amx_takes). */
INLINE void q_team_quantize_f32(const struct qrows *a, const float *x, int64_t x_stride,
                                int32_t fmt, int64_t m, int64_t r0, int64_t r1) {
    if (q_bf16_takes(a, fmt, m))
        for (int64_t i = r0; i < r1; i++) q_pack_row_f32(a, x, x_stride, i);
    else
        for (int64_t i = r0; i < r1; i++) q_quantize_row_f32(a, x, x_stride, fmt, i);
}
INLINE void q_team_quantize_bf16(const struct qrows *a, const bf16 *x, int64_t x_stride,
                                 int32_t fmt, int64_t m, int64_t r0, int64_t r1) {
    if (q_bf16_takes(a, fmt, m))
        for (int64_t i = r0; i < r1; i++) q_pack_row_bf16(a, x, x_stride, i);
    else
        for (int64_t i = r0; i < r1; i++) q_quantize_row_bf16(a, x, x_stride, fmt, i);
}

/* ---- embedding rows from the packed weights (a tied Q8_0 embedding is the LM head) ----
 *
 * out [num_ids, k] = the dequantized rows ids of a packed [n, k] weight: d * q (Q8_0),
 * d * (q - 8) (Q4_0), d * q + m (Q4_1), in fp32, rounded once to the output type.
 * Returns 0, 1 for a bad fmt or k, 2 for an id outside 0..n-1 (nothing written). */
#define QUANT_EMBED(T, S, NAME)                                                                \
    int NAME(T *out, const int64_t *ids, int64_t num_ids, const uint8_t *packed, int32_t fmt,   \
             int64_t n, int64_t k) {                                                           \
        if (specserve_quant_packed_bytes(fmt, n, k) < 0) return 1;                             \
        for (int64_t i = 0; i < num_ids; i++)                                                  \
            if (ids[i] < 0 || ids[i] >= n) return 2;                                           \
        const int64_t nb = k / QK, tb = q_tile_block_bytes(fmt), sb = q_scale_bytes(fmt);      \
        for (int64_t i = 0; i < num_ids; i++) {                                                \
            const int64_t tile = ids[i] / QLANES, lane = ids[i] % QLANES;                      \
            for (int64_t b = 0; b < nb; b++) {                                                 \
                const uint8_t *blk = packed + (tile * nb + b) * tb, *qs = blk + QLANES * sb;   \
                f16 dh, mh = 0;                                                                \
                memcpy(&dh, blk + 2 * lane, 2);                                                \
                if (fmt == QFMT_Q4_1) memcpy(&mh, blk + 2 * QLANES + 2 * lane, 2);             \
                const float d = f16_to_f32(dh), m = f16_to_f32(mh);                            \
                for (int j = 0; j < QK; j++) {                                                 \
                    float w;                                                                   \
                    if (fmt == QFMT_Q8_0) {                                                    \
                        w = d * (float)(int8_t)qs[(j / 4) * QLANES * 4 + lane * 4 + j % 4];    \
                    } else {                                                                   \
                        const int jj = j % 16;                                                 \
                        const uint8_t byte = qs[(jj / 4) * QLANES * 4 + lane * 4 + jj % 4];    \
                        const int q = j < 16 ? byte & 0x0f : byte >> 4;                        \
                        w = fmt == QFMT_Q4_1 ? d * (float)q + m : d * (float)(q - 8);          \
                    }                                                                          \
                    ST_##S(out + i * k, b * QK + j, w);                                        \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        return 0;                                                                              \
    }
QUANT_EMBED(float, f32, specserve_quant_embed)
QUANT_EMBED(bf16, bf16, specserve_quant_embed_bf16)
