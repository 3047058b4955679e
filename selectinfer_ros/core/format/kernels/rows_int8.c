/* int8 weight rows x quantized activations: one row (dot1, rows_q), a few rows prepared
   once (AVX-512 VNNI), the blocked product of a prefill, si_linear_i8. Part of kernel.c. */
/* dot1(w, ldw, nfull, xq, xd, out): *out = sum over the nfull full blocks b of
   xd[b] * sum_{k in b} w[k] * xq[k] (DOT_ROWS(R) would take R rows at stride ldw); ldw also
   says where the next row read starts, for the read-ahead (PF_AT). */
#if defined(SI_AVX2) || defined(SI_AVX512)
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Eight blocks' int32 lane vectors reduced to one vector of their eight sums (lane j: p[j]). */
static inline __m256i sum8(const __m256i p[8]) {
    __m256i s0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    __m256i s1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20),
                            _mm256_permute2x128_si256(s0, s1, 0x31));
}

/* One block: |x| (unsigned) times w with x's sign, summed to 8 int32 lanes. */
static inline __m256i blk256(__m256i ax, __m256i xv, __m256i wv) {
    __m256i sw = _mm256_sign_epi8(wv, xv);
#if defined(SI_AVXVNNI)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ax, sw);
#elif defined(SI_VNNI512)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sw);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sw), _mm256_set1_epi16(1));
#endif
}
#endif

#if defined(SI_AVX2)
/* One int8 row against the quantized activations. Eight blocks at a time: their integer sums
   are reduced into one vector (one lane a block), converted once and scaled by the eight
   activation scales in one multiply-add, so the float work and the accumulator's dependency
   chain are an eighth of a multiply-add per block (as q4_row does). */
static inline void dot1(const int8_t *w, int64_t ldw, int64_t nfull, const int8_t *xq,
                        const float *xd, float *out) {
    const int64_t skip = PF_SKIP(ldw, nfull);
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nfull; b += 8) {
        __m256i p[8];
        for (int j = 0; j < 8; j++) {
            _mm_prefetch((const char *)PF_AT(w, (b + j) * QK, nfull, skip), _MM_HINT_T0);
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (b + j) * QK));
            __m256i wv = _mm256_loadu_si256((const __m256i *)(w + (b + j) * QK));
            p[j] = blk256(_mm256_sign_epi8(xv, xv), xv, wv);
        }
        __m256i sum = sum8(p); /* [8] blocks */
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_loadu_ps(xd + b), acc);
    }
    __m128 acc4 = _mm_setzero_ps();
    for (; b + 4 <= nfull; b += 4) { /* four blocks: the same reduction at half width */
        __m256i p[4];
        for (int j = 0; j < 4; j++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (b + j) * QK));
            __m256i wv = _mm256_loadu_si256((const __m256i *)(w + (b + j) * QK));
            p[j] = blk256(_mm256_sign_epi8(xv, xv), xv, wv);
        }
        __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
        __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        acc4 = _mm_fmadd_ps(_mm_cvtepi32_ps(sum), _mm_loadu_ps(xd + b), acc4);
    }
    __m256 rest = _mm256_setzero_ps();
    for (; b < nfull; b++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + b * QK));
        rest = _mm256_fmadd_ps(_mm256_cvtepi32_ps(blk256(_mm256_sign_epi8(xv, xv), xv, wv)),
                               _mm256_broadcast_ss(xd + b), rest);
    }
    acc = _mm256_add_ps(acc, _mm256_add_ps(rest, _mm256_insertf128_ps(_mm256_setzero_ps(), acc4, 0)));
    *out = hsum256(acc);
}
#elif defined(SI_AVX512)
/* Two blocks per 512-bit register: the weights take the activations' sign by a masked
   negation (|w| <= 127), the activations' magnitudes are the unsigned operand. */
static inline __m512i blk512(__m512i ax, __mmask64 neg, __m512i wv) {
    __m512i sw = _mm512_mask_sub_epi8(wv, neg, _mm512_setzero_si512(), wv);
#if defined(SI_VNNI512)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), ax, sw);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(ax, sw), _mm512_set1_epi16(1));
#endif
}

