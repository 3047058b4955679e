/* 4-bit rows interleaved 16 at a time: the dense 4-bit matrices (the output layer, the attention
   projections) read whole every token. Part of kernel.c.

   The row product (q4_row) reduces eight vectors across their lanes per super-block and row: it
   runs at ~20 GB/s from the cache, about the memory's speed, so memory and arithmetic do not
   overlap (~13 GB/s from memory, Zen 4, one thread). Here a group of 16 rows is one stream: per
   super-block s and sub-block pair p (sub-blocks 2p, 2p + 1: a row's 32 bytes 32 p .. 32 p + 31
   of the super-block's nibbles, as q4_row reads them), 8 chunks c of 64 bytes, 4 bytes of each row
   (row r at 4 r: its bytes 32 p + 4 c .. + 3). One activation word (4 int8) broadcast against a
   chunk gives 16 rows' partial sums in 16 lanes: no reduction across lanes, ~3x fewer
   instructions (llama.cpp's repacked Q4_K rows are the same idea). A group's super-block takes
   16 x 128 bytes (a last partial one 16 x its rows' bytes): the group holds its 16 rows' bytes,
   at the same place.

   Heads per group and super-block (IL_HEAD bytes, the rows' own 16 each): d[16], dmin[16]
   (float16), then the 12 bytes of packed 6-bit scales and minimums as planes [12][16] (row r's
   byte b at [b][r]), which il_scales unpacks for 16 rows at once (llama.cpp's get_scale_min_k4
   on 16 bytes).

     y[r] = sum_s d[r] sum_j xd[j] sc[j][r] sum_i q[r, i] xq[i] - dmin[r] sum_j xd[j] xs[j] m[j][r]

   The same sums as q4_row, in another order: the results agree to float rounding. */
#define IL 16                  /* rows per group */
#define IL_HEAD (IL * Q4_HEAD) /* head bytes per group and super-block */

/* Head bytes of a group over K columns. */
static inline int64_t il_head_bytes(int64_t K) { return (K + Q4_SB - 1) / Q4_SB * IL_HEAD; }

/* Row r's 6-bit scale (*sc) and minimum (*mn) of sub-block j from a super-block's head planes
   (pl: 12 planes of IL bytes), the reference. */
static inline void il_scale_min(const uint8_t *pl, int r, int j, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = pl[j * IL + r] & 63;
        *mn = pl[(4 + j) * IL + r] & 63;
    } else {
        uint8_t q = pl[(4 + j) * IL + r]; /* plane 8 + (j - 4) */
        *sc = (uint8_t)((q & 15) | ((pl[(j - 4) * IL + r] >> 6) << 4));
        *mn = (uint8_t)((q >> 4) | ((pl[j * IL + r] >> 6) << 4));
    }
}

#if defined(SI_AVX2) || defined(SI_AVX512)
/* The 16 rows' scales (*sc) and minimums (*mn) of sub-block j, a byte each, from the planes. */
static inline void il_scales(const uint8_t *pl, int j, __m128i *sc, __m128i *mn) {
    const __m128i m6 = _mm_set1_epi8(63);
    if (j < 4) {
        *sc = _mm_and_si128(_mm_loadu_si128((const __m128i *)(pl + j * IL)), m6);
        *mn = _mm_and_si128(_mm_loadu_si128((const __m128i *)(pl + (4 + j) * IL)), m6);
        return;
    }
    const __m128i q = _mm_loadu_si128((const __m128i *)(pl + (4 + j) * IL));
    const __m128i hs = _mm_loadu_si128((const __m128i *)(pl + (j - 4) * IL));
    const __m128i hm = _mm_loadu_si128((const __m128i *)(pl + j * IL));
    const __m128i m4 = _mm_set1_epi8(15), top = _mm_set1_epi8(0x30); /* bits 6, 7 -> 4, 5 */
    *sc = _mm_or_si128(_mm_and_si128(q, m4), _mm_and_si128(_mm_srli_epi16(hs, 2), top));
    *mn = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(q, 4), m4),
                       _mm_and_si128(_mm_srli_epi16(hm, 2), top));
}
#endif

#if defined(SI_AVX512)
/* Every sub-block's scales and minimums of the 16 rows at once (il_scales for j = 0 .. 7, four
   sub-blocks a register): sm[0][j], sm[1][j]. */
