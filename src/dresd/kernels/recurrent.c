/* The gated delta rule of a Gated DeltaNet layer (Qwen3.5) over a draft tree's rows, in C
 * (dresd/kernels/recurrent.py loads it; decoding/recurrent.py calls it).
 *
 * Per value head h, a row r starting from its parent's state S (the layer's kept state for a
 * row whose parent is -1), with kh its key head:
 *
 *   q = l2norm(q[r, kh]) / sqrt(dk),  k = l2norm(k[r, kh])      l2norm(x) = x / sqrt(x.x + 1e-6)
 *   S = exp(g[r, h]) S                                          decay
 *   d = beta[r, h] (v[r, h] - S^T k)                            what the state misses at k
 *   S = S + k d^T                                               write it
 *   out[r, h] = S^T q                                           read at the query
 *
 * as transformers' `torch_recurrent_gated_delta_rule` computes a token (float32 throughout).
 *
 * The promise: a row's output and state depend only on its own inputs and its parent's state,
 * never on the other rows of the call, their number, or the threads: every sum runs over the
 * key dimension i = 0, 1, 2, ... in that order for each output element (the vector lanes run
 * over the value dimension, one lane an element), and the threads split the heads, each head's
 * rows computed by one thread in row order. So a node of a draft tree gets, bit for bit, what
 * a one-token step gives the same token after the same path, and a state rebuilt along a kept
 * path (`last`) is the one those steps would have left.
 *
 * States: a row's state lives in a slot until its last child has read it; the last child
 * updates its parent's slot in place, other children copy it. A chain therefore runs in one
 * slot; a tree needs a slot per branch alive at once. `last`, where given, receives the state
 * after the last row (a chain's end: the state a kept prompt chunk or path leaves).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Each multiply-add below is written as the fmaf it is, and the compiler fuses no other: left
 * to fuse as it likes (-ffp-contract=fast), GCC's x86 and aarch64 back ends chose differently
 * here and the NEON tier's states differed from the AVX2 tier's in the last bits (found under
 * qemu, tests/kernels_c/harness.py); written out, every tier computes the same operations. */
#pragma STDC FP_CONTRACT OFF
#pragma GCC optimize("fp-contract=off")

#define MAX_HEAD 512  /* the largest key or value head size (a head's scratch on the stack) */

/* x / sqrt(x.x + eps) into out, the sum in index order */
static void l2_normed(const float *x, int n, float scale, float *out) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) sum = fmaf(x[i], x[i], sum);
    float inverse = 1.0f / sqrtf(sum + 1e-6f);
    for (int i = 0; i < n; i++) out[i] = x[i] * inverse * scale;
}

/* One head of one row: the state `s` [dk, dv] updated in place, the output into `out` [dv].
 * `kv` and `delta`: [dv] scratch. */
static void head_step(float *s, const float *q, const float *k, const float *v, float beta,
                      float decay, int dk, int dv, float *kv, float *delta, float *out) {
    for (int j = 0; j < dv; j++) kv[j] = 0.0f;
    for (int i = 0; i < dk; i++) {  /* S = decay S;  kv = S^T k */
        float *row = s + (size_t)i * dv;
        for (int j = 0; j < dv; j++) {
            row[j] *= decay;
            kv[j] = fmaf(row[j], k[i], kv[j]);
        }
    }
    for (int j = 0; j < dv; j++) {
        delta[j] = (v[j] - kv[j]) * beta;
        out[j] = 0.0f;
    }
    for (int i = 0; i < dk; i++) {  /* S += k d^T;  out = S^T q */
        float *row = s + (size_t)i * dv;
        for (int j = 0; j < dv; j++) {
            row[j] = fmaf(k[i], delta[j], row[j]);
            out[j] = fmaf(row[j], q[i], out[j]);
        }
    }
}

