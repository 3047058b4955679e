/* One layer's attention for the rows of a batch. Part of kernel.c. */
static void rope(float *x, const float *cos, const float *sin, int64_t hd) {
    int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] + b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
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
        quantize_part_prep(&R[b], R[b].h, H, t, nt);
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
        quantize_part_prep(&R[b], R[b].att, nh * hd, t, nt);
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
