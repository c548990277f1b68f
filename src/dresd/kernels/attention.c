/* Batch-invariant attention for bf16 models on CPUs (dresd/kernels/attention.py loads it).
 *
 *   out[r, h] = sum_j w[h, r, j] v[g, j] / sum_j w[h, r, j],   g = h / groups (grouped heads)
 *   w[h, r, j] = exp(s[h, r, j] - max_j s[h, r, j]),  s = (q[h, r] . k[g, j]) * scale + mask[r, j]
 *   (with attention sinks, gpt-oss's: a learned logit per head joins the max and the
 *   normaliser, exp(sink[h] - max) added to sum_j w before the keys, and has no value)
 *
 * The promise: a query row's output depends only on the row and on the keys and values it may
 * see, in their order; not on how many rows came with it, nor on masked keys between them. So a
 * node of a draft tree gets, bit for bit, what a one-token decode step gives the same token.
 * How each sum keeps that promise, in float32, without any probabilistic argument:
 *   - q . k: the products summed in a fixed order, the vector lanes running over keys, so a
 *     key's score never depends on its lane or on the key count. With AVX-512 bf16: one
 *     vdpbf16ps per pair of dims (2p, 2p + 1), p = 0, 1, 2, ... (the products exact in float32,
 *     as cpu_linear.c sums); otherwise one float32 multiply-add per dim, d = 0, 1, 2, ...
 *   - max: exact in any order.
 *   - exp: one polynomial, the same instructions in every lane (no scalar tail: the key count
 *     is padded to a whole number of blocks).
 *   - the weighted sum of values and the normaliser: summed key by key in the keys' order (the
 *     vector lanes run over the head dimension). A masked key adds an exact +0, which changes
 *     no sum, so a tree row's sums equal the decode step's, where those keys are absent.
 * Every row runs the same instructions whatever the batch or key count: no scalar remainder
 * loops (keys are padded to whole blocks of BLOCK, the head size is a multiple of BLOCK), so
 * the compiler's fusing of multiply-adds (-ffp-contract=fast) is the same for every row too.
 *
 * With AVX2 but not AVX-512 (the avx2 and avx2vnni tiers), the scores, the weighted sums and
 * the transposition are written in 8-lane intrinsics, in tiles that fit AVX2's 16 registers
 * (16 keys or 16 dims by up to ROWS rows): the same float operations per key and per dim, in
 * the same order, as the 16-lane code they stand for (each multiply-add one fused vfmadd, as
 * -ffp-contract=fast makes of it), so the same bits; only faster (the 16-lane code spills).
 */
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <string.h>

#define LANES 16                /* floats per vector (one AVX-512 register) */
#define BLOCK (4 * LANES)       /* keys scored at once: four independent accumulators */

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint16_t half_vec __attribute__((vector_size(LANES * sizeof(uint16_t))));

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

/* Conversions between the 16-lane types, as __builtin_convertvector does them: with AVX2 and
 * no AVX-512, GCC 12 splits some of these into scalar steps per lane, so there they are two
 * 8-lane instructions each (the same values: exact data movement, or float -> int32 by
 * truncation, vcvttps2dq, as the conversion is defined). */
#if !defined(__AVX512F__) && defined(__AVX2__)
static inline ivec trunc_to_int(vec value) {  /* toward zero; the values here fit */
    __m256 half[2];
    memcpy(half, &value, sizeof half);
    __m256i result[2] = {_mm256_cvttps_epi32(half[0]), _mm256_cvttps_epi32(half[1])};
    ivec out;
    memcpy(&out, result, sizeof out);
    return out;
}
static inline ivec widen_u16(half_vec bits) {  /* zero-extended */
    __m256i both, result[2];
    memcpy(&both, &bits, sizeof both);
    result[0] = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(both));
    result[1] = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(both, 1));
    ivec out;
    memcpy(&out, result, sizeof out);
    return out;
}
static inline half_vec narrow_u16(ivec value) {  /* the low 16 bits; values here 0..65535 */
    __m256i half[2];
    memcpy(half, &value, sizeof half);
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(half[0], half[1]), 0xd8);
    half_vec out;
    memcpy(&out, &packed, sizeof out);
    return out;
}
/* Comparisons, all ones where true, as the vector operators give them (and GCC 12, on AVX2,
 * compares lane by lane in scalar code): ordered >= and <, and != (true where unordered). */
