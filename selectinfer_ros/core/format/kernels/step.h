/* The decode step's structures (si_mat, si_layer, si_model: the ABI with kernel.py) and
   helpers every layer product uses: norms, batch rows' scratch, the rows product of a
   projection, activations, the MLP's residual, row masks, the per-token kept list. Part of
   kernel.c. */
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
   axpy_q4_group over the list).
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
    const uint8_t *d; /* 4-bit rows: heads [n, ceil(k / 256) * 16] at row stride ldd (bytes) */
    int64_t ldd;
    const float *bias; /* [n]; NULL: none (Qwen2's q/k/v projections have one) */
    int64_t tiled;     /* 1: w holds int8 rows as tiles (si_tile_pack), ldw blocks a tile; 2: w
                          4-bit rows interleaved 16 at a time, d their heads (rows_q4il.c) */
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
    /* 4-bit neuron records (NULL: none): records of rec_ld bytes, each gate, up nibbles and down
       column nibbles (H / 2 bytes each), then their heads (q4_head_bytes(H) each); the active
       prefix rec[:rec_active] is read in place. A layer with int8 slots (gu) and records is
       tiered: its output is the sum of both products, each over its own active prefix */
    const uint8_t *rec;
    int64_t rec_ld, rec_active;
    int64_t rec_grouped; /* 1: the records held in groups of 32 slots (rows_q4g.c; rec_ld
                            unused): prefix selection only */
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
    const float *rec_mask; /* the same over the records (NULL: none) */
    int64_t rec_mask_ld;
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
    if (mt->tiled == 1) { /* whole tiles per member; every row of the batch over each */
        share((mt->n + TR - 1) / TR, t, nt, &n0, &n1);
        tiles_rows((const uint8_t *)mt->w, mt->k, mt->ldw, mt->n, B, x, ldx, R[0].xq, R[0].xd,
                   R[0].xs, xq_stride(R), xd_stride(R), mt->scale, y, ldy, n0, n1);
        if (mt->bias)
            for (int64_t b = 0; b < B; b++)
                for (int64_t n = n0 * TR; n < n1 * TR && n < mt->n; n++)
                    y[b * ldy + n] += mt->bias[n];
        return;
    }
    if (mt->tiled == 2) { /* 4-bit groups of 16 rows per member; every row of the batch over each */
        share(mt->n / IL, t, nt, &n0, &n1);
        const uint8_t *w = (const uint8_t *)mt->w;
        int64_t hb = il_head_bytes(mt->k);
        float out[IL];
        for (int64_t g = n0; g < n1; g++)
            for (int64_t b = 0; b < B; b++) {
                const si_model *r = &R[b];
                il_group(w + g * IL * (mt->k / 2), mt->d + g * hb, mt->k, r->xq, r->xd, r->xs, out, NULL);
                for (int i = 0; i < IL; i++)
                    y[b * ldy + g * IL + i] = out[i] + (mt->bias ? mt->bias[g * IL + i] : 0.0f);
            }
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
    int64_t row_bytes = mt->d ? mt->k / 2 + q4_head_bytes(mt->k) : mt->k;
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

/* Row b's mask over the layer's active prefix of int8 slots (NULL: it computes all of it). */
static inline const float *row_mask(const si_model *m, const si_layer *L, int64_t b) {
    return L->mask && m->slots ? L->mask + m->slots[b] * L->mask_ld : NULL;
}

/* The same over its records. */
static inline const float *rec_row_mask(const si_model *m, const si_layer *L, int64_t b) {
    return L->rec_mask && m->slots ? L->rec_mask + m->slots[b] * L->rec_mask_ld : NULL;
}

/* The MLP's input for the B rows of a batch: each row's norm in its h, quantized (and prepared)
   for the products; ends with a barrier. */
static void mlp_input_rows(const si_model *m, const si_model *R, const si_layer *L,
                           const float *x, int64_t B, int t, int nt) {
    int64_t H = m->hidden;
    for (int64_t b = t; b < B; b += nt) rms_norm(x + b * H, L->pre_mlp_norm, H, m->eps, R[b].h);
    barrier();
    for (int64_t b = 0; b < B; b++) quantize_part_prep(&R[b], R[b].h, H, t, nt);
    barrier();
}

/* The same for one row (per-token selection: its products read xq, not prepared activations). */
static void mlp_input_row(const si_model *m, const si_layer *L, const float *x, int t, int nt) {
    if (t == 0) rms_norm(x, L->pre_mlp_norm, m->hidden, m->eps, m->h);
    barrier();
    quantize_part(m, m->h, m->hidden, t, nt);
    barrier();
}

/* The end of a per-token MLP step of one row, its output in h: the layer's kept neurons and
   candidates counted, the residual added; ends with a barrier. */
static void mlp_token_end(const si_model *m, const si_layer *L, float *x, int64_t kept,
                          int64_t cand, int t) {
    if (t == 0) {
        int64_t H = m->hidden;
        float *h = m->h;
        if (L->kept) *L->kept += kept;
        if (L->candidates) *L->candidates += cand;
        if (L->post_mlp_norm) rms_norm(h, L->post_mlp_norm, H, m->eps, h);
        for (int64_t i = 0; i < H; i++) x[i] += h[i];
    }
    barrier();
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
