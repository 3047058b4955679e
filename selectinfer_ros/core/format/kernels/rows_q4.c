/* 4-bit rows: the row product and the down product of 4-bit records. Part of kernel.c. */
/* ---------------------------------------------------------------------------------------
   4-bit rows (llama.cpp's Q4_K values, q4.py): a row of K weights (K a multiple of 64) is
   K / 2 bytes of nibbles and, per super-block of up to 256 weights (8 sub-blocks of 32), a
   16-byte head: float16 d and dmin, then the 6-bit scale sc[j] and minimum m[j] of each
   sub-block j packed in 12 bytes. Weight i of sub-block j is d * sc[j] * q[i] - dmin * m[j], q in
   [0, 15]. Byte c * 32 + i of the nibbles holds q[64 c + i] (low nibble, sub-block 2c) and
   q[64 c + 32 + i] (high nibble, sub-block 2c + 1): one 32-byte load serves two sub-blocks
   whose activations lie in their natural order.

   Against activations quantized per block of 32 (xq, xd, and xs the block's sum of xq):

     y[m, n] = sum_b xd[b] * (d sc[b] * sum_{i in b} q[i] xq[i] - dmin m[b] * xs[b])

   w: [N, K / 2] bytes at row stride ldw, hd: [N, ceil(K / 256) * 16] head bytes at row stride
   ldh. */
#if defined(__aarch64__)
static inline float half_to_float(uint16_t h) { /* the CPU's own conversion (fcvt) */
    __fp16 f;
    memcpy(&f, &h, sizeof f);
    return (float)f;
}
#elif defined(SI_AVX2) || defined(SI_AVX512)
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); } /* F16C */
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

#define Q4_SB 256  /* weights per super-block */
#define Q4_HEAD 16 /* bytes of its head */

/* A super-block's head: d, dmin, and sm[0..7] the sub-blocks' scales, sm[8..15] their minimums
   (llama.cpp's get_scale_min_k4, four at a time in 32-bit words). */
static inline void q4_head(const uint8_t *h, float *d, float *dmin, uint8_t sm[16]) {
    uint16_t hd, hm;
    memcpy(&hd, h, 2);
    memcpy(&hm, h + 2, 2);
    *d = half_to_float(hd);
    *dmin = half_to_float(hm);
    uint32_t u[4];
    memcpy(u, h + 4, 12);
    const uint32_t k1 = 0x3f3f3f3fu, k2 = 0x0f0f0f0fu, k3 = 0x03030303u;
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    uint32_t mins = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = mins;
    u[0] &= k1;
    memcpy(sm, u, 16);
}

#if defined(SI_AVX2) || defined(SI_AVX512)
/* The same in a register: bytes 0-7 the scales, 8-15 the minimums, from one load and two byte
   shuffles (q: the 12 packed bytes; sc[0..3] = q[0..3] & 63, sc[4..7] = q[8..11] & 15 | q[0..3]
   >> 6 << 4, m[0..3] = q[4..7] & 63, m[4..7] = q[8..11] >> 4 | q[4..7] >> 6 << 4), no round trip
   through memory (whose narrower stores a wider load could not forward). */
static inline __m128i q4_head_vec(const uint8_t *h) {
    const __m128i v = _mm_loadu_si128((const __m128i *)h);
    const __m128i x = _mm_shuffle_epi8(v, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11,
                                                        12, 13, 14, 15));
    const __m128i t = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1,
                                                        -1, 8, 9, 10, 11));
    const __m128i low = _mm_or_si128(
        _mm_and_si128(x, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
        _mm_and_si128(_mm_srli_epi16(x, 4),
                      _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15)));
    return _mm_or_si128(low, _mm_and_si128(_mm_srli_epi16(t, 2), _mm_set1_epi8(0x30)));
}
#endif

#if defined(SI_AVX512)
/* q4_head_vec of the heads at h (lane 0) and h + Q4_HEAD (lane 1; zero unless two): the same
   shuffles in each 128-bit lane. */