#define VEC_COMPARE(name, predicate) \
    static inline ivec name(vec a, vec b) { \
        __m256 x[2], y[2]; \
        memcpy(x, &a, sizeof x); \
        memcpy(y, &b, sizeof y); \
        __m256 result[2] = {_mm256_cmp_ps(x[0], y[0], predicate), \
                            _mm256_cmp_ps(x[1], y[1], predicate)}; \
        ivec out; \
        memcpy(&out, result, sizeof out); \
        return out; \
    }
VEC_COMPARE(vec_ge, _CMP_GE_OQ)
VEC_COMPARE(vec_lt, _CMP_LT_OQ)
VEC_COMPARE(vec_ne, _CMP_NEQ_UQ)
#undef VEC_COMPARE
#else
static inline ivec trunc_to_int(vec value) { return __builtin_convertvector(value, ivec); }
static inline ivec widen_u16(half_vec bits) { return __builtin_convertvector(bits, ivec); }
static inline half_vec narrow_u16(ivec value) {
    return __builtin_convertvector(value, half_vec);
}
static inline ivec vec_ge(vec a, vec b) { return a >= b; }
static inline ivec vec_lt(vec a, vec b) { return a < b; }
static inline ivec vec_ne(vec a, vec b) { return a != b; }
#endif

/* exp(x) for x <= 0, within 1 ulp (0.87 at worst, measured on [-87, 0]): x = n ln2 + r with
 * |r| <= ln2 / 2, exp(r) by its Taylor series to r^7 / 7!, times 2^n built in the exponent
 * bits; 0 below -87 (2^n would be subnormal). */
