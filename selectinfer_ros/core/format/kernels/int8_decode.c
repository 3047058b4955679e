/* int8 weight x float activation products, and the whole int8 decode step, for selectinfer_ros.

   y[m, n] = scale[n] * sum_k w[n, k] * x[m, k]

   w: int8 rows of length K at row stride ldw (a prefix of wider rows is fine: the active
   columns of the down projection), scale: float32 per output row (NULL = 1), x: float32
   [M, K] contiguous, y: float32 [M, N] contiguous.

   The activations are quantized per block of 32 values to int8 with their own float scale
   (llama.cpp's Q8_0 layout), then every weight row is read once for all M activation rows.
   Where the path gains from it (si_tile_pays), the loader holds the int8 matrices of a decode
   step (output layer, attention projections, prompt-mode neuron slots) as tiles of 16
   interleaved rows instead (si_tile_pack, si_tile_linear; si_mat.tiled, si_layer.tiled).

   The instruction set is chosen at compile time from the compiler's macros (the Python side
   passes the flags for what /proc/cpuinfo lists; si_isa() names the path compiled in):
     avx512vnni  AVX-512 VNNI: vpdpbusd on two blocks (64 bytes) per instruction
     avx512bw    AVX-512BW: maddubs + madd on two blocks per instruction
     avxvnni     AVX-VNNI: vpdpbusd on 256 bits
     avx2        AVX2 + FMA (+ F16C): maddubs + madd on 256 bits
     neon-dotprod / neon-i8mm   aarch64 NEON sdot (the Jetson Orin's Cortex-A78AE)
     plain       plain C, the reference (-DSI_PLAIN forces it)
   Every path computes each block's integer dot product exactly; they differ only in the
   order of the float sums over blocks (float rounding).

   si_decode_layers (below) runs every decoder layer of one decode step of an int8 model in one
   call, in one parallel region (threads meet at barriers between the products), with no
   framework dispatch between the small operations of a layer.

   The contract with the Python side (ctypes): si_abi() returns SI_ABI_VERSION and the sizes of
   the structs; the caller refuses a library whose answer differs from its own mirror. Change
   SI_ABI_VERSION with any change of a struct or of an exported function's signature.
*/
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef SI_ABI_VERSION
#define SI_ABI_VERSION 15
#endif

#if defined(SI_PLAIN)
#define SI_ISA "plain"
#elif defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SI_AVX512 1
#define SI_VNNI512 1
#define SI_ISA "avx512vnni"
#elif defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX2__) && defined(__FMA__) && \
    defined(__F16C__)
#define SI_AVX512 1
#define SI_ISA "avx512bw"
#elif defined(__AVXVNNI__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SI_AVX2 1
#define SI_AVXVNNI 1
#define SI_ISA "avxvnni"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SI_AVX2 1
#define SI_ISA "avx2"
#elif defined(__aarch64__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
#define SI_NEON_DOT 1
#if defined(__ARM_FEATURE_MATMUL_INT8)
#define SI_ISA "neon-i8mm"
#else
#define SI_ISA "neon-dotprod"
#endif
#else
#define SI_ISA "plain"
#endif

#if defined(SI_AVX512) || defined(SI_AVX2)
#include <immintrin.h>
#endif
#ifdef SI_NEON_DOT
#include <arm_neon.h>
#endif

#define QK 32
#define SI_MAX_BATCH 64 /* rows of one batched decode step */
#ifndef PF
#define PF 1024 /* bytes ahead of each weight row's read: the rows are short streams */
#endif
/* The prefetch PF bytes ahead of offset o of a row of nfull blocks: past the row's end it goes
   on at the next row read, ldw bytes after this one's start (a prefix of wider rows: the active
   columns of the down projection; per-token selection: the next candidate's up row), not into
   the bytes between. */
#define PF_SKIP(ldw, nfull) ((ldw) > (nfull) * QK ? (ldw) - (nfull) * QK : 0)
#define PF_AT(w, o, nfull, skip) \
    ((w) + (o) + PF + ((o) + PF >= (nfull) * QK ? (skip) : 0))

/* x [K] blocks [b0, b1) -> xq (zero padded to whole blocks), xd block scales, xs (NULL: not
   wanted) the blocks' sums of xq (the 4-bit products take 8 * xs off, see q4_row). */
static void quantize_blocks(const float *x, int64_t K, int64_t b0, int64_t b1, int8_t *xq,
                            float *xd, int32_t *xs) {
    for (int64_t b = b0; b < b1; b++) {
        int64_t lo = b * QK, hi = lo + QK < K ? lo + QK : K;
        float amax = 0.0f;
        for (int64_t k = lo; k < hi; k++) {
            float a = fabsf(x[k]);
            amax = a > amax ? a : amax;
        }
        float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        xd[b] = d;
        int32_t sum = 0;
        for (int64_t k = lo; k < lo + QK; k++) {
            xq[k] = k < hi ? (int8_t)lrintf(x[k] * id) : 0;
            sum += xq[k];
        }
        if (xs) xs[b] = sum;
    }
}

/* x [K] -> xq [nb * QK] int8 (zero padded), xd [nb] block scales; nb = ceil(K / QK). */
static void quantize_row(const float *x, int64_t K, int8_t *xq, float *xd) {
    quantize_blocks(x, K, 0, (K + QK - 1) / QK, xq, xd, NULL);
}

