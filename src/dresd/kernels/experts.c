/* A mixture-of-experts MLP (Qwen3-MoE's, gpt-oss's) in C, and the decoder whose layers end in one
 * (dresd/kernels/experts.py loads it; decoding/forward.py calls it). Every kernel tier.
 *
 * Per row x of the post-attention norm's output, as llama.cpp's `build_moe_ffn` (softmax
 * gating, SiLU experts, weights renormalised) and transformers' `Qwen3MoeSparseMoeBlock`:
 *
 *   logits  = x R^T                     float32: R the router (float32 [experts][hidden]), each
 *                                       logit 16 float32 lanes over the row, then `sum_lanes`
 *   p       = softmax(logits)           float32: exp of (logit - max) (attention.c's
 *                                       exp_nonpositive), the sum in expert order
 *   chosen  = the `used` largest p      in rank order; equal p: the lower expert first
 *   w_j     = p_j / sum_j p_j           where `norm` (the sum in rank order), else p_j
 *   y_j     = silu(x Wg_j^T) * (x Wu_j^T) Wd_j^T     each expert's MLP on the file's own
 *                                       weights (linear.c or quant.c, through decoder.c's
 *                                       `project`), rounded to bf16 as the dense MLP is
 *   out     = bf16(sum_j w_j y_j)       float32, in rank order j = 0, 1, ..., one rounding
 *
 * gpt-oss's experts differ (the `Experts` fields after `down`): the router and every
 * projection have biases (added in float32 before the rounding); the gating takes the top k
 * logits first, then the softmax over those k; the activation is the clamped SwiGLU
 * (`swiglu_times`). Its layers' sliding windows, attention sinks and output bias are
 * decoder.c's.
 *
 * The promise, as decoder.c's: a row's output depends on that row alone. Its routing reads
 * its own values only; each expert's rows are gathered and multiplied together, and the linear
 * kernels give every row the bits it has alone (whatever other rows chose that expert); the
 * sum runs in the row's own rank order. So a row's bits do not depend on the rows beside it,
 * their number, or the threads; a forward of many rows does read more experts' weights (the
 * cost of verifying a draft tree grows with the experts its rows reach: the README of
 * benchmarks/results/qwen3moe measures it).
 */
#include "decoder.c"

typedef struct {
    int experts, used, ffn;  /* experts per layer, chosen per row, each expert's hidden size */
    int norm;                /* 1: the chosen weights renormalised to sum to 1 */
    const float *const *router;  /* [layers] -> float32 [experts][hidden] */
    const Weight *gate_up;       /* [layers * experts]: [gate | up], 2 * ffn outputs */
    const Weight *down;          /* [layers * experts]: hidden outputs from ffn inputs */
    /* gpt-oss's (0 / NULL: Qwen3-MoE's softmax gating, SiLU experts, no biases): */
    int gating;                  /* GATING_SOFTMAX or GATING_TOP_K_SOFTMAX */
    int activation;              /* EXPERTS_SILU or EXPERTS_SWIGLU_CLAMPED */
    float alpha, limit;          /* the clamped SwiGLU's (swiglu_times) */
    const float *const *router_bias;   /* [layers] -> float32 [experts], or NULL */
    const float *const *gate_up_bias;  /* [layers * experts] -> float32 [2 * ffn], or NULL */
    const float *const *down_bias;     /* [layers * experts] -> float32 [hidden], or NULL */
} Experts;

/* GATING_SOFTMAX (Qwen3-MoE): p = softmax(logits) over every expert, the top k of p, their
 * weights renormalised where `norm`. GATING_TOP_K_SOFTMAX (gpt-oss): the top k logits, their
 * weights the softmax over those k alone (the same weights as the former renormalised, in
 * exact arithmetic; not the same float32 steps). */
enum { GATING_SOFTMAX = 0, GATING_TOP_K_SOFTMAX = 1 };
enum { EXPERTS_SILU = 0, EXPERTS_SWIGLU_CLAMPED = 1 };

static const float *bias_of(const float *const *biases, int at) {
    return biases ? biases[at] : NULL;
}

