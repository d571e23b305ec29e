/* specserve CPU kernels, part 3 of 3 (after cpu_kernels.c and quant_kernels.c, in one
 * translation unit: engine/kernels/build.py concatenates them): the decoder layers in
 * one call. */

/* ---- the decoder layers in one call ----
 *
 * Every layer of a Llama-family decoder, bf16 or fp32, on the kernels above: the same
 * calls, in the same order, on the same values as the model's Python forward
 * (models/llama.py), so the result is bit-identical to it; without the 10-odd Python
 * calls per layer around them, which cost more than the work itself at batch 1 (30
 * layers x ~100 us on the default model, on a CPU whose caches the weight stream has
 * just flushed). Linear layers quantized, or float on the Linear kernel of the model's
 * dtype where the build has it (bf16: AVX512-BF16; fp32: FMA, weights stored fp32 or
 * bf16). */
struct specserve_layer {
    const void *input_norm;      /* [hidden], the model's dtype */
    const void *qkv;             /* packed [q + 2 kv, hidden] (see the formats below) */
    const void *qkv_bias;        /* [q + 2 kv], or NULL */
    const void *o;               /* packed [hidden, q] */
    const void *post_norm;       /* [hidden] */
    const void *gate_up;         /* packed [2 inter, hidden] */
    const void *down;            /* packed [hidden, inter] */
    void *k_cache;               /* [num_blocks, block_size, num_kv_heads, head_dim], the
                                  * model's dtype or bf16 (the _f32_bf16kv entry point) */
    void *v_cache;
    /* Each Linear's weight format: FMT_FLOAT_PACKED or FMT_BF16_STORED (below), else a
     * GGML type id, packed for the quantized Linear. */
    int32_t qkv_fmt, o_fmt, gate_up_fmt, down_fmt;
};

/* A float Linear's weight formats (engine/kernels/decoder.py); a quantized Linear's is
 * its GGML type id (2, 3, 8). */
#define FMT_FLOAT_PACKED 0 /* packed for the Linear kernel of the model's dtype */
#define FMT_BF16_STORED 30 /* fp32 model, weight stored as bf16 (GGML's BF16 id) */

/* One Linear of a layer, on the kernel its weight format needs; 0, or a quantized
 * Linear's status (3: out of memory). */
INLINE int decoder_linear_bf16(bf16 *out, const bf16 *x, int64_t x_stride, const void *w,
                               int32_t fmt, const bf16 *bias, int64_t m, int64_t n, int64_t k,
                               int32_t num_threads) {
    if (fmt != FMT_FLOAT_PACKED)
        return specserve_quant_linear_bf16(out, x, x_stride, w, fmt, bias, m, n, k, num_threads);
    return specserve_linear_bf16(out, x, x_stride, w, bias, m, n, k, num_threads);
}
INLINE int decoder_linear_f32(float *out, const float *x, int64_t x_stride, const void *w,
                              int32_t fmt, const float *bias, int64_t m, int64_t n, int64_t k,
                              int32_t num_threads) {
    if (fmt != FMT_FLOAT_PACKED && fmt != FMT_BF16_STORED)
        return specserve_quant_linear(out, x, x_stride, w, fmt, bias, m, n, k, num_threads);
    specserve_linear_f32(out, x, x_stride, w, fmt == FMT_BF16_STORED, bias, m, n, k,
                         num_threads);
    return 0;
}

/* hidden [n, hidden_size]: the embeddings in, the last layer's MLP output out;
 * residual [n, hidden_size]: the residual stream before that output, out (the final
 * norm adds them). Scratch: normed [n, hidden_size], qkv [n, q + 2 kv], attn [n, q],
 * gate_up [n, 2 inter], act [n, inter]. The attention arguments are paged attention's
 * (tree_masks too). Returns 0; 1 when a position is outside the rotary table, 2 when a
 * slot is past the cache, 3 when a quantized Linear runs out of memory, 10 + paged
 * attention's status otherwise (the layers before the failing call have run). With
 * continue_residual, hidden and residual come in as a previous call left them (the
 * layers before these ones): a model run in several calls computes exactly what one
 * call does. */
