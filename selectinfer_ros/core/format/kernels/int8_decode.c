/* int8 weight x float activation matrix products for selectinfer_ros.

   y[m, n] = scale[n] * sum_k w[n, k] * x[m, k]

   w: int8 rows of length K at row stride ldw (a prefix of wider rows is fine: the active
   columns of the down projection), scale: float32 per output row (NULL = 1), x: float32
   [M, K] contiguous, y: float32 [M, N] contiguous.

   The activations are quantized per block of 32 values to int8 with their own float scale
   (llama.cpp's Q8_0 layout), then every weight row is read once for all M activation rows.
   AVX2: 32 int8 products per maddubs; elsewhere plain C that compilers vectorize (NEON dot
   products with -march=native on the Jetson's cores).

   si_decode_layers (below) runs every decoder layer of one decode step of an int8 model in one
   call, on these products: no framework dispatch between the small operations of a layer.
*/
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
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

/* ---------------------------------------------------------------------------------------
   One decode step of a whole int8 model, for one token (batch 1), in float32 activations.

   Every decoder layer: h = norm(x); q, k, v = W h (one quantization of h for the three);
   per-head q/k norms (Gemma 3); rotary embedding from tables; k, v into the cache at pos;
   attention of each query head over its kv head's cached keys (a sliding window where set);
   o = Wo att; x += post_norm(o) (post norm Gemma 3 only). Then h = norm(x); the active
   prefix of the neuron slots: gate/up rows (interleaved, [k, 2, H]), a = act(gate) * up *
   down_scale, y = Down[:, :n_active] a; x += post_norm(y).

   Norms: out = x / sqrt(mean(x^2) + eps) * w, with w the effective float32 weight (Gemma 3:
   1 + weight, computed by the caller). Rotary: out = x * cos + roll(x, hd / 2) * sin, with
   the sign of the first half folded into sin by the caller.
*/
typedef struct {
    const int8_t *w;
    const float *scale; /* [n] */
    int64_t n, k, ldw;
} si_mat;

typedef struct {
    const float *in_norm, *post_attn_norm, *pre_mlp_norm, *post_mlp_norm; /* [H]; NULL: none */
    const float *q_norm, *k_norm;                                           /* [hd]; NULL: none */
    si_mat q, k, v, o;
    float *k_cache, *v_cache; /* [n_kv, cap, hd] */
    const float *cos, *sin;   /* [cap, hd] */
    int64_t window;           /* keys per query, itself included; 0 = all */
    const int8_t *gu;         /* [n_loaded, 2, H] */
    const float *gu_scale;    /* [n_loaded, 2] */
    const int8_t *down;       /* [H, >= n_active] at row stride down_ld */
    const float *down_scale;  /* [>= n_active] */
    int64_t down_ld, n_active;
} si_layer;

typedef struct {
    int64_t hidden, n_heads, n_kv, head_dim, cap, max_k;
    float eps, scaling;
    int act; /* 0: SiLU, 1: GELU (tanh approximation) */
    /* scratch, float32 unless noted: h [max_k], q [n_heads*hd], kv [2*n_kv*hd],
       att [n_heads*hd], scores [cap], gu [2*max_k], xq int8 [max_k + QK], xd [max_k/QK + 1] */
    float *h, *q, *kv, *att, *scores, *gu;
    int8_t *xq;
    float *xd;
} si_model;

static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

static void quantize_vec(const float *x, int64_t K, int8_t *xq, float *xd) {
    quantize_row(x, K, xq, xd);
}

/* y [N] = scale * (W [N, K] . x), x already quantized (xq, xd); exact tail from x. */
static void gemv_q(const si_mat *m, const int8_t *xq, const float *xd, const float *x, float *y,
                   int threads) {
    int64_t K = m->k, N = m->n, ldw = m->ldw, nfull = K / QK, from = nfull * QK;
    int64_t groups = (N + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n0 = g * 4, rows = N - n0 < 4 ? N - n0 : 4;
        const int8_t *wg = m->w + n0 * ldw;
        float out[4];
        if (rows == 4) {
            dot4(wg, ldw, nfull, xq, xd, out);
        } else {
            for (int64_t r = 0; r < rows; r++) dot1(wg + r * ldw, ldw, nfull, xq, xd, out + r);
        }
        for (int64_t r = 0; r < rows; r++) {
            float v = out[r] + (from < K ? tail(wg + r * ldw, from, K, x) : 0.0f);
            y[n0 + r] = m->scale ? v * m->scale[n0 + r] : v;
        }
    }
}

static void rope(float *x, const float *cos, const float *sin, int64_t hd) {
    int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] + b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

static inline float act(float g, int kind) {
    if (kind == 1) {
        const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
        return 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g)));
    }
    return g / (1.0f + expf(-g));
}

