/* int8 weights held as tiles of 16 interleaved rows (si_tile_*). Part of kernel.c. */
/* ---------------------------------------------------------------------------------------
   Weights in tiles (the output layer, every activation row count): TR = 16 weight rows
   interleaved so that 64 bytes hold the same four columns (a "quad") of all 16 rows:
   pk[tile][block][quad][row][4], a tile's blocks contiguous (nb = ceil(K / 32) of them, the
   last padded with zero weights), the last tile padded with zero rows. Against it each
   activation quad is broadcast and multiplied into the lanes of 16 (AVX-512), 8 (AVX2) or 4
   (NEON) rows at once: no per-row horizontal sums, one conversion and one multiply-add per
   block for all rows of a vector, and the whole matrix read as one stream. On Zen 4 the
   262144 x 640 output layer of Gemma 3 270M, 1 thread: 6.3 ms a token (rows: 9.6), 4 tokens
   together 6.0 ms (rows: 18.4).

   VNNI (vpdpbusd multiplies unsigned by signed bytes): stored w + 128, and each block's sum
   starts at -128 * (the block's sum of activations), so it is exactly sum xq * w. AVX2 and
   AVX-512BW: stored w, the activation quad's signs moved onto the weights (maddubs of |x| and
   sign(w, x), as on the row path); NEON sdot and plain C: stored w. Every block's integer
   product is exact and a last partial block is added in float, as on the row path; only the
   order of the float sums differs. */
#define TR 16
#if defined(SI_VNNI512) || defined(SI_AVXVNNI)
#define TILE_U8 1
#define TILE_STORE(v) ((uint8_t)((int)(v) + 128))
#define TILE_LOAD(b) ((int8_t)((int)(b) - 128))
#else
#define TILE_STORE(v) ((uint8_t)(int8_t)(v))
#define TILE_LOAD(b) ((int8_t)(b))
#endif

/* 1 where the tiles beat the rows on this path (measured, Zen 4 forcing each path, the Gemma
   output layer, 1 thread, one activation row / four: avx512vnni 1.5x / 2.4x, avx2 1.4x / 1.8x;
   avx512bw 0.8x / 1.5x and plain C slower: they keep the rows). */
int si_tile_pays(void) {
#if defined(SI_VNNI512) || defined(SI_AVX2) || defined(SI_NEON_DOT)
    return 1;
#else
    return 0;
#endif
}

/* Bytes of the tiles of an [N, K] matrix. */
int64_t si_tile_bytes(int64_t N, int64_t K) {
    return (N + TR - 1) / TR * ((K + QK - 1) / QK) * TR * QK;
}

