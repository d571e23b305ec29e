/* specserve CPU kernels (fp32): paged attention, KV write, RMSNorm, rotary embedding,
 * SiLU-and-multiply.
 *
 * Built at first use by engine/kernels/cpu.py with the system C compiler
 * (-O3 -march=native -ffast-math -fopenmp) and called through ctypes. The OpenMP
 * runtime is the one torch already loaded (same soname), so these kernels and torch's
 * own ops share one thread pool.
 *
 * Every kernel reads and writes plain row-major fp32 buffers; strides are in elements.
 * -ffast-math is safe here because no kernel relies on inf or NaN: attention never
 * scores a masked key (loop bounds stop at each query's causal limit) and the running
 * maximum starts at a large finite negative number.
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

static inline __attribute__((always_inline)) float dot(
    const float *restrict a, const float *restrict b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* One query row against keys [0, n) of one cache block, folded into the row's running
 * (max, sum, acc) of a streaming softmax. k and v rows are kv_stride apart. */
static inline __attribute__((always_inline)) void attend_block(
    const float *restrict qr, const float *restrict kb, const float *restrict vb, int n,
    int64_t kv_stride, int head_dim, float scale, float *restrict scores,
    float *restrict row_max, float *restrict row_sum, float *restrict acc) {
    float block_max = NEG_BIG;
    for (int t = 0; t < n; t++) {
        const float s = dot(qr, kb + t * kv_stride, head_dim) * scale;
        scores[t] = s;
        block_max = s > block_max ? s : block_max;
    }
    const float new_max = block_max > *row_max ? block_max : *row_max;
    const float rescale = expf(*row_max - new_max);
    *row_max = new_max;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < n; t++) {
        scores[t] = expf(scores[t] - new_max);
        sum += scores[t];
    }
    *row_sum = *row_sum * rescale + sum;
#pragma omp simd
    for (int d = 0; d < head_dim; d++) acc[d] *= rescale;
    for (int t = 0; t < n; t++) {
        const float p = scores[t];
        const float *vt = vb + t * kv_stride;
#pragma omp simd
        for (int d = 0; d < head_dim; d++) acc[d] += p * vt[d];
    }
}

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

/* Attention of the query tokens of the selected sequences over their paged context,
 * causal with offset: sequence `seq` adds q_len tokens and holds seq_lens[seq] after
 * the step, so its query j sits at position seq_len - q_len + j and sees keys
 * 0 .. seq_len - q_len + j (the new tokens' K/V must already be in the cache).
 *
 * A work item is one (sequence, KV head): every query row of that KV head (its group
 * of query heads x the query tokens) is folded over each cache block in turn with a
 * streaming softmax, so each K/V block is read from memory once. (Items of a whole
 * sequence, all KV heads at once, measured 1.7x slower on SmolLM2's 32-sequence
 * decode, and would leave threads idle at batch 1.)
 *
 * out[token, head, :] is written for every query token of the selected sequences.
 * Returns 0; 1 when scratch memory could not be allocated, 2 when a sequence has more
 * than max_rows / (num_heads / num_kv_heads) query tokens, 3 when a sequence id, a
 * block id or a length does not fit the buffers passed, or a size is out of range
 * (nothing is read out of bounds in any case, and for 2 and 3 nothing is written).
 */
