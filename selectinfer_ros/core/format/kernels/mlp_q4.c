/* The MLP over 4-bit neuron records: the active prefix (mlp_rows_q4) and per-token selection
   (mlp_step_q4_token). Part of kernel.c. */
/* The MLP over 4-bit records: gate and up rows of the active records (split by neuron; a
   record is read once for every row), a = act(gate) * up, then the down columns of the same
   records (split by blocks of H), row by row. */
/* Records fetched ahead of the one read (mlp_rows_q4), every line of each, into L2 (prefetcht1):
   the hardware prefetchers do not follow the records (gate and up rows, their heads at the end,
   the down column after the group), and a record's 40 lines fetched into L1 (prefetcht0) fill
   its miss buffers. Qwen2.5 1.5B, 0.7 / 0.5, one thread, Zen 4: the MLP of a decode token 61 ms
   with no fetch, 41 ms with 2 records into L1, 20-25 ms with 2-8 into L2. */
#ifndef PF_RECORDS
#define PF_RECORDS 4
#endif

/* A row's (r: its scratch) partial down sums of thread u over 4-bit records: for thread 0 h
   (free once the MLP's input is quantized), or q in a tiered layer (whose int8 tier writes h),
   part for the others. */
static inline float *q4_part(const si_model *r, int u, int tiered) {
    return u == 0 ? (tiered ? r->q : r->h) : r->part + (u - 1) * r->max_k;
}

/* y[0, H) += the down product of list entries [n0, n0 + G) (one coefficient group of a list
   of k) of 4-bit records: activations a[n0 ..], records idx[n0 ..] (idx NULL: records n0 ..);
   pf: fetch the next group's columns meanwhile (gathered rows), else they are near already. */
static void down_q4_group(const si_layer *L, int64_t H, const float *a, const int32_t *idx,
                          int64_t n0, int64_t G, int64_t k, float *y, int pf) {
    const int64_t nb = H / QK, RL = L->rec_ld;
    const uint8_t *hd = L->rec + 3 * H / 2 + 2 * q4_head_bytes(H); /* record 0's down heads */
    int16_t cq[DG * DB];
    float s[DB], kb[DB];
    int32_t cs[DB];
    const uint8_t *wr[DG];
    for (int64_t i = 0; i < G; i++) wr[i] = L->rec + (idx ? idx[n0 + i] : n0 + i) * RL + H;
    for (int64_t bc = 0; bc < nb; bc += DB) {
        int64_t nbc = nb - bc < DB ? nb - bc : DB;
        down_coeffs(a, hd, RL, idx, n0, G, bc, nbc, cq, s, cs, kb, NULL);
        axpy_q4_group(wr, G, cq, s, cs, kb, bc, nbc, y, pf ? L->rec + H : NULL, hd, RL, RL, idx,
                      n0, k);
    }
}

/* The partial down sums of threads 1 .. nt - 1 (and thread 0's in q, tiered) added into h (row
   scratch r), a share of the blocks of H each: every path and row sums a layer's groups in the
   same order. */
static void add_q4_parts(const si_model *r, int64_t H, int tiered, int t, int nt) {
    int64_t j0, j1;
    share(H / QK, t, nt, &j0, &j1);
    for (int u = tiered ? 0 : 1; u < nt; u++) {
        const float *p = q4_part(r, u, tiered);
        for (int64_t j = j0 * QK; j < j1 * QK; j++) r->h[j] += p[j];
    }
}

/* Thread t's partial down sums of the B rows cleared, and each row's mask (NULL: none) in mks. */
static void start_parts(const si_model *m, const si_model *R, const si_layer *L, int64_t B,
                        int tiered, int t, const float **mks) {
    for (int64_t b = 0; b < B; b++) {
        memset(q4_part(&R[b], t, tiered), 0, (size_t)m->hidden * sizeof(float));
        mks[b] = rec_row_mask(m, L, b);
    }
}

/* The active records rec[:rec_active] for the B rows of a batch (their input quantized in R[b]),
   into each row's partial sums (q4_part); no barrier. One pass over the records, in memory
   order: each thread takes whole groups of DG neurons (the down product's coefficient groups),
   reads a group's gate and up rows, then its down columns while they are in the cache, and sums
   its groups' down products into its own partial sums. */
static void records_q4(const si_model *m, const si_model *R, const si_layer *L, int64_t B,
                       int tiered, int t, int nt) {
    int64_t H = m->hidden, k = L->rec_active, nb = H / QK, RL = L->rec_ld, hb = q4_head_bytes(H);
    int64_t g0, g1;
    share((k + DG - 1) / DG, t, nt, &g0, &g1);
    const float *mks[SI_MAX_BATCH]; /* each row's mask (NULL: none) */
    start_parts(m, R, L, B, tiered, t, mks);
    for (int64_t g = g0; g < g1; g++) {
        int64_t n0 = g * DG, G = k - n0 < DG ? k - n0 : DG;
        for (int64_t n = n0; n < n0 + G; n++) {
            const uint8_t *r = L->rec + n * RL;
            const uint8_t *d = r + 3 * H / 2; /* gate's heads, then up's */
            if (n + PF_RECORDS < k) /* a whole record a few ahead, into L2 (see PF_RECORDS) */
                for (int64_t o = 0; o < RL; o += 64)
                    __builtin_prefetch(r + PF_RECORDS * RL + o, 0, 2);
            for (int64_t b = 0; b < B; b++) {
                const si_model *rb = &R[b];
                const float *mk = mks[b];
                float gv, uv;
                if (mk && mk[n] == 0.0f) { /* another row's neuron: not computed for this one */
                    rb->a[n] = 0.0f;
                    continue;
                }
                q4_row(r, d, nb, rb->xq, rb->xd, rb->xs, &gv);
                q4_row(r + H / 2, d + hb, nb, rb->xq, rb->xd, rb->xs, &uv);
                rb->a[n] = act(gv, m->act) * uv;
            }
        }
        for (int64_t b = 0; b < B; b++)
            down_q4_group(L, H, R[b].a, NULL, n0, G, k, q4_part(&R[b], t, tiered), 0);
    }
}

