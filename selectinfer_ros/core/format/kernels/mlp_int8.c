/* The MLP over int8 neuron slots: the active prefix (mlp_rows) and per-token selection
   (mlp_step_token). Part of kernel.c. */
/* The gate and up rows of the active prefix for the B rows of a batch (their input quantized in
   R[b]): gu [2k] per row; no barrier. */
static void gate_up_int8(const si_model *m, const si_model *R, const si_layer *L, int64_t B,
                         int t, int nt) {
    int64_t H = m->hidden, k = L->n_active, K = m->max_k;
    si_mat gum = {L->gu, L->gu_scale, 2 * k, H, L->tiled ? (H + QK - 1) / QK : H, NULL, 0, NULL,
                  L->tiled};
    gemv_rows(&gum, R, B, m->h, K, m->gu, 2 * K, t, nt);
}

/* After gate_up_int8 and a barrier: the activations, quantized, then the down product into each
   row's h; no barrier at the end. Rows that compute different neurons of the prefix
   (si_layer.mask) zero the others' activations before the down product: their blocks quantize
   only their own values. */
static void down_int8(const si_model *m, const si_model *R, const si_layer *L, int64_t B, int t,
                      int nt) {
    int64_t H = m->hidden, k = L->n_active, K = m->max_k;
    /* activations and their quantization, by pairs of blocks: a member's pairs are its own */
    int64_t nbk = (k + QK - 1) / QK, np = (k / QK + 1) / 2, p0, p1;
    share((nbk + 1) / 2, t, nt, &p0, &p1);
    int64_t b0 = 2 * p0, b1 = 2 * p1 < nbk ? 2 * p1 : nbk;
    for (int64_t b = 0; b < B; b++) {
        const si_model *r = &R[b];
        const float *mk = row_mask(m, L, b);
        for (int64_t n = b0 * QK; n < b1 * QK && n < k; n++)
            r->a[n] = act(r->gu[2 * n], m->act) * r->gu[2 * n + 1] * L->down_scale[n];
        if (mk)
            for (int64_t n = b0 * QK; n < b1 * QK && n < k; n++) r->a[n] *= mk[n];
        quantize_blocks(r->a, k, b0, b1, r->xq, r->xd, r->xs);
#ifdef SI_PREP
        if (r->prep) prep_pairs(r->xq, r->xd, k / QK, p0, p1 < np ? p1 : np, r->prep);
#endif
    }
    (void)np;
    barrier();
    si_mat dm = {L->down, NULL, H, k, L->tiled ? (L->down_ld + QK - 1) / QK : L->down_ld, NULL, 0,
                 NULL, L->tiled};
    gemv_rows(&dm, R, B, m->a, K, m->h, K, t, nt);
}

/* One layer's MLP over the active prefix of int8 slots for the B rows of a batch, run by every
   member; same barriers as above. */
static void mlp_rows(const si_model *m, const si_model *R, const si_layer *L, float *x,
                     int64_t B, int t, int nt) {
    mlp_input_rows(m, R, L, x, B, t, nt);
    gate_up_int8(m, R, L, B, t, nt);
    barrier();
    down_int8(m, R, L, B, t, nt);
    barrier();
    mlp_residual(m, R, L, x, B, t, nt);
}

#define GATHER_AHEAD 8 /* rows of a token's selection fetched ahead (far_prefetch) */

/* The len bytes at r into the outer caches (prefetcht2 on x86). The rows a token's selection
   reads (up rows of the candidates, down rows of the kept) are short streams at scattered
   places, which the hardware prefetchers follow only after their first misses: fetched whole
   GATHER_AHEAD rows ahead, a random half of Qwen2.5 1.5B's down rows (1.5 KB each) read at
   15-17 GB/s, 8-9 GB/s with the nearer fetch of the dense products (Zen 4, one thread; a stream
   of the same bytes: 25-28 GB/s): reading half of the rows so costs about as much as reading all
   of them as one stream. */
static inline void far_prefetch(const int8_t *r, int64_t len) {
    for (int64_t o = 0; o < len; o += 64) __builtin_prefetch(r + o, 0, 1);
    __builtin_prefetch(r + len - 1, 0, 1); /* a slice need not start on a cache line */
}

/* y [i0, i1) = sum over the list j < k of v[j] * down row idx[j] (int8, row stride ld), in
   float: four rows at a time with y's range (in L1) the inner loop, each row's slice read as one
   short stream. */