#define DOT_ROWS(R)                                                                          \
    static inline void dot##R(const int8_t *w, int64_t ldw, int64_t nfull, const int8_t *xq,  \
                              const float *xd, float *out) {                                  \
        __m512 acc[R];                                                                        \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                             \
        const int64_t skip = PF_SKIP(ldw, nfull);                                             \
        int64_t b = 0;                                                                        \
        for (; b + 2 <= nfull; b += 2) {                                                      \
            __m512i xv = _mm512_loadu_si512((const void *)(xq + b * QK));                     \
            __m512i ax = _mm512_abs_epi8(xv);                                                 \
            __mmask64 neg = _mm512_movepi8_mask(xv);                                          \
            __m512 d = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(xd[b]),                    \
                                            _mm512_set1_ps(xd[b + 1]));                       \
            for (int r = 0; r < R; r++) {                                                     \
                _mm_prefetch((const char *)PF_AT(w + r * ldw, b * QK, nfull, skip), _MM_HINT_T0); \
                __m512i wv = _mm512_loadu_si512((const void *)(w + r * ldw + b * QK));        \
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(blk512(ax, neg, wv)), d, acc[r]); \
            }                                                                                 \
        }                                                                                     \
        float last[R];                                                                        \
        for (int r = 0; r < R; r++) last[r] = 0.0f;                                           \
        if (b < nfull) {                                                                      \
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * QK));                  \
            __m256i ax = _mm256_sign_epi8(xv, xv);                                            \
            for (int r = 0; r < R; r++) {                                                     \
                __m256i wv = _mm256_loadu_si256((const __m256i *)(w + r * ldw + b * QK));     \
                last[r] = hsum256(_mm256_cvtepi32_ps(blk256(ax, xv, wv))) * xd[b];            \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]) + last[r];          \
    }
DOT_ROWS(1)
#elif defined(SI_NEON_DOT)
#define DOT_ROWS(R)                                                                          \
    static inline void dot##R(const int8_t *w, int64_t ldw, int64_t nfull, const int8_t *xq,  \
                              const float *xd, float *out) {                                  \
        float32x4_t acc[R];                                                                   \
        for (int r = 0; r < R; r++) acc[r] = vdupq_n_f32(0.0f);                               \
        const int64_t skip = PF_SKIP(ldw, nfull);                                             \
        for (int64_t b = 0; b < nfull; b++) {                                                 \
            int8x16_t x0 = vld1q_s8(xq + b * QK), x1 = vld1q_s8(xq + b * QK + 16);            \
            for (int r = 0; r < R; r++) {                                                     \
                const int8_t *wr = w + r * ldw + b * QK;                                      \
                __builtin_prefetch(PF_AT(w + r * ldw, b * QK, nfull, skip));                  \
                int32x4_t p = vdotq_s32(vdupq_n_s32(0), vld1q_s8(wr), x0);                    \
                p = vdotq_s32(p, vld1q_s8(wr + 16), x1);                                      \
                acc[r] = vfmaq_n_f32(acc[r], vcvtq_f32_s32(p), xd[b]);                        \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < R; r++) out[r] = vaddvq_f32(acc[r]);                              \
    }
DOT_ROWS(1)
#else
static void dot1(const int8_t *w, int64_t ldw, int64_t nfull, const int8_t *xq, const float *xd,
                 float *out) {
    (void)ldw;
    float acc = 0.0f;
    for (int64_t b = 0; b < nfull; b++) {
        int32_t s = 0;
        for (int k = 0; k < QK; k++) s += (int32_t)w[b * QK + k] * (int32_t)xq[b * QK + k];
        acc += (float)s * xd[b];
    }
    *out = acc;
}

#endif

/* The last partial block (K % QK values), exact in float. */
static inline float tail(const int8_t *w, int64_t from, int64_t K, const float *x) {
    float s = 0.0f;
    for (int64_t k = from; k < K; k++) s += (float)w[k] * x[k];
    return s;
}

/* Rows [n0, n1) of y = scale * (W . x), x quantized as (xq, xd). One row at a time: the
   weights are one linear stream, which the hardware prefetchers follow best (reading 4 rows
   side by side ran the 168 MB output layer of Gemma 3 270M 2.3x slower on Zen 4). */
static void rows_q(const int8_t *w, int64_t ldw, int64_t K, const float *scale, const int8_t *xq,
                   const float *xd, const float *x, float *y, int64_t n0, int64_t n1) {
    int64_t nfull = K / QK, from = nfull * QK;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *wn = w + n * ldw;
        float v;
        dot1(wn, ldw, nfull, xq, xd, &v);
        if (from < K) v += tail(wn, from, K, x);
        y[n] = scale ? v * scale[n] : v;
    }
}

