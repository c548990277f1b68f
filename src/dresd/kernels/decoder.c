/* A Llama-shaped decoder's layers in C, bf16, for CPUs with AVX-512 or AVX2 (every kernel tier:
 * dresd/kernels/decoder.py loads it; decoding/forward.py calls it).
 *
 * Why: at one token per sequence, a decode step of a small model is ~300 small operations
 * (norms, rotary embedding, residual adds, cache writes, the SiLU gate) around the linears,
 * and in PyTorch each costs a dispatch and a Python line. Here a whole step is one call: per
 * layer, for all rows of all sequences at once,
 *
 *   normed  = rms_norm(hidden) * w_in
 *   q, k, v = normed [Wq | Wk | Wv]^T (+ bias)          one linear (linear.c, or quant.c
 *                                                        on a GGUF file's quantized blocks)
 *   q, k    = rms_norm(q) * w_q, rms_norm(k) * w_k      per head, where the model has them
 *                                                        (Qwen3), else as they are
 *   q, k    = rotary(q), rotary(k);  k, v -> each sequence's cache, rows start .. start + t - 1
 *   mixed   = attention per sequence                      cpu_attention.c (batch-invariant;
 *                                                        gpt-oss: with its sinks)
 *   hidden  = hidden + mixed Wo^T (+ bias, gpt-oss)       (Gemma: + rms_norm(mixed Wo^T) * w)
 *   normed  = rms_norm(hidden) * w_post
 *   g, u    = normed [Wgate | Wup]^T;  act = silu(g) * u  (Gemma: gelu_tanh(g) * u)
 *   hidden  = hidden + act Wdown^T                        (Gemma: + rms_norm(act Wdown^T) * w)
 *
 * and the final norm after the last layer.
 *
 * The Decoder struct declares what differs between the families it runs, nothing else: the
 * norms' form (`norm_plus_one`: Gemma's RMSNorm, float32 x * rsqrt(...) * (1 + w) rounded once),
 * the MLP's activation, the norms of the attention's and the MLP's outputs (Gemma's sandwich
 * norms), and the layers that attend over a sliding window with their own rotary table
 * (`windowed`: Gemma-3's local layers). A Llama, Qwen2 or Qwen3 leaves them 0 / NULL.
 *
 * The promise, as the kernels it calls: every row of the output depends only on that row's
 * token, its position, and the cache entries it sees; not on the other rows, sequences or
 * threads. Each element-wise step computes an element from that element alone; each norm sums
 * its own row in a fixed order (16 float32 lanes over the row, then one fixed horizontal sum,
 * `sum_lanes`). These steps are written once, in GCC's vector types (attention.c's `vec`, 16
 * lanes: two registers with AVX2), and give the same bits on every tier.
 *
 * Rounding follows transformers' bf16 Llama, operation by operation: every tensor between two
 * operations is bf16, and a bf16 product or sum is computed in float32 and rounded once to
 * bf16 (exactly what PyTorch does for these element-wise ops). Rotary embedding and residual
 * adds therefore give PyTorch's bits; the norm's sum of squares and SiLU's exp are computed in
 * an order and with an approximation of this file's own (float32, within an ulp), so they may
 * differ from PyTorch's in the last bit of a float32 before the rounding to bf16. Every method
 * of a process runs this same code, plain decoding included.
 */
#include "linear.c"
#include "attention.c"
#include "quant.c"

#include <math.h>
#include <stdlib.h>

/* A projection's weight: one part (bf16 packed for linear.c, or one quant.c layout), or up to
 * three parts side by side along the outputs (a GGUF file's q, k and v of different types). */
typedef struct {
    int count;
    int layout[3];        /* -1: bf16 packed (linear.c); else quant.c's LAYOUTS number */
    int n[3];             /* outputs of each part */
    const void *data[3];
} Weight;

