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

/* The final norm and the LM head, run by the same call after the last layer (NULL: the
 * caller runs them): for each of `num_rows` rows of hidden (`rows`, strictly
 * increasing, or NULL: rows 0 .. num_rows - 1), normed = RMSNorm(hidden + residual) *
 * norm, as the model's final norm computes it row by row (the row's residual updated in
 * place, the others left as they are), then logits = normed @ weight^T: the same
 * kernels on the same values as the model's Python norm and head, so the same bits. */
struct specserve_head {
    const void *norm;   /* [hidden], the model's dtype */
    const void *weight; /* packed [vocab, hidden], in format fmt (as a layer's Linear) */
    int32_t fmt;
    int64_t vocab;
    const int64_t *rows;
    int64_t num_rows;
    void *normed; /* scratch [num_rows, hidden], the model's dtype */
    void *logits; /* out [num_rows, vocab], the model's dtype */
    /* NULL, or (a bf16 model) out [num_rows, vocab]: the logits widened to fp32, what
     * the sampler reads, written while they are in cache (logits is then scratch) */
    float *logits_f32;
};

/* Elements lo .. hi - 1 of the head's bf16 logits widened into logits_f32 (exact). */
static void head_widen(const struct specserve_head *head, int64_t lo, int64_t hi) {
    const bf16 *src = (const bf16 *)head->logits;
    float *dst = head->logits_f32;
#pragma omp simd
    for (int64_t i = lo; i < hi; i++) dst[i] = ld_bf16(src, i);
}

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

/* The decoder's parameters (T: the activations' type) and its arguments, as named. */
#define DECODER_PARAMS(T)                                                                      \
    const struct specserve_layer *layers, int64_t num_layers, T *hidden, T *residual,          \
        T *normed, T *qkv, T *attn, T *gate_up, T *act, int64_t n, int64_t hidden_size,        \
        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t inter, float eps,   \
        const int64_t *positions, const T *cos_sin, int64_t num_positions,                     \
        const int64_t *slots, int64_t num_cache_blocks, int64_t block_size,                    \
        const int32_t *block_tables, int64_t block_table_stride, int64_t table_width,          \
        const int32_t *seq_lens, const int32_t *query_start_loc, int64_t num_seqs,             \
        const int32_t *seq_ids, int64_t num_selected, int64_t max_rows, float scale,           \
        int32_t num_threads, int32_t continue_residual, const int64_t *tree_masks,           \
        const struct specserve_head *head
#define DECODER_ARGS                                                                           \
    layers, num_layers, hidden, residual, normed, qkv, attn, gate_up, act, n, hidden_size,     \
        num_heads, num_kv_heads, head_dim, inter, eps, positions, cos_sin, num_positions,      \
        slots, num_cache_blocks, block_size, block_tables, block_table_stride, table_width,    \
        seq_lens, query_start_loc, num_seqs, seq_ids, num_selected, max_rows, scale,           \
        num_threads, continue_residual, tree_masks, head

/* ---- the decoder on one team of threads ----
 *
 * The same kernels on the same values as the layer loop below, so the same bits, but
 * inside one OpenMP region for the whole call: each kernel split among the team's
 * threads (rows of the row-wise ones, tiles of outputs of the Linear layers, the work
 * items of attention, handed out one at a time), the threads meeting at team_barrier
 * between kernels instead of opening a region per kernel (see struct team). What can
 * fail is checked, and every buffer allocated, before the region: its loop cannot fail.
 * The team runs layers whose Linear layers have a team form: quantized (on vpdpbusd, or
 * on AMX tiles where a call takes them: q_groups configures each thread's tiles, and
 * a thread without scratch for Q4's nibbles runs its share on vpdpbusd, same bits);
 * float on the FMA kernel (fp32 and bf16 models) or on vdpbf16ps (bf16 models), not on
 * AMX's tiles (team_float_ok); others run the layer loop.
 * specserve_decoder_team(0) turns it off (to compare the two). */
static int32_t decoder_team_on = 1;
int32_t specserve_decoder_team(int32_t on) {
    if (on >= 0) decoder_team_on = on != 0;
    return decoder_team_on;
}
static int64_t decoder_team_calls = 0; /* calls the team ran: tests check the path ran */
int64_t specserve_decoder_team_calls(void) {
    return __atomic_load_n(&decoder_team_calls, __ATOMIC_RELAXED);
}