/* Pair order, the activations as the 4-bit row products read them: blocks 2p and 2p + 1 of
   nb are stored as [x_2p[0:16], x_2p+1[0:16], x_2p[16:32], x_2p+1[16:32]] (the low and the high
   nibbles of two blocks' 32 bytes line up with the first and second half); a last unpaired
   block stays as it is. xq_lo(b, nb): where block b's values 0-15 start (16-31 start at
   xq_hi). */
static inline int64_t xq_lo(int64_t b, int64_t nb) {
    return (b | 1) < nb ? (b >> 1) * 2 * QK + (b & 1) * 16 : b * QK;
}
static inline int64_t xq_hi(int64_t b, int64_t nb) {
    return xq_lo(b, nb) + ((b | 1) < nb ? QK : 16);
}

/* Blocks [b0, b1) of xq (b0 even) from natural into pair order. */
static void pair_blocks(int8_t *xq, int64_t b0, int64_t b1, int64_t nb) {
    for (int64_t b = b0; b + 1 < b1 && b + 1 < nb; b += 2) {
        int8_t t[2 * QK];
        memcpy(t, xq + b * QK, sizeof t);
        int8_t *o = xq + b * QK;
        memcpy(o, t, 16);
        memcpy(o + 16, t + QK, 16);
        memcpy(o + QK, t + 16, 16);
        memcpy(o + QK + 16, t + QK + 16, 16);
    }
}

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

/* Threads: without OpenMP every call runs on one. */
static int clamp_threads(int threads) {
#ifdef _OPENMP
    return threads < 1 ? 1 : threads;
#else
    (void)threads;
    return 1;
#endif
}