/* rows: the call's rows; parents[r] < r (-1: `state`). q, k: [rows, key_heads, dk];
 * v, out: [rows, heads, dv]; beta, g: [rows, heads]; state, last: [heads, dk, dv].
 * tiled: value head h reads key head h % key_heads (a GGUF file's order), else
 * h / (heads / key_heads) (transformers'). Returns 0, -1 out of memory, -2 bad sizes. */
int dresd_delta_rule(int rows, const int32_t *parents, int heads, int key_heads, int dk,
                     int dv, int tiled, const float *q, const float *k, const float *v,
                     const float *beta, const float *g, const float *state, float *out,
                     float *last, int threads) {
    if (rows < 1 || heads < 1 || key_heads < 1 || heads % key_heads || dk < 1 || dv < 1
        || dk > MAX_HEAD || dv > MAX_HEAD)
        return -2;
    for (int r = 0; r < rows; r++)
        if (parents[r] < -1 || parents[r] >= r) return -2;
    /* each row's last child (-1: none), and how many slots are alive at once */
    int *last_child = malloc(sizeof(int) * (size_t)(rows + 1));
    int *slot_of = malloc(sizeof(int) * (size_t)rows);
    int *free_slots = malloc(sizeof(int) * (size_t)(rows + 1));
    if (!last_child || !slot_of || !free_slots) {
        free(last_child); free(slot_of); free(free_slots);
        return -1;
    }
    for (int r = 0; r <= rows; r++) last_child[r] = -1;
    for (int r = 0; r < rows; r++) last_child[parents[r] + 1] = r;  /* index 0: the kept state */
    /* The slot plan, the same for every head: a row takes its parent's slot where it is the
     * parent's last child (never the kept state's, which is read only), else a free one; its
     * slot is freed after it when no row follows from it (the last row's is kept for `last`). */
    int slots = 0, free_count = 0;
    for (int r = 0; r < rows; r++) {
        int p = parents[r];
        if (p >= 0 && last_child[p + 1] == r) slot_of[r] = slot_of[p];
        else slot_of[r] = free_count ? free_slots[--free_count] : slots++;
        if (last_child[r + 1] < 0 && r != rows - 1) free_slots[free_count++] = slot_of[r];
    }
    size_t state_size = (size_t)dk * dv;
    float *pool = malloc(sizeof(float) * state_size * (size_t)slots * heads);
    int status = pool ? 0 : -1;
    if (status == 0) {
        int per_key = heads / key_heads;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int h = 0; h < heads; h++) {
            float scratch[4 * MAX_HEAD];  /* q, k normed (dk), kv, delta (dv) */
            float *qn = scratch, *kn = scratch + MAX_HEAD, *kv = scratch + 2 * MAX_HEAD,
                  *delta = scratch + 3 * MAX_HEAD;
            int kh = tiled ? h % key_heads : h / per_key;
            const float *kept = state + (size_t)h * state_size;
            for (int r = 0; r < rows; r++) {
                int p = parents[r];
                float *s = pool + ((size_t)slot_of[r] * heads + h) * state_size;
                const float *from = p < 0 ? kept : pool + ((size_t)slot_of[p] * heads + h)
                                                          * state_size;
                if (from != s) memcpy(s, from, sizeof(float) * state_size);
                size_t key_at = ((size_t)r * key_heads + kh) * dk;
                size_t value_at = ((size_t)r * heads + h) * dv;
                l2_normed(q + key_at, dk, 1.0f / sqrtf((float)dk), qn);
                l2_normed(k + key_at, dk, 1.0f, kn);
                head_step(s, qn, kn, v + value_at, beta[(size_t)r * heads + h],
                          expf(g[(size_t)r * heads + h]), dk, dv, kv, delta,
                          out + value_at);
            }
            if (last)
                memcpy(last + (size_t)h * state_size,
                       pool + ((size_t)slot_of[rows - 1] * heads + h) * state_size,
                       sizeof(float) * state_size);
        }
    }
    free(pool); free(last_child); free(slot_of); free(free_slots);
    return status;
}
