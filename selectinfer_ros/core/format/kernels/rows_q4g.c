/* 4-bit neuron records held in groups of 32 slots (si_q4g_*): the prompt mode's MLP read as
   one stream. Part of kernel.c.

   A record (pack.q4_records) is per neuron: gate row, up row, down column (H / 2 bytes of
   nibbles each), then their heads. Read record by record, a decode token's MLP is many short
   streams: the gate and up rows of a group of 32 records, then their 32 down columns side by
   side, which the hardware prefetchers do not follow, and software fetches cap one core at
   ~17-18 GB/s (Zen 4). Here the 32 slots of a group are one block, read front to back:

     for half j = 0, 1 (slots 16 j .. 16 j + 15):
       gate rows, interleaved 16 at a time (rows_q4il.c: IL * H / 2 bytes), their heads as
       planes (il_head_bytes(H)), up rows the same
     down heads, slot by slot (q4_head_bytes(H) each, as in the record)
     down nibbles in the order the down product reads them: per pair P of sub-blocks of H,
       quad m (slots 4 m .. 4 m + 3), position p < 32, slot q of the quad: byte
       ((P * 8 + m) * 32 + p) * 4 + q holds slot 4 m + q's byte 32 P + p (one 32-bit lane
       per position holds the quad's four bytes: the dot-product instruction's operand as
       loaded, no unpacking)

   48 H + 4 il_head_bytes(H) + 32 q4_head_bytes(H) bytes a group: the records' bytes exactly
   (a last partial group padded with zero slots: d = 0, they compute 0). The gate and up products are il_group's (the same
   values as q4_row to float rounding); the down product is the records' (axpy_q4_quads: the
   same coefficients and integer sums, y the same to the bit). Slots are written and read
   whole (si_q4g_put, si_q4g_get: the record's bytes exactly).

   The stream alone does not keep the memory busy: a group's products alternate between reading
   (gate and up rows, down nibbles) and computing only (the down coefficients), and the hardware
   prefetchers, driven by the reads, idle in between (one Zen 4 core: 11-12 GB/s from memory,
   35 GB/s from L2). groups_q4 therefore fetches the next group through all three products, a
   few lines at each step (si_pf, pf_step; how many: si_tune, measured per CPU): 20-23 GB/s. */
#define GS 32 /* slots per group (the down product's coefficient group, DG) */

static inline int64_t q4g_il(int64_t H) { return IL * H / 2 + il_head_bytes(H); }

/* Bytes of one group over H columns, and the offsets of its parts. */
static inline int64_t q4g_bytes(int64_t H) {
    return 48 * H + 4 * il_head_bytes(H) + GS * q4_head_bytes(H);
}
static inline int64_t q4g_gate(int64_t H, int j) { return 2 * j * q4g_il(H); }
static inline int64_t q4g_up(int64_t H, int j) { return (2 * j + 1) * q4g_il(H); }
static inline int64_t q4g_dheads(int64_t H) { return 4 * q4g_il(H); }
static inline int64_t q4g_down(int64_t H) { return 4 * q4g_il(H) + GS * q4_head_bytes(H); }

/* Bytes of k slots in groups. */
int64_t si_q4g_bytes(int64_t k, int64_t H) { return (k + GS - 1) / GS * q4g_bytes(H); }

/* 1 where the groups beat the records on this path (x86 vector paths: il_group's; NEON and
   plain C keep the records). */
int si_q4g_pays(void) {
#if defined(SI_AVX2) || defined(SI_AVX512)
    return 1;
#else
    return 0;
#endif
}

/* Row r of an interleaved group of 16 (nibbles w, heads h, H columns) <-> its row layout
   (nibbles [H / 2], heads [q4_head_bytes(H)]); put: row -> group, else group -> row. */
static void il_row_io(uint8_t *w, uint8_t *h, int64_t H, int r, uint8_t *nib, uint8_t *head,
                      int put) {
    for (int64_t c = 0; c < H / 8; c++) { /* 4 bytes: row bytes 4c .. 4c + 3 */
        uint8_t *g = w + ((c / 8 * 8 + c % 8) * IL + r) * 4; /* pair c / 8, chunk c % 8 */
        if (put) memcpy(g, nib + 4 * c, 4);
        else memcpy(nib + 4 * c, g, 4);
    }
    for (int64_t s = 0; s < (H + Q4_SB - 1) / Q4_SB; s++) { /* d, dmin, the 12 planes */
        uint8_t *gh = h + s * IL_HEAD, *rh = head + s * Q4_HEAD;
        for (int b = 0; b < 2; b++) {
            uint8_t *at = gh + 2 * IL * b + 2 * r;
            if (put) memcpy(at, rh + 2 * b, 2);
            else memcpy(rh + 2 * b, at, 2);
        }
        for (int b = 0; b < 12; b++) {
            if (put) gh[4 * IL + b * IL + r] = rh[4 + b];
            else rh[4 + b] = gh[4 * IL + b * IL + r];
        }
    }
}