static inline int team_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline int team_size(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* [lo, hi) of n items for member t of a team of nt: contiguous, sizes differ by at most 1. */
static inline void share(int64_t n, int t, int nt, int64_t *lo, int64_t *hi) {
    *lo = n * t / nt;
    *hi = n * (t + 1) / nt;
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
    int8_t *xq = (int8_t *)aligned_alloc(64, (size_t)((M * nb * QK + 63) / 64 * 64));
    float *xd = (float *)malloc((size_t)(M * nb) * sizeof(float));
    int32_t *xs = (int32_t *)malloc((size_t)(M * nb) * sizeof(int32_t));
    if (!xq || !xd || !xs) {
        free(xq);
        free(xd);
        free(xs);
        return -1;
    }
    for (int64_t m = 0; m < M; m++)
        quantize_blocks(x + m * K, K, 0, nb, xq + m * nb * QK, xd + m * nb, xs + m * nb);
    threads = clamp_threads(threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t t0, t1;
        share(nt, team_id(), team_size(), &t0, &t1);
        tiles_rows(pk, K, nbs, N, M, x, K, xq, xd, xs, nb * QK, nb, scale, y, N, t0, t1);
    }
    free(xq);
    free(xd);
    free(xs);
    return 0;
}

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

/* ---------------------------------------------------------------------------------------
   One decode step of a whole int8 model, for one token (batch 1), in float32 activations.

   Every decoder layer: h = norm(x); q, k, v = W h (one quantization of h for the three)
   plus each projection's bias where set (si_mat.bias: Qwen2); per-head q/k norms (Gemma 3);
   rotary embedding from tables; k, v into the cache at pos; attention of each query head
   over its kv head's cached keys (a sliding window where set); o = Wo att (+ bias);
   x += post_norm(o) (post norm Gemma 3 only). Then h = norm(x); the active
   prefix of the neuron slots: gate/up rows (interleaved, [k, 2, H]), a = act(gate) * up *
   down_scale, y = Down[:, :n_active] a; x += post_norm(y).
   A 4-bit model (pack --weights q4): the projections may be 4-bit rows (si_mat.d) and the
   neuron slots 4-bit records (si_layer.rec, mlp_step_q4); the steps are the same.

   Per-token selection (si_layer.token, mlp_step_token / mlp_step_q4_token): instead of an
   active prefix, every slot n < n_active is a candidate when |act(gate_n . h)| >= gate_thr;
   a candidate's up row is read, and it is kept when |a_n| = |act(gate_n) * up_n| >= act_thr;
   y = sum over the kept of a_n * down_n (int8: times down_scale[n]). The members choose over
   their shares of the slots, then the kept list (slot order) is compacted and the down product
   reads the kept neurons' down columns in place. int8 slots are laid out for it: the gate rows
   of all slots one array (si_layer.gu: the gate pass is one linear stream, like a dense
   product), the up rows another (si_layer.up: a candidate's row is read where it lies, or a
   member's share of the rows as one stream when more than half of it are candidates: then the
   cheaper read), down neuron-major (a kept column is one contiguous row, y summed in float, each member over its
   range of H). 4-bit records keep the column as they are (the integer down product of
   axpy_q4_part over the list).
   Each member counts its kept slots and its candidates (si_model.cnt, .cand); one adds the
   layer's totals to *si_layer.kept and *si_layer.candidates (where set) once per call.

   Norms: out = x / sqrt(mean(x^2) + eps) * w, with w the effective float32 weight (Gemma 3:
   1 + weight, computed by the caller). Rotary: out = x * cos + roll(x, hd / 2) * sin, with
   the sign of the first half folded into sin by the caller.

   Threads: one team for the whole step. Every product is split by rows, each member a
   contiguous share; heads are split across members; the activations are quantized
   by blocks across members; the norms and residual adds (a few thousand floats) run on one
   member. Members meet at a barrier where one's output is another's input.
*/
typedef struct {
    const int8_t *w;    /* int8 rows, or 4-bit rows (nibbles, ldw bytes apart) where d is set */
    const float *scale; /* [n]; int8 rows only */
    int64_t n, k, ldw;
    const uint16_t *d; /* 4-bit rows: float16 block scales [n, k / 32] at row stride ldd */
    int64_t ldd;
    const float *bias; /* [n]; NULL: none (Qwen2's q/k/v projections have one) */
    int64_t tiled;     /* 1: w holds int8 rows as tiles (si_tile_pack), ldw blocks a tile */
} si_mat;

typedef struct {
    const float *in_norm, *post_attn_norm, *pre_mlp_norm, *post_mlp_norm; /* [H]; NULL: none */
    const float *q_norm, *k_norm;                                           /* [hd]; NULL: none */
    si_mat q, k, v, o;
    float *k_cache, *v_cache; /* [n_kv, cap, hd] */
    const float *cos, *sin;   /* [cap, hd] */
    int64_t window;           /* keys per query, itself included; 0 = all */
    const int8_t *gu;         /* [n_loaded, 2, H]; token (int8): the gate rows [n_loaded, H] */
    const float *gu_scale;    /* [n_loaded, 2]; token (int8): [n_loaded] */
    const int8_t *up;         /* token (int8): the up rows [n_loaded, H]; NULL otherwise */
    const float *up_scale;    /* token (int8): [n_loaded] */
    const int8_t *down;       /* [H, >= n_active] at row stride down_ld */
    const float *down_scale;  /* [>= n_active] */
    int64_t down_ld, n_active;
    /* 4-bit neuron records instead of gu/down (NULL: int8 slots): [n_loaded] records of
       rec_ld bytes, each gate, up nibbles and down column nibbles (H / 2 bytes each), then
       their float16 block scales (H / 32 each); the active prefix is read in place */
    const uint8_t *rec;
    int64_t rec_ld;
    int64_t token; /* 1: per-token selection over all n_active slots (int8: gate and up rows
                      planar, gu and up; down neuron-major [n_active, H] at row stride down_ld) */
    float gate_thr, act_thr; /* token: |act(gate)| a candidate clears, |act(gate) * up| a kept
                                neuron clears (0: every slot) */
    int64_t *kept;           /* NULL, or += neurons computed (kept) per call (token) */
    int64_t *candidates;     /* NULL, or += candidates (up row read) per call (token) */
    int64_t tiled; /* 1: gu holds the [n_loaded * 2, H] rows as tiles and down the [H, down_ld]
                      rows (si_tile_pack); prefix selection only */
    const float *mask; /* NULL, or rows of a batch that compute different neurons of one shared
                          prefix: row b's activations a_n are multiplied by
                          mask[slots[b] * mask_ld + n] (1: its neuron, 0: another row's) */
    int64_t mask_ld;
} si_layer;

typedef struct {
    int64_t hidden, n_heads, n_kv, head_dim, cap, max_k;
    float eps, scaling;
    int act; /* 0: SiLU, 1: GELU (tanh approximation) */
    int64_t teams; /* most threads the scratch has room for (scores rows) */
    /* scratch, float32 unless noted: h [max_k], q [n_heads*hd], kv [2*n_kv*hd],
       att [n_heads*hd], scores [teams*cap], gu [2*max_k], a [max_k],
       xq int8 [max_k + QK], xd [max_k/QK + 1], xs int32 [max_k/QK + 1] */
    float *h, *q, *kv, *att, *scores, *gu, *a;
    int8_t *xq;
    float *xd;
    int32_t *xs;
    /* per-token selection: idx [2*max_k]: the kept slots, each member's from its first slot n0
       on (its values at the same place in a), then from max_k on the kept list compacted (its
       values in gu); cnt [teams + 1]: member t's count of kept slots at t; cand [teams]:
       member t's count of candidates (up row read) at t */
    int32_t *idx;
    int64_t *cnt, *cand;
    /* rows of a batch the scratch has room for (0: 1). Row b's scratch: h, q, att, a at
       b * max_k; kv, gu at b * 2 * max_k; xq at b * (max_k + QK); xd, xs at b * (max_k / QK
       + 2) (see row_scratch); scores, idx, cnt, cand are shared (rows take turns) */
    int64_t batch;
    /* NULL, or the activations prepared for the few-rows product (AVX-512 VNNI; prep_bytes(max_k)
       per batch row): the int8 products of a decode step read them */
    uint8_t *prep;
    /* [batch * teams * max_k]: each row's partial down sums of threads 1 .. teams - 1 over
       4-bit records (mlp_rows_q4; row b, thread u at (b * teams + u - 1) * max_k) */
    float *part;
    /* [batch]: row b's mask row (si_layer.mask: its KV slot), filled per call; NULL: no masks */
    const int64_t *slots;
} si_model;

int si_abi(int64_t *sizes, int n) {
    int64_t s[3] = {(int64_t)sizeof(si_mat), (int64_t)sizeof(si_layer), (int64_t)sizeof(si_model)};
    for (int i = 0; i < n && i < 3; i++) sizes[i] = s[i];
    return SI_ABI_VERSION;
}

const char *si_isa(void) { return SI_ISA; }

/* The threads a call may use: OpenMP's default team size, 1 without OpenMP. */
int si_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

int si_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* Row b's scratch: the model with its scratch pointers moved to batch row b (strides in
   si_model); row 0 is the model itself. */