typedef struct {
    int layers, hidden, heads, kv_heads, head_dim, intermediate;
    float eps;   /* the RMS norms' epsilon */
    float scale; /* attention's scaling of q . k */
    const uint16_t *const *input_norm;   /* [layers] -> bf16 [hidden] */
    const uint16_t *const *post_norm;    /* [layers] -> bf16 [hidden] */
    const uint16_t *final_norm;          /* bf16 [hidden] */
    const Weight *qkv;                   /* [layers]: [q | k | v] */
    const float *const *qkv_bias;        /* [layers] -> float32 bias, or NULL (none) */
    const Weight *o;                     /* [layers] */
    const Weight *gate_up;               /* [layers]: [gate | up] */
    const Weight *down;                  /* [layers] */
    /* Per-head norms of q and k before the rotary embedding (Qwen3), NULL where the model has
     * none: [layers] -> bf16 [head_dim], the same epsilon as the other norms. */
    const uint16_t *const *q_norm;
    const uint16_t *const *k_norm;
    /* Gemma's (0 / NULL for Llama's layers): */
    int norm_plus_one;  /* every norm: 1: Gemma3RMSNorm's bf16(x * inverse * (1 + w)), in float32;
                         * 0: LlamaRMSNorm's bf16(w * bf16(x * inverse)) */
    int activation;     /* ACTIVATION_SILU or ACTIVATION_GELU_TANH */
    const uint16_t *const *attention_out_norm; /* [layers] -> bf16 [hidden]: the attention
                         * output's norm before its residual add (Gemma's post_attention_layernorm),
                         * or NULL: none */
    const uint16_t *const *mlp_out_norm;       /* the MLP output's (post_feedforward_layernorm) */
    /* [layers]: 1 where the layer attends over a sliding window (each segment's keys from
     * Segments' window_start on, with its window_masks) and rotates by the second rotary table;
     * NULL: no layer does. */
    const unsigned char *windowed;
    /* gpt-oss's (NULL where the model has none): [layers] -> float32 [heads], each head's
     * attention sink (attention.c's weigh_row); [layers] -> float32 [hidden], the bias of
     * the attention's output projection. */
    const float *const *sinks;
    const float *const *o_bias;
} Decoder;

enum { ACTIVATION_SILU = 0, ACTIVATION_GELU_TANH = 1 };

/* The sequences of one forward. Segment s owns rows first[s] .. first[s] + rows[s] - 1; its
 * cache holds start[s] entries before them, and its rows are written after those. Its keys
 * (values alike) are one buffer [layers][kv_heads][capacity[s]][head_dim]. masks[s]: rows[s] x
 * mask_strides[s] additive bf16, the last start[s] + rows[s] columns read, or NULL (causal). */
typedef struct {
    int count;
    const int *first, *rows, *start;
    uint16_t *const *keys, *const *values;
    const int64_t *capacity;
    const uint16_t *const *masks;
    const int64_t *mask_strides;
    /* For the windowed layers (NULL where the model has none): segment s reads its keys from
     * window_start[s] (<= start[s]: every row's window begins there or later) and masks them
     * by window_masks[s] (rows[s] x window_mask_strides[s], its start[s] + rows[s] -
     * window_start[s] columns), or where that is NULL by masks[s] from column window_start[s]
     * on (NULL: causal). A skipped key is one every row masks, and a masked key changes no
     * sum of the attention (cpu_attention.c), so a row's bits are the same either way. */
    const int *window_start;
    const uint16_t *const *window_masks;
    const int64_t *window_mask_strides;
} Segments;

/* bf16 bits of 16 floats, to nearest, ties to even; NaN a quiet NaN (bf16.h's round_to_bf16,
 * integer steps: the same bits however they compile). */
static inline ivec bf16_bits(vec value) {
    ivec bits = (ivec)value;
    ivec rounded = bits + 0x7fff + ((bits >> 16) & 1);
    ivec nan = vec_ne(value, value);
    rounded = (rounded & ~nan) | ((bits | 0x400000) & nan);
    return (ivec)((uint32_t __attribute__((vector_size(LANES * 4))))rounded >> 16);
}

static inline void store_bf16(uint16_t *to, vec value) {
    half_vec bits = narrow_u16(bf16_bits(value));  /* bf16_bits: 0..65535 */
    memcpy(to, &bits, sizeof bits);
}

/* bf16(value) as a float32 again: what a bf16 tensor between two operations holds. */
static inline vec rounded(vec value) { return (vec)(bf16_bits(value) << 16); }

/* The sum of the 16 lanes, in _mm512_reduce_add_ps's order: the two halves of 8, their halves
 * of 4, lanes (0 + 2, 1 + 3), then those two. */
static inline float sum_lanes(vec v) {
    typedef float vec8 __attribute__((vector_size(32)));
    typedef float vec4 __attribute__((vector_size(16)));
    vec8 eight = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)
                 + __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    vec4 four = __builtin_shufflevector(eight, eight, 4, 5, 6, 7)
                + __builtin_shufflevector(eight, eight, 0, 1, 2, 3);
    vec4 two = four + __builtin_shufflevector(four, four, 2, 3, 0, 1);
    return two[0] + two[1];
}