static inline __m256i q4_head_vec2(const uint8_t *h, int two) {
    const __m256i v = two ? _mm256_loadu_si256((const __m256i *)h)
                          : _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)h));
    const __m256i x = _mm256_shuffle_epi8(v, _mm256_setr_epi8(
        4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15,
        4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m256i t = _mm256_shuffle_epi8(v, _mm256_setr_epi8(
        -1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11,
        -1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
    const __m256i low = _mm256_or_si256(
        _mm256_and_si256(x, _mm256_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0,
                                             63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
        _mm256_and_si256(_mm256_srli_epi16(x, 4),
                         _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15,
                                          0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15)));
    return _mm256_or_si256(low, _mm256_and_si256(_mm256_srli_epi16(t, 2), _mm256_set1_epi8(0x30)));
}
#endif

/* Head bytes of a row of K weights. */
static inline int64_t q4_head_bytes(int64_t K) { return (K + Q4_SB - 1) / Q4_SB * Q4_HEAD; }

/* One super-block of nsub sub-blocks (w: its nibbles, h: its head, xq, xd, xs from its first
   block), plainly: the reference, and the last partial super-block of the vector paths. */
static float q4_superblock(const uint8_t *w, const uint8_t *h, int64_t nsub, const int8_t *xq,
                           const float *xd, const int32_t *xs) {
    float d, dmin, acc = 0.0f, accm = 0.0f;
    uint8_t sm[16];
    q4_head(h, &d, &dmin, sm);
    for (int64_t j = 0; j < nsub; j++) {
        const uint8_t *wc = w + (j / 2) * QK;
        const int8_t *xb = xq + j * QK;
        int shift = (int)(j & 1) * 4;
        int32_t s = 0;
        for (int i = 0; i < QK; i++) s += (int32_t)((wc[i] >> shift) & 15) * (int32_t)xb[i];
        acc += (float)s * xd[j] * (float)sm[j];
        accm += (float)xs[j] * xd[j] * (float)sm[8 + j];
    }
    return d * acc - dmin * accm;
}

/* *out = the row (nb sub-blocks) against the quantized activations (natural order). */
static void q4_row(const uint8_t *w, const uint8_t *hd, int64_t nb, const int8_t *xq,
                   const float *xd, const int32_t *xs, float *out) {
    int64_t s = 0, nfull = nb / 8;
    float rest = 0.0f;
    (void)nfull;
#if defined(SI_AVX2) || defined(SI_AVX512)
    /* per super-block: four 32-byte loads of nibbles, each two sub-blocks' integer products
       (unsigned nibbles times signed activations), reduced to one vector of the eight sums, then
       scaled by d sc xd and the minimums' d m xd xs taken off, in two multiply-adds */
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (; s < nfull; s++) {
        const uint8_t *ws = w + s * (Q4_SB / 2);
        const int8_t *xs8 = xq + s * Q4_SB;
        __m256i p[8];
        for (int c = 0; c < 4; c++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(ws + c * QK));
            __m256i lo = _mm256_and_si256(raw, low);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(xs8 + c * 2 * QK));
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(xs8 + c * 2 * QK + QK));
#if defined(SI_AVXVNNI)
            p[2 * c] = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, x0);
            p[2 * c + 1] = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), hi, x1);
#elif defined(SI_VNNI512)
            p[2 * c] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, x0);
            p[2 * c + 1] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), hi, x1);
#else
            const __m256i one = _mm256_set1_epi16(1);
            p[2 * c] = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), one);
            p[2 * c + 1] = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), one);
#endif
        }
        const uint8_t *h = hd + s * Q4_HEAD;
        uint16_t hdm[2];
        memcpy(hdm, h, 4);
        float d = half_to_float(hdm[0]), dmin = half_to_float(hdm[1]);
        __m128i sm = q4_head_vec(h);
        __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm));
        __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
        __m256 xdv = _mm256_loadu_ps(xd + 8 * s);
        acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum8(p)), xdv),
                              _mm256_mul_ps(sc, _mm256_set1_ps(d)), acc);
        __m256 xsv = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(xs + 8 * s)));
        accm = _mm256_fmadd_ps(_mm256_mul_ps(xsv, xdv), _mm256_mul_ps(mn, _mm256_set1_ps(dmin)),
                               accm);
    }
    rest = hsum256(_mm256_sub_ps(acc, accm));
#elif defined(SI_NEON_DOT)
    const uint8x16_t low = vdupq_n_u8(0x0F);
    for (; s < nfull; s++) {
        const uint8_t *ws = w + s * (Q4_SB / 2);
        const int8_t *xs8 = xq + s * Q4_SB;
        float d, dmin, sums[8];
        uint8_t sm[16];
        for (int c = 0; c < 4; c++) {
            uint8x16_t r0 = vld1q_u8(ws + c * QK), r1 = vld1q_u8(ws + c * QK + 16);
            const int8_t *x = xs8 + c * 2 * QK;
            int32x4_t pl = vdotq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(vandq_u8(r0, low)),
                                     vld1q_s8(x));
            pl = vdotq_s32(pl, vreinterpretq_s8_u8(vandq_u8(r1, low)), vld1q_s8(x + 16));
            int32x4_t ph = vdotq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(vshrq_n_u8(r0, 4)),
                                     vld1q_s8(x + QK));
            ph = vdotq_s32(ph, vreinterpretq_s8_u8(vshrq_n_u8(r1, 4)), vld1q_s8(x + QK + 16));
            sums[2 * c] = (float)vaddvq_s32(pl);
            sums[2 * c + 1] = (float)vaddvq_s32(ph);
        }
        q4_head(hd + s * Q4_HEAD, &d, &dmin, sm);
        float a = 0.0f, am = 0.0f;
        for (int j = 0; j < 8; j++) {
            a += sums[j] * xd[8 * s + j] * (float)sm[j];
            am += (float)xs[8 * s + j] * xd[8 * s + j] * (float)sm[8 + j];
        }
        rest += d * a - dmin * am;
    }
#endif
    for (; s * 8 < nb; s++) {
        int64_t nsub = nb - s * 8 < 8 ? nb - s * 8 : 8;
        rest += q4_superblock(w + s * (Q4_SB / 2), hd + s * Q4_HEAD, nsub, xq + s * Q4_SB,
                              xd + s * 8, xs + s * 8);
    }
    *out = rest;
}

/* q4_row for T <= 4 activation rows at once (row t: xq + t * ldq, xd and xs + t * ldd; out[t *
   ldo]): each super-block's nibbles and head are unpacked once for all of them (a prefill's
   tokens); each row's result equals q4_row's. */
