/* The decode step: every layer of a batch of rows in one parallel region. Part of kernel.c. */
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
                    (L->rec ? (L->gu ? mlp_step_tiers_token : mlp_step_q4_token)
                            : mlp_step_token)(&R[b], L, x + b * H, t, nt);
            } else {
                (L->rec ? (L->gu ? mlp_rows_tiers : mlp_rows_q4) : mlp_rows)(m, R, L, x, B, t, nt);
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