/* out = weight * bf16(x * rsqrt(mean(x^2) + eps)), as LlamaRMSNorm (n a multiple of 16). */
static void rms_norm(const uint16_t *x, const uint16_t *weight, int n, float eps,
                     uint16_t *out) {
    vec squares = {0};
    for (int i = 0; i < n; i += LANES) {
        vec value = load_bf16(x + i);
        squares = value * value + squares;  /* one fused multiply-add (-ffp-contract=fast) */
    }
    float inverse = 1.0f / sqrtf(sum_lanes(squares) / (float)n + eps);
    for (int i = 0; i < n; i += LANES) {
        vec normed = rounded(load_bf16(x + i) * splat(inverse));
        store_bf16(out + i, load_bf16(weight + i) * normed);
    }
}

/* out = bf16(x * rsqrt(mean(x^2) + eps) * (1 + weight)), every step in float32 and one rounding
 * at the end, as Gemma3RMSNorm (n a multiple of 16; out may be x). */
static void rms_norm_plus_one(const uint16_t *x, const uint16_t *weight, int n, float eps,
                              uint16_t *out) {
    vec squares = {0};
    for (int i = 0; i < n; i += LANES) {
        vec value = load_bf16(x + i);
        squares = value * value + squares;
    }
    float inverse = 1.0f / sqrtf(sum_lanes(squares) / (float)n + eps);
    for (int i = 0; i < n; i += LANES) {
        vec normed = load_bf16(x + i) * splat(inverse);
        vec scale = load_bf16(weight + i) + splat(1.0f);
        store_bf16(out + i, normed * scale);
    }
}

/* The model's norm (Decoder.norm_plus_one says which). */
static inline void norm(const Decoder *m, const uint16_t *x, const uint16_t *weight, int n,
                        uint16_t *out) {
    if (m->norm_plus_one) rms_norm_plus_one(x, weight, n, m->eps, out);
    else rms_norm(x, weight, n, m->eps, out);
}

/* Rotary embedding of one head in place, as transformers' `x * cos + rotate_half(x) * sin`
 * with every product and the sum rounded to bf16 (head_dim a multiple of 32). */
static void rotate(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int head_dim) {
    int half = head_dim / 2;
    for (int d = 0; d < half; d += LANES) {
        vec low = load_bf16(x + d), high = load_bf16(x + half + d);
        vec new_low = rounded(low * load_bf16(cos + d)) + rounded((splat(0.0f) - high)
                                                                 * load_bf16(sin + d));
        vec new_high = rounded(high * load_bf16(cos + half + d))
                       + rounded(low * load_bf16(sin + half + d));
        store_bf16(x + d, new_low);
        store_bf16(x + half + d, new_high);
    }
}

/* g * sigmoid(z) for 16 lanes: exp of -|z| only (never overflows); z >= 0: g / (1 + e),
 * z < 0: g e / (1 + e). */
static inline vec times_sigmoid(vec g, vec z) {
    vec e = exp_nonpositive(splat(0.0f) - (vec)((ivec)z & 0x7fffffff));
    ivec negative = vec_lt(z, splat(0.0f));
    vec numerator = (vec)(((ivec)(g * e) & negative) | ((ivec)g & ~negative));
    return numerator / (splat(1.0f) + e);
}

/* act = bf16(bf16(silu(gate)) * up), silu(g) = g sigmoid(g). n a multiple of 16. */
static void silu_times(const uint16_t *gate, const uint16_t *up, int n, uint16_t *act) {
    for (int i = 0; i < n; i += LANES) {
        vec g = load_bf16(gate + i);
        store_bf16(act + i, rounded(times_sigmoid(g, g)) * load_bf16(up + i));
    }
}

/* act = bf16(bf16(gelu_tanh(gate)) * up): PyTorch's gelu(approximate="tanh"),
 * 0.5 g (1 + tanh(y)) with y = sqrt(2 / pi) (g + 0.044715 g^3), computed as g sigmoid(2 y)
 * (the same function; float32, a last-bit difference at most before the rounding to bf16).
 * n a multiple of 16. */