/* ---------------------------------------------------------------------------------------
   A few activation rows (a batch's decode step) on AVX-512 VNNI: the activations are prepared
   once per product, not once per weight row: per pair of blocks (PREP_PAIR bytes), u = xq + 128
   as unsigned bytes and the two blocks' scales spread over the pair's lanes. Against a pair of
   weight blocks wv: c = -128 * (the sums of wv's lane quads), one vpdpbusd shared by every row,
   then per row one vpdpbusd started at c (exactly sum xq * w per lane), one conversion and one
   multiply-add. A weight row is read once (from L1 for the rows after the first). A last unpaired
   block pairs with zero weights (a masked load: nothing past the row is read). */
#if defined(SI_VNNI512)
#define SI_PREP 1
#define PREP_PAIR 128
#define PREP_ROWS 4 /* activation rows per pass over a weight row (accumulators in registers) */
#ifndef PREP_MAX_M
#define PREP_MAX_M 9 /* si_linear_i8 with fewer rows takes this path (more: the blocked product) */
#endif

/* Pairs [p0, p1) of the quantized blocks of one row prepared at prep; nfull: whole blocks (the
   last partial block, if any, is the float tail). */
static void prep_pairs(const int8_t *xq, const float *xd, int64_t nfull, int64_t p0, int64_t p1,
                       uint8_t *prep) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t p = p0; p < p1; p++) {
        int64_t b = 2 * p;
        __m512i x = b + 1 < nfull ? _mm512_loadu_si512((const void *)(xq + b * QK))
                                  : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, xq + b * QK);
        _mm512_storeu_si512((void *)(prep + p * PREP_PAIR), _mm512_xor_si512(x, flip));
        __m512 d = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(xd[b]),
                                        _mm512_set1_ps(b + 1 < nfull ? xd[b + 1] : 0.0f));
        _mm512_storeu_ps((float *)(prep + p * PREP_PAIR + 64), d);
    }
}

#define PREP_STEP(p, A)                                                                        \
    {                                                                                          \
        _mm_prefetch((const char *)PF_AT(w, (p) * 2 * QK, nfull, skip), _MM_HINT_T0);         \
        __m512i wv = 2 * (p) + 1 < nfull ? _mm512_loadu_si512((const void *)(w + (p) * 2 * QK)) \
                                         : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, w + (p) * 2 * QK); \
        __m512i c = _mm512_sub_epi32(z, _mm512_dpbusd_epi32(z, c128, wv));                     \
        for (int r = 0; r < NR; r++) {                                                         \
            const uint8_t *o = pr + r * pld + (p) * PREP_PAIR;                                 \
            __m512i s = _mm512_dpbusd_epi32(c, _mm512_loadu_si512((const void *)o), wv);       \
            A[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_loadu_ps((const float *)(o + 64)), \
                                   A[r]);                                                      \
        }                                                                                      \
    }
/* The sum of one row's 16 lanes, in the order reduce4 takes for each of its rows (float
   addition being commutative, the two give equal sums). */
static inline float reduce1(__m512 s) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_permute_ps(q, 0x4E));
    q = _mm_add_ps(q, _mm_permute_ps(q, 0xB1));
    return _mm_cvtss_f32(q);
}

/* The sums of four rows' lanes at once (a transposing tree: 13 operations, not 4 x 6). */
static inline void reduce4(__m512 s0, __m512 s1, __m512 s2, __m512 s3, float *out) {
    __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(s0, s1, 0x44), _mm512_shuffle_f32x4(s0, s1, 0xEE));
    __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(s2, s3, 0x44), _mm512_shuffle_f32x4(s2, s3, 0xEE));
    __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88),
                             _mm512_shuffle_f32x4(x01, x23, 0xDD)); /* 128-bit lane r: row r */
    y = _mm512_add_ps(y, _mm512_permute_ps(y, 0x4E));
    y = _mm512_add_ps(y, _mm512_permute_ps(y, 0xB1));
    float t[16];
    _mm512_storeu_ps(t, y);
    out[0] = t[0], out[1] = t[4], out[2] = t[8], out[3] = t[12];
}