INLINE int fmt_quantized(int32_t fmt) { return fmt != FMT_FLOAT_PACKED && fmt != FMT_BF16_STORED; }

/* Whether a float Linear of a model with S activations has a team form in this build
 * and process: fp32 on the FMA kernel; bf16 on the kernel the process picked
 * (specserve_set_bf16_linear) where that is vdpbf16ps or widen + FMA. */
INLINE int team_float_ok_f32(void) {
#if defined(HAVE_LF_LINEAR)
    return 1;
#else
    return 0;
#endif
}
INLINE int team_float_ok_bf16(void) {
#if defined(HAVE_DP_LINEAR)
    if (bf16_linear_mode == BF16_LINEAR_DP) return 1;
#endif
#if defined(HAVE_LF_LINEAR)
    if (bf16_linear_mode == BF16_LINEAR_FMA) return 1;
#endif
    return 0;
}
/* Whether the bf16 float Linear widens x to fp32 first (the FMA kernel's input). */
INLINE int team_widens_bf16(void) {
#if defined(HAVE_LF_LINEAR)
    return bf16_linear_mode == BF16_LINEAR_FMA;
#else
    return 0;
#endif
}

static int decoder_team_ok(const struct specserve_layer *layers, int64_t num_layers, int64_t n,
                           const struct specserve_head *head, int32_t num_threads,
                           int float_ok) {
    if (!decoder_team_on || num_threads < 2 || n < 1) return 0;
    for (int64_t l = 0; l < num_layers; l++) {
        const int32_t fmts[4] = {layers[l].qkv_fmt, layers[l].o_fmt, layers[l].gate_up_fmt,
                                 layers[l].down_fmt};
        for (int i = 0; i < 4; i++) {
            if (!fmt_quantized(fmts[i]) && !float_ok) return 0;
        }
    }
    return head == NULL || fmt_quantized(head->fmt) || float_ok;
}

/* 0, or 4 when the head's rows are not strictly increasing rows of the call's n (or
 * its sizes are out of range). */
static int head_check(const struct specserve_head *head, int64_t n, int bf16_model) {
    if (head == NULL) return 0;
    if (head->num_rows < 0 || head->num_rows > n || head->vocab < 1) return 4;
    if (head->logits_f32 != NULL && !bf16_model) return 4;
    if (head->rows != NULL)
        for (int64_t j = 0; j < head->num_rows; j++)
            if (head->rows[j] < (j > 0 ? head->rows[j - 1] + 1 : 0) || head->rows[j] >= n)
                return 4;
    return 0;
}

/* Whether the team's quantized call of m rows runs on AMX tiles (int8 or bf16), by the
 * rules as read once for the call: q_groups then configures the tiles once a call, so
 * the team keeps one call a thread (halves). */
INLINE int q_tiles_take(const struct qrows *a, int32_t fmt, int64_t m) {
    return q_bf16_takes(a, fmt, m) || (fmt == QFMT_Q8_0 ? a->team_amx_q8 : a->team_amx_q4);
}

/* Thread tid's share of a quantized Linear layer's groups of output tiles (q_groups_S
 * on team_linear_S's arguments): each thread first runs a fixed share of the first
 * three quarters (no atomics), then takes the rest from the phase's counter
 * (team_take), so the thread whose share arrived from memory later takes fewer of them
 * instead of the other waiting for it at the barrier after the layer. Take t is a
 * guided chunk: the groups from q - q (1 - 1/nt)^t on of the quarter's q, half of what
 * is left at each take with two threads, down to one group, so the takes are few
 * (about log2 q a layer) and the last of them small. One group a take was worse where
 * groups are small (the AVX2 level's 8 outputs: 4,860 takes a step of the default
 * model; the two threads' streams interleaved tile by tile); takes of a sixteenth of
 * the groups each left the thread done first waiting out the other's last one (these
 * took the AVX2 build's decode step to 0.99x at 1 sequence and 0.98x at 32 on a Zen 4,
 * the native build's to 1.00x). A group is one thread's whole work whichever thread
 * runs it: the same bits as any split. Calls on AMX tiles (q_tiles_take) keep the
 * halves, all groups fixed; otherwise it consumes one dynamic phase. */
