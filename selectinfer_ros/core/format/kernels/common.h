/* Shared by every product: the instruction-set path, the activations' quantization per block
   of 32 (int8 values, a float scale, their sum), threads. Part of kernel.c (one translation
   unit). */
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#define _DEFAULT_SOURCE /* madvise */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <sys/mman.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef SI_ABI_VERSION
#define SI_ABI_VERSION 20
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

/* Lines fetched while a product computes: a cursor over bytes read next (the next group of
   4-bit records), advanced a few lines at each step of a product that takes one (NULL: none).
   A group's products alternate between phases that read (the rows) and phases that only
   compute (the down coefficients); fetching the next group through all of them keeps the
   memory busy where the hardware prefetchers, driven by the reads, would idle. */
#ifndef PF_HINT
#define PF_HINT 2 /* into L2 */
#endif
typedef struct {
    const uint8_t *p, *end;
} si_pf;

/* How many of a step's lines are fetched, in halves (0: none, 2: all, 3: half as many again):
   si_tune sets it from the calibration that measured which is fastest on this CPU (kernel.py;
   one Zen 4 core: 0 -> 11.5, 1 -> 15, 2 -> 22-24, 3 -> 17 GB/s of 4-bit groups from memory). */
static int si_pf_half = 2;

/* Sets si_pf_half (0 .. 4; another value only asks) and returns the value in force. */
int si_tune(int pf_half) {
    if (pf_half >= 0 && pf_half <= 4) si_pf_half = pf_half;
    return si_pf_half;
}

static inline void pf_step(si_pf *f, int lines) {
    if (!f) return;
    lines = lines * si_pf_half / 2;
    for (int i = 0; i < lines && f->p < f->end; i++, f->p += 64) __builtin_prefetch(f->p, 0, PF_HINT);
}

/* x [K] blocks [b0, b1) -> xq (zero padded to whole blocks), xd block scales, xs (NULL: not
   wanted) the blocks' sums of xq (the 4-bit products' minimums, see q4_row). */
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

/* M activation rows x [M, K] quantized per block (quantize_blocks), for the products that take
   float rows: xq [M, nb * QK], xd and xs [M, nb], nb = ceil(K / QK). */
typedef struct {
    int8_t *xq;
    float *xd;
    int32_t *xs;
} si_qrows;

static void free_qrows(si_qrows *q) {
    free(q->xq);
    free(q->xd);
    free(q->xs);
}

/* 0, or -1 out of memory (nothing held). */
static int quantize_rows(const float *x, int64_t M, int64_t K, si_qrows *q) {
    int64_t nb = (K + QK - 1) / QK;
    q->xq = (int8_t *)aligned_alloc(64, (size_t)((M * nb * QK + 63) / 64 * 64));
    q->xd = (float *)malloc((size_t)(M * nb) * sizeof(float));
    q->xs = (int32_t *)malloc((size_t)(M * nb) * sizeof(int32_t));
    if (!q->xq || !q->xd || !q->xs) {
        free_qrows(q);
        return -1;
    }
    for (int64_t m = 0; m < M; m++)
        quantize_blocks(x + m * K, K, 0, nb, q->xq + m * nb * QK, q->xd + m * nb, q->xs + m * nb);
    return 0;
}

/* x [K] -> xq [nb * QK] int8 (zero padded), xd [nb] block scales; nb = ceil(K / QK). */
static void quantize_row(const float *x, int64_t K, int8_t *xq, float *xd) {
    quantize_blocks(x, K, 0, (K + QK - 1) / QK, xq, xd, NULL);
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