/* v[0 .. count - 1] <- softmax(v), float32: exp of (v - max) (attention.c's
 * exp_nonpositive), the sum in index order. v has room for count rounded up to 16 (the
 * padding is written). */
static void softmax_in_place(float *v, int count) {
    int padded = (count + LANES - 1) / LANES * LANES;
    float best = v[0];
    for (int i = 1; i < count; i++)
        if (v[i] > best) best = v[i];
    for (int i = count; i < padded; i++) v[i] = -INFINITY;  /* exp: 0 */
    for (int i = 0; i < padded; i += LANES) {
        vec chunk;
        memcpy(&chunk, v + i, sizeof chunk);
        chunk = exp_nonpositive(chunk - splat(best));
        memcpy(v + i, &chunk, sizeof chunk);
    }
    float total = 0.0f;
    for (int i = 0; i < count; i++) total += v[i];
    for (int i = 0; i < count; i++) v[i] /= total;
}

/* One row's routing: index[used] (experts, in rank order), weight[used] (float32). probs:
 * scratch of the experts rounded up to 16. */
static void route_row(const Experts *e, const float *router, const float *router_bias,
                      const uint16_t *x, int d, float *probs, int *index, float *weight) {
    int count = e->experts;
    for (int ex = 0; ex < count; ex++) {
        const float *w = router + (int64_t)ex * d;
        vec acc = {0};
        for (int i = 0; i < d; i += LANES) {
            vec wv;
            memcpy(&wv, w + i, sizeof wv);
            acc = load_bf16(x + i) * wv + acc;
        }
        probs[ex] = sum_lanes(acc);
        if (router_bias) probs[ex] += router_bias[ex];
    }
    if (e->gating == GATING_SOFTMAX) softmax_in_place(probs, count);
    float chosen = 0.0f;
    for (int j = 0; j < e->used; j++) {
        int pick = -1;
        for (int ex = 0; ex < count; ex++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= index[i] == ex;
            /* strictly greater: of equal probabilities the lowest expert stays */
            if (!taken && (pick < 0 || probs[ex] > probs[pick])) pick = ex;
        }
        index[j] = pick;
        weight[j] = probs[pick];
        chosen += probs[pick];
    }
    if (e->gating == GATING_TOP_K_SOFTMAX) {  /* probs: scratch again (used <= experts) */
        memcpy(probs, weight, (size_t)e->used * sizeof(float));
        softmax_in_place(probs, e->used);
        memcpy(weight, probs, (size_t)e->used * sizeof(float));
    } else if (e->norm) {
        for (int j = 0; j < e->used; j++) weight[j] /= chosen;
    }
}

/* Each lane: yes where the mask's lane is set, else no. */
static inline vec where(ivec mask, vec yes, vec no) {
    return (vec)(((ivec)yes & mask) | ((ivec)no & ~mask));
}

/* act = bf16(bf16(up' + 1) * bf16(gate' sigmoid(alpha gate'))), gate' = min(gate, limit),
 * up' = up clamped to [-limit, limit]: gpt-oss's clamped SwiGLU (transformers'
 * GptOssExperts._apply_gate; alpha 1.702, limit 7). n a multiple of 16. */
static void swiglu_times(const uint16_t *gate, const uint16_t *up, int n, float alpha,
                         float limit, uint16_t *act) {
    vec high = splat(limit), low = splat(-limit), one = splat(1.0f);
    for (int i = 0; i < n; i += LANES) {
        vec g = load_bf16(gate + i), u = load_bf16(up + i);
        g = where(vec_lt(g, high), g, high);
        u = where(vec_lt(u, high), u, high);
        u = where(vec_ge(u, low), u, low);
        vec glu = rounded(times_sigmoid(g, rounded(g * splat(alpha))));
        store_bf16(act + i, rounded(u + one) * glu);
    }
}

/* The routing of `rows` rows of x (rows x d bf16): index and weight rows x used. Exported for
 * the tests. Returns 0, -1 out of memory, -2 sizes it does not take. */