/* Row strides of a batch's scratch: xq (bytes), xd and xs (elements). */
static inline int64_t xq_stride(const si_model *m) { return m->max_k + QK; }
static inline int64_t xd_stride(const si_model *m) { return m->max_k / QK + 2; }

static void row_scratch(const si_model *m, int64_t b, si_model *r) {
    const int64_t K = m->max_k, nb = xd_stride(m);
    *r = *m;
    r->h += b * K;
    r->q += b * K;
    r->att += b * K;
    r->a += b * K;
    r->kv += b * 2 * K;
    r->gu += b * 2 * K;
    r->xq += b * xq_stride(m);
    r->xd += b * nb;
    r->xs += b * nb;
    if (r->prep) r->prep += b * prep_bytes(K);
    if (r->part) r->part += b * m->teams * m->max_k;
}

#ifndef ROWS_CHUNK
#define ROWS_CHUNK (64 * 1024) /* weight bytes a batch's rows take turns over (from the cache) */
#endif

static inline int m_prep(const si_model *R) { return R[0].prep != NULL; }

/* This member's share of y_b = W . x_b (+ bias) for the B rows of a batch, x_b quantized in row
   b's scratch (R[b].xq, .xd, .xs), x_b = x + b * ldx (the float tail), y_b = y + b * ldy; no
   barrier. The weight rows are read from memory once: a chunk of them (ROWS_CHUNK bytes) for
   every batch row in turn, then the next chunk. */
static void gemv_rows(const si_mat *mt, const si_model *R, int64_t B, const float *x, int64_t ldx,
                      float *y, int64_t ldy, int t, int nt) {
    int64_t n0, n1;
    if (mt->tiled) { /* whole tiles per member; every row of the batch over each */
        share((mt->n + TR - 1) / TR, t, nt, &n0, &n1);
        tiles_rows((const uint8_t *)mt->w, mt->k, mt->ldw, mt->n, B, x, ldx, R[0].xq, R[0].xd,
                   R[0].xs, xq_stride(R), xd_stride(R), mt->scale, y, ldy, n0, n1);
        if (mt->bias)
            for (int64_t b = 0; b < B; b++)
                for (int64_t n = n0 * TR; n < n1 * TR && n < mt->n; n++)
                    y[b * ldy + n] += mt->bias[n];
        return;
    }
    share(mt->n, t, nt, &n0, &n1);
#ifdef SI_PREP
    if (!mt->d && m_prep(R)) { /* every row prepared: each weight row once for all of them */
        rows_prep(mt->w, mt->ldw, mt->k, mt->scale, R[0].prep, prep_bytes(R[0].max_k), B, x, ldx,
                  y, ldy, n0, n1);
        if (mt->bias)
            for (int64_t b = 0; b < B; b++)
                for (int64_t n = n0; n < n1; n++) y[b * ldy + n] += mt->bias[n];
        return;
    }
#endif
    int64_t row_bytes = mt->d ? mt->k / 2 + mt->k / QK * 2 : mt->k;
    int64_t chunk = B > 1 ? ROWS_CHUNK / (row_bytes > 0 ? row_bytes : 1) : n1 - n0;
    if (chunk < 1) chunk = 1;
    for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
        int64_t c1 = c0 + chunk < n1 ? c0 + chunk : n1;
        for (int64_t b = 0; b < B; b++) {
            const si_model *r = &R[b];
            float *yb = y + b * ldy;
            if (mt->d) {
                const uint8_t *w = (const uint8_t *)mt->w;
                for (int64_t n = c0; n < c1; n++)
                    q4_row(w + n * mt->ldw, mt->d + n * mt->ldd, mt->k / QK, r->xq, r->xd, r->xs,
                           yb + n);
            } else {
                rows_q(mt->w, mt->ldw, mt->k, mt->scale, r->xq, r->xd, x + b * ldx, yb, c0, c1);
            }
            if (mt->bias)
                for (int64_t n = c0; n < c1; n++) yb[n] += mt->bias[n];
        }
    }
}

/* This member's share of the quantization of x [K] into m->xq, m->xd; no barrier. */
static void quantize_part(const si_model *m, const float *x, int64_t K, int t, int nt) {
    int64_t b0, b1;
    share((K + QK - 1) / QK, t, nt, &b0, &b1);
    quantize_blocks(x, K, b0, b1, m->xq, m->xd, m->xs);
}

/* The same for 4-bit rows: the members share pairs of blocks, each in pair order. */
static void quantize_part_pairs(const si_model *m, const float *x, int64_t K, int t, int nt) {
    int64_t nb = (K + QK - 1) / QK, p0, p1;
    share((nb + 1) / 2, t, nt, &p0, &p1);
    int64_t b0 = 2 * p0, b1 = 2 * p1 < nb ? 2 * p1 : nb;
    quantize_blocks(x, K, b0, b1, m->xq, m->xd, m->xs);
    pair_blocks(m->xq, b0, b1, nb);
}

/* quantize_part for the int8 products of a decode step: where the activations are prepared
   (si_model.prep), the members share pairs of blocks and prepare the pairs they quantized. */