static inline void il_scales_all(const uint8_t *pl, uint8_t sm[2][8][IL]) {
    const __m512i p03 = _mm512_loadu_si512(pl), p47 = _mm512_loadu_si512(pl + 4 * IL);
    const __m512i p8b = _mm512_loadu_si512(pl + 8 * IL);
    const __m512i m6 = _mm512_set1_epi8(63), m4 = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
    /* (a & m4) | b, b holding only bits 4, 5: ternary logic A ? (C ? a : b) with C = m4 */
    _mm512_storeu_si512(sm[0][0], _mm512_and_si512(p03, m6));
    _mm512_storeu_si512(sm[1][0], _mm512_and_si512(p47, m6));
    _mm512_storeu_si512(sm[0][4], _mm512_ternarylogic_epi32(p8b, _mm512_and_si512(_mm512_srli_epi16(p03, 2), top), m4, 0xE4));
    _mm512_storeu_si512(sm[1][4], _mm512_ternarylogic_epi32(_mm512_srli_epi16(p8b, 4),
                                                            _mm512_and_si512(_mm512_srli_epi16(p47, 2), top), m4, 0xE4));
}

/* The 4 int8 at p (an activation word) in every 32-bit lane: a broadcast memory operand. */
static inline __m512i bcast_word(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
#endif

/* y[0, 16) = the group's rows (w: nibbles, h: heads) against one activation row (xq, xd, xs as
   quantize_blocks makes them, K columns). */
static void il_group(const uint8_t *w, const uint8_t *h, int64_t K, const int8_t *xq,
                     const float *xd, const int32_t *xs, float *y, si_pf *pf) {
    int64_t ns = (K + Q4_SB - 1) / Q4_SB, pairs = K / (2 * QK);
#if defined(SI_AVX512)
    /* Per chunk: one load, the low nibbles (and), the high ones where they lie (VNNI: andnot,
       16 q; the sub-block's scale takes the 1 / 16, exactly), two dot products whose activation
       word is a broadcast memory operand. */
#if defined(SI_VNNI512)
    const float hi_scale = 0.0625f;
#else
    const float hi_scale = 1.0f;
#endif
    __m512 acc = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t s = 0; s < ns; s++, h += IL_HEAD) {
        int64_t np = pairs - 4 * s < 4 ? pairs - 4 * s : 4;
        const uint8_t *ws = w + s * IL * (Q4_SB / 2);
        float xm[8]; /* xd[j] xs[j] of the super-block's sub-blocks */
        const __mmask8 live = (__mmask8)((1u << (2 * np)) - 1);
        _mm256_storeu_ps(xm, _mm256_mul_ps(_mm256_maskz_loadu_ps(live, xd + 8 * s),
                                           _mm256_cvtepi32_ps(_mm256_maskz_loadu_epi32(live, xs + 8 * s))));
        uint8_t sm[2][8][IL]; /* the 16 rows' scales [0] and minimums [1] of sub-block j */
        il_scales_all(h + 4 * IL, sm);
        __m512 sacc = _mm512_setzero_ps(), macc = _mm512_setzero_ps();
        for (int64_t p = 0; p < np; p++) {
            const int8_t *x0 = xq + s * Q4_SB + 64 * p, *x1 = x0 + QK; /* sub-blocks 2p, 2p + 1 */
            __m512i a0 = _mm512_setzero_si512(), a1 = a0, b0 = a0, b1 = a0;
            for (int c = 0; c < 8; c += 2) {
                const uint8_t *wc = ws + (p * 8 + c) * 64;
                __m512i r0 = _mm512_loadu_si512(wc), r1 = _mm512_loadu_si512(wc + 64);
                pf_step(pf, 2);
#if defined(SI_VNNI512)
                a0 = _mm512_dpbusd_epi32(a0, _mm512_and_si512(r0, low), bcast_word(x0 + 4 * c));
                a1 = _mm512_dpbusd_epi32(a1, _mm512_and_si512(r1, low), bcast_word(x0 + 4 * c + 4));
                b0 = _mm512_dpbusd_epi32(b0, _mm512_andnot_si512(low, r0), bcast_word(x1 + 4 * c));
                b1 = _mm512_dpbusd_epi32(b1, _mm512_andnot_si512(low, r1), bcast_word(x1 + 4 * c + 4));
#else
                const __m512i one = _mm512_set1_epi16(1);
                __m512i h0 = _mm512_and_si512(_mm512_srli_epi16(r0, 4), low);
                __m512i h1 = _mm512_and_si512(_mm512_srli_epi16(r1, 4), low);
                a0 = _mm512_add_epi32(a0, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_and_si512(r0, low), bcast_word(x0 + 4 * c)), one));
                a1 = _mm512_add_epi32(a1, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_and_si512(r1, low), bcast_word(x0 + 4 * c + 4)), one));
                b0 = _mm512_add_epi32(b0, _mm512_madd_epi16(_mm512_maddubs_epi16(h0, bcast_word(x1 + 4 * c)), one));
                b1 = _mm512_add_epi32(b1, _mm512_madd_epi16(_mm512_maddubs_epi16(h1, bcast_word(x1 + 4 * c + 4)), one));