static inline int32_t quad4(const int8_t *p) { /* four activation bytes, one lane's worth */
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline int64_t tile_at(int64_t nb, int64_t n, int64_t k) { /* byte of w[n, k] */
    return (((n / TR * nb + k / QK) * (QK / 4) + (k % QK) / 4) * TR + n % TR) * 4 + k % 4;
}

/* w [N, K] int8 rows at stride ldw -> pk (si_tile_bytes(N, K) bytes). */
int si_tile_pack(const int8_t *w, int64_t N, int64_t K, int64_t ldw, uint8_t *pk, int threads) {
    const int64_t nb = (K + QK - 1) / QK, nt = (N + TR - 1) / TR;
    threads = clamp_threads(threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t t0, t1;
        share(nt, team_id(), team_size(), &t0, &t1);
        for (int64_t n = t0 * TR; n < t1 * TR; n++)
            for (int64_t k = 0; k < nb * QK; k++) {
                pk[tile_at(nb, n, k)] = TILE_STORE(n < N && k < K ? w[n * ldw + k] : 0);
            }
    }
    return 0;
}

/* Rows (cols 0) or columns (cols 1) ids[0..n) of the packed [N, K] matrix: read into buf (put
   0; rows [n, K], columns as rows [n, N]) or written from it (put 1). A row is four bytes a
   quad (one word; VNNI's +128 is the top bit of each byte), a column one byte in each 4. */
static int tile_io(uint8_t *pk, int64_t N, int64_t K, const int64_t *ids, int64_t n, int8_t *buf,
                   int cols, int put) {
    const int64_t nb = (K + QK - 1) / QK, tile = nb * TR * QK, lim = cols ? K : N;
#ifdef TILE_U8
    const uint32_t flip = 0x80808080u;
#else
    const uint32_t flip = 0;
#endif
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= lim) return -1;
    for (int64_t i = 0; i < n; i++) {
        const int64_t id = ids[i];
        if (!cols) { /* row id: quad q of block b at ((b * 8 + q) * TR + lane) * 4 in its tile */
            uint8_t *p = pk + id / TR * tile + id % TR * 4;
            int8_t *r = buf + i * K;
            for (int64_t k = 0; k < K; k += 4, p += TR * 4) {
                uint32_t w;
                if (k + 4 <= K) {
                    if (put) {
                        memcpy(&w, r + k, 4);
                        w ^= flip;
                        memcpy(p, &w, 4);
                    } else {
                        memcpy(&w, p, 4);
                        w ^= flip;
                        memcpy(r + k, &w, 4);
                    }
                } else {
                    for (int64_t j = 0; k + j < K; j++) {
                        if (put)
                            p[j] = TILE_STORE(r[k + j]);
                        else
                            r[k + j] = TILE_LOAD(p[j]);
                    }
                }
            }
        } else { /* column id: byte id % 4 of quad id / 4 in every row of every tile */
            int8_t *c = buf + i * N;
            uint8_t *p = pk + id / 4 * TR * 4 + id % 4;
            for (int64_t row = 0; row < N; row += TR, p += tile) {
                const int64_t lanes = N - row < TR ? N - row : TR;
                for (int64_t l = 0; l < lanes; l++) {
                    if (put)
                        p[l * 4] = TILE_STORE(c[row + l]);
                    else
                        c[row + l] = TILE_LOAD(p[l * 4]);
                }
            }
        }
    }
    return 0;
}

/* Rows back as int8 rows out [n, K] (a tied embedding's lookup). */
int si_tile_rows(const uint8_t *pk, int64_t N, int64_t K, const int64_t *ids, int64_t n,
                 int8_t *out) {
    return tile_io((uint8_t *)pk, N, K, ids, n, out, 0, 0);
}

/* Rows <- src [n, K] (a task switch's neurons). */
int si_tile_put_rows(uint8_t *pk, int64_t N, int64_t K, const int64_t *ids, int64_t n,
                     const int8_t *src) {
    return tile_io(pk, N, K, ids, n, (int8_t *)src, 0, 1);
}

/* Columns as rows out [n, N]. */
int si_tile_cols(const uint8_t *pk, int64_t N, int64_t K, const int64_t *ids, int64_t n,
                 int8_t *out) {
    return tile_io((uint8_t *)pk, N, K, ids, n, out, 1, 0);
}

/* Columns <- src [n, N] (a down projection's neurons). */
int si_tile_put_cols(uint8_t *pk, int64_t N, int64_t K, const int64_t *ids, int64_t n,
                     const int8_t *src) {
    return tile_io(pk, N, K, ids, n, (int8_t *)src, 1, 1);
}

/* Tiles [t0, t1) against R activation rows (xq [R][nb * 32], xd, xs [R][nb]: blocks, scales,
   sums): y[r * ldy + n] = scale[n] * sum_b xd[r, b] * sum_k xq[r, k] w[n, k]. */
