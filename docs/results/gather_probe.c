/* How fast a CPU reads a random share of short weight rows, against one stream of all of them:
   the memory cost of per-token selection (compute_mode token), apart from any arithmetic.

   Rows of Qwen2.5 1.5B's int8 down projection (H = 1536 bytes, 8960 per layer, 28 layers:
   385 MB, far beyond the caches). Per layer it reads: all rows as one stream; the first
   share * 8960 rows as one stream (same bytes as the gather); a random share of the rows in
   order, with no software prefetch, and fetched whole 8 rows ahead into the outer caches
   (prefetcht2, as the decode kernel's far_prefetch). One thread; times per pass over 28 layers.

     cc -O3 -std=c11 -march=native docs/results/gather_probe.c -o /tmp/gather_probe
     /tmp/gather_probe 0.5        # the share of rows read
*/
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* The sum of rows idx[0..k) (64-bit words: the loads are the work, not the arithmetic). */
static uint64_t read_rows(const int8_t *w, int64_t ld, const int32_t *idx, int64_t k, int ahead) {
    uint64_t s = 0;
    for (int64_t j = 0; j < k; j++) {
        if (ahead && j + ahead < k)
            for (int64_t o = 0; o < ld; o += 64) __builtin_prefetch(w + idx[j + ahead] * ld + o, 0, 1);
        const uint64_t *r = (const uint64_t *)(w + idx[j] * ld);
        for (int64_t i = 0; i < ld / 8; i++) s += r[i];
    }
    return s;
}

int main(int argc, char **argv) {
    const int64_t H = 1536, N = 8960, L = 28;
    double share = argc > 1 ? atof(argv[1]) : 0.5;
    int8_t *w = aligned_alloc(64, (size_t)(L * N * H));
    int32_t *all = malloc(N * sizeof(int32_t)), *some = malloc(N * sizeof(int32_t));
    if (!w || !all || !some) return 1;
    for (int64_t i = 0; i < L * N * H; i++) w[i] = (int8_t)(i * 2654435761u >> 24);
    srand(1);
    int64_t k = 0;
    for (int64_t n = 0; n < N; n++) {
        all[n] = (int32_t)n;
        if (rand() < share * RAND_MAX) some[k++] = (int32_t)n;
    }
    printf("rows read: %lld of %lld per layer, %.0f MB per pass\n", (long long)k, (long long)N,
           L * k * H / 1e6);
    for (int rep = 0; rep < 3; rep++) {
        uint64_t s = 0;
        double t[4];
        for (int v = 0; v < 4; v++) {
            double t0 = now();
            for (int64_t l = 0; l < L; l++) {
                const int8_t *wl = w + l * N * H;
                s += v == 0   ? read_rows(wl, H, all, N, 0)
                     : v == 1 ? read_rows(wl, H, all, k, 0)
                     : v == 2 ? read_rows(wl, H, some, k, 0)
                              : read_rows(wl, H, some, k, 8);
            }
            t[v] = now() - t0;
        }
        printf("all rows %.1f ms (%.1f GB/s) | first share, one stream %.1f ms (%.1f GB/s) | random "
               "share %.1f ms (%.1f GB/s) | random share, fetched 8 rows ahead %.1f ms (%.1f GB/s) "
               "[%llu]\n", t[0] * 1e3, L * N * H / t[0] / 1e9, t[1] * 1e3, L * k * H / t[1] / 1e9,
               t[2] * 1e3, L * k * H / t[2] / 1e9, t[3] * 1e3, L * k * H / t[3] / 1e9,
               (unsigned long long)(s & 1));
    }
    return 0;
}