#endif
            }
            int64_t j0 = 8 * s + 2 * p;
            __m512 s0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sm[0][2 * p])));
            __m512 s1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sm[0][2 * p + 1]))),
                                      _mm512_set1_ps(hi_scale));
            __m512 m0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sm[1][2 * p])));
            __m512 m1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sm[1][2 * p + 1])));
            sacc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)), s0),
                                   _mm512_set1_ps(xd[j0]), sacc);
            sacc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(b0, b1)), s1),
                                   _mm512_set1_ps(xd[j0 + 1]), sacc);
            macc = _mm512_fmadd_ps(m0, _mm512_set1_ps(xm[2 * p]), macc);
            macc = _mm512_fmadd_ps(m1, _mm512_set1_ps(xm[2 * p + 1]), macc);
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
        __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + 2 * IL)));
        acc = _mm512_fnmadd_ps(macc, dm, _mm512_fmadd_ps(sacc, d, acc));
    }
    _mm512_storeu_ps(y, acc);
#elif defined(SI_AVX2)
    /* Both halves of every chunk (rows 0-7: its first 32 bytes, rows 8-15: the next) in one pass:
       [2] arrays are [half]. */
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t s = 0; s < ns; s++, h += IL_HEAD) {
        int64_t np = pairs - 4 * s < 4 ? pairs - 4 * s : 4;
        const uint8_t *ws = w + s * IL * (Q4_SB / 2);
        __m256 sacc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, macc[2] = {sacc[0], sacc[1]};
        for (int64_t p = 0; p < np; p++) {
            const int8_t *x0 = xq + s * Q4_SB + 64 * p, *x1 = x0 + QK; /* sub-blocks 2p, 2p + 1 */
            __m256i a[2], b[2]; /* low nibbles x sub-block 2p, high x 2p + 1 */
            a[0] = a[1] = b[0] = b[1] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                pf_step(pf, 1);
                int32_t v0, v1;
                memcpy(&v0, x0 + 4 * c, 4);
                memcpy(&v1, x1 + 4 * c, 4);
                __m256i c0 = _mm256_set1_epi32(v0), c1 = _mm256_set1_epi32(v1);
                for (int hf = 0; hf < 2; hf++) {
                    __m256i r = _mm256_loadu_si256((const __m256i *)(ws + (p * 8 + c) * 64 + 32 * hf));
                    a[hf] = dp_short(a[hf], _mm256_and_si256(r, low), c0);
                    b[hf] = dp_short(b[hf], _mm256_and_si256(_mm256_srli_epi16(r, 4), low), c1);
                }
            }
            int64_t j0 = 8 * s + 2 * p;
            __m128i sc0, mn0, sc1, mn1;
            il_scales(h + 4 * IL, (int)(2 * p), &sc0, &mn0);
            il_scales(h + 4 * IL, (int)(2 * p + 1), &sc1, &mn1);
            const __m256 x0d = _mm256_set1_ps(xd[j0]), x1d = _mm256_set1_ps(xd[j0 + 1]);
            const __m256 x0m = _mm256_set1_ps(xd[j0] * (float)xs[j0]);
            const __m256 x1m = _mm256_set1_ps(xd[j0 + 1] * (float)xs[j0 + 1]);
            for (int hf = 0; hf < 2; hf++) { /* rows 8 hf .. 8 hf + 7: bytes 8 hf .. of the heads */
                __m256 s0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc0));
                __m256 s1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc1));
                __m256 m0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn0));
                __m256 m1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn1));
                sacc[hf] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dp_short_sum(a[hf])), s0),
                                           x0d, sacc[hf]);
                sacc[hf] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dp_short_sum(b[hf])), s1),
                                           x1d, sacc[hf]);
                macc[hf] = _mm256_fmadd_ps(m0, x0m, macc[hf]);
                macc[hf] = _mm256_fmadd_ps(m1, x1m, macc[hf]);
                sc0 = _mm_srli_si128(sc0, 8), mn0 = _mm_srli_si128(mn0, 8);
                sc1 = _mm_srli_si128(sc1, 8), mn1 = _mm_srli_si128(mn1, 8);
            }
        }
        for (int hf = 0; hf < 2; hf++) {
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 16 * hf)));
            __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 2 * IL + 16 * hf)));
            acc[hf] = _mm256_fnmadd_ps(macc[hf], dm, _mm256_fmadd_ps(sacc[hf], d, acc[hf]));
        }
    }
    _mm256_storeu_ps(y, acc[0]);
    _mm256_storeu_ps(y + 8, acc[1]);