#define Q4_MT 4
static void q4_row_multi(const uint8_t *w, const uint8_t *hd, int64_t nb, int64_t T,
                         const int8_t *xq, int64_t ldq, const float *xd, const int32_t *xs,
                         int64_t ldd, float *out, int64_t ldo) {
#if defined(SI_AVX2) || defined(SI_AVX512)
    int64_t s = 0, nfull = nb / 8;
    __m256 acc[Q4_MT], accm[Q4_MT];
    for (int64_t t = 0; t < T; t++) acc[t] = accm[t] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (; s < nfull; s++) {
        const uint8_t *ws = w + s * (Q4_SB / 2);
        __m256i nib[8]; /* sub-block j's 32 nibbles as bytes */
        for (int c = 0; c < 4; c++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(ws + c * QK));
            nib[2 * c] = _mm256_and_si256(raw, low);
            nib[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        }
        const uint8_t *h = hd + s * Q4_HEAD;
        uint16_t hdm[2];
        memcpy(hdm, h, 4);
        float d = half_to_float(hdm[0]), dmin = half_to_float(hdm[1]);
        __m128i sm = q4_head_vec(h);
        __m256 scd = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)), _mm256_set1_ps(d));
        __m256 mnd = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))),
                                   _mm256_set1_ps(dmin));
        for (int64_t t = 0; t < T; t++) {
            const int8_t *xs8 = xq + t * ldq + s * Q4_SB;
            __m256i p[8];
            for (int j = 0; j < 8; j++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xs8 + j * QK));
#if defined(SI_AVXVNNI)
                p[j] = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), nib[j], xv);
#elif defined(SI_VNNI512)
                p[j] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), nib[j], xv);
#else
                p[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(nib[j], xv), _mm256_set1_epi16(1));
#endif
            }
            __m256 xdv = _mm256_loadu_ps(xd + t * ldd + 8 * s);
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum8(p)), xdv), scd, acc[t]);
            __m256 xsv = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(xs + t * ldd + 8 * s)));
            accm[t] = _mm256_fmadd_ps(_mm256_mul_ps(xsv, xdv), mnd, accm[t]);
        }
    }
    for (int64_t t = 0; t < T; t++) {
        float rest = hsum256(_mm256_sub_ps(acc[t], accm[t]));
        for (int64_t u = s; u * 8 < nb; u++) {
            int64_t nsub = nb - u * 8 < 8 ? nb - u * 8 : 8;
            rest += q4_superblock(w + u * (Q4_SB / 2), hd + u * Q4_HEAD, nsub,
                                  xq + t * ldq + u * Q4_SB, xd + t * ldd + u * 8,
                                  xs + t * ldd + u * 8);
        }
        out[t * ldo] = rest;
    }
#else
    for (int64_t t = 0; t < T; t++)
        q4_row(w, hd, nb, xq + t * ldq, xd + t * ldd, xs + t * ldd, out + t * ldo);
#endif
}

int si_linear_q4(const float *x, int64_t M, int64_t K, const uint8_t *w, const uint8_t *hd,
                 int64_t N, int64_t ldw, int64_t ldh, float *y, int threads) {
    if (K % (2 * QK)) return -2;
    int64_t nb = K / QK;
    si_qrows q;
    if (quantize_rows(x, M, K, &q)) return -1;
    const int8_t *xq = q.xq;
    const float *xd = q.xd;
    const int32_t *xs = q.xs;
    threads = clamp_threads(threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t n0, n1;
        share(N, team_id(), team_size(), &n0, &n1);
        for (int64_t n = n0; n < n1; n++)
            for (int64_t m = 0; m < M; m += Q4_MT)
                q4_row_multi(w + n * ldw, hd + n * ldh, nb, M - m < Q4_MT ? M - m : Q4_MT,
                             xq + m * nb * QK, nb * QK, xd + m * nb, xs + m * nb, nb, y + m * N + n,
                             N);
    }
    free_qrows(&q);
    return 0;
}

/* The transposed product over 4-bit rows: y [H] = sum_{n < k} a[n] * dequant(row n), rows as
   above, for the sub-blocks [b0, b1) of H (b0 a super-block's first; y's other blocks
   untouched). A 4-bit neuron record's down column is such a row: the down product of the
   active prefix reads each active record's column once, in place (with a list of rows, idx,
   the columns of the neurons a token kept: the groups below are then groups of 32 entries of
   the list).

   In integers, like the row products: the coefficients c[n, b] = a[n] * d[n] * sc[n, b] of a
   group of 32 neurons are quantized per sub-block b of H to int8 (cq[i, b], one float scale
   s[b] per group and sub-block, as quantize_blocks does), then

     y[j] += s[b] * sum_{i < 32} cq[i, b] * q[n, j] - sum_{i < 32} a[n] * dmin[n] * m[n, b]

   (j in sub-block b). The integer sum is taken in wrapping int16 lanes and 8 * sum_i cq[i, b]
   taken off, which leaves sum_i cq (q - 8), below 2^15 in magnitude, exactly; the 8 * s[b] *
   sum_i cq[i, b] is added back with the minimums, once per sub-block (kb[b]). Every path
   computes the same cq and integer sums; they differ only where a float multiply-add is
   fused. */