/* Slot i of the groups <-> a record rec [3 H / 2 + 3 q4_head_bytes(H)] (pack.q4_records). */
static void q4g_slot_io(uint8_t *blk, int64_t H, int64_t i, uint8_t *rec, int put) {
    const int64_t nib = H / 2, hb = q4_head_bytes(H);
    uint8_t *g = blk + i / GS * q4g_bytes(H);
    int s = (int)(i % GS), j = s / IL, r = s % IL;
    for (int row = 0; row < 2; row++) { /* gate, up */
        uint8_t *w = g + (row ? q4g_up(H, j) : q4g_gate(H, j));
        il_row_io(w, w + IL * H / 2, H, r, rec + row * nib, rec + 3 * nib + row * hb, put);
    }
    uint8_t *dh = g + q4g_dheads(H) + s * hb, *dn = g + q4g_down(H);
    if (put) memcpy(dh, rec + 3 * nib + 2 * hb, (size_t)hb);
    else memcpy(rec + 3 * nib + 2 * hb, dh, (size_t)hb);
    const int m = s / 4, q = s % 4;
    for (int64_t b = 0; b < nib; b++) {
        uint8_t *at = dn + (((b / 32) * 8 + m) * 32 + b % 32) * 4 + q;
        if (put) *at = rec[2 * nib + b];
        else rec[2 * nib + b] = *at;
    }
}

static int q4g_io(uint8_t *blk, int64_t k, int64_t H, const int64_t *ids, int64_t n,
                  uint8_t *recs, int put) {
    if (H % (2 * QK)) return -2;
    for (int64_t t = 0; t < n; t++)
        if (ids[t] < 0 || ids[t] >= k) return -1;
    const int64_t RL = 3 * H / 2 + 3 * q4_head_bytes(H);
    for (int64_t t = 0; t < n; t++) q4g_slot_io(blk, H, ids[t], recs + t * RL, put);
    return 0;
}

/* Slots ids[t] <- records recs [n, record bytes] (a load, a swap, a task switch). */
int si_q4g_put(uint8_t *blk, int64_t k, int64_t H, const int64_t *ids, int64_t n,
               const uint8_t *recs) {
    return q4g_io(blk, k, H, ids, n, (uint8_t *)recs, 1);
}

/* Records out [n, record bytes] <- slots ids[t]. */
int si_q4g_get(const uint8_t *blk, int64_t k, int64_t H, const int64_t *ids, int64_t n,
               uint8_t *out) {
    return q4g_io((uint8_t *)blk, k, H, ids, n, out, 0);
}

/* The gate and up values of a group's first G slots against one activation row (xq, xd, xs):
   gv[i], uv[i] (i < G; the other entries are left as they are). */
static void q4g_gate_up(const uint8_t *g, int64_t H, int64_t G, const int8_t *xq, const float *xd,
                        const int32_t *xs, float *gv, float *uv, si_pf *pf) {
    for (int j = 0; j * IL < G; j++) {
        const uint8_t *gw = g + q4g_gate(H, j), *uw = g + q4g_up(H, j);
        il_group(gw, gw + IL * H / 2, H, xq, xd, xs, gv + j * IL, pf);
        il_group(uw, uw + IL * H / 2, H, xq, xd, xs, uv + j * IL, pf);
    }
}

/* y[sub-blocks bc .. bc + nbc) += the group's down product (d: its down nibbles) with the
   coefficients of its first G slots (down_coeffs): axpy_q4_quads' sums, read in order. */