INLINE int64_t team_q_start(int64_t fixed, int64_t q, int64_t t, int nt) {
    if (t >= 64) return fixed + q;
    const double left = (double)q * pow(1.0 - 1.0 / nt, (double)t);
    return fixed + q - (int64_t)left;
}
#define TEAM_Q_GROUPS(S)                                                                       \
    do {                                                                                       \
        const int64_t units_ = q_groups_of(n_out);                                             \
        const int64_t fixed_ = nt > 1 && !q_tiles_take(a, fmt, m) ? units_ * 3 / 4 : units_;   \
        int64_t lo_, hi_;                                                                      \
        team_range(fixed_, tid, nt, &lo_, &hi_);                                               \
        q_groups_##S(out, a, w, fmt, bias, m, n_out, lo_, hi_);                                \
        if (fixed_ < units_) {                                                                 \
            const int64_t q_ = units_ - fixed_;                                                \
            team_phase(tm, tid, *phase);                                                       \
            for (int64_t t_ = team_take(tm, *phase), g_;                                       \
                 (g_ = team_q_start(fixed_, q_, t_, nt)) < units_; t_ = team_take(tm, *phase))  \
                q_groups_##S(out, a, w, fmt, bias, m, n_out, g_,                               \
                             team_q_start(fixed_, q_, t_ + 1, nt));                            \
            ++*phase;                                                                          \
        }                                                                                      \
    } while (0)

/* Thread tid's share of a Linear layer: out [m, n_out] = x [m, k] @ W^T (+ bias); a
 * quantized one reads x's rows as quantized into a (a->k = k), a bf16 one on the FMA
 * kernel reads them widened into wide (rows k apart). */
INLINE void team_linear_f32(float *out, const float *x, int64_t x_stride, const void *w,
                            int32_t fmt, const float *bias, int64_t m, int64_t n_out, int64_t k,
                            const struct qrows *a, const float *wide, int tid, int nt,
                            struct team *tm, int *phase) {
    int64_t lo, hi;
    (void)wide;
    if (fmt_quantized(fmt)) {
        TEAM_Q_GROUPS(f32);
        return;
    }
#if defined(HAVE_LF_LINEAR)
    team_range((n_out + LF_TILE - 1) / LF_TILE, tid, nt, &lo, &hi);
    linear_f32_tiles(out, x, x_stride, w, fmt == FMT_BF16_STORED, bias, m, n_out, k, lo, hi);
#else
    (void)out, (void)x, (void)x_stride, (void)w, (void)bias, (void)m, (void)n_out, (void)k;
    (void)lo, (void)hi;
    abort(); /* unreachable: decoder_team_ok refuses float layers without the kernel */
#endif
}
INLINE void team_linear_bf16(bf16 *out, const bf16 *x, int64_t x_stride, const void *w,
                             int32_t fmt, const bf16 *bias, int64_t m, int64_t n_out, int64_t k,
                             const struct qrows *a, const float *wide, int tid, int nt,
                             struct team *tm, int *phase) {
    int64_t lo, hi;
    if (fmt_quantized(fmt)) {
        TEAM_Q_GROUPS(bf16);
        return;
    }
#if defined(HAVE_DP_LINEAR)
    if (bf16_linear_mode == BF16_LINEAR_DP) {
        team_range((n_out + LINEAR_TILE - 1) / LINEAR_TILE, tid, nt, &lo, &hi);
        dp_tiles_bf16(out, x, x_stride, w, bias, m, n_out, k, lo, hi);
        return;
    }
#endif
#if defined(HAVE_LF_LINEAR)
    if (bf16_linear_mode == BF16_LINEAR_FMA) {
        team_range((n_out + LF_TILE - 1) / LF_TILE, tid, nt, &lo, &hi);
        lf_tiles_w16_bf16x(out, wide, k, w, bias, m, n_out, k, lo, hi);
        return;
    }
#endif
    (void)out, (void)x, (void)x_stride, (void)w, (void)bias, (void)m, (void)n_out, (void)k;
    (void)wide, (void)lo, (void)hi;
    abort(); /* unreachable: decoder_team_ok refuses float layers without a team form */
}

