/* The MLP over tiered slots: the high tier's int8 slots (si_layer.gu, its active prefix
   n_active) and the low tier's 4-bit records (si_layer.rec, rec_active), each at its own
   product's speed (no per-neuron branch), the layer's output their sum. Part of kernel.c. */

/* One layer's tiered MLP over both active prefixes for the B rows of a batch: the input is
   quantized once for both; the records' one pass (into partial sums, thread 0's in q) runs
   beside the int8 gate and up rows, then the int8 down product writes h and the partial sums
   are added. */
static void mlp_rows_tiers(const si_model *m, const si_model *R, const si_layer *L, float *x,
                           int64_t B, int t, int nt) {
    mlp_input_rows(m, R, L, x, B, t, nt);
    gate_up_int8(m, R, L, B, t, nt);
    (L->rec_grouped ? groups_q4 : records_q4)(m, R, L, B, 1, t, nt);
    barrier();
    down_int8(m, R, L, B, t, nt);
    barrier();
    for (int64_t b = 0; b < B; b++) add_q4_parts(&R[b], m->hidden, 1, t, nt);
    barrier();
    mlp_residual(m, R, L, x, B, t, nt);
}

/* Per-token selection over both tiers, one row: the int8 slots' (into h), then the records'
   (partial sums), added; the layer's counts are both tiers'. */
static void mlp_step_tiers_token(const si_model *m, const si_layer *L, float *x, int t, int nt) {
    mlp_input_row(m, L, x, t, nt);
    int64_t cand8, kept8 = token_int8(m, L, &cand8, t, nt);
    int64_t cand4, kept4 = token_q4(m, L, 1, &cand4, t, nt);
    add_q4_parts(m, m->hidden, 1, t, nt);
    barrier();
    mlp_token_end(m, L, x, kept8 + kept4, cand8 + cand4, t);
}