int specserve_paged_attention(
    float *out, int64_t out_token_stride,
    const float *q, int64_t q_token_stride,
    const float *k_cache, const float *v_cache,
    const int32_t *block_tables, int64_t block_table_stride, int64_t table_width,
    const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs,
    int64_t num_tokens, const int32_t *seq_ids, int64_t num_selected,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t num_cache_blocks, float scale, int64_t max_rows, int32_t num_threads) {
    /* The wrapper checks these; checked again because C must not divide by zero or
     * truncate a size whatever it is given. */
    if (num_kv_heads < 1 || num_heads < 0 || num_heads % num_kv_heads || head_dim < 1 ||
        head_dim > INT32_MAX || block_size < 1 || block_size > INT32_MAX || max_rows < 1)
        return 3;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t kv_stride = num_kv_heads * head_dim;
    const int64_t num_items = num_selected * num_kv_heads;
    int failed = check_sequences(block_tables, block_table_stride, table_width, seq_lens,
                                 query_start_loc, num_seqs, num_tokens, seq_ids, num_selected,
                                 group, block_size, num_cache_blocks, max_rows);
    if (failed) return failed;

#pragma omp parallel num_threads(num_threads)
    {
        float *acc = malloc(sizeof(float) * (size_t)max_rows * head_dim);
        float *row_max = malloc(sizeof(float) * (size_t)max_rows);
        float *row_sum = malloc(sizeof(float) * (size_t)max_rows);
        float *scores = malloc(sizeof(float) * (size_t)block_size);
        if (!acc || !row_max || !row_sum || !scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; item++) {
            int stop;
#pragma omp atomic read
            stop = failed;
            if (stop) continue;
            const int64_t seq = seq_ids[item / num_kv_heads];
            const int64_t kv_head = item % num_kv_heads;
            const int64_t q_start = query_start_loc[seq];
            const int64_t q_len = (int64_t)query_start_loc[seq + 1] - q_start;
            const int64_t seq_len = seq_lens[seq];
            /* rows: query head (of this KV head's group) major, query token minor */
            const int64_t rows = group * q_len;
            const int32_t *table = block_tables + seq * block_table_stride;
            const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
            for (int64_t r = 0; r < rows; r++) {
                row_max[r] = NEG_BIG;
                row_sum[r] = 0.0f;
            }
            memset(acc, 0, sizeof(float) * (size_t)rows * head_dim);
            const int64_t first_head = kv_head * group;
            for (int64_t b = 0; b < num_blocks; b++) {
                const int64_t base =
                    (int64_t)table[b] * block_size * kv_stride + kv_head * head_dim;
                const int64_t first_key = b * block_size;
                if (b + 1 < num_blocks) { /* the next block is elsewhere: fetch it early */
                    const int64_t next =
                        (int64_t)table[b + 1] * block_size * kv_stride + kv_head * head_dim;
                    for (int t = 0; t < block_size; t++) {
                        for (int d = 0; d < head_dim; d += 16) {
                            __builtin_prefetch(k_cache + next + t * kv_stride + d);
                            __builtin_prefetch(v_cache + next + t * kv_stride + d);
                        }
                    }
                }
                for (int64_t hl = 0; hl < group; hl++) {
                    const int64_t head = first_head + hl;
                    for (int64_t j = 0; j < q_len; j++) {
                        /* keys first_key .. seq_len - q_len + j are visible to query j */
                        const int64_t visible = seq_len - q_len + j + 1 - first_key;
                        if (visible <= 0) continue;
                        const int n = (int)(visible < block_size ? visible : block_size);
                        const int64_t r = hl * q_len + j;
                        const float *qr = q + (q_start + j) * q_token_stride + head * head_dim;
                        float *ar = acc + r * head_dim;
                        const float *kb = k_cache + base, *vb = v_cache + base;
                        /* constant head sizes let the compiler unroll the row loops */
                        if (head_dim == 64)
                            attend_block(qr, kb, vb, n, kv_stride, 64, scale, scores,
                                         row_max + r, row_sum + r, ar);
                        else if (head_dim == 128)
                            attend_block(qr, kb, vb, n, kv_stride, 128, scale, scores,
                                         row_max + r, row_sum + r, ar);
                        else
                            attend_block(qr, kb, vb, n, kv_stride, (int)head_dim, scale, scores,
                                         row_max + r, row_sum + r, ar);
                    }
                }
            }
            for (int64_t hl = 0; hl < group; hl++) {
                for (int64_t j = 0; j < q_len; j++) {
                    const int64_t r = hl * q_len + j;
                    float *o = out + (q_start + j) * out_token_stride +
                               (first_head + hl) * head_dim;
                    const float inv = 1.0f / row_sum[r];
                    const float *ar = acc + r * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) o[d] = ar[d] * inv;
                }
            }
        }
        free(acc);
        free(row_max);
        free(row_sum);
        free(scores);
    }
    return failed;
}

/* out = RMSNorm(x) * weight, row by row. With `residual` non-NULL, first
 * residual = x + residual (written back), then out = RMSNorm(residual) * weight:
 * the residual stream and the next sub-layer's input in one pass. */
static inline void rms_norm_row(
    float *restrict out, const float *restrict x, float *restrict residual,
    const float *restrict weight, int64_t hidden, float eps) {
    const float *src = x;
    if (residual) {
#pragma omp simd
        for (int64_t d = 0; d < hidden; d++) residual[d] += x[d];
        src = residual;
    }
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t d = 0; d < hidden; d++) sq += src[d] * src[d];
    const float inv = 1.0f / sqrtf(sq / (float)hidden + eps);
#pragma omp simd
    for (int64_t d = 0; d < hidden; d++) out[d] = src[d] * inv * weight[d];
}