static void axpy_q4g(const uint8_t *d, int64_t G, const int16_t *cq, const float *s,
                     const int32_t *cs, const float *kb, int64_t bc, int64_t nbc, float *y,
                     si_pf *pf) {
    const int64_t nq = (G + 3) / 4;
#if defined(SI_AVX2) || defined(SI_AVX512)
    enum { NQ = GS / 4 };
    int32_t cw[NQ * DB]; /* quad m's coefficient word of sub-block bc + j at [m * DB + j] */
    quad_words(cq, G, nbc, cw);
#if defined(SI_AVX512)
    /* VNNI: the high nibbles where they lie (andnot: 16 q), their sums less 16 x 8 cs times
       s / 16: the same floats (powers of 2 scale exactly) for one instruction less a load. */
#if defined(SI_VNNI512)
    const int hs = 16;
#else
    const int hs = 1;
#endif
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = bc; b < bc + nbc; b += 2) { /* sub-blocks b (low nibbles), b + 1 (high) */
        __m512i lo0 = _mm512_setzero_si512(), lo1 = lo0, hi0 = lo0, hi1 = lo0;
        const uint8_t *wp = d + (b / 2) * (GS / 4) * 128;
        for (int64_t m = 0; m < nq; m++) {
            __m512i A = _mm512_loadu_si512(wp + m * 128), B = _mm512_loadu_si512(wp + m * 128 + 64);
            pf_step(pf, 2);
            __m512i c0 = _mm512_set1_epi32(cw[m * DB + (b - bc)]);
            __m512i c1 = _mm512_set1_epi32(cw[m * DB + (b - bc) + 1]);
            __m512i al = _mm512_and_si512(A, low), bl = _mm512_and_si512(B, low);
#if defined(SI_VNNI512)
            lo0 = _mm512_dpbusd_epi32(lo0, al, c0);
            lo1 = _mm512_dpbusd_epi32(lo1, bl, c0);
            hi0 = _mm512_dpbusd_epi32(hi0, _mm512_andnot_si512(low, A), c1);
            hi1 = _mm512_dpbusd_epi32(hi1, _mm512_andnot_si512(low, B), c1);
#else
            __m512i ah = _mm512_and_si512(_mm512_srli_epi16(A, 4), low);
            __m512i bh = _mm512_and_si512(_mm512_srli_epi16(B, 4), low);
            const __m512i one = _mm512_set1_epi16(1);
            lo0 = _mm512_add_epi32(lo0, _mm512_madd_epi16(_mm512_maddubs_epi16(al, c0), one));
            lo1 = _mm512_add_epi32(lo1, _mm512_madd_epi16(_mm512_maddubs_epi16(bl, c0), one));
            hi0 = _mm512_add_epi32(hi0, _mm512_madd_epi16(_mm512_maddubs_epi16(ah, c1), one));
            hi1 = _mm512_add_epi32(hi1, _mm512_madd_epi16(_mm512_maddubs_epi16(bh, c1), one));
#endif
        }
        const __m512i v[4] = {lo0, lo1, hi0, hi1}; /* y positions 0-15, 16-31 of b, then b + 1 */
        for (int t = 0; t < 4; t++) { /* the sums of q c less 8 cs: those of (q - 8) c */
            int h = t / 2, k = h ? hs : 1;
            float *yo = y + (b + h) * QK + 16 * (t % 2);
            __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(v[t], _mm512_set1_epi32(8 * k * cs[b - bc + h])));
            _mm512_storeu_ps(yo, _mm512_fmadd_ps(f, _mm512_set1_ps(s[b - bc + h] / (float)k),
                                                 _mm512_add_ps(_mm512_loadu_ps(yo),
                                                               _mm512_set1_ps(kb[b - bc + h]))));
        }
    }
#else
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = bc; b < bc + nbc; b += 2) {
        __m256i lo[4], hi[4]; /* positions 8t .. 8t + 7 */
        for (int t = 0; t < 4; t++) lo[t] = hi[t] = _mm256_setzero_si256();
        const uint8_t *wp = d + (b / 2) * (GS / 4) * 128;
        for (int64_t m = 0; m < nq; m++) {
            pf_step(pf, 2);
            __m256i c0 = _mm256_set1_epi32(cw[m * DB + (b - bc)]);
            __m256i c1 = _mm256_set1_epi32(cw[m * DB + (b - bc) + 1]);
            for (int t = 0; t < 4; t++) {
                __m256i A = _mm256_loadu_si256((const __m256i *)(wp + m * 128 + 32 * t));
                lo[t] = dp_short(lo[t], _mm256_and_si256(A, low), c0); /* nq <= 8 steps */
                hi[t] = dp_short(hi[t], _mm256_and_si256(_mm256_srli_epi16(A, 4), low), c1);
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256i *a = h ? hi : lo;
            __m256i off = _mm256_set1_epi32(8 * cs[b - bc + h]);
            __m256 sc = _mm256_set1_ps(s[b - bc + h]), kc = _mm256_set1_ps(kb[b - bc + h]);
            for (int t = 0; t < 4; t++) {
                float *yo = y + (b + h) * QK + 8 * t;
                __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(dp_short_sum(a[t]), off));
                _mm256_storeu_ps(yo, _mm256_fmadd_ps(f, sc, _mm256_add_ps(_mm256_loadu_ps(yo), kc)));
            }
        }
    }