static void gelu_tanh_times(const uint16_t *gate, const uint16_t *up, int n, uint16_t *act) {
    for (int i = 0; i < n; i += LANES) {
        vec g = load_bf16(gate + i);
        vec y = splat(0.7978845608f) * (g + splat(0.044715f) * g * g * g);
        store_bf16(act + i, rounded(times_sigmoid(g, y + y)) * load_bf16(up + i));
    }
}

/* hidden = bf16(hidden + delta), n a multiple of 16. */
static void add_residual(uint16_t *hidden, const uint16_t *delta, int n) {
    for (int i = 0; i < n; i += LANES)
        store_bf16(hidden + i, load_bf16(hidden + i) + load_bf16(delta + i));
}

static int qkv_width(const Decoder *m) { return (m->heads + 2 * m->kv_heads) * m->head_dim; }
static const float *o_bias(const Decoder *m, int layer) {
    return m->o_bias ? m->o_bias[layer] : NULL;
}

/* Whether the element-wise row loops below share their rows between threads: each row is
 * computed alone, so this changes no bit; under ~8 rows the fork and join would cost more
 * than the loop. */
#define ROWS_IN_PARALLEL(rows, threads) ((threads) > 1 && (rows) >= 8)

/* y = x W^T (+ bias) for contiguous rows: x rows x k, y rows x n, each part of the weight
 * into its own columns (linear.c or quant.c). Returns 0, -1 out of memory, -2 where the parts'
 * outputs do not fill y's n columns exactly (a weight of another shape than the model's: its
 * columns would land past y's rows) or quant.c refuses the sizes. */
static int project(const uint16_t *x, int rows, int k, const Weight *w, const float *bias,
                   int n, uint16_t *y, int threads) {
    int offset = 0;
    if (w->count < 1 || w->count > 3) return -2;
    for (int p = 0; p < w->count; p++) {
        if (w->n[p] < 1) return -2;
        offset += w->n[p];
    }
    if (offset != n) return -2;
    offset = 0;
    for (int p = 0; p < w->count; p++) {
        const float *part_bias = bias ? bias + offset : NULL;
        if (w->layout[p] < 0) {
            dresd_linear(x, k, rows, w->data[p], (k + 1) / 2, w->n[p], part_bias, y + offset,
                         n, threads);
        } else {
            int status = dresd_quant_linear(w->layout[p], x, k, rows, k, w->data[p], w->n[p],
                                            part_bias, y + offset, n, 1, threads);
            if (status != 0) return status;
        }
        offset += w->n[p];
    }
    return 0;
}

/* Layer `layer` up to attention: the norm, q/k/v, rotary embedding, and each segment's keys
 * and values written into its cache. qkv: rows x qkv_width out (q stays there for attention).
 * cos, sin: rows x head_dim bf16 (each row's position; the layer's table). Returns 0, -1 out of memory, -2 a
 * weight of another shape (`project`). */
int dresd_decoder_attention_inputs(const Decoder *m, int layer, const uint16_t *hidden, int rows,
                                   const uint16_t *cos, const uint16_t *sin, uint16_t *qkv,
                                   const Segments *segments, int threads) {
    int d = m->hidden, dim = m->head_dim, width = qkv_width(m);
    uint16_t *normed = malloc((size_t)rows * d * sizeof(uint16_t));
    if (!normed) return -1;
#pragma omp parallel for num_threads(threads) if (ROWS_IN_PARALLEL(rows, threads))
    for (int r = 0; r < rows; r++)
        norm(m, hidden + (int64_t)r * d, m->input_norm[layer], d, normed + (int64_t)r * d);
    int status = project(normed, rows, d, &m->qkv[layer], m->qkv_bias[layer], width, qkv,
                         threads);
    free(normed);
    if (status != 0) return status;
    const uint16_t *q_norm = m->q_norm ? m->q_norm[layer] : NULL;
    const uint16_t *k_norm = m->k_norm ? m->k_norm[layer] : NULL;
#pragma omp parallel for num_threads(threads) if (ROWS_IN_PARALLEL(rows, threads))
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < m->heads + m->kv_heads; h++) { /* q heads, then k heads */
            uint16_t *head = qkv + (int64_t)r * width + h * dim;
            const uint16_t *head_norm = h < m->heads ? q_norm : k_norm;
            /* in place: rms_norm reads each value before it writes the same one */
            if (head_norm) norm(m, head, head_norm, dim, head);
            rotate(head, cos + (int64_t)r * dim, sin + (int64_t)r * dim, dim);
        }
    for (int s = 0; s < segments->count; s++) {
        int64_t head_stride = segments->capacity[s] * dim;
        int64_t layer_stride = m->kv_heads * head_stride;
        for (int i = 0; i < segments->rows[s]; i++) {
            const uint16_t *row = qkv + (int64_t)(segments->first[s] + i) * width;
            int64_t at = layer * layer_stride + (int64_t)(segments->start[s] + i) * dim;
            for (int g = 0; g < m->kv_heads; g++) {
                memcpy(segments->keys[s] + at + g * head_stride,
                       row + (m->heads + g) * dim, dim * sizeof(uint16_t));
                memcpy(segments->values[s] + at + g * head_stride,
                       row + (m->heads + m->kv_heads + g) * dim, dim * sizeof(uint16_t));
            }
        }
    }
    return 0;
}