static void quantize_part_prep(const si_model *m, const float *x, int64_t K, int t, int nt) {
#ifdef SI_PREP
    if (m->prep) {
        int64_t nb = (K + QK - 1) / QK, nfull = K / QK, p0, p1;
        share((nb + 1) / 2, t, nt, &p0, &p1);
        quantize_blocks(x, K, 2 * p0, 2 * p1 < nb ? 2 * p1 : nb, m->xq, m->xd, m->xs);
        int64_t np = (nfull + 1) / 2;
        prep_pairs(m->xq, m->xd, nfull, p0, p1 < np ? p1 : np, m->prep);
        return;
    }
#endif
    quantize_part(m, x, K, t, nt);
}

static void barrier(void) {
#pragma omp barrier
}

static void rope(float *x, const float *cos, const float *sin, int64_t hd) {
    int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] + b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* e^x in float32, x clamped to [-87, 88]: x = k ln 2 + r (k rounded by the 1.5 * 2^23 trick,
   ln 2 in two parts), e^r by its Taylor polynomial of degree 6 on |r| <= ln 2 / 2 (truncation
   below 1.2e-7 relative), 2^k put into the exponent bits: within 2 ulp of expf, and plain
   arithmetic, so a loop over neurons vectorizes (libm's expf and tanhf do not). */
static inline float exp_fast(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float round = 12582912.0f; /* 1.5 * 2^23 */
    float kf = (x * 1.4426950408889634f + round) - round;
    float r = (x - kf * 0.693145751953125f) - kf * 1.4286068203094172e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } two = {.i = ((int32_t)kf + 127) << 23};
    return p * two.f;
}

/* The MLP's activation of a gate value: SiLU g * sigmoid(g), or GELU (tanh form)
   0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3), which is g * sigmoid(2 y). Both as
   g / (1 + e^-z) with exp_fast: Gemma 3 270M's GELU cost 0.75 ms of a 12 ms decode token on one
   thread through tanhf (20 ns a call, 36864 a token), a quarter of the time a second, third and
   fourth row add to a batched step. */
static inline float act(float g, int kind) {
    float z = kind == 1 ? 1.5957691216057308f * (g + 0.044715f * g * g * g) : g;
    return g / (1.0f + exp_fast(-z));
}

/* sum a[i] * b[i] in 16 independent partial sums (the compiler keeps them in vector lanes; one
   sum would be a chain of n dependent additions), added in a fixed order. */
static inline float dotf(const float *a, const float *b, int64_t n) {
    float acc[16] = {0.0f};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (; i < n; i++) s += a[i] * b[i];
    for (int j = 0; j < 16; j++) s += acc[j];
    return s;
}

/* Query head j over its kv head's cached keys [lo, pos] -> m->att[j]; the row's cache starts
   off floats into the layer's. */
static void attend(const si_model *m, const si_layer *L, int64_t off, int64_t j, int64_t lo,
                   int64_t pos, float *s) {
    int64_t hd = m->head_dim, cap = m->cap, G = m->n_heads / m->n_kv, S = pos + 1 - lo;
    const float *qj = m->q + j * hd;
    const float *kc = L->k_cache + off + ((j / G) * cap + lo) * hd;
    const float *vc = L->v_cache + off + ((j / G) * cap + lo) * hd;
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t t = 0; t < S; t++) {
        float d = dotf(qj, kc + t * hd, hd);
        s[t] = d * m->scaling;
        mx = s[t] > mx ? s[t] : mx;
    }
    for (int64_t t = 0; t < S; t++) {
        s[t] = exp_fast(s[t] - mx);
        sum += s[t];
    }
    float *out = m->att + j * hd;
    for (int64_t i = 0; i < hd; i++) out[i] = 0.0f;
    for (int64_t t = 0; t < S; t++) {
        float p = s[t] / sum;
        for (int64_t i = 0; i < hd; i++) out[i] += p * vc[t * hd + i];
    }
}

/* One layer's attention for the B rows of a batch (row b: x + b * H at position pos[b], its
   cache off[b] floats into the layer's), run by every member t of nt; x is updated in place.
   Starts after a barrier, ends with one. The weights are read once for all rows; the (row,
   head) pairs are split across members. */
