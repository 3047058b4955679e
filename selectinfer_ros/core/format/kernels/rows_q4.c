/* 4-bit rows: the row product and the down product of 4-bit records. Part of kernel.c. */
/* ---------------------------------------------------------------------------------------
   4-bit rows (llama.cpp's Q4_0 values): per block of 32 weights, 16 bytes of nibbles (byte j:
   weight j in the low nibble, weight j + 16 in the high one, stored as q + 8, q in [-8, 7])
   and one float16 scale: w = q * d. The activations are quantized per block as above and
   stored in pair order (pair_blocks), so that one 32-byte load of nibbles serves two blocks.

   y[m, n] = sum_b d[n, b] * xd[m, b] * sum_{k in b} q[n, k] * xq[m, k]

   w4: [N, K / 2] bytes at row stride ldw (bytes), d: [N, K / 32] float16 bits at row stride
   ldd; K a multiple of 32. */
#if defined(__aarch64__)
static inline float half_to_float(uint16_t h) { /* the CPU's own conversion (fcvt) */
    __fp16 f;
    memcpy(&f, &h, sizeof f);
    return (float)f;
}
#else
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
    union {
        uint32_t u;
        float f;
    } v;
    if (e == 0) { /* zero or subnormal: m * 2^-24 */
        float f = (float)m * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    v.u = sign | (e == 31 ? 0x7F800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    return v.f;
}
#endif

static void q4_row(const uint8_t *w, const uint16_t *d, int64_t nb, const int8_t *xq,
                   const float *xd, const int32_t *xs, float *out) {
    /* xq in pair order (pair_blocks) */
#if defined(SI_AVX2) || defined(SI_AVX512)
    /* the nibbles q + 8 are the unsigned operand as they are: sum (q + 8) x = sum q x +
       8 sum x, and 8 sum x is taken off as 8 xs[b] (the block's activation sum). Two blocks
       per 32-byte load: their low nibbles times the pair's first 32 activations, their high
       nibbles times the next 32, give block 2p in lanes 0-3 and 2p + 1 in lanes 4-7. Eight
       blocks at a time: their integer sums are reduced into one vector, then scaled by their
       eight scales (converted together) in one multiply-add. */
    __m256 acc = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        __m256i p[4];
        for (int j = 0; j < 4; j++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(w + (b + 2 * j) * 16));
            __m256i lo = _mm256_and_si256(raw, low);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            const int8_t *xp = xq + (b + 2 * j) * QK;
            __m256i x0 = _mm256_loadu_si256((const __m256i *)xp);
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(xp + QK));
#if defined(SI_AVXVNNI)
            p[j] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, x0),
                                           hi, x1);
#elif defined(SI_VNNI512)
            p[j] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, x0), hi, x1);
#else
            p[j] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, x0),
                                                      _mm256_maddubs_epi16(hi, x1)),
                                     _mm256_set1_epi16(1));
#endif
        }
        /* lanes: blocks 0 2 4 6 | 1 3 5 7 of the eight, then in block order */
        __m256i sum = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
        sum = _mm256_permutevar8x32_epi32(sum, order);
        sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(
                                        _mm256_loadu_si256((const __m256i *)(xs + b)), 3));
        __m256 sc = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b))),
                                  _mm256_loadu_ps(xd + b));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), sc, acc);
    }
    float rest = 0.0f;
    const __m128i low16 = _mm_set1_epi8(0x0F);
    for (; b < nb; b++) { /* one block, its halves where pair order put them */
        __m128i raw = _mm_loadu_si128((const __m128i *)(w + b * 16));
        __m128i lo = _mm_and_si128(raw, low16), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low16);
        __m128i v = _mm_add_epi16(
            _mm_maddubs_epi16(lo, _mm_loadu_si128((const __m128i *)(xq + xq_lo(b, nb)))),
            _mm_maddubs_epi16(hi, _mm_loadu_si128((const __m128i *)(xq + xq_hi(b, nb)))));
        v = _mm_madd_epi16(v, _mm_set1_epi16(1));
        v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
        v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1));
        rest += (float)(_mm_cvtsi128_si32(v) - 8 * xs[b]) * (_cvtsh_ss(d[b]) * xd[b]);
    }
    *out = hsum256(acc) + rest;
#elif defined(SI_NEON_DOT)
    float32x4_t acc = vdupq_n_f32(0.0f);
    const uint8x16_t low = vdupq_n_u8(0x0F);
    const int8x16_t eight = vdupq_n_s8(8);
    for (int64_t b = 0; b < nb; b++) {
        uint8x16_t raw = vld1q_u8(w + b * 16);
        int8x16_t lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(raw, low)), eight);
        int8x16_t hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(raw, 4)), eight);
        int32x4_t p = vdotq_s32(vdupq_n_s32(0), lo, vld1q_s8(xq + xq_lo(b, nb)));
        p = vdotq_s32(p, hi, vld1q_s8(xq + xq_hi(b, nb)));
        acc = vfmaq_n_f32(acc, vcvtq_f32_s32(p), half_to_float(d[b]) * xd[b]);
    }
    (void)xs;
    *out = vaddvq_f32(acc);