#else
    (void)pf;
    for (int r = 0; r < IL; r++) y[r] = 0.0f;
    for (int64_t s = 0; s < ns; s++, h += IL_HEAD) {
        int64_t np = pairs - 4 * s < 4 ? pairs - 4 * s : 4;
        const uint8_t *ws = w + s * IL * (Q4_SB / 2);
        for (int r = 0; r < IL; r++) {
            float sacc = 0.0f, macc = 0.0f;
            uint16_t hd16[2];
            memcpy(hd16, h + 2 * r, 2);
            memcpy(hd16 + 1, h + 2 * IL + 2 * r, 2);
            for (int64_t p = 0; p < np; p++) {
                const int8_t *x0 = xq + s * Q4_SB + 64 * p, *x1 = x0 + QK;
                int32_t a = 0, b = 0;
                for (int c = 0; c < 8; c++)
                    for (int i = 0; i < 4; i++) {
                        uint8_t q = ws[(p * 8 + c) * 64 + 4 * r + i];
                        a += (int32_t)(q & 15) * x0[4 * c + i];
                        b += (int32_t)(q >> 4) * x1[4 * c + i];
                    }
                int64_t j0 = 8 * s + 2 * p;
                uint8_t sc0, mn0, sc1, mn1;
                il_scale_min(h + 4 * IL, r, (int)(2 * p), &sc0, &mn0);
                il_scale_min(h + 4 * IL, r, (int)(2 * p + 1), &sc1, &mn1);
                sacc += (float)a * (float)sc0 * xd[j0] + (float)b * (float)sc1 * xd[j0 + 1];
                macc += (float)mn0 * (xd[j0] * (float)xs[j0]) +
                        (float)mn1 * (xd[j0 + 1] * (float)xs[j0 + 1]);
            }
            y[r] += sacc * half_to_float(hd16[0]) - macc * half_to_float(hd16[1]);
        }
    }
#endif
}

/* y [M, N] = x [M, K] . W^T over an interleaved 4-bit matrix (w: its N / 16 groups of nibbles,
   16 * K / 2 bytes each; h: their heads, il_head_bytes(K) each); threads split the groups.
   N a multiple of 16; -1: out of memory, -2: a bad shape. */
int si_linear_q4il(const float *x, int64_t M, int64_t K, const uint8_t *w, const uint8_t *h,
                   int64_t N, float *y, int threads) {
    if (K % (2 * QK) || N % IL) return -2;
    int64_t nb = K / QK, G = N / IL, hb = il_head_bytes(K);
    si_qrows q;
    if (quantize_rows(x, M, K, &q)) return -1;
    const int8_t *xq = q.xq;
    const float *xd = q.xd;
    const int32_t *xs = q.xs;
    threads = clamp_threads(threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t g0, g1;
        share(G, team_id(), team_size(), &g0, &g1);
        float out[IL];
        for (int64_t g = g0; g < g1; g++)
            for (int64_t m = 0; m < M; m++) {
                il_group(w + g * IL * (K / 2), h + g * hb, K, xq + m * nb * QK, xd + m * nb,
                         xs + m * nb, out, NULL);
                memcpy(y + m * N + g * IL, out, sizeof out);
            }
    }
    free_qrows(&q);
    return 0;
}