/* two accumulators per row (even and odd pairs): two chains of multiply-adds */
#define DOT_PREP(R)                                                                            \
    static inline void dot_prep##R(const int8_t *w, int64_t ldw, int64_t nfull, const uint8_t *pr, \
                                   int64_t pld, float *out) {                                  \
        const int64_t np = (nfull + 1) / 2, skip = PF_SKIP(ldw, nfull);                        \
        enum { NR = R };                                                                       \
        const __m512i c128 = _mm512_set1_epi8((char)0x80), z = _mm512_setzero_si512();         \
        __m512 a0[R], a1[R];                                                                   \
        for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();                        \
        int64_t p = 0;                                                                         \
        for (; p + 2 <= np; p += 2) {                                                          \
            PREP_STEP(p, a0)                                                                   \
            PREP_STEP(p + 1, a1)                                                               \
        }                                                                                      \
        if (p < np) PREP_STEP(p, a0)                                                           \
        for (int r = 0; r < R; r++) a0[r] = _mm512_add_ps(a0[r], a1[r]);                       \
        if (R == 4)                                                                            \
            reduce4(a0[0], a0[R > 1 ? 1 : 0], a0[R > 2 ? 2 : 0], a0[R > 3 ? 3 : 0], out);      \
        else                                                                                   \
            for (int r = 0; r < R; r++) out[r] = reduce1(a0[r]);                               \
    }
DOT_PREP(1)
DOT_PREP(2)
DOT_PREP(3)
DOT_PREP(4)

/* Rows [n0, n1) of y_m = scale * (W . x_m) for the M rows prepared at prep (row stride pld;
   x_m = x + m * ldx for the float tail, y_m = y + m * ldy). */
static void rows_prep(const int8_t *w, int64_t ldw, int64_t K, const float *scale,
                      const uint8_t *prep, int64_t pld, int64_t M, const float *x, int64_t ldx,
                      float *y, int64_t ldy, int64_t n0, int64_t n1) {
    const int64_t nfull = K / QK, from = nfull * QK;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *wn = w + n * ldw;
        for (int64_t m0 = 0; m0 < M; m0 += PREP_ROWS) {
            float v[PREP_ROWS];
            const uint8_t *pr = prep + m0 * pld;
            switch (M - m0 < PREP_ROWS ? M - m0 : PREP_ROWS) {
            case 1: dot_prep1(wn, ldw, nfull, pr, pld, v); break;
            case 2: dot_prep2(wn, ldw, nfull, pr, pld, v); break;
            case 3: dot_prep3(wn, ldw, nfull, pr, pld, v); break;
            default: dot_prep4(wn, ldw, nfull, pr, pld, v); break;
            }
            for (int64_t r = 0; r < PREP_ROWS && m0 + r < M; r++) {
                float vr = v[r];
                if (from < K) vr += tail(wn, from, K, x + (m0 + r) * ldx);
                y[(m0 + r) * ldy + n] = scale ? vr * scale[n] : vr;
            }
        }
    }
}
#endif /* SI_VNNI512 */

/* Bytes of one row's prepared activations for K values (0 where there is no prepared path). */
static inline int64_t prep_bytes(int64_t K) {
#ifdef SI_PREP
    return (K / (2 * QK) + 2) * PREP_PAIR;
#else
    (void)K;
    return 0;
#endif
}