#else
    (void)xs;
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *x0 = xq + xq_lo(b, nb), *x1 = xq + xq_hi(b, nb);
        int32_t s = 0;
        for (int j = 0; j < 16; j++) {
            s += ((int32_t)(w[b * 16 + j] & 15) - 8) * (int32_t)x0[j];
            s += ((int32_t)(w[b * 16 + j] >> 4) - 8) * (int32_t)x1[j];
        }
        acc += (float)s * (half_to_float(d[b]) * xd[b]);
    }
    *out = acc;
#endif
}

int si_linear_q4(const float *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *d,
                 int64_t N, int64_t ldw, int64_t ldd, float *y, int threads) {
    if (K % QK) return -2;
    int64_t nb = K / QK;
    int8_t *xq = (int8_t *)aligned_alloc(64, (size_t)((M * nb * QK + 63) / 64 * 64));
    float *xd = (float *)malloc((size_t)(M * nb) * sizeof(float));
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return -1;
    }
    int32_t *xs = (int32_t *)malloc((size_t)(M * nb) * sizeof(int32_t));
    if (!xs) {
        free(xq);
        free(xd);
        return -1;
    }
    for (int64_t m = 0; m < M; m++) {
        quantize_blocks(x + m * K, K, 0, nb, xq + m * nb * QK, xd + m * nb, xs + m * nb);
        pair_blocks(xq + m * nb * QK, 0, nb, nb);
    }
    threads = clamp_threads(threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t n0, n1;
        share(N, team_id(), team_size(), &n0, &n1);
        for (int64_t n = n0; n < n1; n++)
            for (int64_t m = 0; m < M; m++)
                q4_row(w + n * ldw, d + n * ldd, nb, xq + m * nb * QK, xd + m * nb, xs + m * nb,
                       y + m * N + n);
    }
    free(xq);
    free(xd);
    free(xs);
    return 0;
}

/* The transposed product over 4-bit rows: y [H] = sum_{n < k} a[n] * dequant(row n), rows
   as above (w at stride ldw bytes, d at stride ldd float16s), for the blocks [b0, b1) of H
   (y's other blocks untouched). A 4-bit neuron record's down column is such a row: the down
   product of the active prefix reads each active record's column once, in place (with a list
   of rows, idx, the columns of the neurons a token kept: the groups below are then groups of 32
   entries of the list).

   In integers, like the row products: the coefficients c[n, b] = a[n] * d[n, b] of a group of
   32 neurons (n = 32 g + i) are quantized per block b of H to int8 (cq[i, b], one float scale
   s[b] per group and block, as quantize_blocks does), then

     y[j] += s[b] * sum_{i < 32} cq[i, b] * q[n, j]      (j in block b)

   where the sum over 32 neurons of a 4-bit weight times an int8 is below 2^15 in magnitude:
   it is summed exactly in int16 lanes (AVX2: the unsigned nibbles q + 8, in wrapping int16
   arithmetic, then 8 * sum_i cq[i, b] taken off, which leaves the exact signed sum). Every
   path computes the same cq and the same integer sums; they differ only where a float
   multiply-add is fused. */
#define DG 32 /* neurons per coefficient group */
#define DB 64 /* blocks of H per coefficient pass */

/* The columns are short streams (H / 2 bytes, a record apart), too short for the hardware
   prefetchers to follow from memory: while a group is read at block b, the next group's
   nibbles (a cache line per four blocks) and scales (a line per 32 blocks) at b are fetched,
   into L2 (Qwen2.5 1.5B, per-token selection at 0.5, one thread, Zen 4: decode 0.80x of all
   neurons, into L1 0.72x). */
static inline void prefetch_column(const uint8_t *w, const uint16_t *d, int64_t ldw, int64_t ldd,
                                   const int32_t *idx, int64_t n, int64_t k, int64_t b) {
    if (n >= k) return;
    int64_t r = idx ? idx[n] : n;
    if ((b & 3) == 0) __builtin_prefetch(w + r * ldw + b * 16, 0, 2);
    if ((b & 31) == 0) __builtin_prefetch(d + r * ldd + b, 0, 2);
}

/* The coefficients of neurons [g0, g0 + G) of the list for blocks [bc, bc + nbc): cq [G, DB]
   int16 (row i: list entry g0 + i, column b - bc), s [nbc] the scales, cs [nbc] the sums over i
   of cq. List entry j is a[j] times the scales of row idx[j] of d (idx NULL: row j). */