#define DG 32 /* neurons per coefficient group */
#define DB 64 /* sub-blocks of H per coefficient pass (whole super-blocks) */

/* The columns are short streams (H / 2 bytes, a record apart), too short for the hardware
   prefetchers to follow from memory: while a group is read at sub-block b, the next group's
   nibbles (a cache line per four sub-blocks) and heads (a line per 32) at b are fetched, into
   L2 (Qwen2.5 1.5B, per-token selection at 0.5, one thread, Zen 4: decode 0.80x of all neurons,
   into L1 0.72x). */
static inline void prefetch_column(const uint8_t *w, const uint8_t *hd, int64_t ldw, int64_t ldh,
                                   const int32_t *idx, int64_t n, int64_t k, int64_t b) {
    if (n >= k) return;
    int64_t r = idx ? idx[n] : n;
    if ((b & 3) == 0) __builtin_prefetch(w + r * ldw + b * 16, 0, 2);
    if ((b & 31) == 0) __builtin_prefetch(hd + r * ldh + b / 8 * Q4_HEAD, 0, 2);
}

/* The coefficients' quantization (down_coeffs): D [G, DB] entry i's a * d * sc per sub-block, Mt
   [DB] the sums over the entries of a * dmin * m -> cq, s, cs, kb. */
static void quant_coeffs(const float *D, const float *Mt, int64_t G, int64_t nbc, int16_t *cq,
                         float *s, int32_t *cs, float *kb) {
    int64_t b = 0;
#if defined(SI_AVX512)
    for (; b + 16 <= nbc; b += 16) { /* 16 sub-blocks a pass: the 8-wide loop's operations */
        __m512 mx = _mm512_setzero_ps();
        for (int64_t i = 0; i < G; i++)
            mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(D + i * DB + b)));
        __m512 sc = _mm512_div_ps(mx, _mm512_set1_ps(127.0f));
        __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(sc, _mm512_setzero_ps(), _CMP_GT_OQ),
                                         _mm512_set1_ps(1.0f), sc);
        _mm512_storeu_ps(s + b, sc);
        __m512i sum = _mm512_setzero_si512();
        for (int64_t i = 0; i < G; i++) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(D + i * DB + b), inv));
            sum = _mm512_add_epi32(sum, q); /* nearest, ties to even */
            _mm256_storeu_si256((__m256i *)(cq + i * DB + b), _mm512_cvtsepi32_epi16(q));
        }
        _mm512_storeu_si512(cs + b, sum);
        _mm512_storeu_ps(kb + b, _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(8.0f),
                                                             _mm512_mul_ps(sc, _mm512_cvtepi32_ps(sum))),
                                               _mm512_loadu_ps(Mt + b)));
    }
#endif
#if defined(SI_AVX2) || defined(SI_AVX512)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (; b + 8 <= nbc; b += 8) {
        __m256 mx = _mm256_setzero_ps();
        for (int64_t i = 0; i < G; i++)
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(D + i * DB + b)));
        __m256 sc = _mm256_div_ps(mx, _mm256_set1_ps(127.0f));
        __m256 inv = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), sc),
                                   _mm256_cmp_ps(sc, _mm256_setzero_ps(), _CMP_GT_OQ));
        _mm256_storeu_ps(s + b, sc);
        __m256i sum = _mm256_setzero_si256();
        for (int64_t i = 0; i < G; i++) {
            __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(D + i * DB + b), inv));
            sum = _mm256_add_epi32(sum, q); /* nearest, ties to even */
            _mm_storeu_si128((__m128i *)(cq + i * DB + b),
                             _mm_packs_epi32(_mm256_castsi256_si128(q),
                                             _mm256_extracti128_si256(q, 1)));
        }
        _mm256_storeu_si256((__m256i *)(cs + b), sum);
        _mm256_storeu_ps(kb + b, _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(8.0f),
                                                             _mm256_mul_ps(sc, _mm256_cvtepi32_ps(sum))),
                                               _mm256_loadu_ps(Mt + b)));
    }
#endif
    for (; b < nbc; b++) {
        float mx = 0.0f;
        for (int64_t i = 0; i < G; i++) {
            float c = fabsf(D[i * DB + b]);
            mx = c > mx ? c : mx;
        }
        float sc = mx / 127.0f, inv = sc > 0.0f ? 1.0f / sc : 0.0f;
        int32_t sum = 0;
        for (int64_t i = 0; i < G; i++) {
            int32_t q = (int32_t)lrintf(D[i * DB + b] * inv);
            cq[i * DB + b] = (int16_t)q;
            sum += q;
        }
        s[b] = sc;
        cs[b] = sum;
        kb[b] = 8.0f * (sc * (float)sum) - Mt[b];
    }
}


/* The coefficients of list entries [g0, g0 + G) for sub-blocks [bc, bc + nbc) (bc a super-block's
   first): cq [G, DB] int16 (row i: entry g0 + i, column b - bc), s [nbc] the scales, cs [nbc]
   the sums over i of cq, kb [nbc] the constant each y of the sub-block gets (see above). Entry j
   is a[j] with the heads of row idx[j] of hd (idx NULL: row j). */