void specserve_rms_norm(
    float *out, const float *x, float *residual, const float *weight,
    int64_t num_rows, int64_t hidden, float eps, int32_t num_threads) {
#define RMS_ROW(i) \
    rms_norm_row(out + (i) * hidden, x + (i) * hidden, \
                 residual ? residual + (i) * hidden : NULL, weight, hidden, eps)
    if (num_rows >= PARALLEL_MIN_ROWS && num_threads > 1) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t i = 0; i < num_rows; i++) RMS_ROW(i);
    } else {
        for (int64_t i = 0; i < num_rows; i++) RMS_ROW(i);
    }
#undef RMS_ROW
}

static inline void rope_row(float *restrict row, const float *restrict cos_sin,
                            int64_t num_rotated, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    const float *c = cos_sin, *s = cos_sin + half;
    for (int64_t h = 0; h < num_rotated; h++) {
        float *x1 = row + h * head_dim;
        float *x2 = x1 + half;
#pragma omp simd
        for (int64_t d = 0; d < half; d++) {
            const float a = x1[d], b = x2[d];
            x1[d] = a * c[d] - b * s[d];
            x2[d] = b * c[d] + a * s[d];
        }
    }
}

/* Rotate-half rotary embedding, in place, of the first `num_rotated` heads of each
 * row of `x` (a fused qkv buffer: the q heads then the k heads come first).
 * cos_sin: [num_positions, 2, head_dim / 2] (cos then sin). Returns 1, changing
 * nothing, when a position is outside the table. */
int specserve_rope(
    float *x, int64_t row_stride, int64_t num_tokens, const int64_t *positions,
    const float *cos_sin, int64_t num_positions, int64_t num_rotated, int64_t head_dim,
    int32_t num_threads) {
    for (int64_t i = 0; i < num_tokens; i++) {
        if (positions[i] < 0 || positions[i] >= num_positions) return 1;
    }
    if (num_tokens >= PARALLEL_MIN_ROWS && num_threads > 1) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t i = 0; i < num_tokens; i++)
            rope_row(x + i * row_stride, cos_sin + positions[i] * head_dim, num_rotated,
                     head_dim);
    } else {
        for (int64_t i = 0; i < num_tokens; i++)
            rope_row(x + i * row_stride, cos_sin + positions[i] * head_dim, num_rotated,
                     head_dim);
    }
    return 0;
}

/* Copy each token's K and V row (`width` = num_kv_heads * head_dim values) into its
 * cache slot; slot < 0 is padding and is skipped. Returns 1, writing nothing, when a
 * slot is past the cache. */
int specserve_write_kv(
    const float *key, int64_t key_row_stride, const float *value, int64_t value_row_stride,
    int64_t num_tokens, int64_t width, float *k_cache, float *v_cache, const int64_t *slots,
    int64_t num_slots) {
    for (int64_t i = 0; i < num_tokens; i++) {
        if (slots[i] >= num_slots) return 1;
    }
    for (int64_t i = 0; i < num_tokens; i++) {
        const int64_t slot = slots[i];
        if (slot < 0) continue;
        memcpy(k_cache + slot * width, key + i * key_row_stride, sizeof(float) * (size_t)width);
        memcpy(v_cache + slot * width, value + i * value_row_stride,
               sizeof(float) * (size_t)width);
    }
    return 0;
}

/* out[i, :] = silu(x[i, :inter]) * x[i, inter:] for x [num_rows, 2 * inter]. */
static inline void silu_and_mul_row(float *restrict out, const float *restrict gate,
                                    const float *restrict up, int64_t inter) {
#pragma omp simd
    for (int64_t d = 0; d < inter; d++) {
        /* exp(-g) clamped below overflow: inf would turn into NaN under fast-math */
        const float e = expf(fminf(-gate[d], 80.0f));
        out[d] = gate[d] / (1.0f + e) * up[d];
    }
}

void specserve_silu_and_mul(
    float *out, const float *x, int64_t num_rows, int64_t inter, int32_t num_threads) {
    if (num_rows >= PARALLEL_MIN_ROWS && num_threads > 1) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t i = 0; i < num_rows; i++)
            silu_and_mul_row(out + i * inter, x + i * 2 * inter, x + i * 2 * inter + inter, inter);
    } else {
        for (int64_t i = 0; i < num_rows; i++)
            silu_and_mul_row(out + i * inter, x + i * 2 * inter, x + i * 2 * inter + inter, inter);
    }
}