static void down_coeffs(const float *a, const uint16_t *d, int64_t ldd, const int32_t *idx,
                        int64_t g0, int64_t G, int64_t bc, int64_t nbc, int16_t *cq, float *s,
                        int32_t *cs) {
    const uint16_t *dr[DG]; /* the group's scale rows, from block bc */
    for (int64_t i = 0; i < G; i++) dr[i] = d + (idx ? idx[g0 + i] : g0 + i) * ldd + bc;
    int64_t b = 0;
#if defined(SI_AVX2) || defined(SI_AVX512)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (; b + 8 <= nbc; b += 8) {
        __m256 mx = _mm256_setzero_ps();
        for (int64_t i = 0; i < G; i++) {
            __m256 c = _mm256_mul_ps(
                _mm256_set1_ps(a[g0 + i]),
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dr[i] + b))));
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, c));
        }
        __m256 sc = _mm256_div_ps(mx, _mm256_set1_ps(127.0f));
        __m256 inv = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), sc),
                                   _mm256_cmp_ps(sc, _mm256_setzero_ps(), _CMP_GT_OQ));
        _mm256_storeu_ps(s + b, sc);
        __m256i sum = _mm256_setzero_si256();
        for (int64_t i = 0; i < G; i++) {
            __m256 c = _mm256_mul_ps(
                _mm256_set1_ps(a[g0 + i]),
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dr[i] + b))));
            __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(c, inv)); /* nearest, ties to even */
            sum = _mm256_add_epi32(sum, q);
            _mm_storeu_si128((__m128i *)(cq + i * DB + b),
                             _mm_packs_epi32(_mm256_castsi256_si128(q),
                                             _mm256_extracti128_si256(q, 1)));
        }
        _mm256_storeu_si256((__m256i *)(cs + b), sum);
    }
#endif
    for (; b < nbc; b++) {
        float mx = 0.0f;
        for (int64_t i = 0; i < G; i++) {
            float c = fabsf(a[g0 + i] * half_to_float(dr[i][b]));
            mx = c > mx ? c : mx;
        }
        float sc = mx / 127.0f, inv = sc > 0.0f ? 1.0f / sc : 0.0f;
        int32_t sum = 0;
        for (int64_t i = 0; i < G; i++) {
            int32_t q = (int32_t)lrintf(a[g0 + i] * half_to_float(dr[i][b]) * inv);
            cq[i * DB + b] = (int16_t)q;
            sum += q;
        }
        s[b] = sc;
        cs[b] = sum;
    }
}

/* y[blocks bc .. bc + nbc) += the group's G rows wr[i] (4-bit, from block 0) times their
   coefficients (down_coeffs: cq, s, cs); pf: the next group's columns are fetched meanwhile
   (prefetch_column with the list, from entry g0 + DG), NULL when its rows are near already. */
static void axpy_q4_group(const uint8_t *const *wr, int64_t G, const int16_t *cq,
                          const float *s, const int32_t *cs, int64_t bc, int64_t nbc, float *y,
                          const uint8_t *pf, const uint16_t *d, int64_t ldw, int64_t ldd,
                          const int32_t *idx, int64_t g0, int64_t k) {
    for (int64_t b = bc; b < bc + nbc; b++) {
        float *yb = y + b * QK;
        const int16_t *cb = cq + (b - bc);
#if defined(SI_AVX2) || defined(SI_AVX512)
        const __m256i low = _mm256_set1_epi16(0x0F);
        __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
        for (int64_t i = 0; i < G; i++) {
            const uint8_t *wn = wr[i] + b * 16;
            if (pf) prefetch_column(pf, d, ldw, ldd, idx, g0 + i + DG, k, b);
            __m256i r = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)wn));
            __m256i c = _mm256_set1_epi16(cb[i * DB]);
            lo = _mm256_add_epi16(lo, _mm256_mullo_epi16(_mm256_and_si256(r, low), c));
            hi = _mm256_add_epi16(hi, _mm256_mullo_epi16(_mm256_srli_epi16(r, 4), c));
        }
        __m256i off = _mm256_set1_epi16((int16_t)(uint16_t)(8u * (uint32_t)cs[b - bc]));
        lo = _mm256_sub_epi16(lo, off); /* sum (q + 8) c - 8 sum c: the exact signed sum */
        hi = _mm256_sub_epi16(hi, off);
        __m256 sc = _mm256_set1_ps(s[b - bc]);
        __m256i v[4] = {_mm256_cvtepi16_epi32(_mm256_castsi256_si128(lo)),
                        _mm256_cvtepi16_epi32(_mm256_extracti128_si256(lo, 1)),
                        _mm256_cvtepi16_epi32(_mm256_castsi256_si128(hi)),
                        _mm256_cvtepi16_epi32(_mm256_extracti128_si256(hi, 1))};
        for (int j = 0; j < 4; j++)
            _mm256_storeu_ps(yb + 8 * j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v[j]), sc,
                                                         _mm256_loadu_ps(yb + 8 * j)));