/* Whether the Linear of format fmt next reads x's rows prepared (quantized, widened),
 * and rows [r0, r1) of x prepared for it, k inputs (a->k set for it on every thread). */
INLINE int team_prepares_f32(int32_t fmt) { return fmt_quantized(fmt); }
INLINE int team_prepares_bf16(int32_t fmt) { return fmt_quantized(fmt) || team_widens_bf16(); }
INLINE void team_prepare_f32(struct qrows *a, float *wide, int32_t fmt, const float *x,
                             int64_t k, int64_t m, int64_t r0, int64_t r1) {
    (void)wide;
    if (!fmt_quantized(fmt)) return;
    a->k = k, a->nb = k / QK;
    q_team_quantize_f32(a, x, k, fmt, m, r0, r1);
}
INLINE void team_prepare_bf16(struct qrows *a, float *wide, int32_t fmt, const bf16 *x,
                              int64_t k, int64_t m, int64_t r0, int64_t r1) {
    if (fmt_quantized(fmt)) {
        a->k = k, a->nb = k / QK;
        q_team_quantize_bf16(a, x, k, fmt, m, r0, r1);
    } else if (team_widens_bf16()) {
        widen_rows_bf16(wide, x, k, k, r0, r1); /* as specserve_linear_bf16 does */
    }
}

/* What the team's buffers must hold for a Linear of format fmt, [n_out, k], run on m rows
 * (prepares: team_prepares_S(fmt)): *wide_k the widest input a float one widens, *kmax
 * the widest a quantized one reads, *reads what the quantized ones read of the rows
 * (qrows_alloc). 3 when a quantized format does not fit [n_out, k], else 0. */
INLINE int team_needs(int32_t fmt, int prepares, int64_t n_out, int64_t k, int64_t m,
                      int32_t bf16_rule, int64_t *wide_k, int64_t *kmax, int *reads) {
    if (!fmt_quantized(fmt)) {
        if (prepares && k > *wide_k) *wide_k = k;
        return 0;
    }
    if (specserve_quant_packed_bytes(fmt, n_out, k) < 0) return 3;
    *reads |= q_bf16_at(bf16_rule, fmt, m) ? QROWS_BF16 : QROWS_INT8;
    if (k > *kmax) *kmax = k;
    return 0;
}