#if defined(SI_VNNI512)
#define TILE_PRODUCT(R)                                                                        \
    static void tiles##R(const uint8_t *pk, int64_t nb, int64_t nbs, int64_t N, const int8_t *xq,  \
                         const float *xd, const int32_t *xs, const float *scale, float *y,      \
                         int64_t ldy, int64_t ldq, int64_t lds, int64_t t0, int64_t t1) {       \
        for (int64_t t = t0; t < t1; t++) {                                                     \
            __m512 f[R];                                                                        \
            for (int r = 0; r < R; r++) f[r] = _mm512_setzero_ps();                             \
            const uint8_t *p = pk + t * nbs * TR * QK;                                           \
            _mm_prefetch((const char *)(p + nbs * TR * QK), _MM_HINT_T0);                        \
            for (int64_t b = 0; b < nb; b++, p += TR * QK) {                                    \
                __m512i a[R];                                                                   \
                for (int r = 0; r < R; r++) a[r] = _mm512_set1_epi32(-128 * xs[r * lds + b]);    \
                for (int q = 0; q < QK / 4; q++) {                                              \
                    __m512i wv = _mm512_loadu_si512((const void *)(p + q * 64));                \
                    for (int r = 0; r < R; r++)                                                 \
                        a[r] = _mm512_dpbusd_epi32(                                             \
                            a[r], wv, _mm512_set1_epi32(quad4(xq + r * ldq + b * QK + q * 4))); \
                }                                                                               \
                for (int r = 0; r < R; r++)                                                     \
                    f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r]), _mm512_set1_ps(xd[r * lds + b]), f[r]); \
            }                                                                                   \
            int64_t n0 = t * TR, left = N - n0;                                                 \
            __mmask16 k = left >= TR ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);       \
            __m512 s = scale ? _mm512_maskz_loadu_ps(k, scale + n0) : _mm512_set1_ps(1.0f);     \
            for (int r = 0; r < R; r++)                                                         \
                _mm512_mask_storeu_ps(y + r * ldy + n0, k, _mm512_mul_ps(f[r], s));             \
        }                                                                                       \
    }
#elif defined(SI_AVX2) || defined(SI_AVX512)
/* 256 bits: each half of a tile (8 rows) in turn, the tile read from L1 the second time. */
#if defined(SI_AVXVNNI)
#define TILE_DOT(a, wv, xb) _mm256_dpbusd_avx_epi32(a, wv, xb)
#else
#define TILE_DOT(a, wv, xb)                                                                     \
    _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(xb, xb),        \
                                                               _mm256_sign_epi8(wv, xb)),       \
                                          _mm256_set1_epi16(1)))
#endif
#define TILE_PRODUCT(R)                                                                        \
    static void tiles##R(const uint8_t *pk, int64_t nb, int64_t nbs, int64_t N, const int8_t *xq,  \
                         const float *xd, const int32_t *xs, const float *scale, float *y,      \
                         int64_t ldy, int64_t ldq, int64_t lds, int64_t t0, int64_t t1) {       \
        for (int64_t t = t0; t < t1; t++)                                                       \
            for (int h = 0; h < 2; h++) {                                                       \
                __m256 f[R];                                                                    \
                for (int r = 0; r < R; r++) f[r] = _mm256_setzero_ps();                         \
                const uint8_t *p = pk + t * nbs * TR * QK + h * 32;                              \
                for (int64_t b = 0; b < nb; b++, p += TR * QK) {                                \
                    __m256i a[R];                                                               \
                    for (int r = 0; r < R; r++) a[r] = TILE_INIT(xs[r * lds + b]);               \
                    for (int q = 0; q < QK / 4; q++) {                                          \
                        __m256i wv = _mm256_loadu_si256((const __m256i *)(p + q * 64));         \
                        for (int r = 0; r < R; r++)                                             \
                            a[r] = TILE_DOT(a[r], wv,                                           \
                                _mm256_set1_epi32(quad4(xq + r * ldq + b * QK + q * 4))); \
                    }                                                                           \
                    for (int r = 0; r < R; r++)                                                 \
                        f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r]), _mm256_set1_ps(xd[r * lds + b]), f[r]); \
                }                                                                               \
                int64_t n0 = t * TR + h * 8;                                                    \
                float o[8];                                                                     \
                for (int r = 0; r < R; r++) {                                                   \
                    _mm256_storeu_ps(o, f[r]);                                                  \
                    for (int64_t i = 0; i < 8 && n0 + i < N; i++)                               \
                        y[r * ldy + n0 + i] = scale ? o[i] * scale[n0 + i] : o[i];              \
                }                                                                               \
            }                                                                                   \
    }