#define DECODER_LAYERS(T, S, KT, NAME, NORM_FN, ROPE_FN, KV_FN, ATTN_FN, SILU_FN)                  \
    int NAME(const struct specserve_layer *layers, int64_t num_layers, T *hidden, T *residual,     \
             T *normed, T *qkv, T *attn, T *gate_up, T *act, int64_t n, int64_t hidden_size,       \
             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t inter,             \
             float eps, const int64_t *positions, const T *cos_sin, int64_t num_positions,         \
             const int64_t *slots, int64_t num_cache_blocks, int64_t block_size,                   \
             const int32_t *block_tables, int64_t block_table_stride, int64_t table_width,         \
             const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs,            \
             const int32_t *seq_ids, int64_t num_selected, int64_t max_rows, float scale,          \
             int32_t num_threads, int32_t continue_residual, const int64_t *tree_masks) {          \
        const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;            \
        const int64_t qkv_size = q_size + 2 * kv_size;                                             \
        const int64_t num_slots = num_cache_blocks * block_size;                                   \
        for (int64_t l = 0; l < num_layers; l++) {                                                 \
            const struct specserve_layer *w = &layers[l];                                          \
            int status;                                                                            \
            if (l == 0 && !continue_residual) {                                                    \
                memcpy(residual, hidden, sizeof(T) * (size_t)(n * hidden_size));                   \
                NORM_FN(normed, hidden, NULL, (const T *)w->input_norm, n, hidden_size, eps,       \
                     num_threads);                                                                 \
            } else {                                                                               \
                NORM_FN(normed, hidden, residual, (const T *)w->input_norm, n, hidden_size, eps,   \
                     num_threads);                                                                 \
            }                                                                                      \
            status = decoder_linear_##S(qkv, normed, hidden_size, w->qkv, w->qkv_fmt,              \
                                        (const T *)w->qkv_bias, n, qkv_size, hidden_size,          \
                                        num_threads);                                              \
            if (status) return 3;                                                                   \
            if (ROPE_FN(qkv, qkv_size, n, positions, cos_sin, num_positions,                       \
                     num_heads + num_kv_heads, head_dim, num_threads))                             \
                return 1;                                                                          \
            if (KV_FN(qkv + q_size, qkv_size, qkv + q_size + kv_size, qkv_size, n, kv_size,        \
                         (KT *)w->k_cache, (KT *)w->v_cache, slots, num_slots))                    \
                return 2;                                                                          \
            status = ATTN_FN(attn, q_size, qkv, qkv_size, (const KT *)w->k_cache,                  \
                               (const KT *)w->v_cache, block_tables, block_table_stride,           \
                               table_width, seq_lens, query_start_loc, num_seqs, n, seq_ids,       \
                               num_selected, num_heads, num_kv_heads, head_dim, block_size,        \
                               num_cache_blocks, scale, max_rows, num_threads, tree_masks);        \
            if (status) return 10 + status;                                                        \
            status = decoder_linear_##S(hidden, attn, q_size, w->o, w->o_fmt, NULL, n,             \
                                        hidden_size, q_size, num_threads);                         \
            if (status) return 3;                                                                   \
            NORM_FN(normed, hidden, residual, (const T *)w->post_norm, n, hidden_size, eps,        \
                 num_threads);                                                                     \
            status = decoder_linear_##S(gate_up, normed, hidden_size, w->gate_up,                  \
                                        w->gate_up_fmt, NULL, n, 2 * inter, hidden_size,           \
                                        num_threads);                                              \
            if (status) return 3;                                                                   \
            SILU_FN(act, gate_up, n, inter, num_threads);                                          \
            status = decoder_linear_##S(hidden, act, inter, w->down, w->down_fmt, NULL, n,         \
                                        hidden_size, inter, num_threads);                          \
            if (status) return 3;                                                                   \
        }                                                                                          \
        return 0;                                                                                  \
    }
DECODER_LAYERS(bf16, bf16, bf16, specserve_decoder_layers_bf16, specserve_rms_norm_bf16,
               specserve_rope_bf16, specserve_write_kv_bf16, specserve_paged_attention_bf16,
               specserve_silu_and_mul_bf16)
DECODER_LAYERS(float, f32, float, specserve_decoder_layers, specserve_rms_norm, specserve_rope,
               specserve_write_kv, specserve_paged_attention, specserve_silu_and_mul)
/* a float32 model over a bf16 KV cache (--kv-cache-dtype bfloat16) */
DECODER_LAYERS(float, f32, bf16, specserve_decoder_layers_f32_bf16kv, specserve_rms_norm,
               specserve_rope, specserve_write_kv_f32_bf16kv,
               specserve_paged_attention_f32_bf16kv, specserve_silu_and_mul)