static void attention_rows(const si_model *m, const si_model *R, const si_layer *L, float *x,
                           int64_t B, const int64_t *pos, const int64_t *off, int t, int nt) {
    int64_t H = m->hidden, nh = m->n_heads, nkv = m->n_kv, hd = m->head_dim, cap = m->cap,
            K = m->max_k;
    for (int64_t b = t; b < B; b += nt) rms_norm(x + b * H, L->in_norm, H, m->eps, R[b].h);
    barrier();
    for (int64_t b = 0; b < B; b++) /* q, k, v: one format */
        (L->q.d ? quantize_part_pairs : quantize_part_prep)(&R[b], R[b].h, H, t, nt);
    barrier();
    gemv_rows(&L->q, R, B, m->h, K, m->q, K, t, nt);
    gemv_rows(&L->k, R, B, m->h, K, m->kv, 2 * K, t, nt);
    gemv_rows(&L->v, R, B, m->h, K, m->kv + nkv * hd, 2 * K, t, nt);
    barrier();
    for (int64_t i = t; i < B * nkv; i += nt) {
        int64_t b = i / nkv, j = i % nkv, p = pos[b];
        float *k = R[b].kv + j * hd, *v = R[b].kv + (nkv + j) * hd;
        if (L->k_norm) rms_norm(k, L->k_norm, hd, m->eps, k);
        rope(k, L->cos + p * hd, L->sin + p * hd, hd);
        memcpy(L->k_cache + off[b] + (j * cap + p) * hd, k, (size_t)hd * sizeof(float));
        memcpy(L->v_cache + off[b] + (j * cap + p) * hd, v, (size_t)hd * sizeof(float));
    }
    barrier();
    for (int64_t i = t; i < B * nh; i += nt) {
        int64_t b = i / nh, j = i % nh, p = pos[b];
        int64_t lo = L->window > 0 && p + 1 > L->window ? p + 1 - L->window : 0;
        float *q = R[b].q + j * hd;
        if (L->q_norm) rms_norm(q, L->q_norm, hd, m->eps, q);
        rope(q, L->cos + p * hd, L->sin + p * hd, hd);
        attend(&R[b], L, off[b], j, lo, p, m->scores + t * cap);
    }
    barrier();
    for (int64_t b = 0; b < B; b++)
        (L->o.d ? quantize_part_pairs : quantize_part_prep)(&R[b], R[b].att, nh * hd, t, nt);
    barrier();
    gemv_rows(&L->o, R, B, m->att, K, m->h, K, t, nt);
    barrier();
    for (int64_t b = t; b < B; b += nt) {
        float *h = R[b].h, *xb = x + b * H;
        if (L->post_attn_norm) rms_norm(h, L->post_attn_norm, H, m->eps, h);
        for (int64_t i = 0; i < H; i++) xb[i] += h[i];
    }
    barrier();
}

/* The residual add of an MLP's output (row scratch h) for every row; ends with a barrier. */
static void mlp_residual(const si_model *m, const si_model *R, const si_layer *L, float *x,
                         int64_t B, int t, int nt) {
    int64_t H = m->hidden;
    for (int64_t b = t; b < B; b += nt) {
        float *h = R[b].h, *xb = x + b * H;
        if (L->post_mlp_norm) rms_norm(h, L->post_mlp_norm, H, m->eps, h);
        for (int64_t i = 0; i < H; i++) xb[i] += h[i];
    }
    barrier();
}

/* Row b's mask over the layer's active prefix (NULL: it computes all of it). */
static inline const float *row_mask(const si_model *m, const si_layer *L, int64_t b) {
    return L->mask && m->slots ? L->mask + m->slots[b] * L->mask_ld : NULL;
}

/* One layer's MLP over the active prefix for the B rows of a batch, run by every member; same
   barriers as above. Rows that compute different neurons of the prefix (si_layer.mask) zero the
   others' activations before the down product: their blocks quantize only their own values. */
static void mlp_rows(const si_model *m, const si_model *R, const si_layer *L, float *x,
                     int64_t B, int t, int nt) {
    int64_t H = m->hidden, k = L->n_active, K = m->max_k;
    for (int64_t b = t; b < B; b += nt) rms_norm(x + b * H, L->pre_mlp_norm, H, m->eps, R[b].h);
    barrier();
    for (int64_t b = 0; b < B; b++) quantize_part_prep(&R[b], R[b].h, H, t, nt);
    barrier();
    si_mat gum = {L->gu, L->gu_scale, 2 * k, H, L->tiled ? (H + QK - 1) / QK : H, NULL, 0, NULL,
                  L->tiled};
    gemv_rows(&gum, R, B, m->h, K, m->gu, 2 * K, t, nt);
    barrier();
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
    barrier();
    mlp_residual(m, R, L, x, B, t, nt);
}

/* The MLP over 4-bit records: gate and up rows of the active records (split by neuron; a
   record is read once for every row), a = act(gate) * up, then the down columns of the same
   records (split by blocks of H), row by row. */
/* Records fetched ahead of the one read (mlp_rows_q4), every line of each, into L2 (prefetcht1):
   the hardware prefetchers do not follow the records (gate and up rows, their scales at the end,
   the down column after the group), and a record's 40 lines fetched into L1 (prefetcht0) fill
   its miss buffers. Qwen2.5 1.5B, 0.7 / 0.5, one thread, Zen 4: the MLP of a decode token 61 ms
   with no fetch, 41 ms with 2 records into L1, 20-25 ms with 2-8 into L2. */
#ifndef PF_RECORDS
#define PF_RECORDS 4
#endif

/* A row's (r: its scratch) partial down sums of thread u over 4-bit records: h for thread 0
   (free once the MLP's input is quantized), part for the others. */
static inline float *q4_part(const si_model *r, int u) {
    return u == 0 ? r->h : r->part + (u - 1) * r->max_k;
}

/* y[0, H) += the down product of list entries [n0, n0 + G) (one coefficient group of a list
   of k) of 4-bit records: activations a[n0 ..], records idx[n0 ..] (idx NULL: records n0 ..);
   pf: fetch the next group's columns meanwhile (gathered rows), else they are near already. */
static void down_q4_group(const si_layer *L, int64_t H, const float *a, const int32_t *idx,
                          int64_t n0, int64_t G, int64_t k, float *y, int pf) {
    const int64_t nb = H / QK, RL = L->rec_ld;
    const uint16_t *dd = (const uint16_t *)(L->rec + 3 * H / 2) + 2 * nb; /* record 0's down scales */
    int16_t cq[DG * DB];
    float s[DB];
    int32_t cs[DB];
    const uint8_t *wr[DG];
    for (int64_t i = 0; i < G; i++) wr[i] = L->rec + (idx ? idx[n0 + i] : n0 + i) * RL + H;
    for (int64_t bc = 0; bc < nb; bc += DB) {
        int64_t nbc = nb - bc < DB ? nb - bc : DB;
        down_coeffs(a, dd, RL / 2, idx, n0, G, bc, nbc, cq, s, cs);
        axpy_q4_group(wr, G, cq, s, cs, bc, nbc, y, pf ? L->rec + H : NULL, dd, RL, RL / 2, idx,
                      n0, k);
    }
}