#ifdef TILE_U8
#define TILE_INIT(s) _mm256_set1_epi32(-128 * (s))
#else
#define TILE_INIT(s) _mm256_setzero_si256()
#endif
#elif defined(SI_NEON_DOT)
/* 128 bits: each quarter of a tile (4 rows) in turn; sdot by lane of 16 activation bytes. */
#define TILE_PRODUCT(R)                                                                        \
    static void tiles##R(const uint8_t *pk, int64_t nb, int64_t nbs, int64_t N, const int8_t *xq,  \
                         const float *xd, const int32_t *xs, const float *scale, float *y,      \
                         int64_t ldy, int64_t ldq, int64_t lds, int64_t t0, int64_t t1) {       \
        (void)xs;                                                                               \
        for (int64_t t = t0; t < t1; t++)                                                       \
            for (int h = 0; h < 4; h++) {                                                       \
                float32x4_t f[R];                                                               \
                for (int r = 0; r < R; r++) f[r] = vdupq_n_f32(0.0f);                           \
                const int8_t *p = (const int8_t *)pk + t * nbs * TR * QK + h * 16;               \
                for (int64_t b = 0; b < nb; b++, p += TR * QK) {                                \
                    int32x4_t a[R];                                                             \
                    for (int r = 0; r < R; r++) a[r] = vdupq_n_s32(0);                          \
                    for (int q = 0; q < QK / 4; q += 4) {                                       \
                        int8x16_t w0 = vld1q_s8(p + q * 64), w1 = vld1q_s8(p + (q + 1) * 64);    \
                        int8x16_t w2 = vld1q_s8(p + (q + 2) * 64), w3 = vld1q_s8(p + (q + 3) * 64); \
                        for (int r = 0; r < R; r++) {                                           \
                            int8x16_t xv = vld1q_s8(xq + r * ldq + b * QK + q * 4);            \
                            a[r] = vdotq_laneq_s32(a[r], w0, xv, 0);                            \
                            a[r] = vdotq_laneq_s32(a[r], w1, xv, 1);                            \
                            a[r] = vdotq_laneq_s32(a[r], w2, xv, 2);                            \
                            a[r] = vdotq_laneq_s32(a[r], w3, xv, 3);                            \
                        }                                                                       \
                    }                                                                           \
                    for (int r = 0; r < R; r++)                                                 \
                        f[r] = vfmaq_n_f32(f[r], vcvtq_f32_s32(a[r]), xd[r * lds + b]);          \
                }                                                                               \
                int64_t n0 = t * TR + h * 4;                                                    \
                float o[4];                                                                     \
                for (int r = 0; r < R; r++) {                                                   \
                    vst1q_f32(o, f[r]);                                                         \
                    for (int64_t i = 0; i < 4 && n0 + i < N; i++)                               \
                        y[r * ldy + n0 + i] = scale ? o[i] * scale[n0 + i] : o[i];              \
                }                                                                               \
            }                                                                                   \
    }
#else
/* Plain C: 16 rows' integer sums of a block side by side, as the vector paths hold them. */
#define TILE_PRODUCT(R)                                                                        \
    static void tiles##R(const uint8_t *pk, int64_t nb, int64_t nbs, int64_t N, const int8_t *xq,  \
                         const float *xd, const int32_t *xs, const float *scale, float *y,      \
                         int64_t ldy, int64_t ldq, int64_t lds, int64_t t0, int64_t t1) {       \
        (void)xs;                                                                               \
        for (int64_t t = t0; t < t1; t++) {                                                     \
            float f[R][TR] = {{0.0f}};                                                          \
            const int8_t *p = (const int8_t *)pk + t * nbs * TR * QK;                            \
            for (int64_t b = 0; b < nb; b++, p += TR * QK)                                      \
                for (int r = 0; r < R; r++) {                                                   \
                    int32_t a[TR] = {0};                                                        \
                    const int8_t *x = xq + r * ldq + b * QK;                                   \
                    for (int q = 0; q < QK / 4; q++)                                            \
                        for (int i = 0; i < TR; i++)                                            \
                            for (int j = 0; j < 4; j++)                                         \
                                a[i] += (int32_t)p[(q * TR + i) * 4 + j] * x[q * 4 + j];        \
                    for (int i = 0; i < TR; i++) f[r][i] += (float)a[i] * xd[r * lds + b];       \
                }                                                                               \
            for (int r = 0; r < R; r++)                                                         \
                for (int64_t i = 0; i < TR && t * TR + i < N; i++)                              \
                    y[r * ldy + t * TR + i] = scale ? f[r][i] * scale[t * TR + i] : f[r][i];    \
        }                                                                                       \
    }