/* ---------------------------------------------------------------------------------------
   Many activation rows (a prompt's prefill: M >= GEMM_MIN_M): a blocked product. A tile of GN
   weight rows is repacked, KC blocks at a time, so that one vector holds the same four columns
   (a "quad") of consecutive rows: pk[b][q][GN][4] for block b, quad q of the block (8 quads of
   4 bytes). Against it, GM activation rows at a time: each quad of an activation row is
   broadcast and multiplied into the lanes of every row of the tile (one vpdpbusd / maddubs /
   sdot per 16 / 8 / 4 rows), and the integer sums of a block are scaled once by its activation
   scale. Every block's integer product is exact, as on the row path; only the order of the
   float sums differs. Each weight row is read from memory once per call, as on the row path,
   and from the cache once per GM activation rows.

   AVX-512 VNNI multiplies unsigned by signed bytes: the activations are stored offset, u = xq +
   128, and each block's accumulator starts at -128 * (the sum of its weights in each lane),
   computed once per tile (negc), so the block's sum is exactly sum xq * w. AVX2, AVX-VNNI and
   AVX-512BW (256 bits) move the activation quad's signs onto the weights (|x| unsigned, as on
   the row path); NEON's sdot is signed by signed. Plain C takes the row path (the reference).
   Tile sizes measured on Zen 4 (forcing each path): per-product rates 3.4-5.4x the row path's
   with VNNI, about 2x with AVX2 and AVX-512BW. */
#if defined(SI_AVX2) || defined(SI_AVX512) || defined(SI_NEON_DOT)
#define SI_GEMM 1
#ifndef GEMM_MIN_M /* fewer activation rows take the row path (AVX2, AVX-VNNI, AVX-512BW: the
                      row path is faster at 4 rows, e.g. a batch's output layer, 1.3x on Zen 4) */
#if defined(SI_VNNI512) || defined(SI_NEON_DOT)
#define GEMM_MIN_M 4
#else
#define GEMM_MIN_M 5
#endif
#endif
#if defined(SI_VNNI512) /* weight rows per tile, activation rows per pass: 32, 64 rows slower */
#define VL 16 /* int32 lanes: weight rows per vector */
#define GN_BEST 48
#define GM_BEST 4
#elif defined(SI_NEON_DOT)
#define VL 4
#define GN_BEST 8
#define GM_BEST 4
#elif defined(SI_AVX512) /* AVX-512BW without VNNI: the 256-bit tile, 32 registers */
#define VL 8
#define GN_BEST 24
#define GM_BEST 4
#else /* AVX2, AVX-VNNI: 16 registers */
#define VL 8
#define GN_BEST 24
#define GM_BEST 2
#endif
#ifndef GN
#define GN GN_BEST
#endif
#ifndef GM
#define GM GM_BEST
#endif
#define NJ (GN / VL) /* vectors per quad of a tile */

#if defined(SI_VNNI512)
/* r[i] (16 int32 each) -> r[c] = {r[0][c], ..., r[15][c]}. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int c = 0; c < 4; c++) {
            t[8 * i + c] = _mm512_shuffle_i32x4(r[8 * i + c], r[8 * i + 4 + c], 0x88);
            t[8 * i + 4 + c] = _mm512_shuffle_i32x4(r[8 * i + c], r[8 * i + 4 + c], 0xDD);
        }
    for (int c = 0; c < 8; c++) {
        r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xDD);
    }
}
#endif

/* Rows [n0, n0 + GN) of w (rows >= N read as zero), the nfull full blocks -> pk [nfull][8][GN][4]
   (AVX-512: 16 rows x 16 quads at a time, one transpose in registers). */
static void repack(const int8_t *w, int64_t ldw, int64_t N, int64_t n0, int64_t nfull, int8_t *pk) {
    const int64_t quads = nfull * (QK / 4);
    int64_t c0 = 0;
#if defined(SI_VNNI512)
    for (; c0 + 16 <= quads; c0 += 16)
        for (int j = 0; j < NJ; j++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                const int64_t n = n0 + j * VL + i;
                r[i] = n < N ? _mm512_loadu_si512(w + n * ldw + c0 * 4) : _mm512_setzero_si512();
            }
            transpose16(r);
            for (int c = 0; c < 16; c++) _mm512_storeu_si512(pk + ((c0 + c) * GN + j * VL) * 4, r[c]);
        }
#endif
    for (int64_t r = 0; r < GN; r++) {
        int8_t *o = pk + r * 4;
        if (n0 + r >= N) {
            for (int64_t c = c0; c < quads; c++) memset(o + c * GN * 4, 0, 4);
            continue;
        }
        const int8_t *src = w + (n0 + r) * ldw;
        for (int64_t c = c0; c < quads; c++) memcpy(o + c * GN * 4, src + c * 4, 4);
    }
}