/* T: the activations' type (S its suffix), KT the KV cache's; V the attention's. */
#define DECODER_TEAM(T, S, KT, V, NAME, NORM_FN, ROPE_FN, KV_FN, SILU_FN)                      \
    static int NAME(DECODER_PARAMS(T)) {                                                       \
        const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;        \
        const int64_t qkv_size = q_size + 2 * kv_size, h = hidden_size;                        \
        const int64_t num_slots = num_cache_blocks * block_size;                               \
        for (int64_t i = 0; i < n; i++)                                                        \
            if (positions[i] < 0 || positions[i] >= num_positions) return 1;                   \
        for (int64_t i = 0; i < n; i++)                                                        \
            if (slots[i] >= num_slots) return 2;                                               \
        int64_t kmax = 0, wide_k = 0;                                                          \
        const int32_t bf16_rule = q_bf16_rule(); /* read once: the step follows one rule */   \
        int reads = 0; /* what the quantized layers read of the rows (qrows_alloc) */          \
        for (int64_t l = 0; l < num_layers; l++) {                                             \
            const struct specserve_layer *w = &layers[l];                                      \
            const int32_t fmts[4] = {w->qkv_fmt, w->o_fmt, w->gate_up_fmt, w->down_fmt};      \
            const int64_t outs[4] = {qkv_size, h, 2 * inter, h}, ins[4] = {h, q_size, h, inter}; \
            for (int i = 0; i < 4; i++)                                                        \
                if (team_needs(fmts[i], team_prepares_##S(fmts[i]), outs[i], ins[i], n,        \
                               bf16_rule, &wide_k, &kmax, &reads))                             \
                    return 3;                                                                  \
        }                                                                                      \
        const int64_t hr = head != NULL ? head->num_rows : 0; /* rows the head runs */       \
        if (hr > 0 && team_needs(head->fmt, team_prepares_##S(head->fmt), head->vocab, h, hr,  \
                                 bf16_rule, &wide_k, &kmax, &reads))                           \
            return 3;                                                                          \
        const struct attn_args args = {                                                        \
            attn, q_size, qkv, qkv_size, NULL, NULL, block_tables, block_table_stride,         \
            table_width, seq_lens, query_start_loc, num_seqs, n, seq_ids, num_selected,        \
            num_heads, num_kv_heads, head_dim, block_size, num_cache_blocks, scale, max_rows,  \
            tree_masks};                                                                       \
        struct attn_plan plan;                                                                 \
        const int status = attn_plan_make(&plan, &args, num_threads, !dot_chunks_##V(head_dim)); \
        if (status) return 10 + status;                                                        \
        struct qrows qa;                                                                       \
        memset(&qa, 0, sizeof qa);                                                             \
        float *wide = NULL;                                                                    \
        if (kmax > 0 && qrows_alloc(&qa, n, kmax, reads, bf16_rule)) { /* frees what it took */\
            attn_plan_free(&plan);                                                             \
            return 3;                                                                          \
        }                                                                                      \
        qa.team_amx_q8 = (uint8_t)q_amx_takes(QFMT_Q8_0, n);                                   \
        qa.team_amx_q4 = (uint8_t)q_amx_takes(QFMT_Q4_0, n);                                   \
        if (wide_k > 0 && (wide = malloc(sizeof(float) * (size_t)(n * wide_k))) == NULL) {    \
            qrows_free(&qa);                                                                   \
            attn_plan_free(&plan);                                                             \
            return 3;                                                                          \
        }                                                                                      \
        const int need_qf = !(sizeof(T) == sizeof(float) && sizeof(KT) == sizeof(float));      \
        struct team tm;                                                                        \
        memset(&tm, 0, sizeof tm);                                                             \
        int failed = 0;                                                                        \
        _Pragma("omp parallel num_threads(num_threads)") {                                     \
            const int tid = omp_get_thread_num(), nt = omp_get_num_threads();                  \
            struct attn_scratch scratch;                                                       \
            if (attn_scratch_alloc(&scratch, &args, need_qf, sizeof(KT)))                      \
                __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);                                \
            team_barrier(&tm, nt);                                                             \
            if (!__atomic_load_n(&failed, __ATOMIC_RELAXED)) {                                 \
                struct attn_args la = args; /* this thread's, the layer's caches in it */     \
                struct qrows a = qa;        /* this thread's, its k the next Linear's */      \
                int64_t r0, r1;                                                                \
                team_range(n, tid, nt, &r0, &r1);                                              \
                const int64_t nr = r1 - r0;                                                    \
                int phase = 0;                                                                 \
                for (int64_t l = 0; l < num_layers; l++) {                                     \
                    const struct specserve_layer *w = &layers[l];                              \
                    if (l == 0 && !continue_residual) {                                        \
                        memcpy(residual + r0 * h, hidden + r0 * h,                             \
                               sizeof(T) * (size_t)(nr * h));                                  \
                        NORM_FN(normed + r0 * h, hidden + r0 * h, NULL,                        \
                                (const T *)w->input_norm, nr, h, eps, 1);                      \
                    } else {                                                                   \
                        NORM_FN(normed + r0 * h, hidden + r0 * h, residual + r0 * h,           \
                                (const T *)w->input_norm, nr, h, eps, 1);                      \
                    }                                                                          \
                    team_prepare_##S(&a, wide, w->qkv_fmt, normed, h, n, r0, r1);              \
                    team_barrier(&tm, nt);                                                     \
                    team_linear_##S(qkv, normed, h, w->qkv, w->qkv_fmt, (const T *)w->qkv_bias, \
                                    n, qkv_size, h, &a, wide, tid, nt, &tm, &phase);               \
                    team_barrier(&tm, nt);                                                     \
                    ROPE_FN(qkv + r0 * qkv_size, qkv_size, nr, positions + r0, cos_sin,        \
                            num_positions, num_heads + num_kv_heads, head_dim, 1);             \
                    team_barrier(&tm, nt);                                                     \
                    /* in row order on one thread: rows sharing a slot leave the last one's */ \
                    if (tid == 0)                                                              \
                        KV_FN(qkv + q_size, qkv_size, qkv + q_size + kv_size, qkv_size, n,     \
                              kv_size, (KT *)w->k_cache, (KT *)w->v_cache, slots, num_slots);  \
                    team_barrier(&tm, nt);                                                     \
                    la.k_cache = w->k_cache, la.v_cache = w->v_cache;                          \
                    team_phase(&tm, tid, phase);                                               \
                    attn_items_##V(&la, &plan, &scratch, team_counter(&tm, phase), NULL);      \
                    phase++;                                                                   \
                    team_barrier(&tm, nt);                                                     \
                    if (plan.partials) {                                                       \
                        team_phase(&tm, tid, phase);                                           \
                        for (int64_t it = team_take(&tm, phase);                               \
                             it < plan.num_tiles * num_kv_heads; it = team_take(&tm, phase))   \
                            attn_merge_##V(&la, &plan, &scratch, it);                          \
                        phase++;                                                               \
                        team_barrier(&tm, nt);                                                 \
                    }                                                                          \
                    if (team_prepares_##S(w->o_fmt)) {                                         \
                        team_prepare_##S(&a, wide, w->o_fmt, attn, q_size, n, r0, r1);         \
                        team_barrier(&tm, nt);                                                 \
                    }                                                                          \
                    team_linear_##S(hidden, attn, q_size, w->o, w->o_fmt, NULL, n, h, q_size,  \
                                    &a, wide, tid, nt, &tm, &phase);                               \
                    team_barrier(&tm, nt);                                                     \
                    NORM_FN(normed + r0 * h, hidden + r0 * h, residual + r0 * h,               \
                            (const T *)w->post_norm, nr, h, eps, 1);                           \
                    team_prepare_##S(&a, wide, w->gate_up_fmt, normed, h, n, r0, r1);          \
                    team_barrier(&tm, nt);                                                     \
                    team_linear_##S(gate_up, normed, h, w->gate_up, w->gate_up_fmt, NULL, n,   \
                                    2 * inter, h, &a, wide, tid, nt, &tm, &phase);                 \
                    team_barrier(&tm, nt);                                                     \
                    SILU_FN(act + r0 * inter, gate_up + r0 * 2 * inter, nr, inter, 1);         \
                    team_prepare_##S(&a, wide, w->down_fmt, act, inter, n, r0, r1);            \
                    team_barrier(&tm, nt);                                                     \
                    team_linear_##S(hidden, act, inter, w->down, w->down_fmt, NULL, n, h,      \
                                    inter, &a, wide, tid, nt, &tm, &phase);                        \
                    team_barrier(&tm, nt);                                                     \
                }                                                                              \
                if (hr > 0) { /* the final norm of the head's rows, then the head */           \
                    T *hn = (T *)head->normed;                                                 \
                    int64_t j0, j1;                                                            \
                    team_range(hr, tid, nt, &j0, &j1);                                         \
                    for (int64_t j = j0; j < j1; j++) {                                        \
                        const int64_t i = head->rows != NULL ? head->rows[j] : j;              \
                        NORM_FN(hn + j * h, hidden + i * h, residual + i * h,                  \
                                (const T *)head->norm, 1, h, eps, 1);                          \
                    }                                                                          \
                    team_prepare_##S(&a, wide, head->fmt, hn, h, hr, j0, j1);                  \
                    team_barrier(&tm, nt);                                                     \
                    team_linear_##S((T *)head->logits, hn, h, head->weight, head->fmt, NULL,   \
                                    hr, head->vocab, h, &a, wide, tid, nt, &tm, &phase);       \
                    if (head->logits_f32 != NULL) {                                            \
                        team_barrier(&tm, nt);                                                 \
                        team_range(hr * head->vocab, tid, nt, &j0, &j1);                       \
                        head_widen(head, j0, j1);                                              \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
            attn_scratch_free(&scratch);                                                       \
        }                                                                                      \
        free(wide);                                                                            \
        qrows_free(&qa);                                                                       \
        attn_plan_free(&plan);                                                                 \
        __atomic_fetch_add(&decoder_team_calls, 1, __ATOMIC_RELAXED);                          \
        return failed ? 11 : 0;                                                                \
    }