int dresd_moe_route(const Experts *e, int layer, const uint16_t *x, int rows, int d,
                    int *index, float *weight, int threads) {
    if (e->experts < 1 || e->used < 1 || e->used > e->experts || d < 16 || d % 16 || rows < 0)
        return -2;
    int padded = (e->experts + LANES - 1) / LANES * LANES;
    float *probs = malloc((size_t)rows * padded * sizeof(float));
    if (!probs) return -1;
#pragma omp parallel for num_threads(threads) if (ROWS_IN_PARALLEL(rows, threads))
    for (int r = 0; r < rows; r++)
        route_row(e, e->router[layer], bias_of(e->router_bias, layer), x + (int64_t)r * d, d,
                  probs + (int64_t)r * padded, index + (int64_t)r * e->used,
                  weight + (int64_t)r * e->used);
    free(probs);
    return 0;
}

/* out = the MoE MLP of layer `layer` on x (rows x d bf16; the header says what it computes).
 * Returns 0, -1 out of memory, -2 sizes it does not take, or a weight of another shape than
 * the model's (`project`). */
int dresd_moe_mlp(const Experts *e, int layer, const uint16_t *x, int rows, int d,
                  uint16_t *out, int threads) {
    int count = e->experts, used = e->used, ffn = e->ffn;
    if (ffn < 16 || ffn % 16 || (e->gating != GATING_SOFTMAX && e->gating != GATING_TOP_K_SOFTMAX)
        || (e->activation != EXPERTS_SILU && e->activation != EXPERTS_SWIGLU_CLAMPED))
        return -2;
    if (rows == 0) return 0;
    size_t picks = (size_t)rows * used;
    int *index = malloc(picks * sizeof(int) + (size_t)rows * sizeof(int));
    float *weight = malloc(picks * sizeof(float));
    /* results: each (row, rank)'s expert output; then one expert's gathered rows, its gate and
     * up, its activation, its output */
    uint16_t *results = malloc((picks * d + (size_t)rows * (2 * d + 3 * ffn))
                               * sizeof(uint16_t));
    int status = -1;
    if (!index || !weight || !results) goto done;
    status = dresd_moe_route(e, layer, x, rows, d, index, weight, threads);
    if (status != 0) goto done;
    int *members = index + picks;  /* the (row, rank) picks of one expert */
    uint16_t *gathered = results + picks * d, *gate_up = gathered + (size_t)rows * d;
    uint16_t *act = gate_up + (size_t)rows * 2 * ffn, *y = act + (size_t)rows * ffn;
    for (int ex = 0; ex < count && status == 0; ex++) {
        int n = 0;  /* a row picks an expert once at most: n <= rows */
        for (size_t p = 0; p < picks; p++)
            if (index[p] == ex) {
                members[n] = (int)p;
                memcpy(gathered + (size_t)n * d, x + (p / used) * d, d * sizeof(uint16_t));
                n++;
            }
        if (n == 0) continue;
        int w = layer * count + ex;
        status = project(gathered, n, d, &e->gate_up[w], bias_of(e->gate_up_bias, w), 2 * ffn,
                         gate_up, threads);
        if (status != 0) break;
#pragma omp parallel for num_threads(threads) if (ROWS_IN_PARALLEL(n, threads))
        for (int r = 0; r < n; r++) {
            const uint16_t *gate = gate_up + (int64_t)r * 2 * ffn;
            if (e->activation == EXPERTS_SWIGLU_CLAMPED)
                swiglu_times(gate, gate + ffn, ffn, e->alpha, e->limit, act + (int64_t)r * ffn);
            else
                silu_times(gate, gate + ffn, ffn, act + (int64_t)r * ffn);
        }
        status = project(act, n, ffn, &e->down[w], bias_of(e->down_bias, w), d, y, threads);
        for (int r = 0; r < n && status == 0; r++)
            memcpy(results + (size_t)members[r] * d, y + (size_t)r * d, d * sizeof(uint16_t));
    }
    if (status != 0) goto done;
#pragma omp parallel for num_threads(threads) if (ROWS_IN_PARALLEL(rows, threads))
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < d; i += LANES) {
            vec acc = splat(0.0f);
            for (int j = 0; j < used; j++) {
                size_t p = (size_t)r * used + j;
                acc = load_bf16(results + p * d + i) * splat(weight[p]) + acc;
            }
            store_bf16(out + (int64_t)r * d + i, acc);
        }