/* The partial down sums of threads 1 .. nt - 1 added into h (row scratch r), a share of the
   blocks of H each: every path and row sums a layer's groups in the same order. */
static void add_q4_parts(const si_model *r, int64_t H, int t, int nt) {
    int64_t j0, j1;
    share(H / QK, t, nt, &j0, &j1);
    for (int u = 1; u < nt; u++) {
        const float *p = q4_part(r, u);
        for (int64_t j = j0 * QK; j < j1 * QK; j++) r->h[j] += p[j];
    }
}

static void mlp_rows_q4(const si_model *m, const si_model *R, const si_layer *L, float *x,
                        int64_t B, int t, int nt) {
    int64_t H = m->hidden, k = L->n_active, nb = H / QK, RL = L->rec_ld;
    for (int64_t b = t; b < B; b += nt) rms_norm(x + b * H, L->pre_mlp_norm, H, m->eps, R[b].h);
    barrier();
    for (int64_t b = 0; b < B; b++) quantize_part_pairs(&R[b], R[b].h, H, t, nt);
    barrier();
    /* One pass over the records, in memory order: each thread takes whole groups of DG
       neurons (the down product's coefficient groups), reads a group's gate and up rows, then
       its down columns while they are in the cache, and sums its groups' down products into
       its own partial sums (q4_part). */
    int64_t g0, g1;
    share((k + DG - 1) / DG, t, nt, &g0, &g1);
    const float *mks[SI_MAX_BATCH]; /* each row's mask (NULL: none) */
    for (int64_t b = 0; b < B; b++) {
        memset(q4_part(&R[b], t), 0, (size_t)H * sizeof(float));
        mks[b] = row_mask(m, L, b);
    }
    for (int64_t g = g0; g < g1; g++) {
        int64_t n0 = g * DG, G = k - n0 < DG ? k - n0 : DG;
        for (int64_t n = n0; n < n0 + G; n++) {
            const uint8_t *r = L->rec + n * RL;
            const uint16_t *d = (const uint16_t *)(r + 3 * H / 2);
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
                q4_row(r + H / 2, d + nb, nb, rb->xq, rb->xd, rb->xs, &uv);
                rb->a[n] = act(gv, m->act) * uv;
            }
        }
        for (int64_t b = 0; b < B; b++)
            down_q4_group(L, H, R[b].a, NULL, n0, G, k, q4_part(&R[b], t), 0);
    }
    barrier();
    for (int64_t b = 0; b < B; b++) add_q4_parts(&R[b], H, t, nt);
    barrier();
    mlp_residual(m, R, L, x, B, t, nt);
}

/* Per-token selection, after every member t has put its cnt[t] kept slots and their values from
   its first slot n0 on (m->idx, m->a) and a barrier: member t copies them to their place in the
   compacted list (m->idx + max_k, values m->gu; slot order). Returns the list's length; a
   barrier must follow before the list is read. */
static int64_t compact_kept(const si_model *m, int64_t n0, int t, int nt) {
    int64_t off = 0, total = 0;
    for (int s = 0; s < nt; s++) {
        off += s < t ? m->cnt[s] : 0;
        total += m->cnt[s];
    }
    int64_t c = m->cnt[t];
    memcpy(m->idx + m->max_k + off, m->idx + n0, (size_t)c * sizeof(int32_t));
    memcpy(m->gu + off, m->a + n0, (size_t)c * sizeof(float));
    return total;
}

