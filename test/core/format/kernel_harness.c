/* A stand-alone run of the kernel (included whole), for test_kernel_aarch64.py: built once per
   instruction-set path (for aarch64, run under qemu-user on other machines), it prints
   - "isa <name>",
   - "linear <i> <threads> <values...>": si_linear_i8 over shapes with odd block counts,
     partial blocks and column prefixes of wider rows, on 1 and 2 threads (shapes 8-11:
     M >= 4, the blocked product of a prefill),
   - "q4 <i> <threads> <values...>": si_linear_q4 (4-bit rows) likewise,
   - "axpy <i> <threads> <values...>": si_axpy_q4 (the down product of 4-bit records),
   - "decode <pos> <values...>": the hidden state after si_decode_layers of a small random
     int8 model (2 layers, GQA, q/k norms, q/k/v biases, a sliding window, a partial active
     prefix),
   - "decode4 <pos> <values...>": the same for a 4-bit model (4-bit projections and records),
   - "decodet <pos> <values...>" and "decode4t <pos> <values...>": the int8 model (gate and up
     rows planar, its down projection neuron-major) and the 4-bit model with per-token selection (si_layer.token,
     thresholds that keep about half of the slots), each followed by
     "keptt <pos> <layer 0 and 1 counts>" / "kept4t <pos> <counts>": the neurons kept, and
     with the argument "candidates" (test_kernel.py) then "candt <pos> <counts>" /
     "cand4t <pos> <counts>": the candidates (|act(gate)| over its threshold, up row read),
   all from a fixed pseudo-random sequence, as %a (exact) floats. */
#include "kernel.c"

#include <stdio.h>

/* per-token thresholds (|act(gate)|, |act(gate) * up|) of the harness's int8 and 4-bit models:
   each keeps about 35 of the 80 active slots per layer and token (4-bit: more than one group
   of 32 in the down product); the int8 model's layer 0 (_FEW) about 28 of 30 candidates */
#define TOKEN_GATE_THR 0.1f
#define TOKEN_ACT_THR 1.0f
#define TOKEN_GATE_THR_FEW 1.6f
#define TOKEN_ACT_THR_FEW 1.0f
#define TOKEN4_GATE_THR 0.2f
#define TOKEN4_ACT_THR 0.05f

static uint64_t state = 88172645463325252ull;

static float urand(void) { /* xorshift64: [-1, 1) */
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (float)((state >> 40) & 0xFFFFFF) / 8388608.0f - 1.0f;
}

static int8_t *qrows(int64_t n) {
    int8_t *w = malloc((size_t)n);
    for (int64_t i = 0; i < n; i++) w[i] = (int8_t)lrintf(urand() * 127.0f);
    return w;
}

static float *frand(int64_t n, float lo, float hi) {
    float *v = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) v[i] = lo + (hi - lo) * 0.5f * (urand() + 1.0f);
    return v;
}

static void print(const char *what, int64_t a, int64_t b, const float *y, int64_t n) {
    printf("%s %lld %lld", what, (long long)a, (long long)b);
    for (int64_t i = 0; i < n; i++) printf(" %a", y[i]);
    printf("\n");
}

static si_mat mat(int64_t n, int64_t k) {
    si_mat m = {qrows(n * k), frand(n, 0.001f, 0.02f), n, k, k, NULL, 0, NULL};
    return m;
}

/* The heads of n 4-bit rows of k (q4.py): per super-block float16 d in [2^-11, 2^-9), dmin in
   [2^-8, 2^-6) (sub-block steps near 0.02, offsets near 7.5 steps), 12 bytes of 6-bit scales and minimums from the random sequence */
static uint8_t *heads4(int64_t n, int64_t k) {
    int64_t hb = (k + 255) / 256 * 16;
    uint8_t *h = (uint8_t *)qrows(n * hb);
    for (int64_t j = 0; j < n * hb / 16; j++) {
        uint16_t d = (uint16_t)(((15 - 11 + (j % 2)) << 10) | ((uint16_t)(urand() * 511.0f + 512.0f)));
        uint16_t dm = (uint16_t)(((15 - 8 + (j % 2)) << 10) | ((uint16_t)(urand() * 511.0f + 512.0f)));
        memcpy(h + 16 * j, &d, 2);
        memcpy(h + 16 * j + 2, &dm, 2);
    }
    return h;
}

/* n 4-bit rows of k: nibbles [n, k / 2] and heads [n, ceil(k / 256) * 16] */
static si_mat mat4(int64_t n, int64_t k) {
    si_mat m = {qrows(n * k / 2), NULL, n, k, k / 2, heads4(n, k), (k + 255) / 256 * 16, NULL};
    return m;
}

