/* Batch-invariant attention for bf16 models on CPUs (dresd/cpu_attention.py loads it).
 *
 *   out[r, h] = sum_j w[h, r, j] v[g, j] / sum_j w[h, r, j],   g = h / groups (grouped heads)
 *   w[h, r, j] = exp(s[h, r, j] - max_j s[h, r, j]),  s = (q[h, r] . k[g, j]) * scale + mask[r, j]
 *
 * The promise: a query row's output depends only on the row and on the keys and values it may
 * see, in their order; not on how many rows came with it, nor on masked keys between them. So a
 * node of a draft tree gets, bit for bit, what a one-token decode step gives the same token.
 * How each sum keeps that promise, in float32, without any probabilistic argument:
 *   - q . k: the 64 (dim) products summed in a fixed order, d = 0, 1, 2, ...; the vector lanes
 *     run over keys, so a key's score never depends on its lane or on the key count.
 *   - max: exact in any order.
 *   - exp: one polynomial, the same instructions in every lane (no scalar tail: the key count
 *     is padded to a whole number of blocks).
 *   - the weighted sum of values and the normaliser: summed key by key in the keys' order (the
 *     vector lanes run over the head dimension). A masked key adds an exact +0, which changes
 *     no sum, so a tree row's sums equal the decode step's, where those keys are absent.
 * Every row runs the same instructions whatever the batch or key count: no scalar remainder
 * loops (keys are padded to whole blocks of BLOCK, the head size is a multiple of BLOCK), so
 * the compiler's fusing of multiply-adds (-ffp-contract=fast) is the same for every row too.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16                /* floats per vector (one AVX-512 register) */
#define BLOCK (4 * LANES)       /* keys scored at once: four independent accumulators */

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

/* Round to nearest, ties to even, as torch's .to(torch.bfloat16) does. */
static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline vec splat(float value) { return (vec){0} + value; }

/* exp(x) for x <= 0, within 1 ulp (0.87 at worst, measured on [-87, 0]): x = n ln2 + r with
 * |r| <= ln2 / 2, exp(r) by its Taylor series to r^7 / 7!, times 2^n built in the exponent
 * bits; 0 below -87 (2^n would be subnormal). */
static inline vec exp_nonpositive(vec x) {
    const float round_magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    ivec keep = x >= splat(-87.0f);        /* all ones where x >= -87 (-inf: all zeros) */
    x = (vec)((ivec)x & keep);             /* below -87: computed as exp(0), zeroed at the end */
    vec n = (x * splat(1.44269504f) + splat(round_magic)) - splat(round_magic);
    vec r = (x - n * splat(0.693145752f)) - n * splat(1.42860677e-6f);
    vec p = splat(1.0f / 5040);
    p = p * r + splat(1.0f / 720);
    p = p * r + splat(1.0f / 120);
    p = p * r + splat(1.0f / 24);
    p = p * r + splat(1.0f / 6);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    ivec scale_bits = (__builtin_convertvector(n, ivec) + 127) << 23;
    return (vec)((ivec)(p * (vec)scale_bits) & keep);
}

static inline vec load(const float *from) {
    vec value;
    memcpy(&value, from, sizeof value);
    return value;
}

static inline void store(float *to, vec value) { memcpy(to, &value, sizeof value); }

#define ROWS 4 /* query rows of one kv head computed together: they share the key loads, and
                  their independent sums keep the multiply-add units busy */

/* Scores of ROWS query rows against a kv head's keys (keys_t: dim x padded, transposed),
 * BLOCK keys at a time; each key's dot product summed in the order d = 0, 1, 2, ... */
static void score_rows(const float *const query[ROWS], const float *keys_t, int padded, int dim,
                       float *const scores[ROWS]) {
    for (int block = 0; block < padded; block += BLOCK) {
        vec acc[ROWS][4] = {{{0}}};
        for (int d = 0; d < dim; d++) {
            const float *row = keys_t + (int64_t)d * padded + block;
            vec keys[4] = {load(row), load(row + LANES), load(row + 2 * LANES),
                           load(row + 3 * LANES)};
            for (int i = 0; i < ROWS; i++) {
                vec q = splat(query[i][d]);
                for (int part = 0; part < 4; part++) acc[i][part] += q * keys[part];
            }
        }
        for (int i = 0; i < ROWS; i++)
            for (int part = 0; part < 4; part++)
                store(scores[i] + block + part * LANES, acc[i][part]);
    }
}

/* Turns one row's scores into weights exp(s * scale + mask - max), in place. Masked keys (an
 * additive mask below -1e30, at or past visible_until, or padding) get exactly 0. Returns 0,
 * or -1 when the row sees no key. */
static int weigh_row(float *scores, const uint16_t *mask, int length, int padded,
                     int visible_until, float scale) {
    const vec lane_index = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const vec minus_inf = splat(-__builtin_inff());
    vec top = minus_inf;
    for (int j = 0; j < padded; j += LANES) {
        vec bias = {0};
        if (mask) /* bf16; the row holds `length` of them */
            for (int lane = 0; lane < LANES && j + lane < length; lane++)
                bias[lane] = bf16_to_float(mask[j + lane]);
        vec s = load(scores + j) * splat(scale) + bias;
        ivec hidden = (lane_index + (float)j >= splat((float)visible_until)) | (s < splat(-1e30f));
        s = (vec)(((ivec)s & ~hidden) | ((ivec)minus_inf & hidden));
        store(scores + j, s);
        top = (vec)(((ivec)top & (top >= s)) | ((ivec)s & (top < s))); /* max, exact */
    }
    float best = top[0];
    for (int lane = 1; lane < LANES; lane++) best = top[lane] > best ? top[lane] : best;
    if (best == -__builtin_inff()) return -1;
    for (int j = 0; j < padded; j += LANES)
        store(scores + j, exp_nonpositive(load(scores + j) - splat(best))); /* -inf -> 0 */
    return 0;
}