#endif
#else
    for (int64_t b = bc; b < bc + nbc; b += 2) { /* the reference: the plain records' sums */
        const uint8_t *wp = d + (b / 2) * (GS / 4) * 128;
        const int16_t *cb = cq + (b - bc);
        int32_t acc[2 * QK] = {0};
        for (int64_t i = 0; i < G; i++) {
            const uint8_t *wq = wp + (i / 4) * 128 + i % 4;
            int32_t c0 = cb[i * DB], c1 = cb[i * DB + 1];
            for (int p = 0; p < QK; p++) {
                acc[p] += ((int32_t)(wq[4 * p] & 15) - 8) * c0;
                acc[p + QK] += ((int32_t)(wq[4 * p] >> 4) - 8) * c1;
            }
        }
        float *yb = y + b * QK;
        float s0 = s[b - bc], s1 = s[b - bc + 1], k0 = kb[b - bc], k1 = kb[b - bc + 1];
        for (int p = 0; p < QK; p++) yb[p] += s0 * (float)acc[p] + k0;
        for (int p = 0; p < QK; p++) yb[QK + p] += s1 * (float)acc[QK + p] + k1;
    }
    (void)nq, (void)cs, (void)pf;
#endif
}

/* y [H] += the down product of group block g's first G slots with activations a[0 .. G). */
static void down_q4g(const uint8_t *g, int64_t H, const float *a, int64_t G, float *y, si_pf *pf) {
    const int64_t nb = H / QK;
    int16_t cq[DG * DB];
    float s[DB], kb[DB];
    int32_t cs[DB];
    for (int64_t bc = 0; bc < nb; bc += DB) {
        int64_t nbc = nb - bc < DB ? nb - bc : DB;
        down_coeffs(a, g + q4g_dheads(H), q4_head_bytes(H), NULL, 0, G, bc, nbc, cq, s, cs, kb, pf);
        axpy_q4g(g + q4g_down(H), G, cq, s, cs, kb, bc, nbc, y, pf);
    }
}

/* out [M, k, 2] = the gate and up products of slots [0, k) against x [M, H] (a prefill);
   threads split the groups. -1: out of memory, -2: a bad shape. */
int si_q4g_linear(const float *x, int64_t M, int64_t H, const uint8_t *blk, int64_t k, float *out,
                  int threads) {
    if (H % (2 * QK)) return -2;
    int64_t nb = H / QK, ng = (k + GS - 1) / GS;
    si_qrows q;
    if (quantize_rows(x, M, H, &q)) return -1;
    threads = clamp_threads(threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t g0, g1;
        share(ng, team_id(), team_size(), &g0, &g1);
        float gv[GS], uv[GS];
        for (int64_t g = g0; g < g1; g++) {
            int64_t G = k - g * GS < GS ? k - g * GS : GS;
            for (int64_t m = 0; m < M; m++) {
                q4g_gate_up(blk + g * q4g_bytes(H), H, G, q.xq + m * nb * QK, q.xd + m * nb,
                            q.xs + m * nb, gv, uv, NULL);
                float *o = out + (m * k + g * GS) * 2;
                for (int64_t i = 0; i < G; i++) {
                    o[2 * i] = gv[i];
                    o[2 * i + 1] = uv[i];
                }
            }
        }
    }
    free_qrows(&q);
    return 0;
}

/* y [M, H] = a [M, k] . the down columns of slots [0, k), group by group in order (the sums of
   si_axpy_q4 over the same records); threads split the super-blocks of H. */
int si_q4g_down(const float *a, int64_t M, int64_t k, const uint8_t *blk, int64_t H, float *y,
                int threads) {
    if (H % (2 * QK)) return -2;
    threads = clamp_threads(threads);
    const int64_t nb = H / QK, ng = (k + GS - 1) / GS;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t s0, s1;
        share((nb + 7) / 8, team_id(), team_size(), &s0, &s1);
        int64_t b0 = 8 * s0, b1 = 8 * s1 < nb ? 8 * s1 : nb;
        int16_t cq[DG * DB];
        float s[DB], kb[DB], hs[DG * DB], hm[DG * DB], dm[DG * DB / 4];
        int32_t cs[DB];
        for (int64_t m = 0; m < M; m++)
            for (int64_t i = b0 * QK; i < b1 * QK; i++) y[m * H + i] = 0.0f;
        for (int64_t bc = b0; bc < b1; bc += DB) {
            int64_t nbc = b1 - bc < DB ? b1 - bc : DB;
            for (int64_t g = 0; g < ng; g++) {
                const uint8_t *gb = blk + g * q4g_bytes(H);
                int64_t G = k - g * GS < GS ? k - g * GS : GS;
                const uint8_t *dh = gb + q4g_dheads(H);
                if (M == 1) {
                    down_coeffs(a + g * GS, dh, q4_head_bytes(H), NULL, 0, G, bc, nbc, cq, s, cs, kb,
                                NULL);
                    axpy_q4g(gb + q4g_down(H), G, cq, s, cs, kb, bc, nbc, y, NULL);
                    continue;
                }
                down_heads(dh, q4_head_bytes(H), NULL, 0, G, bc, nbc, dm, hs, hm);
                for (int64_t m = 0; m < M; m++) {
                    coeffs_from_heads(a + m * k + g * GS, 0, G, nbc, dm, hs, hm, cq, s, cs, kb);
                    axpy_q4g(gb + q4g_down(H), G, cq, s, cs, kb, bc, nbc, y + m * H, NULL);
                }
            }
        }
    }
    return 0;
}