/* n 4-bit neuron records of hidden size H (layout of pack.q4_records), heads as above */
static int64_t record4_bytes(int64_t H) { return 3 * (H / 2 + (H + 255) / 256 * 16); }
static uint8_t *records4(int64_t n, int64_t H) {
    int64_t R = record4_bytes(H), hb = (H + 255) / 256 * 16;
    uint8_t *r = (uint8_t *)qrows(n * R);
    for (int64_t i = 0; i < n; i++) {
        uint8_t *h = heads4(3, H);
        memcpy(r + i * R + 3 * H / 2, h, (size_t)(3 * hb));
        free(h);
    }
    return r;
}

/* si_linear_i8 over shapes {N, K, M, ldw} on 1 and 2 threads, printed as "linear" cases first,
   first + 1, ... (odd cases without row scales); nonzero if the kernel fails. */
static int linear_cases(const int64_t (*shapes)[4], int n, int first) {
    for (int i = 0; i < n; i++) {
        int64_t N = shapes[i][0], K = shapes[i][1], M = shapes[i][2], ld = shapes[i][3];
        int8_t *w = qrows(N * ld);
        float *scale = frand(N, 0.001f, 0.02f), *x = frand(M * K, -2.0f, 2.0f);
        float *y = malloc((size_t)(M * N) * sizeof(float));
        for (int threads = 1; threads <= 2; threads++) {
            if (si_linear_i8(x, M, K, w, N, ld, (first + i) % 2 ? NULL : scale, y, threads) != 0)
                return 1;
            print("linear", first + i, threads, y, M * N);
        }
        /* the same rows held as tiles (an output layer's layout); "tilerows": 1 if every row
           reads back unchanged */
        uint8_t *pk = malloc((size_t)si_tile_bytes(N, K));
        si_tile_pack(w, N, K, ld, pk, 2);
        for (int threads = 1; threads <= 2; threads++) {
            if (si_tile_linear(x, M, K, pk, N, K, (first + i) % 2 ? NULL : scale, y, threads) != 0)
                return 1;
            print("tiles", first + i, threads, y, M * N);
        }
        int8_t *back = malloc((size_t)K);
        float same = 1.0f;
        for (int64_t n = 0; n < N; n++) {
            if (si_tile_rows(pk, N, K, &n, 1, back) != 0 || memcmp(back, w + n * ld, (size_t)K))
                same = 0.0f;
        }
        print("tilerows", first + i, 0, &same, 1);
        free(back);
        free(pk);
    }
    return 0;
}