/* records_q4 over slots held in groups (si_layer.rec_grouped, rows_q4g.c): each thread takes
   whole groups, reads a group's gate and up rows (16 slots at a time), then its down columns,
   one stream; a row's masked slots and those past the active prefix take activation 0. */
static void groups_q4(const si_model *m, const si_model *R, const si_layer *L, int64_t B,
                      int tiered, int t, int nt) {
    int64_t H = m->hidden, k = L->rec_active, gb = q4g_bytes(H);
    int64_t g0, g1;
    share((k + GS - 1) / GS, t, nt, &g0, &g1);
    const float *mks[SI_MAX_BATCH]; /* each row's mask (NULL: none) */
    start_parts(m, R, L, B, tiered, t, mks);
    for (int64_t g = g0; g < g1; g++) {
        int64_t n0 = g * GS, G = k - n0 < GS ? k - n0 : GS;
        const uint8_t *blk = L->rec + g * gb;
        si_pf pf = {blk + gb, g + 1 < g1 ? blk + 2 * gb : blk + gb}; /* the next group, meanwhile */
        for (int64_t b = 0; b < B; b++) {
            const si_model *rb = &R[b];
            const float *mk = mks[b];
            float gv[GS], uv[GS], *a = rb->a + n0;
            q4g_gate_up(blk, H, G, rb->xq, rb->xd, rb->xs, gv, uv, &pf);
            for (int64_t i = 0; i < G; i++)
                a[i] = mk && mk[n0 + i] == 0.0f ? 0.0f : act(gv[i], m->act) * uv[i];
            down_q4g(blk, H, a, G, q4_part(rb, t, tiered), &pf);
        }
    }
}

/* One layer's MLP over the active 4-bit records for the B rows of a batch. */
static void mlp_rows_q4(const si_model *m, const si_model *R, const si_layer *L, float *x,
                        int64_t B, int t, int nt) {
    mlp_input_rows(m, R, L, x, B, t, nt);
    (L->rec_grouped ? groups_q4 : records_q4)(m, R, L, B, 0, t, nt);
    barrier();
    for (int64_t b = 0; b < B; b++) add_q4_parts(&R[b], m->hidden, 0, t, nt);
    barrier();
    mlp_residual(m, R, L, x, B, t, nt);
}

/* Per-token selection over 4-bit records rec[:rec_active], its input quantized: gate and up rows
   as records_q4 reads them (up for the candidates only), the down product over the kept list,
   read in place, into the partial sums (q4_part). Returns the neurons kept; *cand: the
   candidates. Ends with a barrier. */
static int64_t token_q4(const si_model *m, const si_layer *L, int tiered, int64_t *cand, int t,
                        int nt) {
    int64_t H = m->hidden, k = L->rec_active, nb = H / QK, R = L->rec_ld, hb = q4_head_bytes(H);
    int64_t n0, n1, c = 0, nc = 0; /* kept, candidates */
    share(k, t, nt, &n0, &n1);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *r = L->rec + n * R;
        const uint8_t *d = r + 3 * H / 2; /* gate's heads, then up's */
        if (n + PF_RECORDS < n1) { /* a record's gate and up rows and their heads a few
                                      ahead, into L2 (see PF_RECORDS; most records are
                                      candidates, whose up row is read) */
            const uint8_t *ahead = r + PF_RECORDS * R;
            for (int64_t o = 0; o < H; o += 64) __builtin_prefetch(ahead + o, 0, 2);
            for (int64_t o = 0; o < 2 * hb; o += 64) __builtin_prefetch(ahead + 3 * H / 2 + o, 0, 2);
        }
        float g, u;
        q4_row(r, d, nb, m->xq, m->xd, m->xs, &g);
        g = act(g, m->act);
        if (!(fabsf(g) >= L->gate_thr)) continue;
        nc++;
        q4_row(r + H / 2, d + hb, nb, m->xq, m->xd, m->xs, &u);
        float a = g * u;
        if (!(fabsf(a) >= L->act_thr)) continue;
        m->idx[n0 + c] = (int32_t)n;
        m->a[n0 + c] = a;
        c++;
    }
    m->cnt[t] = c;
    m->cand[t] = nc;
    barrier();
    int64_t kept = compact_kept(m, n0, t, nt);
    *cand = sum_candidates(m, nt);
    barrier();
    int64_t g0, g1; /* the kept list's groups, summed as records_q4 sums the active prefix's */
    share((kept + DG - 1) / DG, t, nt, &g0, &g1);
    float *y = q4_part(m, t, tiered);
    memset(y, 0, (size_t)H * sizeof(float));
    for (int64_t g = g0; g < g1; g++)
        down_q4_group(L, H, m->gu, m->idx + m->max_k, g * DG,
                      kept - g * DG < DG ? kept - g * DG : DG, kept, y, 1);
    barrier();
    return kept;
}

/* The MLP with per-token selection over 4-bit records, one row (token_q4). */
static void mlp_step_q4_token(const si_model *m, const si_layer *L, float *x, int t, int nt) {
    mlp_input_row(m, L, x, t, nt);
    int64_t cand, kept = token_q4(m, L, 0, &cand, t, nt);
    add_q4_parts(m, m->hidden, 0, t, nt);
    barrier();
    mlp_token_end(m, L, x, kept, cand, t);
}
