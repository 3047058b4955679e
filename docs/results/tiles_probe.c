/* The int8 product of the kernel (selectinfer_ros/core/format/kernels/kernel.c) with the
   weights held as tiles (si_tile_linear) against the same weights as rows (si_linear_i8), for
   1..M activation rows: the output layer of a decode step (M = 1), of a batch of goals (M = 2-4),
   and a prompt's chunk. Default shape: Gemma 3 270M's output layer (262144 x 640, 168 MB).
   Best of 5 per row count; the maximum difference of the two results is printed beside.

     cc -O3 -std=c11 -fopenmp -march=native -Iselectinfer_ros/core/format/kernels \
        docs/results/tiles_probe.c -o /tmp/tiles_probe -lm
     /tmp/tiles_probe [N K threads max_rows]      # 262144 640 1 5
   Another path: the kernel's flags instead of -march=native (kernel.py ISAS), e.g.
   -mavx2 -mfma -mf16c for the AVX2 path. */
#include "kernel.c"
#include <stdio.h>

int main(int argc, char **argv) {
    int64_t N = argc > 1 ? atoll(argv[1]) : 262144, K = argc > 2 ? atoll(argv[2]) : 640;
    int th = argc > 3 ? atoi(argv[3]) : 1, Mmax = argc > 4 ? atoi(argv[4]) : 5;
    int8_t *w = aligned_alloc(64, (size_t)(N * K));
    for (int64_t i = 0; i < N * K; i++) w[i] = (int8_t)((i * 2654435761u >> 13) % 255 - 127);
    uint8_t *pk = aligned_alloc(64, (size_t)si_tile_bytes(N, K));
    double t0 = now();
    si_tile_pack(w, N, K, K, pk, th);
    printf("# %s, %lld x %lld, %d thread(s): packed in %.0f ms\n", SI_ISA, (long long)N,
           (long long)K, th, (now() - t0) * 1e3);
    float *sc = malloc((size_t)N * 4), *x = malloc((size_t)(Mmax * K) * 4);
    float *y = malloc((size_t)(Mmax * N) * 4), *y2 = malloc((size_t)(Mmax * N) * 4);
    for (int64_t i = 0; i < N; i++) sc[i] = 0.01f + (float)(i % 7) * 0.001f;
    for (int64_t i = 0; i < Mmax * K; i++) x[i] = (float)((i * 7919) % 200 - 100) / 50.0f;
    for (int M = 1; M <= Mmax; M = M < 8 ? M + 1 : M * 2) {
        double tiles = 1e9, rows = 1e9;
        for (int rep = 0; rep < 5; rep++) {
            t0 = now();
            si_tile_linear(x, M, K, pk, N, K, sc, y, th);
            double t = now() - t0;
            tiles = t < tiles ? t : tiles;
            t0 = now();
            si_linear_i8(x, M, K, w, N, K, sc, y2, th);
            t = now() - t0;
            rows = t < rows ? t : rows;
        }
        double md = 0, mx = 0;
        for (int64_t i = 0; i < M * N; i++) {
            md = fabs(y[i] - y2[i]) > md ? fabs(y[i] - y2[i]) : md;
            mx = fabs(y2[i]) > mx ? fabs(y2[i]) : mx;
        }
        printf("rows %2d  tiles %7.2f ms (%5.1f GB/s)  rows %7.2f ms  %.2fx  max diff %.1e of %.1f\n",
               M, tiles * 1e3, (double)(N * K) / tiles / 1e9, rows * 1e3, rows / tiles, md, mx);
    }
    return 0;
}