/* The calibration of the fetch (kernel.py's tune): seconds of one pass over n groups of
   synthetic 4-bit records (H columns, in 2 MiB pages where Linux gives them, as the weights are)
   read from memory as the decode step's MLP reads them, one row on this thread, with si_pf_half
   = pf_half; the best of reps passes. -1: out of memory, -2: a bad shape. */
static double q4g_clock(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

double si_q4g_calibrate(int64_t H, int64_t n, int pf_half, int reps) {
    if (H % (2 * QK) || H > 16384 || n < 2 || reps < 1) return -2;
    const int64_t gb = q4g_bytes(H), nb = H / QK, hb = q4_head_bytes(H);
    const size_t al = (size_t)2 << 20, m = ((size_t)(n * gb) + al - 1) / al * al;
    uint8_t *blk = (uint8_t *)aligned_alloc(al, m);
    float *x = (float *)malloc((size_t)H * sizeof(float)), *y = (float *)calloc((size_t)H, sizeof(float));
    int8_t *xq = (int8_t *)aligned_alloc(64, (size_t)(H + 64));
    float *xd = (float *)malloc((size_t)nb * sizeof(float));
    int32_t *xs = (int32_t *)malloc((size_t)nb * sizeof(int32_t));
    if (!blk || !x || !y || !xq || !xd || !xs) {
        free(blk), free(x), free(y), free(xq), free(xd), free(xs);
        return -1;
    }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(blk, m, MADV_HUGEPAGE);
#endif
    uint64_t r = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < m; i += 8) {
        r ^= r << 13, r ^= r >> 7, r ^= r << 17;
        memcpy(blk + i, &r, 8);
    }
    const uint8_t d16[2] = {0x00, 0x20}; /* float16 2^-7: every d and dmin, the sums stay finite */
    for (int64_t g = 0; g < n; g++) {
        uint8_t *b = blk + g * gb;
        for (int j = 0; j < 4; j++) /* gate, up of both halves: d[16], dmin[16] per super-block */
            for (int64_t s = 0; s < hb / Q4_HEAD; s++)
                for (int i = 0; i < 2 * IL; i++) memcpy(b + j * q4g_il(H) + IL * H / 2 + s * IL_HEAD + 2 * i, d16, 2);
        for (int sl = 0; sl < GS; sl++)
            for (int64_t s = 0; s < hb / Q4_HEAD; s++)
                for (int i = 0; i < 2; i++) memcpy(b + q4g_dheads(H) + sl * hb + s * Q4_HEAD + 2 * i, d16, 2);
    }
    for (int64_t i = 0; i < H; i++) x[i] = sinf(0.37f * (float)i);
    quantize_blocks(x, H, 0, nb, xq, xd, xs);
    const int saved = si_pf_half;
    si_tune(pf_half);
    double best = 1e30;
    for (int rep = 0; rep < reps; rep++) {
        double t0 = q4g_clock();
        for (int64_t g = 0; g < n; g++) {
            const uint8_t *b = blk + g * gb;
            si_pf pf = {b + gb, g + 1 < n ? b + 2 * gb : b + gb};
            float gv[GS], uv[GS], a[GS];
            q4g_gate_up(b, H, GS, xq, xd, xs, gv, uv, &pf);
            for (int i = 0; i < GS; i++) a[i] = gv[i] * uv[i];
            down_q4g(b, H, a, GS, y, &pf);
        }
        double t = q4g_clock() - t0;
        best = t < best ? t : best;
    }
    si_pf_half = saved;
    free(blk), free(x), free(y), free(xq), free(xd), free(xs);
    return best;
}