static void down_coeffs(const float *a, const uint8_t *hd, int64_t ldh, const int32_t *idx,
                        int64_t g0, int64_t G, int64_t bc, int64_t nbc, int16_t *cq, float *s,
                        int32_t *cs, float *kb, si_pf *pf) {
    /* D: entry i's a * d * sc per sub-block; Mt: the sum over the entries of a * dmin * m (in
       entry order on every path). A partial last super-block writes a few unread columns. */
    float D[DG * DB], Mt[DB];
    for (int64_t b = 0; b < DB; b++) Mt[b] = 0.0f;
#if defined(SI_AVX512)
    /* Two super-blocks (16 sub-blocks) a step: their heads unpacked side by side in one
       register, d and dmin of both converted at once; per element the 8-wide code's products. */
    const __m512i lo8 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m512i hi8 = _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3);
    for (int64_t i = 0; i < G; i++) {
        const uint8_t *h = hd + (idx ? idx[g0 + i] : g0 + i) * ldh + bc / 8 * Q4_HEAD;
        const __m512 ai = _mm512_set1_ps(a[g0 + i]);
        for (int64_t b = 0; b < nbc; b += 16, h += 2 * Q4_HEAD) {
            const int two = b + 8 < nbc;
            pf_step(pf, 2);
            __m256i sm = q4_head_vec2(h, two); /* lane 0: super-block b / 8, lane 1: the next */
            int32_t w0, w1 = 0;
            memcpy(&w0, h, 4);
            if (two) memcpy(&w1, h + Q4_HEAD, 4);
            /* [d, dmin] of both, times a: fl(a d) as the 8-wide code's half_to_float product */
            __m512 dd = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_setr_epi32(w0, w1, 0, 0)));
            dd = _mm512_mul_ps(ai, dd);
            __m512 ad = _mm512_permutexvar_ps(lo8, dd), am = _mm512_permutexvar_ps(hi8, dd);
            __m128i sc = _mm_unpacklo_epi64(_mm256_castsi256_si128(sm), _mm256_extracti128_si256(sm, 1));
            __m128i mn = _mm_unpackhi_epi64(_mm256_castsi256_si128(sm), _mm256_extracti128_si256(sm, 1));
            _mm512_storeu_ps(D + i * DB + b, _mm512_mul_ps(ad, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc))));
            _mm512_storeu_ps(Mt + b, _mm512_add_ps(_mm512_loadu_ps(Mt + b),
                                                   _mm512_mul_ps(am, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)))));
        }
    }
#else
    for (int64_t i = 0; i < G; i++) {
        const uint8_t *h = hd + (idx ? idx[g0 + i] : g0 + i) * ldh + bc / 8 * Q4_HEAD;
        float ai = a[g0 + i];
        for (int64_t b = 0; b < nbc; b += 8, h += Q4_HEAD) {
            pf_step(pf, 2);
#if defined(SI_AVX2) || defined(SI_AVX512)
            uint16_t hdm[2];
            memcpy(hdm, h, 4);
            float ad = ai * half_to_float(hdm[0]), am = ai * half_to_float(hdm[1]);
            __m128i sm = q4_head_vec(h);
            _mm256_storeu_ps(D + i * DB + b, _mm256_mul_ps(_mm256_set1_ps(ad),
                                                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm))));
            __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
            _mm256_storeu_ps(Mt + b, _mm256_add_ps(_mm256_loadu_ps(Mt + b),
                                                   _mm256_mul_ps(_mm256_set1_ps(am), mn)));
#else
            float d, dmin;
            uint8_t sm[16];
            q4_head(h, &d, &dmin, sm);
            float ad = ai * d, am = ai * dmin;
            for (int j = 0; j < 8; j++) {
                D[i * DB + b + j] = ad * (float)sm[j];
                Mt[b + j] += am * (float)sm[8 + j];
            }
#endif
        }
    }
#endif
    quant_coeffs(D, Mt, G, nbc, cq, s, cs, kb);
}

#if defined(SI_AVX2) || defined(SI_AVX512)
/* acc + the sums of four products u (unsigned bytes) times s (signed bytes) per 32-bit lane:
   one instruction with VNNI, else two (the pairs' 16-bit sums cannot saturate here: u <= 15). */
static inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i s) {
#if defined(SI_VNNI512)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(SI_AVXVNNI)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
#endif
}

/* dpbusd256 where at most 8 steps sum into one accumulator (the groups' products: rows_q4il.c,
   rows_q4g.c): without a dot-product instruction the byte pairs' products are summed in 16-bit
   lanes (8 x 2 x 15 x 128 < 2^15) and widened to dpbusd256's 32-bit sums once, by dp_short_sum:
   one instruction less a step, the same integers. */
#if defined(SI_VNNI512) || defined(SI_AVXVNNI)
static inline __m256i dp_short(__m256i acc, __m256i u, __m256i s) { return dpbusd256(acc, u, s); }
static inline __m256i dp_short_sum(__m256i acc) { return acc; }
#else
static inline __m256i dp_short(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s));
}
static inline __m256i dp_short_sum(__m256i acc) {
    return _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
}
#endif