/* Layer `layer` after attention: hidden += mixed Wo^T, then the MLP and its residual.
 * mixed: rows x (heads * head_dim). Returns 0, -1 out of memory, -2 a weight of another
 * shape (`project`). */
int dresd_decoder_attention_outputs(const Decoder *m, int layer, uint16_t *hidden, int rows,
                                    const uint16_t *mixed, int threads) {
    int d = m->hidden, inter = m->intermediate;
    uint16_t *scratch = malloc((size_t)rows * (2 * d + 3 * inter) * sizeof(uint16_t));
    if (!scratch) return -1;
    uint16_t *projected = scratch, *normed = projected + (size_t)rows * d;
    uint16_t *gate_up = normed + (size_t)rows * d, *act = gate_up + (size_t)rows * 2 * inter;
    int status = project(mixed, rows, m->heads * m->head_dim, &m->o[layer], o_bias(m, layer), d,
                         projected, threads);
    if (status != 0) {
        free(scratch);
        return status;
    }
    const uint16_t *out_norm = m->attention_out_norm ? m->attention_out_norm[layer] : NULL;
#pragma omp parallel for num_threads(threads) if (ROWS_IN_PARALLEL(rows, threads))
    for (int r = 0; r < rows; r++) {
        uint16_t *row = projected + (int64_t)r * d;
        if (out_norm) norm(m, row, out_norm, d, row);
        add_residual(hidden + (int64_t)r * d, row, d);
        norm(m, hidden + (int64_t)r * d, m->post_norm[layer], d, normed + (int64_t)r * d);
    }
    status = project(normed, rows, d, &m->gate_up[layer], NULL, 2 * inter, gate_up, threads);
    if (status != 0) {
        free(scratch);
        return status;
    }
#pragma omp parallel for num_threads(threads) if (ROWS_IN_PARALLEL(rows, threads))
    for (int r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + (int64_t)r * 2 * inter;
        if (m->activation == ACTIVATION_GELU_TANH)
            gelu_tanh_times(gate, gate + inter, inter, act + (int64_t)r * inter);
        else
            silu_times(gate, gate + inter, inter, act + (int64_t)r * inter);
    }
    status = project(act, rows, inter, &m->down[layer], NULL, d, projected, threads);
    if (status != 0) {
        free(scratch);
        return status;
    }
    out_norm = m->mlp_out_norm ? m->mlp_out_norm[layer] : NULL;
#pragma omp parallel for num_threads(threads) if (ROWS_IN_PARALLEL(rows, threads))
    for (int r = 0; r < rows; r++) {
        uint16_t *row = projected + (int64_t)r * d;
        if (out_norm) norm(m, row, out_norm, d, row);
        add_residual(hidden + (int64_t)r * d, row, d);
    }
    free(scratch);
    return 0;
}

/* Every segment's attention for layer `layer` on the C attention kernel (cpu_attention.c),
 * q read from the qkv rows; a windowed layer's keys from each segment's window_start on (the
 * Segments struct says how). mixed: rows x (heads * head_dim). Returns 0, -1 out of memory. */