static inline vec exp_nonpositive(vec x) {
    const float round_magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    ivec keep = vec_ge(x, splat(-87.0f));       /* all ones where x >= -87 (-inf: all zeros) */
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
    ivec scale_bits = (trunc_to_int(n) + 127) << 23;
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

#ifdef __AVX512BF16__
/* Scores of n (<= ROWS) bf16 query rows against a kv head's keys, BLOCK keys at a time.
 * keys_w: dim / 2 x padded 32-bit words, word [p][j] holding k[j][2p] (low half) and
 * k[j][2p + 1] (high half). Each key's score is one lane: acc = vdpbf16ps(acc; q[2p], q[2p + 1];
 * k[j][2p], k[j][2p + 1]) for p = 0, 1, ..., in increasing p (the two products are exact in
 * float32; the lane adds them to acc as the hardware defines, DAZ/FTZ). */
static inline __attribute__((always_inline)) void score_rows(
        const int n, const void *const query[ROWS], const void *keys_w, int padded, int dim,
        float *const scores[ROWS]) {
    const int32_t *words = keys_w;
    for (int block = 0; block < padded; block += BLOCK) {
        __m512 acc[ROWS][4];
        for (int i = 0; i < n; i++)
            for (int part = 0; part < 4; part++) acc[i][part] = _mm512_setzero_ps();
        for (int p = 0; p < dim / 2; p++) {
            const int32_t *row = words + (int64_t)p * padded + block;
            __m512bh keys[4];
            for (int part = 0; part < 4; part++)
                keys[part] = (__m512bh)_mm512_loadu_si512(row + part * LANES);
            for (int i = 0; i < n; i++) {
                __m512bh pair = (__m512bh)_mm512_set1_epi32(((const int32_t *)query[i])[p]);
                for (int part = 0; part < 4; part++)
                    acc[i][part] = _mm512_dpbf16_ps(acc[i][part], pair, keys[part]);
            }
        }
        for (int i = 0; i < n; i++)
            for (int part = 0; part < 4; part++)
                _mm512_storeu_ps(scores[i] + block + part * LANES, acc[i][part]);
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* As the portable score_rows below, 16 keys (two registers) at a time: acc = fma(q[d], k[j][d],
 * acc) for d = 0, 1, 2, ... per key, the same fused multiply-adds in the same order. */
static inline __attribute__((always_inline)) void score_rows(
        const int n, const void *const query[ROWS], const void *keys_t, int padded, int dim,
        float *const scores[ROWS]) {
    for (int block = 0; block < padded; block += 16) {
        __m256 acc[ROWS][2];
        for (int i = 0; i < n; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        for (int d = 0; d < dim; d++) {
            const float *row = (const float *)keys_t + (int64_t)d * padded + block;
            __m256 keys0 = _mm256_loadu_ps(row), keys1 = _mm256_loadu_ps(row + 8);
            for (int i = 0; i < n; i++) {
                __m256 q = _mm256_broadcast_ss((const float *)query[i] + d);
                acc[i][0] = _mm256_fmadd_ps(q, keys0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(q, keys1, acc[i][1]);
            }
        }
        for (int i = 0; i < n; i++) {
            _mm256_storeu_ps(scores[i] + block, acc[i][0]);
            _mm256_storeu_ps(scores[i] + block + 8, acc[i][1]);
        }
    }
}
#else
/* Scores of n (<= ROWS) float query rows against a kv head's keys (keys_t: dim x padded
 * floats, transposed), BLOCK keys at a time; each key's dot product summed in the order
 * d = 0, 1, 2, ... */
static inline __attribute__((always_inline)) void score_rows(
        const int n, const void *const query[ROWS], const void *keys_t, int padded, int dim,
        float *const scores[ROWS]) {
    for (int block = 0; block < padded; block += BLOCK) {
        vec acc[ROWS][4] = {{{0}}};
        for (int d = 0; d < dim; d++) {
            const float *row = (const float *)keys_t + (int64_t)d * padded + block;
            vec keys[4] = {load(row), load(row + LANES), load(row + 2 * LANES),
                           load(row + 3 * LANES)};
            for (int i = 0; i < n; i++) {
                vec q = splat(((const float *)query[i])[d]);
                for (int part = 0; part < 4; part++) acc[i][part] += q * keys[part];
            }
        }
        for (int i = 0; i < n; i++)
            for (int part = 0; part < 4; part++)
                store(scores[i] + block + part * LANES, acc[i][part]);
    }
}
#endif

/* Turns one row's scores into weights exp(s * scale + mask - max), in place. Masked keys (an
 * additive mask below -1e30, at or past visible_until, or padding) get exactly 0. With an
 * attention sink (gpt-oss: a learned logit per head, -inf where there is none) the max runs
 * over the keys and the sink, and *sink_weight = exp(sink - max) joins the normaliser only
 * (the sink has no value). Returns 0, or -1 when the row sees no key. */
static int weigh_row(float *scores, const uint16_t *mask, int length, int padded,
                     int visible_until, float scale, float sink, float *sink_weight) {
    const vec lane_index = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const vec minus_inf = splat(-__builtin_inff());
    vec top = minus_inf;
    for (int j = 0; j < padded; j += LANES) {
        vec bias = {0};
        if (mask) /* bf16; the row holds `length` of them */
            for (int lane = 0; lane < LANES && j + lane < length; lane++)
                bias[lane] = bf16_to_float(mask[j + lane]);
        vec s = load(scores + j) * splat(scale) + bias;
        ivec hidden = vec_ge(lane_index + (float)j, splat((float)visible_until))
                      | vec_lt(s, splat(-1e30f));
        s = (vec)(((ivec)s & ~hidden) | ((ivec)minus_inf & hidden));
        store(scores + j, s);
        top = (vec)(((ivec)top & vec_ge(top, s)) | ((ivec)s & vec_lt(top, s))); /* max */
    }
    float best = top[0];
    for (int lane = 1; lane < LANES; lane++) best = top[lane] > best ? top[lane] : best;
    if (best == -__builtin_inff()) return -1;
    if (sink > best) best = sink;
    for (int j = 0; j < padded; j += LANES)
        store(scores + j, exp_nonpositive(load(scores + j) - splat(best))); /* -inf -> 0 */
    *sink_weight = exp_nonpositive(splat(sink - best))[0]; /* the same polynomial; none: 0 */
    return 0;
}

/* 16 bf16 values as floats (exact). */
static inline vec load_bf16(const uint16_t *from) {
    half_vec bits;
    memcpy(&bits, from, sizeof bits);
    return (vec)(widen_u16(bits) << 16);
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* As the portable weigh_values below, 16 dims (two registers) at a time: per row and dim,
 * acc = fma(w[j], v[j], acc) and total += w[j] for j = 0, 1, ... (total from the sink's
 * weight), then acc / total rounded to bf16: the same operations in the same order. */
static inline __attribute__((always_inline)) void weigh_values(
        const int n, const float *const weights[ROWS], const float sink_weights[ROWS],
        const uint16_t *values, int length, int dim, uint16_t *const out[ROWS]) {
    float total[ROWS];
    for (int i = 0; i < n; i++) {
        total[i] = sink_weights[i];
        for (int j = 0; j < length; j++) total[i] += weights[i][j];
    }
    for (int chunk = 0; chunk < dim; chunk += 16) {
        __m256 acc[ROWS][2];
        for (int i = 0; i < n; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        for (int j = 0; j < length; j++) {
            const uint16_t *row = values + (int64_t)j * dim + chunk;
            __m256i bits = _mm256_loadu_si256((const __m256i *)row);
            __m256 value0 = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm256_castsi256_si128(bits)), 16));
            __m256 value1 = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm256_extracti128_si256(bits, 1)), 16));
            for (int i = 0; i < n; i++) {
                __m256 weight = _mm256_broadcast_ss(weights[i] + j);
                acc[i][0] = _mm256_fmadd_ps(weight, value0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(weight, value1, acc[i][1]);
            }
        }
        for (int i = 0; i < n; i++) {
            if (!out[i]) continue;
            float mean[16];
            __m256 divisor = _mm256_set1_ps(total[i]);
            _mm256_storeu_ps(mean, _mm256_div_ps(acc[i][0], divisor));
            _mm256_storeu_ps(mean + 8, _mm256_div_ps(acc[i][1], divisor));
            for (int lane = 0; lane < 16; lane++) out[i][chunk + lane] = float_to_bf16(mean[lane]);
        }
    }
}
#else
/* out[i] = sum_j weights[i][j] values[j] / (sink_weights[i] + sum_j weights[i][j]) for n
 * rows, key by key in the keys' order (the lanes run over the head dimension, BLOCK
 * dimensions at a time); as bf16. values: length x dim bf16, read as floats (exact) where
 * they are used. */
static inline __attribute__((always_inline)) void weigh_values(
        const int n, const float *const weights[ROWS], const float sink_weights[ROWS],
        const uint16_t *values, int length, int dim, uint16_t *const out[ROWS]) {
    for (int chunk = 0; chunk < dim; chunk += BLOCK) {
        vec acc[ROWS][4] = {{{0}}};
        float total[ROWS];
        for (int i = 0; i < n; i++) total[i] = sink_weights[i];
        for (int j = 0; j < length; j++) {
            const uint16_t *row = values + (int64_t)j * dim + chunk;
            vec value[4] = {load_bf16(row), load_bf16(row + LANES), load_bf16(row + 2 * LANES),
                            load_bf16(row + 3 * LANES)};
            for (int i = 0; i < n; i++) {
                float weight = weights[i][j];
                total[i] += weight;
                for (int part = 0; part < 4; part++) acc[i][part] += splat(weight) * value[part];
            }
        }
        for (int i = 0; i < n; i++)
            if (out[i])
                for (int part = 0; part < 4; part++)
                    for (int lane = 0; lane < LANES; lane++)
                        out[i][chunk + part * LANES + lane] =
                            float_to_bf16(acc[i][part][lane] / total[i]);
    }
}
#endif

/* The keys transposed so that score_rows' lanes run over keys, zero from length up to padded.
 * With AVX-512 bf16: keys_w[p][j], the 32-bit word of key j holding its dims 2p (low half) and
 * 2p + 1 (high half), the bf16 bits as they are. Otherwise keys_t[d][j] = float(k[j][d]).
 * Exact data movement either way, so how it is done changes no result. With AVX-512, 16 keys
 * at a time: their rows as 16 x (dim / 2) words, transposed in registers 16 words at a time. */
#ifdef __AVX512F__
/* rows[i] <- column i of the 16 x 16 matrix of 32-bit words whose row i was rows[i]. */
static inline void transpose_words(__m512i rows[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {   /* pairs of rows interleaved by words */
        t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {   /* four rows' words together, per 128-bit lane */
        rows[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        rows[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        rows[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        rows[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {       /* 128-bit lanes of rows 0-7 and of rows 8-15 */
        t[i] = _mm512_shuffle_i32x4(rows[i], rows[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(rows[i], rows[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(rows[i + 8], rows[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(rows[i + 8], rows[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {       /* ... and the two halves together: whole columns */
        rows[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        rows[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}
#elif defined(__AVX2__)
/* rows[i] <- column i of the 8 x 8 matrix of 32-bit words whose row i was rows[i]. */
static inline void transpose_words8(__m256 rows[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {    /* pairs of rows interleaved by words */
        t[i] = _mm256_unpacklo_ps(rows[i], rows[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(rows[i], rows[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {    /* four rows' words together, per 128-bit lane */
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {       /* the 128-bit lanes of rows 0-3 and of rows 4-7 */
        rows[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        rows[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}
#endif

static void transpose_keys(const uint16_t *k, int length, int padded, int dim, void *keys_t) {
#ifdef __AVX512F__
    for (int j = 0; j < padded; j += LANES) {
        for (int word = 0; word < dim / 2; word += 16) {
            __m512i rows[16];
            for (int i = 0; i < 16; i++)
                rows[i] = j + i < length
                    ? _mm512_loadu_si512(k + (int64_t)(j + i) * dim + 2 * word)
                    : _mm512_setzero_si512();
            transpose_words(rows);
            for (int i = 0; i < 16; i++) {
#ifdef __AVX512BF16__
                _mm512_storeu_si512((int32_t *)keys_t + (size_t)(word + i) * padded + j, rows[i]);
#else
                float *to = (float *)keys_t + (size_t)2 * (word + i) * padded + j;
                _mm512_storeu_si512(to, _mm512_slli_epi32(rows[i], 16));
                _mm512_storeu_si512(to + padded, _mm512_and_si512(
                    rows[i], _mm512_set1_epi32((int)0xffff0000u)));
#endif
            }
        }
    }
#elif defined(__AVX2__)
    /* 8 keys at a time: their rows as 8 x (dim / 2) words, transposed 8 words at a time. */
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    for (int j = 0; j < padded; j += 8) {
        for (int word = 0; word < dim / 2; word += 8) {
            __m256 rows[8];
            for (int i = 0; i < 8; i++)
                rows[i] = j + i < length
                    ? _mm256_loadu_ps((const float *)(k + (int64_t)(j + i) * dim + 2 * word))
                    : _mm256_setzero_ps();
            transpose_words8(rows);
            for (int i = 0; i < 8; i++) {
                __m256i words = _mm256_castps_si256(rows[i]);
                float *to = (float *)keys_t + (size_t)2 * (word + i) * padded + j;
                _mm256_storeu_si256((__m256i *)to, _mm256_slli_epi32(words, 16));
                _mm256_storeu_si256((__m256i *)(to + padded), _mm256_and_si256(words, high));
            }
        }
    }
#else
    for (int d = 0; d < dim; d++) {
        float *row = (float *)keys_t + (size_t)d * padded;
        for (int j = 0; j < length; j++) row[j] = bf16_to_float(k[(int64_t)j * dim + d]);
        for (int j = length; j < padded; j++) row[j] = 0.0f;
    }
#endif
}

/* Floats of scratch that one kv head of `length` keys needs (attend_kv_head's buffers). */
static size_t scratch_floats(int length, int dim) {
    size_t padded = (size_t)(length + BLOCK - 1) / BLOCK * BLOCK;
    return (size_t)dim * padded + ROWS * (padded + dim);
}

/* Rows [first, first + n) of one kv head's query rows (see attend_kv_head): scores, weights,
 * weighted values. n is a constant where it is inlined, so the sums stay in registers. */
static inline __attribute__((always_inline)) void attend_rows(
        const int n, int first, const uint16_t *query, int64_t query_head_stride,
        int64_t query_row_stride, const void *keys_t, const uint16_t *v, const uint16_t *mask,
        int64_t mask_stride, int g, int groups, int rows, int length, int padded, int dim,
        float scale, const float *sinks, uint16_t *out, int64_t out_row_stride,
        float *const scores[ROWS], float *const query_f[ROWS]) {
    const void *queries[ROWS];
    uint16_t *outs[ROWS];
    float sink_weights[ROWS];
    for (int i = 0; i < n; i++) {
        int h = g * groups + (first + i) / rows, r = (first + i) % rows;
        const uint16_t *q = query + h * query_head_stride + r * query_row_stride;
#ifdef __AVX512BF16__
        queries[i] = q; /* read as pairs of bf16 */
#else
        for (int d = 0; d < dim; d++) query_f[i][d] = bf16_to_float(q[d]);
        queries[i] = query_f[i];
#endif
        outs[i] = out + r * out_row_stride + (int64_t)h * dim;
    }
    score_rows(n, queries, keys_t, padded, dim, scores);
    for (int i = 0; i < n; i++) {
        int h = g * groups + (first + i) / rows, r = (first + i) % rows;
        const uint16_t *row_mask = mask ? mask + (int64_t)r * mask_stride : NULL;
        int visible_until = mask ? length : length - rows + r + 1;
        float sink = sinks ? sinks[h] : -__builtin_inff();
        sink_weights[i] = 0.0f;
        if (weigh_row(scores[i], row_mask, length, padded, visible_until, scale, sink,
                      &sink_weights[i]) != 0) {
            memset(outs[i], 0, (size_t)dim * sizeof(uint16_t)); /* sees no key */
            outs[i] = NULL;
            memset(scores[i], 0, (size_t)padded * sizeof(float));
        }
    }
    weigh_values(n, (const float *const *)scores, sink_weights, v, length, dim, outs);
}

/* One kv head g of one sequence: every query row of the heads that read it. Query row
 * (head h, row r) at query + h * query_head_stride + r * query_row_stride; its output at
 * out + r * out_row_stride + h * dim. Where these rows live, and how many are computed
 * together, changes no arithmetic. */
static void attend_kv_head(const uint16_t *query, int64_t query_head_stride,
                           int64_t query_row_stride, const uint16_t *k, const uint16_t *v,
                           const uint16_t *mask, int64_t mask_stride, int g, int groups,
                           int rows, int length, int dim, float scale, const float *sinks,
                           uint16_t *out, int64_t out_row_stride, float *scratch) {
    int padded = (length + BLOCK - 1) / BLOCK * BLOCK;
    float *keys_t = scratch;
    float *scores[ROWS], *query_f[ROWS];
    for (int i = 0; i < ROWS; i++) {
        scores[i] = keys_t + (size_t)dim * padded + (size_t)i * padded;
        query_f[i] = scores[0] + (size_t)ROWS * padded + (size_t)i * dim;
    }
    transpose_keys(k, length, padded, dim, keys_t);
    /* The kv head's query rows (head h, row r), ROWS at a time, then the rest together. */
    int count = groups * rows, first = 0;
#define ATTEND(n) attend_rows(n, first, query, query_head_stride, query_row_stride, keys_t, v, \
                              mask, mask_stride, g, groups, rows, length, padded, dim, scale, \
                              sinks, out, out_row_stride, scores, query_f)
    for (; first + ROWS <= count; first += ROWS) ATTEND(ROWS);
    switch (count - first) {
        case 3: ATTEND(3); break;
        case 2: ATTEND(2); break;
        case 1: ATTEND(1); break;
        default: break;
    }
#undef ATTEND
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
    float *scratch = aligned_alloc(64, (scratch_floats(length, dim) * sizeof(float) + 63)
                                       / 64 * 64);
    if (!scratch) return -1;
    for (int g = 0; g < kv_heads; g++)
        attend_kv_head(query, (int64_t)rows * dim, dim, keys + g * key_head_stride,
                       values + g * value_head_stride, mask, mask_stride, g, heads / kv_heads,
                       rows, length, dim, scale, NULL, out, (int64_t)heads * dim, scratch);
    free(scratch);
    return 0;
}

/* Many sequences' attention in one call, `threads` OpenMP threads sharing the (segment, kv
 * head) pairs: each pair runs attend_kv_head exactly as dresd_attention does, so every row is
 * bit for bit what dresd_attention gives it, whatever the threads or the other segments.
 * query: total_rows x heads x dim, row stride query_row_stride, heads dim apart; segment s
 * owns rows first[s] .. first[s] + rows[s] - 1 of query and of out (total_rows x heads x dim,
 * contiguous). keys[s], values[s]: its kv_heads x lengths[s] x dim, head strides given;
 * masks[s]: rows[s] x mask_strides[s] additive bf16 (last lengths[s] columns) or NULL (causal).
 * sinks: each head's attention sink (float32 [heads], weigh_row says how), or NULL: none.
 * Returns 0, or -1 when out of memory. */
int dresd_attention_batch(int segments, const uint16_t *query, int64_t query_row_stride,
                          const int *first, const int *rows, const uint16_t *const *keys,
                          const uint16_t *const *values, const int64_t *key_head_strides,
                          const int64_t *value_head_strides, const uint16_t *const *masks,
                          const int64_t *mask_strides, const int *lengths, int heads,
                          int kv_heads, int dim, float scale, const float *sinks, uint16_t *out,
                          int threads) {
    int longest = 0, failed = 0;
    for (int s = 0; s < segments; s++) longest = lengths[s] > longest ? lengths[s] : longest;
    size_t bytes = (scratch_floats(longest, dim) * sizeof(float) + 63) / 64 * 64;
    int items = segments * kv_heads;
    if (threads > items) threads = items; /* an idle thread would only add to the join */
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *scratch = aligned_alloc(64, bytes);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++) {
            int s = item / kv_heads, g = item % kv_heads;
            if (!scratch || rows[s] == 0) continue;
            const uint16_t *q = query + (int64_t)first[s] * query_row_stride;
            attend_kv_head(q, dim, query_row_stride, keys[s] + g * key_head_strides[s],
                           values[s] + g * value_head_strides[s], masks[s], mask_strides[s], g,
                           heads / kv_heads, rows[s], lengths[s], dim, scale, sinks,
                           out + (int64_t)first[s] * heads * dim, (int64_t)heads * dim,
                           scratch);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