done:
    free(index);
    free(weight);
    free(results);
    return status;
}

/* Layer `layer` after attention, its MLP the experts': hidden += mixed Wo^T; hidden +=
 * moe(rms_norm(hidden) * w_post). Returns as `dresd_moe_mlp`. */
static int moe_attention_outputs(const Decoder *m, const Experts *e, int layer, uint16_t *hidden,
                                 int rows, const uint16_t *mixed, int threads) {
    int d = m->hidden;
    uint16_t *projected = malloc((size_t)rows * 3 * d * sizeof(uint16_t));
    if (!projected) return -1;
    uint16_t *normed = projected + (size_t)rows * d, *moe = normed + (size_t)rows * d;
    int status = project(mixed, rows, m->heads * m->head_dim, &m->o[layer], o_bias(m, layer), d,
                         projected, threads);
    if (status == 0) {
#pragma omp parallel for num_threads(threads) if (ROWS_IN_PARALLEL(rows, threads))
        for (int r = 0; r < rows; r++) {
            add_residual(hidden + (int64_t)r * d, projected + (int64_t)r * d, d);
            rms_norm(hidden + (int64_t)r * d, m->post_norm[layer], d, m->eps,
                     normed + (int64_t)r * d);
        }
        status = dresd_moe_mlp(e, layer, normed, rows, d, moe, threads);
    }
    if (status == 0) {
#pragma omp parallel for num_threads(threads) if (ROWS_IN_PARALLEL(rows, threads))
        for (int r = 0; r < rows; r++)
            add_residual(hidden + (int64_t)r * d, moe + (int64_t)r * d, d);
    }
    free(projected);
    return status;
}

/* decoder.c's `dresd_decoder` with every layer's MLP the experts' (the decoder's gate_up and
 * down are not read). Returns 0, -1 out of memory, -2 sizes it does not take. */
int dresd_moe_decoder(const Decoder *m, const Experts *e, uint16_t *hidden, int rows,
                      const uint16_t *cos, const uint16_t *sin, const Segments *segments,
                      uint16_t *out, int threads) {
    if (m->layers < 0 || m->hidden < 16 || m->hidden % 16 || m->head_dim < 32
        || m->head_dim % 32 || m->heads < 1 || m->kv_heads < 1 || m->heads % m->kv_heads
        || rows < 0 || e->experts < 1 || e->used < 1 || e->used > e->experts || e->ffn < 16
        || e->ffn % 16)
        return -2;
    for (int s = 0; s < segments->count; s++)
        if (segments->first[s] < 0 || segments->rows[s] < 0 || segments->start[s] < 0
            || segments->first[s] + segments->rows[s] > rows
            || segments->start[s] + segments->rows[s] > segments->capacity[s]
            || (segments->window_start && (segments->window_start[s] < 0
                                           || segments->window_start[s] > segments->start[s])))
            return -2;
    uint16_t *qkv = malloc((size_t)rows * (qkv_width(m) + m->heads * m->head_dim)
                           * sizeof(uint16_t));
    if (!qkv) return -1;
    uint16_t *mixed = qkv + (size_t)rows * qkv_width(m);
    int status = 0;
    for (int layer = 0; layer < m->layers && status == 0; layer++) {
        status = dresd_decoder_attention_inputs(m, layer, hidden, rows, cos, sin, qkv, segments,
                                                threads);
        if (status == 0)
            status = dresd_decoder_attention(m, layer, qkv, segments, mixed, threads);
        if (status == 0)
            status = moe_attention_outputs(m, e, layer, hidden, rows, mixed, threads);
    }
    if (status == 0) dresd_decoder_final_norm(m, hidden, rows, out);
    free(qkv);
    return status;
}