DECODER_TEAM(float, f32, float, f32, decoder_team_f32, specserve_rms_norm, specserve_rope,
             specserve_write_kv, specserve_silu_and_mul)
DECODER_TEAM(float, f32, bf16, f32_bf16kv, decoder_team_f32_bf16kv, specserve_rms_norm,
             specserve_rope, specserve_write_kv_f32_bf16kv, specserve_silu_and_mul)
DECODER_TEAM(bf16, bf16, bf16, bf16, decoder_team_bf16, specserve_rms_norm_bf16,
             specserve_rope_bf16, specserve_write_kv_bf16, specserve_silu_and_mul_bf16)
#define DECODER_DISPATCH(S, TEAM)                                                              \
    if (decoder_team_ok(layers, num_layers, n, head, num_threads, team_float_ok_##S()))        \
        return TEAM(DECODER_ARGS);

/* hidden [n, hidden_size]: the embeddings in, the last layer's MLP output out;
 * residual [n, hidden_size]: the residual stream before that output, out (the final
 * norm adds them). Scratch: normed [n, hidden_size], qkv [n, q + 2 kv], attn [n, q],
 * gate_up [n, 2 inter], act [n, inter]. The attention arguments are paged attention's
 * (tree_masks too); head, where not NULL, the final norm and LM head run after the
 * last layer (struct specserve_head). Returns 0; 1 when a position is outside the
 * rotary table, 2 when a slot is past the cache, 3 when a quantized Linear runs out of
 * memory, 4 when the head's rows are out of order or range, or it asks a float32 model
 * for logits_f32 (checked before anything runs), 10 + paged attention's status
 * otherwise (the layers before the failing call have run). With
 * continue_residual, hidden and residual come in as a previous call left them (the
 * layers before these ones): a model run in several calls computes exactly what one
 * call does. */
#define DECODER_LAYERS(T, S, KT, NAME, NORM_FN, ROPE_FN, KV_FN, ATTN_FN, SILU_FN, DISPATCH)        \
    int NAME(DECODER_PARAMS(T)) {                                                                  \
        const int head_status = head_check(head, n, sizeof(T) == 2);                               \
        if (head_status) return head_status;                                                       \
        DISPATCH                                                                                   \
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
        if (head != NULL && head->num_rows > 0) {                                                  \
            T *hn = (T *)head->normed;                                                             \
            if (head->rows == NULL) {                                                              \
                NORM_FN(hn, hidden, residual, (const T *)head->norm, head->num_rows, hidden_size,  \
                        eps, num_threads);                                                         \
            } else {                                                                               \
                for (int64_t j = 0; j < head->num_rows; j++) {                                     \
                    const int64_t i = head->rows[j];                                               \
                    NORM_FN(hn + j * hidden_size, hidden + i * hidden_size,                        \
                            residual + i * hidden_size, (const T *)head->norm, 1, hidden_size,     \
                            eps, 1);                                                               \
                }                                                                                  \
            }                                                                                      \
            if (decoder_linear_##S((T *)head->logits, hn, hidden_size, head->weight, head->fmt,    \
                                   NULL, head->num_rows, head->vocab, hidden_size, num_threads))   \
                return 3;                                                                          \
            if (head->logits_f32 != NULL) head_widen(head, 0, head->num_rows * head->vocab);       \
        }                                                                                          \
        return 0;                                                                                  \
    }
DECODER_LAYERS(bf16, bf16, bf16, specserve_decoder_layers_bf16, specserve_rms_norm_bf16,
               specserve_rope_bf16, specserve_write_kv_bf16, specserve_paged_attention_bf16,
               specserve_silu_and_mul_bf16, DECODER_DISPATCH(bf16, decoder_team_bf16))
DECODER_LAYERS(float, f32, float, specserve_decoder_layers, specserve_rms_norm, specserve_rope,
               specserve_write_kv, specserve_paged_attention, specserve_silu_and_mul,
               DECODER_DISPATCH(f32, decoder_team_f32))
/* a float32 model over a bf16 KV cache (--kv-cache-dtype bfloat16) */
DECODER_LAYERS(float, f32, bf16, specserve_decoder_layers_f32_bf16kv, specserve_rms_norm,
               specserve_rope, specserve_write_kv_f32_bf16kv,
               specserve_paged_attention_f32_bf16kv, specserve_silu_and_mul,
               DECODER_DISPATCH(f32, decoder_team_f32_bf16kv))