static void attention_step(const si_model *m, si_layer *L, float *x, int64_t pos, int threads) {
    int64_t H = m->hidden, nh = m->n_heads, nkv = m->n_kv, hd = m->head_dim, cap = m->cap;
    int64_t G = nh / nkv;
    float *h = m->h, *q = m->q, *k = m->kv, *v = m->kv + nkv * hd;
    rms_norm(x, L->in_norm, H, m->eps, h);
    quantize_vec(h, H, m->xq, m->xd);
    gemv_q(&L->q, m->xq, m->xd, h, q, threads);
    gemv_q(&L->k, m->xq, m->xd, h, k, threads);
    gemv_q(&L->v, m->xq, m->xd, h, v, threads);
    const float *cs = L->cos + pos * hd, *sn = L->sin + pos * hd;
    for (int64_t j = 0; j < nh; j++) {
        if (L->q_norm) rms_norm(q + j * hd, L->q_norm, hd, m->eps, q + j * hd);
        rope(q + j * hd, cs, sn, hd);
    }
    for (int64_t j = 0; j < nkv; j++) {
        if (L->k_norm) rms_norm(k + j * hd, L->k_norm, hd, m->eps, k + j * hd);
        rope(k + j * hd, cs, sn, hd);
        memcpy(L->k_cache + (j * cap + pos) * hd, k + j * hd, (size_t)hd * sizeof(float));
        memcpy(L->v_cache + (j * cap + pos) * hd, v + j * hd, (size_t)hd * sizeof(float));
    }
    int64_t lo = L->window > 0 && pos + 1 > L->window ? pos + 1 - L->window : 0;
    int64_t S = pos + 1 - lo;
    for (int64_t j = 0; j < nh; j++) {
        const float *qj = q + j * hd;
        const float *kc = L->k_cache + ((j / G) * cap + lo) * hd;
        const float *vc = L->v_cache + ((j / G) * cap + lo) * hd;
        float *s = m->scores, mx = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < S; t++) {
            float d = 0.0f;
            for (int64_t i = 0; i < hd; i++) d += qj[i] * kc[t * hd + i];
            s[t] = d * m->scaling;
            mx = s[t] > mx ? s[t] : mx;
        }
        for (int64_t t = 0; t < S; t++) {
            s[t] = expf(s[t] - mx);
            sum += s[t];
        }
        float *out = m->att + j * hd;
        for (int64_t i = 0; i < hd; i++) out[i] = 0.0f;
        for (int64_t t = 0; t < S; t++) {
            float p = s[t] / sum;
            for (int64_t i = 0; i < hd; i++) out[i] += p * vc[t * hd + i];
        }
    }
    quantize_vec(m->att, nh * hd, m->xq, m->xd);
    gemv_q(&L->o, m->xq, m->xd, m->att, h, threads);
    if (L->post_attn_norm) rms_norm(h, L->post_attn_norm, H, m->eps, h);
    for (int64_t i = 0; i < H; i++) x[i] += h[i];
}

static void mlp_step(const si_model *m, si_layer *L, float *x, int threads) {
    int64_t H = m->hidden, k = L->n_active;
    float *h = m->h, *gu = m->gu;
    rms_norm(x, L->pre_mlp_norm, H, m->eps, h);
    quantize_vec(h, H, m->xq, m->xd);
    si_mat gum = {L->gu, L->gu_scale, 2 * k, H, H};
    gemv_q(&gum, m->xq, m->xd, h, gu, threads);
    for (int64_t n = 0; n < k; n++) gu[n] = act(gu[2 * n], m->act) * gu[2 * n + 1] * L->down_scale[n];
    quantize_vec(gu, k, m->xq, m->xd);
    si_mat dm = {L->down, NULL, H, k, L->down_ld};
    gemv_q(&dm, m->xq, m->xd, gu, h, threads);
    if (L->post_mlp_norm) rms_norm(h, L->post_mlp_norm, H, m->eps, h);
    for (int64_t i = 0; i < H; i++) x[i] += h[i];
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* x [H]: the token's embedding in, the last layer's output out. timing (NULL = off): seconds
   in attention and in the MLP are added to timing[0] and timing[1]. */
int si_decode_layers(const si_model *m, si_layer *layers, int64_t n_layers, float *x, int64_t pos,
                     int threads, double *timing) {
    if (pos >= m->cap) return -1;
    for (int64_t l = 0; l < n_layers; l++) {
        double t0 = timing ? now() : 0.0;
        attention_step(m, &layers[l], x, pos, threads);
        double t1 = timing ? now() : 0.0;
        mlp_step(m, &layers[l], x, threads);
        if (timing) {
            timing[0] += t1 - t0;
            timing[1] += now() - t1;
        }
    }
    return 0;
}