#endif
TILE_PRODUCT(1)
TILE_PRODUCT(2)
TILE_PRODUCT(3)
TILE_PRODUCT(4)

#ifndef TILE_CHUNK
#define TILE_CHUNK 2 /* tiles all activation rows take turns over (from L1) */
#endif

/* Tiles [t0, t1) (nbs blocks apart) over their first K columns against M activation rows (x
   float at row stride ldx, quantized: xq, xd, xs at row strides ldq, lds), y row stride ldy:
   the tiles a chunk at a time, all rows (4 at a time) over each chunk from the cache. The
   whole blocks as integer products; a last partial block (the active neurons of a down
   projection) in float, as the row path adds it. */
static void tiles_rows(const uint8_t *pk, int64_t K, int64_t nbs, int64_t N, int64_t M,
                       const float *x, int64_t ldx, const int8_t *xq, const float *xd,
                       const int32_t *xs, int64_t ldq, int64_t lds, const float *scale, float *y,
                       int64_t ldy, int64_t t0, int64_t t1) {
    const int64_t nb = K / QK, from = nb * QK;
    for (int64_t c = t0; c < t1; c += TILE_CHUNK) {
        const int64_t c1 = c + TILE_CHUNK < t1 ? c + TILE_CHUNK : t1;
        for (int64_t m = 0; m < M; m += 4) {
            const int8_t *q = xq + m * ldq;
            const float *d = xd + m * lds;
            const int32_t *s = xs + m * lds;
            float *o = y + m * ldy;
            switch (M - m < 4 ? M - m : 4) {
            case 1: tiles1(pk, nb, nbs, N, q, d, s, scale, o, ldy, ldq, lds, c, c1); break;
            case 2: tiles2(pk, nb, nbs, N, q, d, s, scale, o, ldy, ldq, lds, c, c1); break;
            case 3: tiles3(pk, nb, nbs, N, q, d, s, scale, o, ldy, ldq, lds, c, c1); break;
            default: tiles4(pk, nb, nbs, N, q, d, s, scale, o, ldy, ldq, lds, c, c1); break;
            }
        }
        if (from == K) continue;
        for (int64_t t = c; t < c1; t++) { /* the partial block: column k of row i of tile t */
            const uint8_t *p = pk + (t * nbs + nb) * TR * QK;
            for (int64_t i = 0; i < TR && t * TR + i < N; i++)
                for (int64_t m = 0; m < M; m++) {
                    float v = 0.0f;
                    for (int64_t k = from; k < K; k++)
                        v += (float)TILE_LOAD(p[(((k - from) / 4) * TR + i) * 4 + k % 4]) *
                             x[m * ldx + k];
                    y[m * ldy + t * TR + i] += scale ? v * scale[t * TR + i] : v;
                }
        }
    }
}

/* y [M, N] = x [M, K] . (the packed matrix)^T * scale (NULL = 1), for a packed matrix of
   [>= N, ldk] (K <= ldk: its first columns, the active neurons of a down projection); every row
   count: each tile is read from memory once and from the cache once per 4 activation rows. */
int si_tile_linear(const float *x, int64_t M, int64_t K, const uint8_t *pk, int64_t N,
                   int64_t ldk, const float *scale, float *y, int threads) {
    const int64_t nb = (K + QK - 1) / QK, nbs = (ldk + QK - 1) / QK, nt = (N + TR - 1) / TR;
    if (K > ldk) return -2;
    si_qrows q;
    if (quantize_rows(x, M, K, &q)) return -1;
    const int8_t *xq = q.xq;
    const float *xd = q.xd;
    const int32_t *xs = q.xs;
    threads = clamp_threads(threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t t0, t1;
        share(nt, team_id(), team_size(), &t0, &t1);
        tiles_rows(pk, K, nbs, N, M, x, K, xq, xd, xs, nb * QK, nb, scale, y, N, t0, t1);
    }
    free_qrows(&q);
    return 0;
}