#if defined(SI_VNNI512)
/* negc [nfull][GN]: -128 * the sum of each lane's four weights over each block's quads. */
static void offsets(const int8_t *pk, int64_t nfull, int32_t *negc) {
    const __m512i k80 = _mm512_set1_epi8((char)0x80);
    for (int64_t b = 0; b < nfull; b++)
        for (int j = 0; j < NJ; j++) {
            __m512i s = _mm512_setzero_si512();
            for (int q = 0; q < QK / 4; q++)
                s = _mm512_dpbusd_epi32(s, k80, _mm512_loadu_si512(pk + ((b * 8 + q) * GN + j * VL) * 4));
            _mm512_storeu_si512(negc + b * GN + j * VL, _mm512_sub_epi32(_mm512_setzero_si512(), s));
        }
}

/* out [GM][GN] = the tile's products with activation rows u [GM][ldu] (offset bytes), their
   block scales xd [GM][ldd]. */
static void tile_product(const int8_t *pk, const int32_t *negc, const uint8_t *u, int64_t ldu,
                         const float *xd, int64_t ldd, int64_t nfull, float *out, int add) {
    __m512 f[GM][NJ];
    for (int m = 0; m < GM; m++)
        for (int j = 0; j < NJ; j++)
            f[m][j] = add ? _mm512_loadu_ps(out + m * GN + j * VL) : _mm512_setzero_ps();
    for (int64_t b = 0; b < nfull; b++) {
        __m512i a[GM][NJ];
        for (int j = 0; j < NJ; j++) {
            const __m512i c = _mm512_loadu_si512(negc + b * GN + j * VL);
            for (int m = 0; m < GM; m++) a[m][j] = c;
        }
        const int8_t *p = pk + b * 8 * GN * 4;
        for (int q = 0; q < QK / 4; q++) {
            __m512i w[NJ];
            for (int j = 0; j < NJ; j++) w[j] = _mm512_loadu_si512(p + (q * GN + j * VL) * 4);
            for (int m = 0; m < GM; m++) {
                int32_t v;
                memcpy(&v, u + m * ldu + b * QK + q * 4, 4);
                const __m512i xb = _mm512_set1_epi32(v);
                for (int j = 0; j < NJ; j++) a[m][j] = _mm512_dpbusd_epi32(a[m][j], xb, w[j]);
            }
        }
        for (int m = 0; m < GM; m++) {
            const __m512 s = _mm512_set1_ps(xd[m * ldd + b]);
            for (int j = 0; j < NJ; j++)
                f[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[m][j]), s, f[m][j]);
        }
    }
    for (int m = 0; m < GM; m++)
        for (int j = 0; j < NJ; j++) _mm512_storeu_ps(out + m * GN + j * VL, f[m][j]);
}
#elif defined(SI_NEON_DOT)
#define LANE_STEP(L)                                                                           \
    do {                                                                                       \
        const int8x16_t w0 = vld1q_s8(p + (qq * 4 + L) * GN * 4);                             \
        const int8x16_t w1 = vld1q_s8(p + (qq * 4 + L) * GN * 4 + 16);                        \
        for (int m = 0; m < GM; m++) {                                                         \
            a[m][0] = vdotq_laneq_s32(a[m][0], w0, xv[m], L);                                  \
            a[m][1] = vdotq_laneq_s32(a[m][1], w1, xv[m], L);                                  \
        }                                                                                      \
    } while (0)

