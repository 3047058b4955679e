/* int8 weight x float activation matrix products for selectinfer_ros.

   y[m, n] = scale[n] * sum_k w[n, k] * x[m, k]

   w: int8 rows of length K at row stride ldw (a prefix of wider rows is fine: the active
   columns of the down projection), scale: float32 per output row (NULL = 1), x: float32
   [M, K] contiguous, y: float32 [M, N] contiguous.

   The activations are quantized per block of 32 values to int8 with their own float scale
   (llama.cpp's Q8_0 layout), then every weight row is read once for all M activation rows.
   AVX2: 32 int8 products per maddubs; elsewhere plain C that compilers vectorize (NEON dot
   products with -march=native on the Jetson's cores).
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#define QK 32
#ifndef PF
#define PF 1024 /* bytes ahead of each weight row's read: the rows are short streams */
#endif

/* x [K] -> xq [nb * QK] int8 (zero padded), xd [nb] block scales; nb = ceil(K / QK). */
static void quantize_row(const float *x, int64_t K, int8_t *xq, float *xd) {
    int64_t nb = (K + QK - 1) / QK;
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * QK, hi = lo + QK < K ? lo + QK : K;
        float amax = 0.0f;
        for (int64_t k = lo; k < hi; k++) {
            float a = fabsf(x[k]);
            amax = a > amax ? a : amax;
        }
        float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        xd[b] = d;
        for (int64_t k = lo; k < lo + QK; k++)
            xq[k] = k < hi ? (int8_t)lrintf(x[k] * id) : 0;
    }
}

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Dot products of R weight rows with one quantized activation row over the full blocks. */
#define DOT_ROWS(R)                                                                          \
    static inline void dot##R(const int8_t *w, int64_t ldw, int64_t nfull, const int8_t *xq,  \
                              const float *xd, float *out) {                                  \
        __m256 acc[R];                                                                        \
        const __m256i ones = _mm256_set1_epi16(1);                                            \
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                             \
        for (int64_t b = 0; b < nfull; b++) {                                                 \
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * QK));                  \
            __m256i ax = _mm256_sign_epi8(xv, xv);                                            \
            __m256 d = _mm256_broadcast_ss(xd + b);                                           \
            for (int r = 0; r < R; r++) {                                                     \
                _mm_prefetch((const char *)(w + r * ldw + b * QK + PF), _MM_HINT_T0);        \
                __m256i wv = _mm256_loadu_si256((const __m256i *)(w + r * ldw + b * QK));     \
                __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, xv)), \
                                              ones);                                          \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc[r]);                   \
            }                                                                                 \
        }                                                                                     \
        for (int r = 0; r < R; r++) out[r] = hsum(acc[r]);                                    \
    }
DOT_ROWS(1)
DOT_ROWS(4)
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

static void dot4(const int8_t *w, int64_t ldw, int64_t nfull, const int8_t *xq, const float *xd,
                 float *out) {
    for (int r = 0; r < 4; r++) dot1(w + r * ldw, ldw, nfull, xq, xd, out + r);
}
#endif

/* The last partial block (K % QK values), exact in float. */
static inline float tail(const int8_t *w, int64_t from, int64_t K, const float *x) {
    float s = 0.0f;
    for (int64_t k = from; k < K; k++) s += (float)w[k] * x[k];
    return s;
}

int si_linear_i8(const float *x, int64_t M, int64_t K, const int8_t *w, int64_t N, int64_t ldw,
                 const float *scale, float *y, int threads) {
    int64_t nb = (K + QK - 1) / QK, nfull = K / QK, from = nfull * QK;
    int8_t *xq = (int8_t *)aligned_alloc(64, (size_t)((M * nb * QK + 63) / 64 * 64));
    float *xd = (float *)malloc((size_t)(M * nb) * sizeof(float));
    if (!xq || !xd) {
        free(xq);
        free(xd);
        return -1;
    }
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, xq + m * nb * QK, xd + m * nb);
    int64_t groups = (N + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n0 = g * 4, rows = N - n0 < 4 ? N - n0 : 4;
        const int8_t *wg = w + n0 * ldw;
        for (int64_t m = 0; m < M; m++) {
            float out[4];
            const int8_t *q = xq + m * nb * QK;
            const float *d = xd + m * nb;
            if (rows == 4) {
                dot4(wg, ldw, nfull, q, d, out);
            } else {
                for (int64_t r = 0; r < rows; r++) dot1(wg + r * ldw, ldw, nfull, q, d, out + r);
            }
            for (int64_t r = 0; r < rows; r++) {
                float v = out[r] + (from < K ? tail(wg + r * ldw, from, K, x + m * K) : 0.0f);
                y[m * N + n0 + r] = scale ? v * scale[n0 + r] : v;
            }
        }
    }
    free(xq);
    free(xd);
    return 0;
}
