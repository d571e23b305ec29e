/* specserve CPU kernels, part 3 of 3 (after cpu_kernels.c and quant_kernels.c, in one
 * translation unit: engine/kernels/build.py concatenates them): the decoder layers in
 * one call. */

/* ---- the bf16 decoder layers in one call ----
 *
 * Every layer of a Llama-family decoder, bf16, on the kernels above: the same calls, in
 * the same order, on the same values as the model's Python forward (models/llama.py),
 * so the result is bit-identical to it; without the 10-odd Python calls per layer
 * around them, which cost more than the work itself at batch 1 (30 layers x ~100 us on
 * the default model, on a CPU whose caches the weight stream has just flushed). */
struct specserve_layer_bf16 {
    const bf16 *input_norm;      /* [hidden] */
    const void *qkv;             /* packed [q + 2 kv, hidden] (see the formats below) */
    const bf16 *qkv_bias;        /* [q + 2 kv], or NULL */
    const void *o;               /* packed [hidden, q] */
    const bf16 *post_norm;       /* [hidden] */
    const void *gate_up;         /* packed [2 inter, hidden] */
    const void *down;            /* packed [hidden, inter] */
    bf16 *k_cache;               /* [num_blocks, block_size, num_kv_heads, head_dim] */
    bf16 *v_cache;
    /* Each Linear's weight format: 0 = bf16 packed for specserve_linear_bf16, else a
     * GGML type id, packed for specserve_quant_linear_bf16. */
    int32_t qkv_fmt, o_fmt, gate_up_fmt, down_fmt;
};

/* One Linear of a layer, on the kernel its weight format needs; 0 or a quantized
 * Linear's status (3: out of memory). */
INLINE int decoder_linear(bf16 *out, const bf16 *x, int64_t x_stride, const void *w,
                          int32_t fmt, const bf16 *bias, int64_t m, int64_t n, int64_t k,
                          int32_t num_threads) {
    if (fmt != 0)
        return specserve_quant_linear_bf16(out, x, x_stride, w, fmt, bias, m, n, k, num_threads);
    specserve_linear_bf16(out, x, x_stride, w, bias, m, n, k, num_threads);
    return 0;
}

/* hidden [n, hidden_size]: the embeddings in, the last layer's MLP output out;
 * residual [n, hidden_size]: the residual stream before that output, out (the final
 * norm adds them). Scratch: normed [n, hidden_size], qkv [n, q + 2 kv], attn [n, q],
 * gate_up [n, 2 inter], act [n, inter]. The attention arguments are
 * specserve_paged_attention's (tree_masks too). Returns 0; 1 when a position is outside the rotary
 * table, 2 when a slot is past the cache, 3 when a quantized Linear runs out of memory,
 * 10 + paged attention's status otherwise
 * (the layers before the failing call have run). With continue_residual, hidden and
 * residual come in as a previous call left them (the layers before these ones): a model
 * run in several calls computes exactly what one call does. */
int specserve_decoder_layers_bf16(
    const struct specserve_layer_bf16 *layers, int64_t num_layers, bf16 *hidden,
    bf16 *residual, bf16 *normed, bf16 *qkv, bf16 *attn, bf16 *gate_up, bf16 *act, int64_t n,
    int64_t hidden_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t inter, float eps, const int64_t *positions, const bf16 *cos_sin,
    int64_t num_positions, const int64_t *slots, int64_t num_cache_blocks, int64_t block_size,
    const int32_t *block_tables, int64_t block_table_stride, int64_t table_width,
    const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs,
    const int32_t *seq_ids, int64_t num_selected, int64_t max_rows, float scale,
    int32_t num_threads, int32_t continue_residual, const int64_t *tree_masks) {
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    const int64_t num_slots = num_cache_blocks * block_size;
    for (int64_t l = 0; l < num_layers; l++) {
        const struct specserve_layer_bf16 *w = &layers[l];
        if (l == 0 && !continue_residual) {
            memcpy(residual, hidden, sizeof(bf16) * (size_t)(n * hidden_size));
            specserve_rms_norm_bf16(normed, hidden, NULL, w->input_norm, n, hidden_size, eps,
                                    num_threads);
        } else {
            specserve_rms_norm_bf16(normed, hidden, residual, w->input_norm, n, hidden_size,
                                    eps, num_threads);
        }
        if (decoder_linear(qkv, normed, hidden_size, w->qkv, w->qkv_fmt, w->qkv_bias, n,
                           qkv_size, hidden_size, num_threads))
            return 3;
        if (specserve_rope_bf16(qkv, qkv_size, n, positions, cos_sin, num_positions,
                                num_heads + num_kv_heads, head_dim, num_threads))
            return 1;
        if (specserve_write_kv_bf16(qkv + q_size, qkv_size, qkv + q_size + kv_size, qkv_size, n,
                                    kv_size, w->k_cache, w->v_cache, slots, num_slots))
            return 2;
        const int status = specserve_paged_attention_bf16(
            attn, q_size, qkv, qkv_size, w->k_cache, w->v_cache, block_tables,
            block_table_stride, table_width, seq_lens, query_start_loc, num_seqs, n, seq_ids,
            num_selected, num_heads, num_kv_heads, head_dim, block_size, num_cache_blocks, scale,
            max_rows, num_threads, tree_masks);
        if (status) return 10 + status;
        if (decoder_linear(hidden, attn, q_size, w->o, w->o_fmt, NULL, n, hidden_size, q_size,
                           num_threads))
            return 3;
        specserve_rms_norm_bf16(normed, hidden, residual, w->post_norm, n, hidden_size, eps,
                                num_threads);
        if (decoder_linear(gate_up, normed, hidden_size, w->gate_up, w->gate_up_fmt, NULL, n,
                           2 * inter, hidden_size, num_threads))
            return 3;
        specserve_silu_and_mul_bf16(act, gate_up, n, inter, num_threads);
        if (decoder_linear(hidden, act, inter, w->down, w->down_fmt, NULL, n, hidden_size,
                           inter, num_threads))
            return 3;
    }
    return 0;
}