/* axpy_q4_group's sums with the dot-product instruction: four rows at a time (a quad), their
   bytes at each position interleaved into 32-bit lanes (two byte and two word unpacks), times
   the quad's four int8 coefficients of the sub-block broadcast: each lane sums four rows, no
   widening to 16 bits and no multiply per row (~2x fewer instructions with VNNI; without it the
   dot product is two instructions). The integer sums are
   exact (int32, as the NEON and plain paths sum them), so y is the same as theirs to the
   bit. Rows past G take coefficient 0. */
/* The coefficients of a group's first G rows as quads' words: cw[m * DB + j] holds rows 4m ..
   4m + 3's int8 coefficients of sub-block bc + j (rows past G: 0), the dot product's signed
   operand broadcast against four rows' bytes. */
static void quad_words(const int16_t *cq, int64_t G, int64_t nbc, int32_t *cw) {
    const __m256i pair = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                          0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    for (int64_t m = 0; m < (G + 3) / 4; m++)
        for (int64_t j = 0; j < nbc; j += 16) { /* rows 4m .. 4m + 3, sub-blocks j .. j + 15 */
            __m256i r[4];
            for (int q = 0; q < 4; q++)
                r[q] = 4 * m + q < G ? _mm256_loadu_si256((const __m256i *)(cq + (4 * m + q) * DB + j))
                                     : _mm256_setzero_si256();
            __m256i p01 = _mm256_shuffle_epi8(_mm256_packs_epi16(r[0], r[1]), pair);
            __m256i p23 = _mm256_shuffle_epi8(_mm256_packs_epi16(r[2], r[3]), pair);
            __m256i v0 = _mm256_unpacklo_epi16(p01, p23), v1 = _mm256_unpackhi_epi16(p01, p23);
            _mm256_storeu_si256((__m256i *)(cw + m * DB + j), _mm256_permute2x128_si256(v0, v1, 0x20));
            _mm256_storeu_si256((__m256i *)(cw + m * DB + j + 8), _mm256_permute2x128_si256(v0, v1, 0x31));
        }
}

static void axpy_q4_quads(const uint8_t *const *wr, int64_t G, const int16_t *cq,
                          const float *s, const int32_t *cs, const float *kb, int64_t bc,
                          int64_t nbc, float *y, const uint8_t *pf, const uint8_t *hd,
                          int64_t ldw, int64_t ldh, const int32_t *idx, int64_t g0, int64_t k) {
    enum { NQ = DG / 4 };
    int32_t cw[NQ * DB]; /* quad m's coefficient word of sub-block bc + j at [m * DB + j] */
    const uint8_t *rows[DG];
    int64_t nq = (G + 3) / 4;
    for (int64_t i = 0; i < 4 * nq; i++) rows[i] = wr[i < G ? i : 0];
    quad_words(cq, G, nbc, cw);
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = bc; b < bc + nbc; b += 2) { /* sub-blocks b (low nibbles), b + 1 (high) */
        __m256i lo[4], hi[4]; /* lane l of [t]: positions 4t + l (l < 4), 16 + 4t + l - 4 */
        for (int t = 0; t < 4; t++) lo[t] = hi[t] = _mm256_setzero_si256();
        for (int64_t m = 0; m < nq; m++) {
            if (pf)
                for (int q = 0; q < 4; q++)
                    prefetch_column(pf, hd, ldw, ldh, idx, g0 + 4 * m + q + DG, k, b);
            __m256i A = _mm256_loadu_si256((const __m256i *)(rows[4 * m] + b * 16));
            __m256i B = _mm256_loadu_si256((const __m256i *)(rows[4 * m + 1] + b * 16));
            __m256i C = _mm256_loadu_si256((const __m256i *)(rows[4 * m + 2] + b * 16));
            __m256i D = _mm256_loadu_si256((const __m256i *)(rows[4 * m + 3] + b * 16));
            __m256i ab0 = _mm256_unpacklo_epi8(A, B), ab1 = _mm256_unpackhi_epi8(A, B);
            __m256i cd0 = _mm256_unpacklo_epi8(C, D), cd1 = _mm256_unpackhi_epi8(C, D);
            __m256i q4[4] = {_mm256_unpacklo_epi16(ab0, cd0), _mm256_unpackhi_epi16(ab0, cd0),
                             _mm256_unpacklo_epi16(ab1, cd1), _mm256_unpackhi_epi16(ab1, cd1)};
            __m256i c0 = _mm256_set1_epi32(cw[m * DB + (b - bc)]);
            __m256i c1 = _mm256_set1_epi32(cw[m * DB + (b - bc) + 1]);
            for (int t = 0; t < 4; t++) {
                lo[t] = dpbusd256(lo[t], _mm256_and_si256(q4[t], low), c0);
                hi[t] = dpbusd256(hi[t], _mm256_and_si256(_mm256_srli_epi16(q4[t], 4), low), c1);
            }
        }
        float *yb = y + b * QK;
        for (int h = 0; h < 2; h++) { /* the sums of q c less 8 cs: those of (q - 8) c */
            const __m256i *a = h ? hi : lo;
            __m256i off = _mm256_set1_epi32(8 * cs[b - bc + h]);
            __m256 sc = _mm256_set1_ps(s[b - bc + h]), kc = _mm256_set1_ps(kb[b - bc + h]);
            __m256i v[4] = {_mm256_permute2x128_si256(a[0], a[1], 0x20),  /* positions 0-7 */
                            _mm256_permute2x128_si256(a[2], a[3], 0x20),  /* 8-15 */
                            _mm256_permute2x128_si256(a[0], a[1], 0x31),  /* 16-23 */
                            _mm256_permute2x128_si256(a[2], a[3], 0x31)}; /* 24-31 */
            for (int j = 0; j < 4; j++) {
                float *yo = yb + h * QK + 8 * j;
                __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(v[j], off));
                _mm256_storeu_ps(yo, _mm256_fmadd_ps(f, sc, _mm256_add_ps(_mm256_loadu_ps(yo), kc)));
            }
        }
    }
}
#endif