/* out[i] = sum_j weights[i][j] values[j] / sum_j weights[i][j] for ROWS rows, key by key in the
 * keys' order (the lanes run over the head dimension, BLOCK dimensions at a time); as bf16. */
static void weigh_values(const float *const weights[ROWS], const float *values, int length,
                         int dim, uint16_t *const out[ROWS]) {
    for (int chunk = 0; chunk < dim; chunk += BLOCK) {
        vec acc[ROWS][4] = {{{0}}};
        float total[ROWS] = {0};
        for (int j = 0; j < length; j++) {
            const float *row = values + (int64_t)j * dim + chunk;
            vec value[4] = {load(row), load(row + LANES), load(row + 2 * LANES),
                            load(row + 3 * LANES)};
            for (int i = 0; i < ROWS; i++) {
                float weight = weights[i][j];
                total[i] += weight;
                for (int part = 0; part < 4; part++) acc[i][part] += splat(weight) * value[part];
            }
        }
        for (int i = 0; i < ROWS; i++)
            if (out[i])
                for (int part = 0; part < 4; part++)
                    for (int lane = 0; lane < LANES; lane++)
                        out[i][chunk + part * LANES + lane] =
                            float_to_bf16(acc[i][part][lane] / total[i]);
    }
}

/* query: heads x rows x dim; keys, values: kv_heads x length x dim (head stride given, rows
 * contiguous; dim a multiple of BLOCK); mask: rows x mask_stride additive bf16, the last
 * `length` columns used, or NULL for causal (row r sees keys up to length - rows + r);
 * out: rows x heads x dim.
 * Returns 0, or -1 when out of memory. */
int dresd_attention(const uint16_t *query, const uint16_t *keys, const uint16_t *values,
                    const uint16_t *mask, int64_t key_head_stride, int64_t value_head_stride,
                    int64_t mask_stride, int heads, int kv_heads, int rows, int length, int dim,
                    float scale, uint16_t *out) {
    int groups = heads / kv_heads, padded = (length + BLOCK - 1) / BLOCK * BLOCK;
    size_t floats = (size_t)dim * padded + (size_t)length * dim + ROWS * ((size_t)padded + dim);
    float *scratch = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    if (!scratch) return -1;
    float *keys_t = scratch, *values_f = keys_t + (size_t)dim * padded;
    float *scores[ROWS], *query_f[ROWS];
    for (int i = 0; i < ROWS; i++) {
        scores[i] = values_f + (size_t)length * dim + (size_t)i * padded;
        query_f[i] = scores[0] + (size_t)ROWS * padded + (size_t)i * dim;
    }
    for (int g = 0; g < kv_heads; g++) {
        const uint16_t *k = keys + g * key_head_stride, *v = values + g * value_head_stride;
        for (int d = 0; d < dim; d++) {
            float *row = keys_t + (size_t)d * padded;
            for (int j = 0; j < length; j++) row[j] = bf16_to_float(k[(int64_t)j * dim + d]);
            for (int j = length; j < padded; j++) row[j] = 0.0f;
        }
        for (int64_t i = 0; i < (int64_t)length * dim; i++) values_f[i] = bf16_to_float(v[i]);
        /* The kv head's query rows (head h, row r), ROWS at a time; a short last block is
         * filled with zero queries whose results are dropped. */
        int count = groups * rows;
        for (int first = 0; first < count; first += ROWS) {
            uint16_t *outs[ROWS] = {NULL};
            for (int i = 0; i < ROWS; i++) {
                memset(query_f[i], 0, (size_t)dim * sizeof(float));
                if (first + i >= count) continue;
                int h = g * groups + (first + i) / rows, r = (first + i) % rows;
                const uint16_t *q = query + ((int64_t)h * rows + r) * dim;
                for (int d = 0; d < dim; d++) query_f[i][d] = bf16_to_float(q[d]);
                outs[i] = out + ((int64_t)r * heads + h) * dim;
            }
            score_rows((const float *const *)query_f, keys_t, padded, dim, scores);
            for (int i = 0; i < ROWS; i++) {
                int r = (first + i) % rows;
                const uint16_t *row_mask = mask ? mask + (int64_t)r * mask_stride : NULL;
                int visible_until = mask ? length : length - rows + r + 1;
                if (outs[i] && weigh_row(scores[i], row_mask, length, padded, visible_until,
                                         scale) != 0) {
                    memset(outs[i], 0, (size_t)dim * sizeof(uint16_t)); /* sees no key */
                    outs[i] = NULL;
                }
                if (!outs[i]) memset(scores[i], 0, (size_t)padded * sizeof(float));
            }
            weigh_values((const float *const *)scores, values_f, length, dim, outs);
        }
    }
    free(scratch);
    return 0;
}