int dresd_decoder_attention(const Decoder *m, int layer, const uint16_t *qkv,
                            const Segments *segments, uint16_t *mixed, int threads) {
    int count = segments->count, dim = m->head_dim;
    int windowed = m->windowed && m->windowed[layer] && segments->window_start;
    const uint16_t **keys = malloc(3 * (size_t)count * sizeof(uint16_t *));
    int64_t *strides = malloc(2 * (size_t)count * sizeof(int64_t));
    int *lengths = malloc((size_t)count * sizeof(int));
    int status = -1;
    if (keys && strides && lengths) {
        const uint16_t **values = keys + count, **masks = keys + 2 * count;
        int64_t *mask_strides = strides + count;
        for (int s = 0; s < count; s++) {
            int from = windowed ? segments->window_start[s] : 0; /* keys before: all masked */
            strides[s] = segments->capacity[s] * dim;
            int64_t at = layer * m->kv_heads * strides[s] + (int64_t)from * dim;
            keys[s] = segments->keys[s] + at;
            values[s] = segments->values[s] + at;
            lengths[s] = segments->start[s] + segments->rows[s] - from;
            masks[s] = segments->masks[s] ? segments->masks[s] + from : NULL;
            mask_strides[s] = segments->mask_strides[s];
            if (windowed && segments->window_masks && segments->window_masks[s]) {
                masks[s] = segments->window_masks[s];
                mask_strides[s] = segments->window_mask_strides[s];
            }
        }
        status = dresd_attention_batch(count, qkv, qkv_width(m), segments->first,
                                       segments->rows, keys, values, strides, strides,
                                       masks, mask_strides, lengths,
                                       m->heads, m->kv_heads, dim, m->scale,
                                       m->sinks ? m->sinks[layer] : NULL, mixed, threads);
    }
    free(keys);
    free(strides);
    free(lengths);
    return status;
}

/* The final norm of every row: out = rms_norm(hidden) * w_final. */
void dresd_decoder_final_norm(const Decoder *m, const uint16_t *hidden, int rows, uint16_t *out) {
    for (int r = 0; r < rows; r++)
        norm(m, hidden + (int64_t)r * m->hidden, m->final_norm, m->hidden,
             out + (int64_t)r * m->hidden);
}

/* The whole decoder on the embedded rows `hidden` (rows x hidden, updated in place), every
 * attention on the C kernel; `out` gets the final norm. cos, sin: each row's rotary table
 * (rows x head_dim bf16); local_cos, local_sin: the windowed layers' (NULL: the same).
 * Returns 0, -1 out of memory, -2 sizes it does not take (the loops above step 16 lanes, a
 * head's rotation 32), or a weight of another shape than the model's (`project`), or a
 * segment's rows outside the forward's or its cache's, or a window start past its cache. */
int dresd_decoder(const Decoder *m, uint16_t *hidden, int rows, const uint16_t *cos,
                  const uint16_t *sin, const uint16_t *local_cos, const uint16_t *local_sin,
                  const Segments *segments, uint16_t *out, int threads) {
    if (m->layers < 0 || m->hidden < 16 || m->hidden % 16 || m->intermediate < 16
        || m->intermediate % 16 || m->head_dim < 32 || m->head_dim % 32 || m->heads < 1
        || m->kv_heads < 1 || m->heads % m->kv_heads || rows < 0)
        return -2;
    for (int s = 0; s < segments->count; s++)
        if (segments->first[s] < 0 || segments->rows[s] < 0 || segments->start[s] < 0
            || segments->first[s] + segments->rows[s] > rows
            || segments->start[s] + segments->rows[s] > segments->capacity[s]
            || (segments->window_start && (segments->window_start[s] < 0
                                           || segments->window_start[s] > segments->start[s])))
            return -2;
    if (m->activation != ACTIVATION_SILU && m->activation != ACTIVATION_GELU_TANH) return -2;
    uint16_t *qkv = malloc((size_t)rows * (qkv_width(m) + m->heads * m->head_dim)
                           * sizeof(uint16_t));
    if (!qkv) return -1;
    uint16_t *mixed = qkv + (size_t)rows * qkv_width(m);
    int status = 0;
    for (int layer = 0; layer < m->layers && status == 0; layer++) {
        int local = m->windowed && m->windowed[layer] && local_cos && local_sin;
        status = dresd_decoder_attention_inputs(m, layer, hidden, rows, local ? local_cos : cos,
                                                local ? local_sin : sin, qkv, segments, threads);
        if (status == 0)
            status = dresd_decoder_attention(m, layer, qkv, segments, mixed, threads);
        if (status == 0)
            status = dresd_decoder_attention_outputs(m, layer, hidden, rows, mixed, threads);
    }
    if (status == 0) dresd_decoder_final_norm(m, hidden, rows, out);
    free(qkv);
    return status;
}