/* y[sub-blocks bc .. bc + nbc) += the group's G rows wr[i] (nibbles, from sub-block 0) times
   their coefficients (down_coeffs); pf: the next group's columns are fetched meanwhile
   (prefetch_column with the list, from entry g0 + DG), NULL when its rows are near already. */
static void axpy_q4_group(const uint8_t *const *wr, int64_t G, const int16_t *cq,
                          const float *s, const int32_t *cs, const float *kb, int64_t bc,
                          int64_t nbc, float *y, const uint8_t *pf, const uint8_t *hd,
                          int64_t ldw, int64_t ldh, const int32_t *idx, int64_t g0, int64_t k) {
#if defined(SI_AVX2) || defined(SI_AVX512)
    axpy_q4_quads(wr, G, cq, s, cs, kb, bc, nbc, y, pf, hd, ldw, ldh, idx, g0, k);
#else
    for (int64_t b = bc; b < bc + nbc; b += 2) { /* sub-blocks b (low nibbles), b + 1 (high) */
        float *yb = y + b * QK;
        const int16_t *cb = cq + (b - bc);
        float s0 = s[b - bc], s1 = s[b - bc + 1], k0 = kb[b - bc], k1 = kb[b - bc + 1];
#if defined(SI_NEON_DOT)
        const uint8x16_t low = vdupq_n_u8(0x0F);
        const int8x16_t eight = vdupq_n_s8(8);
        int16x8_t acc[8]; /* y 0-7, ..., 56-63 */
        for (int j = 0; j < 8; j++) acc[j] = vdupq_n_s16(0);
        for (int64_t i = 0; i < G; i++) {
            if (pf) prefetch_column(pf, hd, ldw, ldh, idx, g0 + i + DG, k, b);
            const uint8_t *wn = wr[i] + b * 16;
            int8x8_t c0 = vdup_n_s8((int8_t)cb[i * DB]), c1 = vdup_n_s8((int8_t)cb[i * DB + 1]);
            for (int h = 0; h < 2; h++) {
                uint8x16_t raw = vld1q_u8(wn + 16 * h);
                int8x16_t lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(raw, low)), eight);
                int8x16_t hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(raw, 4)), eight);
                acc[2 * h] = vmlal_s8(acc[2 * h], vget_low_s8(lo), c0);
                acc[2 * h + 1] = vmlal_s8(acc[2 * h + 1], vget_high_s8(lo), c0);
                acc[4 + 2 * h] = vmlal_s8(acc[4 + 2 * h], vget_low_s8(hi), c1);
                acc[4 + 2 * h + 1] = vmlal_s8(acc[4 + 2 * h + 1], vget_high_s8(hi), c1);
            }
        }
        for (int j = 0; j < 8; j++) { /* the sums of cq (q - 8): add back 8 s cs with kb */
            float sc = j < 4 ? s0 : s1, kc = j < 4 ? k0 : k1;
            float32x4_t v0 = vcvtq_f32_s32(vmovl_s16(vget_low_s16(acc[j])));
            float32x4_t v1 = vcvtq_f32_s32(vmovl_s16(vget_high_s16(acc[j])));
            float *yo = yb + 8 * j;
            vst1q_f32(yo, vfmaq_n_f32(vaddq_f32(vld1q_f32(yo), vdupq_n_f32(kc)), v0, sc));
            vst1q_f32(yo + 4, vfmaq_n_f32(vaddq_f32(vld1q_f32(yo + 4), vdupq_n_f32(kc)), v1, sc));
        }
#else
        (void)cs, (void)pf, (void)hd, (void)ldw, (void)ldh, (void)idx, (void)g0, (void)k;
        int32_t acc[2 * QK] = {0};
        for (int64_t i = 0; i < G; i++) {
            const uint8_t *wn = wr[i] + b * 16;
            int32_t c0 = cb[i * DB], c1 = cb[i * DB + 1];
            for (int j = 0; j < QK; j++) {
                acc[j] += ((int32_t)(wn[j] & 15) - 8) * c0;
                acc[j + QK] += ((int32_t)(wn[j] >> 4) - 8) * c1;
            }
        }
        for (int j = 0; j < QK; j++) yb[j] += s0 * (float)acc[j] + k0;
        for (int j = 0; j < QK; j++) yb[QK + j] += s1 * (float)acc[QK + j] + k1;
#endif
    }
#endif
}

/* The heads of list entries [g0, g0 + G) for sub-blocks [bc, bc + nbc), decoded once for several
   activation rows: per entry and super-block d and dmin (dm [G][DB / 8][2]), per sub-block its
   scale and minimum as floats (hs, hm [G][DB]). */