static void tile_product(const int8_t *pk, const int32_t *negc, const uint8_t *u, int64_t ldu,
                         const float *xd, int64_t ldd, int64_t nfull, float *out, int add) {
    (void)negc;
    const int8_t *xq = (const int8_t *)u;
    float32x4_t f[GM][2];
    for (int m = 0; m < GM; m++)
        for (int j = 0; j < 2; j++) f[m][j] = add ? vld1q_f32(out + m * GN + j * 4) : vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nfull; b++) {
        int32x4_t a[GM][2];
        for (int m = 0; m < GM; m++) a[m][0] = a[m][1] = vdupq_n_s32(0);
        const int8_t *p = pk + b * 8 * GN * 4;
        for (int qq = 0; qq < 2; qq++) {
            int8x16_t xv[GM];
            for (int m = 0; m < GM; m++) xv[m] = vld1q_s8(xq + m * ldu + b * QK + qq * 16);
            LANE_STEP(0);
            LANE_STEP(1);
            LANE_STEP(2);
            LANE_STEP(3);
        }
        for (int m = 0; m < GM; m++) {
            f[m][0] = vfmaq_n_f32(f[m][0], vcvtq_f32_s32(a[m][0]), xd[m * ldd + b]);
            f[m][1] = vfmaq_n_f32(f[m][1], vcvtq_f32_s32(a[m][1]), xd[m * ldd + b]);
        }
    }
    for (int m = 0; m < GM; m++) {
        vst1q_f32(out + m * GN, f[m][0]);
        vst1q_f32(out + m * GN + 4, f[m][1]);
    }
}
#else /* AVX2, AVX-VNNI, AVX-512BW: 256-bit, the activations' signs moved onto the weights */
static void tile_product(const int8_t *pk, const int32_t *negc, const uint8_t *u, int64_t ldu,
                         const float *xd, int64_t ldd, int64_t nfull, float *out, int add) {
    (void)negc;
    const int8_t *xq = (const int8_t *)u;
#if !defined(SI_AVXVNNI)
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    __m256 f[GM][NJ];
    for (int m = 0; m < GM; m++)
        for (int j = 0; j < NJ; j++)
            f[m][j] = add ? _mm256_loadu_ps(out + m * GN + j * VL) : _mm256_setzero_ps();
    for (int64_t b = 0; b < nfull; b++) {
        __m256i a[GM][NJ];
        for (int m = 0; m < GM; m++)
            for (int j = 0; j < NJ; j++) a[m][j] = _mm256_setzero_si256();
        const int8_t *p = pk + b * 8 * GN * 4;
        for (int q = 0; q < QK / 4; q++) {
            __m256i w[NJ];
            for (int j = 0; j < NJ; j++) w[j] = _mm256_loadu_si256((const __m256i *)(p + (q * GN + j * VL) * 4));
            for (int m = 0; m < GM; m++) {
                int32_t v;
                memcpy(&v, xq + m * ldu + b * QK + q * 4, 4);
                const __m256i xb = _mm256_set1_epi32(v), ax = _mm256_sign_epi8(xb, xb);
                for (int j = 0; j < NJ; j++) {
                    const __m256i sw = _mm256_sign_epi8(w[j], xb);
#if defined(SI_AVXVNNI)
                    a[m][j] = _mm256_dpbusd_avx_epi32(a[m][j], ax, sw);
#else
                    a[m][j] = _mm256_add_epi32(a[m][j], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sw), ones));
#endif
                }
            }
        }
        for (int m = 0; m < GM; m++) {
            const __m256 s = _mm256_set1_ps(xd[m * ldd + b]);
            for (int j = 0; j < NJ; j++)
                f[m][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[m][j]), s, f[m][j]);
        }
    }
    for (int m = 0; m < GM; m++)
        for (int j = 0; j < NJ; j++) _mm256_storeu_ps(out + m * GN + j * VL, f[m][j]);
}
#endif

/* y = scale * (W . x) for M >= GEMM_MIN_M activation rows, quantized as xq [Mp][nb * QK] (Mp:
   M rounded up to GM, rows beyond M zero), xd [Mp][nb]. Tiles of GN rows are shared among the
   threads; a tile is repacked and multiplied KC blocks at a time (the repacked part stays in the
   first-level cache while every activation row passes over it), the float sums kept in acc
   [Mp][GN]. The last partial block (K % QK) is added exactly in float. */