static void down_rows_part(const int8_t *down, int64_t ld, const int32_t *idx, const float *v,
                           int64_t k, float *y, int64_t i0, int64_t i1) {
    int64_t len = i1 - i0;
    float *restrict yo = y + i0;
    for (int64_t i = 0; i < len; i++) yo[i] = 0.0f;
    if (len <= 0) return;
    int64_t j = 0;
    for (; j + 4 <= k; j += 4) {
        for (int64_t p = j + GATHER_AHEAD; p < j + GATHER_AHEAD + 4 && p < k; p++)
            far_prefetch(down + idx[p] * ld + i0, len);
        const int8_t *restrict r0 = down + idx[j] * ld + i0;
        const int8_t *restrict r1 = down + idx[j + 1] * ld + i0;
        const int8_t *restrict r2 = down + idx[j + 2] * ld + i0;
        const int8_t *restrict r3 = down + idx[j + 3] * ld + i0;
        float v0 = v[j], v1 = v[j + 1], v2 = v[j + 2], v3 = v[j + 3];
        int64_t i = 0;
#if defined(SI_AVX512)
        const __m512 w0 = _mm512_set1_ps(v0), w1 = _mm512_set1_ps(v1), w2 = _mm512_set1_ps(v2),
                     w3 = _mm512_set1_ps(v3);
#define I8F(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
        for (; i + 16 <= len; i += 16) {
            __m512 acc = _mm512_fmadd_ps(I8F(r0 + i), w0, _mm512_loadu_ps(yo + i));
            acc = _mm512_fmadd_ps(I8F(r1 + i), w1, acc);
            acc = _mm512_fmadd_ps(I8F(r2 + i), w2, acc);
            _mm512_storeu_ps(yo + i, _mm512_fmadd_ps(I8F(r3 + i), w3, acc));
        }
#undef I8F
#elif defined(SI_AVX2)
        const __m256 w0 = _mm256_set1_ps(v0), w1 = _mm256_set1_ps(v1), w2 = _mm256_set1_ps(v2),
                     w3 = _mm256_set1_ps(v3);
#define I8F(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
        for (; i + 8 <= len; i += 8) {
            __m256 acc = _mm256_fmadd_ps(I8F(r0 + i), w0, _mm256_loadu_ps(yo + i));
            acc = _mm256_fmadd_ps(I8F(r1 + i), w1, acc);
            acc = _mm256_fmadd_ps(I8F(r2 + i), w2, acc);
            _mm256_storeu_ps(yo + i, _mm256_fmadd_ps(I8F(r3 + i), w3, acc));
        }
#undef I8F
#endif
        for (; i < len; i++)
            yo[i] += (v0 * (float)r0[i] + v1 * (float)r1[i]) + (v2 * (float)r2[i] + v3 * (float)r3[i]);
    }
    for (; j < k; j++) {
        const int8_t *restrict r = down + idx[j] * ld + i0;
        float vj = v[j];
        for (int64_t i = 0; i < len; i++) yo[i] += vj * (float)r[i];
    }
}

/* Per-token selection over int8 slots (gate rows [n_active, H] at gu, up rows [n_active, H] at
   up, down neuron-major [n_active, H] at row stride down_ld), its input quantized: each member
   runs the gate rows of its share of the slots as one stream, lists its candidates, reads their
   up rows where they lie and keeps its neurons; then the members split the down product by
   ranges of H (16 floats a unit), into h. Returns the neurons kept; *cand: the candidates. Ends
   with a barrier. */
static int64_t token_int8(const si_model *m, const si_layer *L, int64_t *cand, int t, int nt) {
    int64_t H = m->hidden, k = L->n_active, nfull = H / QK, from = nfull * QK;
    float *h = m->h, *g = m->gu + k; /* g [k]: the slots' gate values, then act(gate) */
    int64_t n0, n1, c = 0, nc = 0; /* kept, candidates */
    share(k, t, nt, &n0, &n1);
    rows_q(L->gu, H, H, L->gu_scale, m->xq, m->xd, h, g, n0, n1);
    int32_t *list = m->idx + n0; /* the candidates, then (in place, c <= j) the kept */
    for (int64_t n = n0; n < n1; n++) {
        float gn = act(g[n], m->act);
        if (!(fabsf(gn) >= L->gate_thr)) continue;
        g[n] = gn;
        list[nc++] = (int32_t)n;
    }
    /* the up rows: of the candidates where they lie, or all of the share as one stream when
       the candidates are more than half of it (a gather of that many rows costs more) */
    int stream = 2 * nc > n1 - n0;
    float *ua = m->gu; /* stream: the up values [n0, n1) (free until the kept are compacted) */
    if (stream) rows_q(L->up, H, H, L->up_scale, m->xq, m->xd, h, ua, n0, n1);
    for (int64_t j = 0; j < nc; j++) {
        int64_t n = list[j];
        float u;
        if (stream) {
            u = ua[n];
        } else {
            if (j + GATHER_AHEAD < nc) far_prefetch(L->up + list[j + GATHER_AHEAD] * H, H);
            const int8_t *w = L->up + n * H;
            /* row stride: where the next candidate's row starts, for dot1's read-ahead */
            dot1(w, j + 1 < nc ? (list[j + 1] - n) * H : H, nfull, m->xq, m->xd, &u);
            if (from < H) u += tail(w, from, H, h);
            u *= L->up_scale[n];
        }
        float a = g[n] * u;
        if (!(fabsf(a) >= L->act_thr)) continue;
        list[c] = (int32_t)n;
        m->a[n0 + c] = a * L->down_scale[n];
        c++;
    }
    m->cnt[t] = c;
    m->cand[t] = nc;
    barrier();
    int64_t kept = compact_kept(m, n0, t, nt);
    *cand = sum_candidates(m, nt);
    barrier();
    int64_t c0, c1;
    share((H + 15) / 16, t, nt, &c0, &c1);
    down_rows_part(L->down, L->down_ld, m->idx + m->max_k, m->gu, kept, h, c0 * 16,
                   c1 * 16 < H ? c1 * 16 : H);
    barrier();
    return kept;
}

/* The MLP with per-token selection over int8 slots, one row (token_int8). */
static void mlp_step_token(const si_model *m, const si_layer *L, float *x, int t, int nt) {
    mlp_input_row(m, L, x, t, nt);
    int64_t cand, kept = token_int8(m, L, &cand, t, nt);
    mlp_token_end(m, L, x, kept, cand, t);
}