int main(int argc, char **argv) {
    int cands = argc > 1 && strcmp(argv[1], "candidates") == 0; /* print candt, cand4t */
    printf("isa %s\n", si_isa());
    static const int64_t shapes[][4] = {/* N, K, M, ldw */
                                        {7, 45, 3, 45},    {64, 640, 1, 640}, {33, 31, 2, 40},
                                        {9, 96, 1, 96},    {12, 100, 2, 130}, {5, 160, 1, 160},
                                        {130, 2048, 2, 2048}, {16, 1024, 1, 1100}};
    if (linear_cases(shapes, (int)(sizeof shapes / sizeof shapes[0]), 0) != 0) return 1;

    static const int64_t q4shapes[][3] = {{7, 64, 3}, {64, 640, 1}, {33, 192, 2}, {130, 2048, 2}};
    for (int i = 0; i < 4; i++) {
        int64_t N = q4shapes[i][0], K = q4shapes[i][1], M = q4shapes[i][2], hb = (K + 255) / 256 * 16;
        uint8_t *w = (uint8_t *)qrows(N * K / 2);
        uint8_t *d = heads4(N, K);
        float *x = frand(M * K, -2.0f, 2.0f), *y = malloc((size_t)(M * N) * sizeof(float));
        for (int threads = 1; threads <= 2; threads++) {
            if (si_linear_q4(x, M, K, w, d, N, K / 2, hb, y, threads) != 0) return 1;
            print("q4", i, threads, y, M * N);
        }
        float *a = frand(M * N, -2.0f, 2.0f), *z = malloc((size_t)(M * K) * sizeof(float));
        for (int threads = 1; threads <= 2; threads++) { /* N rows of K as the down columns */
            if (si_axpy_q4(a, M, N, w, d, K / 2, hb, K, z, threads) != 0) return 1;
            print("axpy", i, threads, z, M * K);
        }
    }

    const int64_t H = 64, nh = 4, nkv = 2, hd = 16, cap = 8, loaded = 96, L = 2, teams = 2;
    si_model m = {H, nh, nkv, hd, cap, loaded > H ? loaded : H, 1e-6f, 0.25f, 1, teams,
                  NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    m.h = calloc(m.max_k, sizeof(float));
    m.q = calloc(nh * hd, sizeof(float));
    m.kv = calloc(2 * nkv * hd, sizeof(float));
    m.att = calloc(nh * hd, sizeof(float));
    m.scores = calloc(teams * cap, sizeof(float));
    m.gu = calloc(2 * loaded, sizeof(float));
    m.a = calloc(m.max_k, sizeof(float));
    m.xq = calloc(m.max_k + QK, 1);
    m.xd = calloc(m.max_k / QK + 2, sizeof(float));
    m.xs = calloc(m.max_k / QK + 2, sizeof(int32_t));
    m.idx = calloc(2 * m.max_k, sizeof(int32_t));
    m.cnt = calloc(teams + 1, sizeof(int64_t));
    m.cand = calloc(teams, sizeof(int64_t));
    m.part = calloc(teams * m.max_k, sizeof(float));
    si_layer layers[2];
    memset(layers, 0, sizeof layers); /* rec NULL: int8 slots first */
    float *cos = frand(cap * hd, -1.0f, 1.0f), *sin = frand(cap * hd, -1.0f, 1.0f);
    for (int l = 0; l < L; l++) {
        si_layer *ly = &layers[l];
        ly->in_norm = frand(H, 0.5f, 1.5f);
        ly->post_attn_norm = frand(H, 0.5f, 1.5f);
        ly->pre_mlp_norm = frand(H, 0.5f, 1.5f);
        ly->post_mlp_norm = frand(H, 0.5f, 1.5f);
        ly->q_norm = frand(hd, 0.5f, 1.5f);
        ly->k_norm = frand(hd, 0.5f, 1.5f);
        ly->q = mat(nh * hd, H);
        ly->k = mat(nkv * hd, H);
        ly->v = mat(nkv * hd, H);
        ly->o = mat(H, nh * hd);
        ly->q.bias = frand(nh * hd, -0.5f, 0.5f); /* Qwen2: biased q, k, v */
        ly->k.bias = frand(nkv * hd, -0.5f, 0.5f);
        ly->v.bias = frand(nkv * hd, -0.5f, 0.5f);
        ly->k_cache = calloc(nkv * cap * hd, sizeof(float));
        ly->v_cache = calloc(nkv * cap * hd, sizeof(float));
        ly->cos = cos;
        ly->sin = sin;
        ly->window = l == 1 ? 4 : 0;
        ly->gu = qrows(loaded * 2 * H);
        ly->gu_scale = frand(loaded * 2, 0.001f, 0.02f);
        ly->down = qrows(H * loaded);
        ly->down_scale = frand(loaded, 0.001f, 0.02f);
        ly->down_ld = loaded;
        ly->n_active = 80; /* two full blocks and a partial one */
    }
    float *x = malloc(H * sizeof(float)), *xin = malloc(6 * H * sizeof(float));
    for (int64_t pos = 0; pos < 6; pos++) {
        for (int64_t i = 0; i < H; i++) x[i] = xin[pos * H + i] = urand();
        if (si_decode_layers(&m, layers, L, x, pos, 2, NULL) != 0) return 1;
        print("decode", pos, 0, x, H);
    }
    /* the same steps with the attention projections and the neuron slots held as tiles
       ("decodetl"; gu: [2 loaded, H] rows, down: [H, loaded]) */
    si_mat rows[2][4];
    const int8_t *slot_rows[2][2];
    for (int l = 0; l < L; l++) {
        si_layer *ly = &layers[l];
        slot_rows[l][0] = ly->gu;
        slot_rows[l][1] = ly->down;
        uint8_t *gt = malloc((size_t)si_tile_bytes(2 * loaded, H));
        uint8_t *dt = malloc((size_t)si_tile_bytes(H, loaded));
        si_tile_pack(ly->gu, 2 * loaded, H, H, gt, 1);
        si_tile_pack(ly->down, H, loaded, ly->down_ld, dt, 1);
        ly->gu = (const int8_t *)gt;
        ly->down = (const int8_t *)dt;
        ly->down_ld = loaded;
        ly->tiled = 1;
    }
    for (int l = 0; l < L; l++) {
        si_mat *ms[4] = {&layers[l].q, &layers[l].k, &layers[l].v, &layers[l].o};
        for (int j = 0; j < 4; j++) {
            rows[l][j] = *ms[j];
            uint8_t *pk = malloc((size_t)si_tile_bytes(ms[j]->n, ms[j]->k));
            si_tile_pack(ms[j]->w, ms[j]->n, ms[j]->k, ms[j]->ldw, pk, 1);
            ms[j]->w = (const int8_t *)pk;
            ms[j]->ldw = (ms[j]->k + QK - 1) / QK; /* blocks a tile */
            ms[j]->tiled = 1;
        }
    }
    for (int64_t pos = 0; pos < 6; pos++) {
        memcpy(x, xin + pos * H, H * sizeof(float));
        if (si_decode_layers(&m, layers, L, x, pos, 2, NULL) != 0) return 1;
        print("decodetl", pos, 0, x, H);
    }
    for (int l = 0; l < L; l++) {
        si_mat *ms[4] = {&layers[l].q, &layers[l].k, &layers[l].v, &layers[l].o};
        for (int j = 0; j < 4; j++) {
            free((void *)ms[j]->w);
            *ms[j] = rows[l][j];
        }
        free((void *)layers[l].gu);
        free((void *)layers[l].down);
        layers[l].gu = slot_rows[l][0];
        layers[l].down = slot_rows[l][1];
        layers[l].down_ld = loaded;
        layers[l].tiled = 0;
    }
    /* per-token selection over all 80 active slots (GELU), about half of them kept */
    int64_t kept[2], cand[2];
    for (int l = 0; l < L; l++) {
        si_layer *ly = &layers[l];
        ly->down = qrows(loaded * H); /* neuron-major [loaded, H] */
        ly->down_ld = H;
        ly->up = ly->gu + loaded * H; /* planar: gate rows [loaded, H], then up rows */
        ly->up_scale = ly->gu_scale + loaded;
        ly->token = 1;
        /* layer 0: fewer candidates than half of each member's slots (their up rows read where
           they lie); layer 1: more (the member's up rows read as one stream) */
        ly->gate_thr = l == 0 ? TOKEN_GATE_THR_FEW : TOKEN_GATE_THR;
        ly->act_thr = l == 0 ? TOKEN_ACT_THR_FEW : TOKEN_ACT_THR;
        ly->kept = &kept[l];
        ly->candidates = &cand[l];
        memset(ly->k_cache, 0, (size_t)(nkv * cap * hd) * sizeof(float));
        memset(ly->v_cache, 0, (size_t)(nkv * cap * hd) * sizeof(float));
    }
    for (int64_t pos = 0; pos < 6; pos++) {
        for (int64_t i = 0; i < H; i++) x[i] = urand();
        kept[0] = kept[1] = cand[0] = cand[1] = 0;
        if (si_decode_layers(&m, layers, L, x, pos, 2, NULL) != 0) return 1;
        print("decodet", pos, 0, x, H);
        float kf[2] = {(float)kept[0], (float)kept[1]};
        print("keptt", pos, 0, kf, 2);
        float cf[2] = {(float)cand[0], (float)cand[1]};
        if (cands) print("candt", pos, 0, cf, 2);
    }
    for (int l = 0; l < L; l++) { /* the same model over 4-bit rows and records */
        si_layer *ly = &layers[l];
        ly->token = 0; /* the active prefix first */
        ly->kept = ly->candidates = NULL;
        const float *qb = ly->q.bias, *kb = ly->k.bias, *vb = ly->v.bias;
        ly->q = mat4(nh * hd, H);
        ly->k = mat4(nkv * hd, H);
        ly->v = mat4(nkv * hd, H);
        ly->o = mat4(H, nh * hd);
        ly->q.bias = qb;
        ly->k.bias = kb;
        ly->v.bias = vb;
        ly->rec = records4(loaded, H);
        ly->rec_ld = record4_bytes(H);
        memset(ly->k_cache, 0, (size_t)(nkv * cap * hd) * sizeof(float));
        memset(ly->v_cache, 0, (size_t)(nkv * cap * hd) * sizeof(float));
    }
    for (int64_t pos = 0; pos < 6; pos++) {
        for (int64_t i = 0; i < H; i++) x[i] = urand();
        if (si_decode_layers(&m, layers, L, x, pos, 2, NULL) != 0) return 1;
        print("decode4", pos, 0, x, H);
    }
    for (int l = 0; l < L; l++) {
        si_layer *ly = &layers[l];
        ly->token = 1;
        ly->gate_thr = TOKEN4_GATE_THR;
        ly->act_thr = TOKEN4_ACT_THR;
        ly->kept = &kept[l];
        ly->candidates = &cand[l];
        memset(ly->k_cache, 0, (size_t)(nkv * cap * hd) * sizeof(float));
        memset(ly->v_cache, 0, (size_t)(nkv * cap * hd) * sizeof(float));
    }
    for (int64_t pos = 0; pos < 6; pos++) {
        for (int64_t i = 0; i < H; i++) x[i] = urand();
        kept[0] = kept[1] = cand[0] = cand[1] = 0;
        if (si_decode_layers(&m, layers, L, x, pos, 2, NULL) != 0) return 1;
        print("decode4t", pos, 0, x, H);
        float kf[2] = {(float)kept[0], (float)kept[1]};
        print("kept4t", pos, 0, kf, 2);
        float cf[2] = {(float)cand[0], (float)cand[1]};
        if (cands) print("cand4t", pos, 0, cf, 2);
    }

    /* M >= 4 (after the rest, which keeps its random draws): the blocked product of a prefill,
       tiles of weight rows with a partial last one, odd block counts, a partial block, K beyond
       one chunk of blocks, M not a multiple of the rows per pass */
    static const int64_t gemm[][4] = {{50, 1000, 9, 1013}, {100, 96, 4, 96}, {7, 45, 5, 45},
                                      {33, 2080, 6, 2080}};
    if (linear_cases(gemm, 4, 8) != 0) return 1;

    /* a batch of 3 rows, each at its own position in its own cache slot, on the 4-bit model:
       the active prefix (batchp), then per-token selection (batcht, row after row); each step's
       rows alone first ("...a", one row per call), then the same steps together ("...b") */
    const int64_t B = 3, slot = nkv * cap * hd;
    si_model mb = m;
    mb.batch = B;
    mb.h = calloc(B * mb.max_k, sizeof(float));
    mb.q = calloc(B * mb.max_k, sizeof(float));
    mb.att = calloc(B * mb.max_k, sizeof(float));
    mb.a = calloc(B * mb.max_k, sizeof(float));
    mb.kv = calloc(B * 2 * mb.max_k, sizeof(float));
    mb.gu = calloc(B * 2 * mb.max_k, sizeof(float));
    mb.xq = calloc(B * (mb.max_k + QK), 1);
    mb.xd = calloc(B * (mb.max_k / QK + 2), sizeof(float));
    mb.xs = calloc(B * (mb.max_k / QK + 2), sizeof(int32_t));
    mb.part = calloc(B * teams * mb.max_k, sizeof(float));
    for (int l = 0; l < L; l++) {
        layers[l].k_cache = calloc(B * slot, sizeof(float));
        layers[l].v_cache = calloc(B * slot, sizeof(float));
        layers[l].kept = layers[l].candidates = NULL;
    }
    float *xb = malloc((size_t)(B * H) * sizeof(float)), *xa = malloc((size_t)(B * H) * sizeof(float));
    for (int token = 0; token <= 1; token++) {
        for (int l = 0; l < L; l++) layers[l].token = token;
        float *in = frand(4 * B * H, -1.0f, 1.0f);
        for (int pass = 0; pass < 2; pass++) {
            for (int l = 0; l < L; l++) {
                memset(layers[l].k_cache, 0, (size_t)(B * slot) * sizeof(float));
                memset(layers[l].v_cache, 0, (size_t)(B * slot) * sizeof(float));
            }
            for (int64_t step = 0; step < 4; step++) {
                int64_t pos[3] = {step, step + 1, step + 2}, off[3] = {0, slot, 2 * slot};
                memcpy(xb, in + step * B * H, (size_t)(B * H) * sizeof(float));
                if (pass == 0) {
                    for (int64_t b = 0; b < B; b++) {
                        if (step == 0) /* rows 1, 2 start later: fill their first positions */
                            for (int64_t p = 0; p < pos[b]; p++) {
                                memcpy(xa, in + b * H, (size_t)H * sizeof(float));
                                if (si_decode_batch(&mb, layers, L, xa, 1, &p, &off[b], 2, NULL)) return 1;
                            }
                        if (si_decode_batch(&mb, layers, L, xb + b * H, 1, &pos[b], &off[b], 2, NULL))
                            return 1;
                    }
                    print(token ? "batchta" : "batchpa", step, 0, xb, B * H);
                } else {
                    if (step == 0)
                        for (int64_t b = 1; b < B; b++)
                            for (int64_t p = 0; p < pos[b]; p++) {
                                memcpy(xa, in + b * H, (size_t)H * sizeof(float));
                                if (si_decode_batch(&mb, layers, L, xa, 1, &p, &off[b], 2, NULL)) return 1;
                            }
                    if (si_decode_batch(&mb, layers, L, xb, B, pos, off, 2, NULL)) return 1;
                    print(token ? "batchtb" : "batchpb", step, 0, xb, B * H);
                }
            }
        }
    }
    return 0;
}