#ifndef KC
#define KC 32
#endif
static int gemm_i8(const float *x, int64_t M, int64_t K, const int8_t *w, int64_t N, int64_t ldw,
                   const float *scale, float *y, int8_t *xq, const float *xd, int threads) {
    const int64_t nb = (K + QK - 1) / QK, nfull = K / QK, from = nfull * QK, ldu = nb * QK;
    const int64_t tiles = (N + GN - 1) / GN, Mp = (M + GM - 1) / GM * GM;
#if defined(SI_VNNI512)
    for (int64_t i = 0; i < Mp * ldu; i++) xq[i] = (int8_t)((uint8_t)xq[i] ^ 0x80); /* u = xq + 128 */
#endif
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int8_t *pk = (int8_t *)aligned_alloc(64, (size_t)(KC * QK * GN));
        int32_t *negc = (int32_t *)aligned_alloc(64, (size_t)(KC * GN) * sizeof(int32_t));
        float *acc = (float *)aligned_alloc(64, (size_t)(Mp * GN) * sizeof(float));
        if (!pk || !negc || !acc) {
#pragma omp atomic write
            failed = 1;
        } else {
            int64_t t0, t1;
            share(tiles, team_id(), team_size(), &t0, &t1);
            for (int64_t t = t0; t < t1; t++) {
                const int64_t n0 = t * GN;
                if (nfull == 0) memset(acc, 0, (size_t)(Mp * GN) * sizeof(float));
                for (int64_t b0 = 0; b0 < nfull; b0 += KC) {
                    const int64_t kb = nfull - b0 < KC ? nfull - b0 : KC;
                    repack(w + b0 * QK, ldw, N, n0, kb, pk);
#if defined(SI_VNNI512)
                    offsets(pk, kb, negc);
#endif
                    for (int64_t m0 = 0; m0 < Mp; m0 += GM)
                        tile_product(pk, negc, (const uint8_t *)xq + m0 * ldu + b0 * QK, ldu,
                                     xd + m0 * nb + b0, nb, kb, acc + m0 * GN, b0 > 0);
                }
                for (int64_t m = 0; m < M; m++)
                    for (int64_t n = n0; n < N && n < n0 + GN; n++) {
                        float v = acc[m * GN + (n - n0)];
                        if (from < K) v += tail(w + n * ldw, from, K, x + m * K);
                        y[m * N + n] = scale ? v * scale[n] : v;
                    }
            }
        }
        free(pk);
        free(negc);
        free(acc);
    }
    return failed ? -1 : 0;
}
#endif /* SI_GEMM */

int si_linear_i8(const float *x, int64_t M, int64_t K, const int8_t *w, int64_t N, int64_t ldw,
                 const float *scale, float *y, int threads) {
    int64_t nb = (K + QK - 1) / QK;
#ifdef SI_GEMM
    const int64_t Mp = M >= GEMM_MIN_M ? (M + GM - 1) / GM * GM : M;
#else
    const int64_t Mp = M;
#endif
    int8_t *xq = (int8_t *)aligned_alloc(64, (size_t)((Mp * nb * QK + 63) / 64 * 64));
    float *xd = (float *)calloc((size_t)(Mp * nb), sizeof(float));
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return -1;
    }
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, xq + m * nb * QK, xd + m * nb);
    memset(xq + M * nb * QK, 0, (size_t)((Mp - M) * nb * QK));
    threads = clamp_threads(threads);
    int rc = 0;
#ifdef SI_PREP
    if (M < PREP_MAX_M) { /* a few rows (a batch's output layer): activations prepared once */
        const int64_t pld = prep_bytes(K), nfull = K / QK;
        uint8_t *prep = (uint8_t *)aligned_alloc(64, (size_t)((M * pld + 63) / 64 * 64));
        if (!prep) {
            rc = -1;
        } else {
            for (int64_t m = 0; m < M; m++)
                prep_pairs(xq + m * nb * QK, xd + m * nb, nfull, 0, (nfull + 1) / 2,
                           prep + m * pld);
#pragma omp parallel num_threads(threads) if (threads > 1)
            {
                int64_t n0, n1;
                share(N, team_id(), team_size(), &n0, &n1);
                rows_prep(w, ldw, K, scale, prep, pld, M, x, K, y, N, n0, n1);
            }
        }
        free(prep);
        free(xq);
        free(xd);
        return rc;
    }
#endif
#ifdef SI_GEMM
    if (M >= GEMM_MIN_M) {
        rc = gemm_i8(x, M, K, w, N, ldw, scale, y, xq, xd, threads);
        free(xq);
        free(xd);
        return rc;
    }
#endif
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t n0, n1;
        share(N, team_id(), team_size(), &n0, &n1);
        /* one row at a time for all M activation rows: every weight row is read once */
        for (int64_t n = n0; n < n1; n++)
            for (int64_t m = 0; m < M; m++)
                rows_q(w, ldw, K, scale, xq + m * nb * QK, xd + m * nb, x + m * K, y + m * N, n,
                       n + 1);
    }
    free(xq);
    free(xd);
    return rc;
}