/* The candidates of all nt members (m->cand, after the barrier that follows their counts). */
static int64_t sum_candidates(const si_model *m, int nt) {
    int64_t total = 0;
    for (int s = 0; s < nt; s++) total += m->cand[s];
    return total;
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

/* The MLP with per-token selection over int8 slots (gate rows [n_active, H] at gu, up rows
   [n_active, H] at up, down neuron-major [n_active, H] at row stride down_ld): each member runs
   the gate rows of its share of the slots as one stream, lists its candidates, reads their up
   rows where they lie and keeps its neurons; then the members split the down product by ranges
   of H (16 floats a unit). Same barriers as mlp_step. */
static void mlp_step_token(const si_model *m, const si_layer *L, float *x, int t, int nt) {
    int64_t H = m->hidden, k = L->n_active, nfull = H / QK, from = nfull * QK;
    float *h = m->h, *g = m->gu + k; /* g [k]: the slots' gate values, then act(gate) */
    if (t == 0) rms_norm(x, L->pre_mlp_norm, H, m->eps, h);
    barrier();
    quantize_part(m, h, H, t, nt);
    barrier();
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
    barrier();
    int64_t c0, c1;
    share((H + 15) / 16, t, nt, &c0, &c1);
    down_rows_part(L->down, L->down_ld, m->idx + m->max_k, m->gu, kept, h, c0 * 16,
                   c1 * 16 < H ? c1 * 16 : H);
    barrier();
    if (t == 0) {
        if (L->kept) *L->kept += kept;
        if (L->candidates) *L->candidates += sum_candidates(m, nt);
        if (L->post_mlp_norm) rms_norm(h, L->post_mlp_norm, H, m->eps, h);
        for (int64_t i = 0; i < H; i++) x[i] += h[i];
    }
    barrier();
}

/* The same over 4-bit records: gate and up rows as mlp_step_q4 reads them (up for the
   candidates only), the down product of axpy_q4_part over the kept list, read in place. */
static void mlp_step_q4_token(const si_model *m, const si_layer *L, float *x, int t, int nt) {
    int64_t H = m->hidden, k = L->n_active, nb = H / QK, R = L->rec_ld;
    float *h = m->h;
    if (t == 0) rms_norm(x, L->pre_mlp_norm, H, m->eps, h);
    barrier();
    quantize_part_pairs(m, h, H, t, nt);
    barrier();
    int64_t n0, n1, c = 0, nc = 0; /* kept, candidates */
    share(k, t, nt, &n0, &n1);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *r = L->rec + n * R;
        const uint16_t *d = (const uint16_t *)(r + 3 * H / 2);
        if (n + PF_RECORDS < n1) { /* a record's gate and up rows and their scales a few
                                      ahead, into L2 (see PF_RECORDS; most records are
                                      candidates, whose up row is read) */
            const uint8_t *ahead = r + PF_RECORDS * R;
            for (int64_t o = 0; o < H; o += 64) __builtin_prefetch(ahead + o, 0, 2);
            for (int64_t o = 0; o < H / 8; o += 64) __builtin_prefetch(ahead + 3 * H / 2 + o, 0, 2);
        }
        float g, u;
        q4_row(r, d, nb, m->xq, m->xd, m->xs, &g);
        g = act(g, m->act);
        if (!(fabsf(g) >= L->gate_thr)) continue;
        nc++;
        q4_row(r + H / 2, d + nb, nb, m->xq, m->xd, m->xs, &u);
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
    barrier();
    int64_t g0, g1; /* the kept list's groups, summed as mlp_rows_q4 sums the active prefix's */
    share((kept + DG - 1) / DG, t, nt, &g0, &g1);
    float *y = q4_part(m, t);
    memset(y, 0, (size_t)H * sizeof(float));
    for (int64_t g = g0; g < g1; g++)
        down_q4_group(L, H, m->gu, m->idx + m->max_k, g * DG,
                      kept - g * DG < DG ? kept - g * DG : DG, kept, y, 1);
    barrier();
    add_q4_parts(m, H, t, nt);
    barrier();
    if (t == 0) {
        if (L->kept) *L->kept += kept;
        if (L->candidates) *L->candidates += sum_candidates(m, nt);
        if (L->post_mlp_norm) rms_norm(h, L->post_mlp_norm, H, m->eps, h);
        for (int64_t i = 0; i < H; i++) x[i] += h[i];
    }
    barrier();
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}


/* x [B, H]: the batch rows' token embeddings in, the last layer's outputs out; row b at position
   pos[b] with its KV cache off[b] floats into every layer's k_cache and v_cache. A batch reads
   every weight once for all its rows; each row's result equals a step of that row alone (the
   same operations in the same order). timing (NULL = off): seconds in attention and in the MLP
   are added to timing[0] and timing[1]. threads: at most m->teams. Per-token selection layers
   run row after row. Returns -1 for a position past the cache, -2 for more rows than the
   scratch has. */
int si_decode_batch(const si_model *m, const si_layer *layers, int64_t n_layers, float *x,
                    int64_t B, const int64_t *pos, const int64_t *off, int threads,
                    double *timing) {
    int64_t room = m->batch > 0 ? m->batch : 1;
    if (B < 1 || B > room || B > SI_MAX_BATCH) return -2;
    for (int64_t b = 0; b < B; b++)
        if (pos[b] < 0 || pos[b] >= m->cap) return -1;
    si_model R[SI_MAX_BATCH];
    for (int64_t b = 0; b < B; b++) row_scratch(m, b, &R[b]);
    threads = clamp_threads(threads);
    if (threads > m->teams) threads = (int)m->teams;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int t = team_id(), nt = team_size();
        int64_t H = m->hidden;
        for (int64_t l = 0; l < n_layers; l++) {
            double t0 = timing && t == 0 ? now() : 0.0;
            const si_layer *L = &layers[l];
            attention_rows(m, R, L, x, B, pos, off, t, nt);
            double t1 = timing && t == 0 ? now() : 0.0;
            if (L->token) {
                for (int64_t b = 0; b < B; b++)
                    (L->rec ? mlp_step_q4_token : mlp_step_token)(&R[b], L, x + b * H, t, nt);
            } else {
                (L->rec ? mlp_rows_q4 : mlp_rows)(m, R, L, x, B, t, nt);
            }
            if (timing && t == 0) {
                timing[0] += t1 - t0;
                timing[1] += now() - t1;
            }
        }
    }
    return 0;
}

/* One row: x [H], the token's embedding in, the last layer's output out (si_decode_batch with
   B = 1, its cache at the layers' own). */
int si_decode_layers(const si_model *m, const si_layer *layers, int64_t n_layers, float *x,
                     int64_t pos, int threads, double *timing) {
    const int64_t off = 0;
    return si_decode_batch(m, layers, n_layers, x, 1, &pos, &off, threads, timing);
}