#elif defined(SI_NEON_DOT)
        const uint8x16_t low = vdupq_n_u8(0x0F);
        const int8x16_t eight = vdupq_n_s8(8);
        int16x8_t acc[4] = {vdupq_n_s16(0), vdupq_n_s16(0), vdupq_n_s16(0),
                            vdupq_n_s16(0)};
        for (int64_t i = 0; i < G; i++) {
            const uint8_t *wn = wr[i] + b * 16;
            if (pf) prefetch_column(pf, d, ldw, ldd, idx, g0 + i + DG, k, b);
            uint8x16_t raw = vld1q_u8(wn);
            int8x16_t lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(raw, low)), eight);
            int8x16_t hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(raw, 4)), eight);
            int8x8_t c = vdup_n_s8((int8_t)cb[i * DB]);
            acc[0] = vmlal_s8(acc[0], vget_low_s8(lo), c);
            acc[1] = vmlal_s8(acc[1], vget_high_s8(lo), c);
            acc[2] = vmlal_s8(acc[2], vget_low_s8(hi), c);
            acc[3] = vmlal_s8(acc[3], vget_high_s8(hi), c);
        }
        float sc = s[b - bc];
        for (int j = 0; j < 4; j++) {
            float32x4_t v0 = vcvtq_f32_s32(vmovl_s16(vget_low_s16(acc[j])));
            float32x4_t v1 = vcvtq_f32_s32(vmovl_s16(vget_high_s16(acc[j])));
            vst1q_f32(yb + 8 * j, vfmaq_n_f32(vld1q_f32(yb + 8 * j), v0, sc));
            vst1q_f32(yb + 8 * j + 4, vfmaq_n_f32(vld1q_f32(yb + 8 * j + 4), v1, sc));
        }
#else
        int32_t acc[QK] = {0};
        for (int64_t i = 0; i < G; i++) {
            const uint8_t *wn = wr[i] + b * 16;
            int32_t c = cb[i * DB];
            for (int j = 0; j < 16; j++) {
                acc[j] += ((int32_t)(wn[j] & 15) - 8) * c;
                acc[j + 16] += ((int32_t)(wn[j] >> 4) - 8) * c;
            }
        }
        for (int j = 0; j < QK; j++) yb[j] += s[b - bc] * (float)acc[j];
#endif
    }
}

/* y = sum over the list j < k of a[j] * row idx[j] (idx NULL: rows 0..k-1, the active prefix;
   else the neurons a token kept, read in place), blocks [b0, b1) of y. */
static void axpy_q4_part(const float *a, int64_t k, const int32_t *idx, const uint8_t *w,
                         const uint16_t *d, int64_t ldw, int64_t ldd, float *y, int64_t b0,
                         int64_t b1) {
    int16_t cq[DG * DB];
    float s[DB];
    int32_t cs[DB];
    const uint8_t *wr[DG]; /* the group's rows */
    for (int64_t i = b0 * QK; i < b1 * QK; i++) y[i] = 0.0f;
    for (int64_t bc = b0; bc < b1; bc += DB) {
        int64_t nbc = b1 - bc < DB ? b1 - bc : DB;
        for (int64_t g0 = 0; g0 < k; g0 += DG) {
            int64_t G = k - g0 < DG ? k - g0 : DG;
            for (int64_t i = 0; i < G; i++) wr[i] = w + (idx ? idx[g0 + i] : g0 + i) * ldw;
            down_coeffs(a, d, ldd, idx, g0, G, bc, nbc, cq, s, cs);
            axpy_q4_group(wr, G, cq, s, cs, bc, nbc, y, w, d, ldw, ldd, idx, g0, k);
        }
    }
}

/* y [M, H] = a [M, k] . W, W: k 4-bit rows of H (the down columns of 4-bit neuron records);
   threads split the blocks of H. */
int si_axpy_q4(const float *a, int64_t M, int64_t k, const uint8_t *w, const uint16_t *d,
               int64_t ldw, int64_t ldd, int64_t H, float *y, int threads) {
    if (H % QK) return -2;
    threads = clamp_threads(threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t b0, b1;
        share(H / QK, team_id(), team_size(), &b0, &b1);
        for (int64_t m = 0; m < M; m++)
            axpy_q4_part(a + m * k, k, NULL, w, d, ldw, ldd, y + m * H, b0, b1);
    }
    return 0;
}