static void down_heads(const uint8_t *hd, int64_t ldh, const int32_t *idx, int64_t g0, int64_t G,
                       int64_t bc, int64_t nbc, float *dm, float *hs, float *hm) {
    for (int64_t i = 0; i < G; i++) {
        const uint8_t *h = hd + (idx ? idx[g0 + i] : g0 + i) * ldh + bc / 8 * Q4_HEAD;
        for (int64_t b = 0; b < nbc; b += 8, h += Q4_HEAD) {
            float *o = dm + (i * (DB / 8) + b / 8) * 2;
            uint8_t sm[16];
            q4_head(h, o, o + 1, sm);
            for (int j = 0; j < 8; j++) {
                hs[i * DB + b + j] = (float)sm[j];
                hm[i * DB + b + j] = (float)sm[8 + j];
            }
        }
    }
}

/* down_coeffs from decoded heads (down_heads): the same products in the same order. */
static void coeffs_from_heads(const float *a, int64_t g0, int64_t G, int64_t nbc, const float *dm,
                              const float *hs, const float *hm, int16_t *cq, float *s, int32_t *cs,
                              float *kb) {
    float D[DG * DB], Mt[DB];
    for (int64_t b = 0; b < DB; b++) Mt[b] = 0.0f;
    for (int64_t i = 0; i < G; i++) {
        float ai = a[g0 + i];
        for (int64_t b = 0; b < nbc; b += 8) {
            const float *o = dm + (i * (DB / 8) + b / 8) * 2;
            float ad = ai * o[0], am = ai * o[1];
#if defined(SI_AVX2) || defined(SI_AVX512)
            _mm256_storeu_ps(D + i * DB + b, _mm256_mul_ps(_mm256_set1_ps(ad),
                                                           _mm256_loadu_ps(hs + i * DB + b)));
            _mm256_storeu_ps(Mt + b, _mm256_add_ps(_mm256_loadu_ps(Mt + b),
                                                   _mm256_mul_ps(_mm256_set1_ps(am),
                                                                 _mm256_loadu_ps(hm + i * DB + b))));
#else
            for (int j = 0; j < 8; j++) {
                D[i * DB + b + j] = ad * hs[i * DB + b + j];
                Mt[b + j] += am * hm[i * DB + b + j];
            }
#endif
        }
    }
    quant_coeffs(D, Mt, G, nbc, cq, s, cs, kb);
}

/* y_m = sum over j < k of a_m[j] * row j, for the M activation rows a_m = a + m * lda (y_m = y +
   m * ldy), sub-blocks [b0, b1) of each y_m (b0 a super-block's first): per group the heads are
   decoded once for every row (a prefill's tokens), and each row sums the group as one row alone
   does (down_coeffs, axpy_q4_group: the same results). */
static void axpy_q4_rows(const float *a, int64_t M, int64_t lda, int64_t k, const uint8_t *w,
                         const uint8_t *hd, int64_t ldw, int64_t ldh, float *y, int64_t ldy,
                         int64_t b0, int64_t b1) {
    int16_t cq[DG * DB];
    float s[DB], kb[DB], hs[DG * DB], hm[DG * DB], dm[DG * DB / 4];
    int32_t cs[DB];
    const uint8_t *wr[DG]; /* the group's rows */
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = b0 * QK; i < b1 * QK; i++) y[m * ldy + i] = 0.0f;
    for (int64_t bc = b0; bc < b1; bc += DB) {
        int64_t nbc = b1 - bc < DB ? b1 - bc : DB;
        for (int64_t g0 = 0; g0 < k; g0 += DG) {
            int64_t G = k - g0 < DG ? k - g0 : DG;
            for (int64_t i = 0; i < G; i++) wr[i] = w + (g0 + i) * ldw;
            if (M == 1) {
                down_coeffs(a, hd, ldh, NULL, g0, G, bc, nbc, cq, s, cs, kb, NULL);
                axpy_q4_group(wr, G, cq, s, cs, kb, bc, nbc, y, w, hd, ldw, ldh, NULL, g0, k);
                continue;
            }
            down_heads(hd, ldh, NULL, g0, G, bc, nbc, dm, hs, hm);
            for (int64_t m = 0; m < M; m++) {
                coeffs_from_heads(a + m * lda, g0, G, nbc, dm, hs, hm, cq, s, cs, kb);
                axpy_q4_group(wr, G, cq, s, cs, kb, bc, nbc, y + m * ldy, m == 0 ? w : NULL, hd,
                              ldw, ldh, NULL, g0, k);
            }
        }
    }
}

/* y [M, H] = a [M, k] . W, W: k 4-bit rows of H (the down columns of 4-bit neuron records);
   threads split the super-blocks of H. */
int si_axpy_q4(const float *a, int64_t M, int64_t k, const uint8_t *w, const uint8_t *hd,
               int64_t ldw, int64_t ldh, int64_t H, float *y, int threads) {
    if (H % (2 * QK)) return -2;
    threads = clamp_threads(threads);
    int64_t nb = H / QK;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t s0, s1;
        share((nb + 7) / 8, team_id(), team_size(), &s0, &s1);
        axpy_q4_rows(a, M, k, k, w, hd, ldw, ldh, y, H, 8 * s0, 8 * s1 < nb ? 8 * s1 : nb);
    }
    return 0;
}
