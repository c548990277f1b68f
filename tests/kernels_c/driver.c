/* A driver for dresd's C kernels outside Python: it runs the jobs of a job file, one a line,
 * reading its inputs from files and writing its outputs to files, so that the same kernels
 * built for another machine (aarch64, run under qemu-aarch64) compute on the same inputs as
 * an x86 build of this driver (tests/kernels_c/harness.py writes the jobs and compares).
 *
 * It compiles the kernels' sources into itself (experts.c holds decoder.c, which holds quant.c,
 * linear.c and attention.c; drafting.c and recurrent.c beside it), one translation unit:
 *   cc -O3 <tier flags> -std=gnu11 -fopenmp -I src/dresd/kernels driver.c -o driver -lm
 *
 * Job lines (files: raw little-endian arrays; "-" for an absent bias or mask):
 *   quant LAYOUT ROWS K N OUT_BF16 THREADS X PACKED BIAS Y
 *       dresd_quant_linear: X rows x K bf16, Y rows x N (bf16 or float32)
 *   pack LAYOUT N K THREADS RAW PACKED
 *       dresd_quant_pack: RAW n rows of a GGUF tensor's blocks over K, PACKED its packed bytes
 *   linear ROWS PAIRS N THREADS X PACKED BIAS Y
 *       dresd_linear: X rows x 2 PAIRS bf16, BIAS float32 padded to whole panels, Y rows x N
 *   attention HEADS KV_HEADS ROWS LENGTH DIM SCALE Q K V MASK MASK_STRIDE OUT
 *       dresd_attention: Q heads x rows x dim, K and V kv_heads x length x dim (contiguous),
 *       MASK rows x MASK_STRIDE additive bf16 (its last LENGTH columns read), OUT rows x heads
 *       x dim bf16
 *   decoder LAYERS HIDDEN HEADS KV_HEADS HEAD_DIM INTER GEMMA LAYOUT ROWS START THREADS
 *           FINAL_NORM HIDDEN_ROWS COS SIN LOCAL_COS LOCAL_SIN WINDOW_START MASK
 *           then per layer: IN_NORM POST_NORM QKV O GATE_UP DOWN Q_NORM K_NORM ATTN_OUT_NORM
 *           MLP_OUT_NORM WINDOWED, then OUT
 *       dresd_decoder over one segment of ROWS rows after START cached ones (the cache's
 *       entries random, read from the file's keys and values after the rows: see harness.py),
 *       GEMMA 1: Gemma's norms (plus one) and GELU-tanh, else Llama's; LAYOUT -1: the weights
 *       bf16 packed for linear.c, else quant.c's layout of that number; "-" for an absent
 *       norm, LOCAL_COS/SIN, WINDOW_START -1 for no window; MASK: ROWS x (START + ROWS)
 *       additive bf16, or "-" (causal). OUT: the final norm's rows, then the keys and values
 *   suffix MAX_DEPTH FACTOR OFFSET MAX_NODES MIN_PROB MAX_LEN SINGLE_PATH CONTEXT OUT
 *       dresd_suffix_context_tree over CONTEXT int64 tokens: OUT the count, match length,
 *       tokens, parents (int32) and probs (float64)
 *   lookup MAX_NGRAM MIN_NGRAM DRAFT_LEN NUM_DRAFTS TOKENS OUT
 *       dresd_prompt_lookup: OUT the count, drafts and lengths (int32)
 *   densekey D DIM BF16 HIDDEN WEIGHT_T BIAS OUT
 *       dresd_dense_key: OUT the key (float32)
 *   moe EXPERTS USED FFN NORM LAYOUT ROWS D THREADS ROUTER X, then per expert GATE_UP DOWN,
 *       then OUT
 *       dresd_moe_mlp of one layer on X (ROWS x D bf16), ROUTER float32 [EXPERTS][D], each
 *       expert's weights in LAYOUT (-1: bf16 packed): OUT ROWS x D bf16
 *   delta ROWS HEADS KEY_HEADS DK DV TILED THREADS PARENTS Q K V BETA G STATE OUT
 *       dresd_delta_rule over a tree's rows (PARENTS int32): OUT each row's output, then the
 *       state after the last row (float32)
 * Exit status 0 when every job ran; else a message on stderr naming the line. */
#include "experts.c"  /* and the decoder.c it holds */
#include "drafting.c"
#include "recurrent.c"

#include <stdio.h>

static void *read_file(const char *path, long *size) {
    if (path[0] == '-' && path[1] == 0) return NULL;
    FILE *file = fopen(path, "rb");
    if (!file) return NULL;
    fseek(file, 0, SEEK_END);
    long bytes = ftell(file);
    fseek(file, 0, SEEK_SET);
    void *data = malloc(bytes + 64);  /* a little slack: no kernel reads past its input */
    if (data && fread(data, 1, bytes, file) != (size_t)bytes) { free(data); data = NULL; }
    fclose(file);
    if (size) *size = bytes;
    return data;
}

static int write_file(const char *path, const void *data, size_t bytes) {
    FILE *file = fopen(path, "wb");
    if (!file) return -1;
    size_t done = fwrite(data, 1, bytes, file);
    fclose(file);
    return done == bytes ? 0 : -1;
}

/* The next word of a job line (strtok over its copy), or NULL at its end. */
static char *word(void) { return strtok(NULL, " \t\n"); }

/* A file named by the next word ("-": NULL). */
static void *next_file(void) {
    char *name = word();
    return name ? read_file(name, NULL) : NULL;
}

static int next_int(void) {
    char *w = word();
    return w ? atoi(w) : -1;
}

#define MAX_LAYERS 8

static int decoder_job(const char *text) {
    char line[16384];
    snprintf(line, sizeof line, "%s", text);
    strtok(line, " \t\n");  /* "decoder" */
    Decoder m = {0};
    m.layers = next_int(); m.hidden = next_int(); m.heads = next_int();
    m.kv_heads = next_int(); m.head_dim = next_int(); m.intermediate = next_int();
    int gemma = next_int(), layout = next_int(), rows = next_int(), start = next_int();
    int threads = next_int();
    if (m.layers < 1 || m.layers > MAX_LAYERS || rows < 1) return -1;
    m.eps = 1e-6f;
    m.scale = 1.0f / sqrtf((float)m.head_dim);
    m.norm_plus_one = gemma;
    m.activation = gemma ? ACTIVATION_GELU_TANH : ACTIVATION_SILU;
    m.final_norm = next_file();
    uint16_t *hidden = next_file(), *cos = next_file(), *sin = next_file();
    uint16_t *local_cos = next_file(), *local_sin = next_file();
    int window_start = next_int();
    uint16_t *mask = next_file();
    const uint16_t *in_norm[MAX_LAYERS], *post_norm[MAX_LAYERS], *q_norm[MAX_LAYERS],
        *k_norm[MAX_LAYERS], *attn_out_norm[MAX_LAYERS], *mlp_out_norm[MAX_LAYERS];
    const float *no_bias[MAX_LAYERS] = {0};
    Weight qkv[MAX_LAYERS], o[MAX_LAYERS], gate_up[MAX_LAYERS], down[MAX_LAYERS];
    unsigned char windowed[MAX_LAYERS];
    int width = (m.heads + 2 * m.kv_heads) * m.head_dim;
    for (int l = 0; l < m.layers; l++) {
        in_norm[l] = next_file(); post_norm[l] = next_file();
        Weight *parts[4] = {&qkv[l], &o[l], &gate_up[l], &down[l]};
        int outputs[4] = {width, m.hidden, 2 * m.intermediate, m.hidden};
        for (int p = 0; p < 4; p++)
            *parts[p] = (Weight){.count = 1, .layout = {layout}, .n = {outputs[p]},
                                 .data = {next_file()}};
        q_norm[l] = next_file(); k_norm[l] = next_file();
        attn_out_norm[l] = next_file(); mlp_out_norm[l] = next_file();
        windowed[l] = (unsigned char)next_int();
    }
    char *out = word();
    if (!out || !hidden || !cos || !sin || !m.final_norm) return -1;
    m.input_norm = in_norm; m.post_norm = post_norm; m.qkv = qkv; m.qkv_bias = no_bias;
    m.o = o; m.gate_up = gate_up; m.down = down;
    m.q_norm = q_norm[0] ? q_norm : NULL; m.k_norm = k_norm[0] ? k_norm : NULL;
    m.attention_out_norm = attn_out_norm[0] ? attn_out_norm : NULL;
    m.mlp_out_norm = mlp_out_norm[0] ? mlp_out_norm : NULL;
    m.windowed = window_start >= 0 ? windowed : NULL;
    /* the cache: its first START entries per layer and kv head from the hidden file's tail */
    int64_t capacity = start + rows, cache = (int64_t)m.layers * m.kv_heads * capacity
                                                * m.head_dim;
    const uint16_t *cached = hidden + (size_t)rows * m.hidden;
    uint16_t *keys = calloc(cache, 2), *values = calloc(cache, 2);
    uint16_t *normed = malloc((size_t)rows * m.hidden * 2 + 4);
    if (!keys || !values || !normed) return -2;
    for (int64_t block = 0; block < (int64_t)m.layers * m.kv_heads; block++)
        for (int i = 0; i < start; i++) {
            memcpy(keys + (block * capacity + i) * m.head_dim,
                   cached + (block * start + i) * m.head_dim, m.head_dim * 2);
            memcpy(values + (block * capacity + i) * m.head_dim,
                   cached + ((int64_t)m.layers * m.kv_heads * start + block * start + i)
                            * m.head_dim, m.head_dim * 2);
        }
    int first = 0, window = window_start;
    int64_t stride = start + rows;
    const uint16_t *masks[1] = {mask};
    uint16_t *key_buffers[1] = {keys}, *value_buffers[1] = {values};
    Segments segments = {.count = 1, .first = &first, .rows = &rows, .start = &start,
                         .keys = key_buffers, .values = value_buffers, .capacity = &capacity,
                         .masks = masks, .mask_strides = &stride,
                         .window_start = window_start >= 0 ? &window : NULL};
    int status = dresd_decoder(&m, hidden, rows, cos, sin, local_cos, local_sin, &segments,
                               normed, threads);
    if (status == 0) {
        FILE *file = fopen(out, "wb");
        if (!file) return -3;
        fwrite(normed, 2, (size_t)rows * m.hidden, file);
        fwrite(keys, 2, cache, file);
        fwrite(values, 2, cache, file);
        fclose(file);
    }
    return status;  /* the inputs are left to the process's end: a test driver */
}

#define MAX_EXPERTS 64

static int moe_job(const char *text) {
    char line[16384];
    snprintf(line, sizeof line, "%s", text);
    strtok(line, " \t\n");  /* "moe" */
    int experts = next_int(), used = next_int(), ffn = next_int(), norm = next_int();
    int layout = next_int(), rows = next_int(), d = next_int(), threads = next_int();
    if (experts < 1 || experts > MAX_EXPERTS || rows < 1) return -1;
    const float *router[1] = {next_file()};
    uint16_t *x = next_file();
    Weight gate_up[MAX_EXPERTS], down[MAX_EXPERTS];
    for (int j = 0; j < experts; j++) {
        gate_up[j] = (Weight){.count = 1, .layout = {layout}, .n = {2 * ffn},
                              .data = {next_file()}};
        down[j] = (Weight){.count = 1, .layout = {layout}, .n = {d}, .data = {next_file()}};
    }
    char *out = word();
    if (!out || !router[0] || !x) return -1;
    Experts e = {.experts = experts, .used = used, .ffn = ffn, .norm = norm, .router = router,
                 .gate_up = gate_up, .down = down};
    uint16_t *y = malloc((size_t)rows * d * 2 + 4);
    if (!y) return -2;
    int status = dresd_moe_mlp(&e, 0, x, rows, d, y, threads);
    if (status == 0) status = write_file(out, y, (size_t)rows * d * 2);
    free(y);
    return status;
}

static int run(char *line) {
    char kind[16], a[4][512], out[512];
    if (sscanf(line, "%15s", kind) != 1) return 0;  /* a blank line */
    if (!strcmp(kind, "quant")) {
        int layout, rows, k, n, out_bf16, threads;
        if (sscanf(line, "%*s %d %d %d %d %d %d %511s %511s %511s %511s", &layout, &rows, &k, &n,
                   &out_bf16, &threads, a[0], a[1], a[2], out) != 10) return -1;
        uint16_t *x = read_file(a[0], NULL);
        uint8_t *packed = read_file(a[1], NULL);
        float *bias = read_file(a[2], NULL);
        size_t bytes = (size_t)rows * n * (out_bf16 ? 2 : 4);
        void *y = malloc(bytes + 4);
        if (!x || !packed || !y) return -2;
        int status = dresd_quant_linear(layout, x, k, rows, k, packed, n, bias, y, n, out_bf16,
                                        threads);
        if (status == 0) status = write_file(out, y, bytes);
        free(x); free(packed); free(bias); free(y);
        return status;
    }
    if (!strcmp(kind, "pack")) {
        int layout, n, k, threads;
        long raw_bytes;
        if (sscanf(line, "%*s %d %d %d %d %511s %511s", &layout, &n, &k, &threads, a[0], out)
            != 6) return -1;
        uint8_t *raw = read_file(a[0], &raw_bytes);
        size_t bytes = (size_t)((n + QPARTS * QLANES - 1) / (QPARTS * QLANES))
                       * dresd_quant_group_bytes(layout, k);
        uint8_t *packed = malloc(bytes);
        if (!raw || !packed) return -2;
        int status = dresd_quant_pack(layout, raw, raw_bytes / n, n, k, packed, threads, 0);
        if (status == 0) status = write_file(out, packed, bytes);
        free(raw); free(packed);
        return status;
    }
    if (!strcmp(kind, "linear")) {
        int rows, pairs, n, threads;
        if (sscanf(line, "%*s %d %d %d %d %511s %511s %511s %511s", &rows, &pairs, &n, &threads,
                   a[0], a[1], a[2], out) != 8) return -1;
        uint16_t *x = read_file(a[0], NULL), *packed = read_file(a[1], NULL);
        float *bias = read_file(a[2], NULL);
        size_t bytes = (size_t)rows * n * 2;
        uint16_t *y = malloc(bytes + 4);
        if (!x || !packed || !y) return -2;
        dresd_linear(x, 2 * pairs, rows, packed, pairs, n, bias, y, n, threads);
        int status = write_file(out, y, bytes);
        free(x); free(packed); free(bias); free(y);
        return status;
    }
    if (!strcmp(kind, "attention")) {
        int heads, kv_heads, rows, length, dim;
        long mask_stride;
        float scale;
        if (sscanf(line, "%*s %d %d %d %d %d %f %511s %511s %511s %511s %ld %511s", &heads,
                   &kv_heads, &rows, &length, &dim, &scale, a[0], a[1], a[2], a[3],
                   &mask_stride, out) != 12) return -1;
        uint16_t *q = read_file(a[0], NULL), *keys = read_file(a[1], NULL),
                 *values = read_file(a[2], NULL), *mask = read_file(a[3], NULL);
        size_t bytes = (size_t)rows * heads * dim * 2;
        uint16_t *o = malloc(bytes + 4);
        if (!q || !keys || !values || !o) return -2;
        /* the mask's last `length` columns */
        const uint16_t *columns = mask ? mask + (mask_stride - length) : NULL;
        int status = dresd_attention(q, keys, values, columns, (int64_t)length * dim,
                                     (int64_t)length * dim, mask_stride, heads, kv_heads, rows,
                                     length, dim, scale, o);
        if (status == 0) status = write_file(out, o, bytes);
        free(q); free(keys); free(values); free(mask); free(o);
        return status;
    }
    if (!strcmp(kind, "decoder")) return decoder_job(line);
    if (!strcmp(kind, "suffix")) {
        int max_depth, max_nodes, max_len, single_path;
        double factor, offset, min_prob;
        if (sscanf(line, "%*s %d %lf %lf %d %lf %d %d %511s %511s", &max_depth, &factor,
                   &offset, &max_nodes, &min_prob, &max_len, &single_path, a[0], out) != 9)
            return -1;
        long bytes;
        int64_t *context = read_file(a[0], &bytes);
        size_t size = 2 * sizeof(int32_t) + (size_t)max_nodes * (2 * sizeof(int32_t)
                                                                   + sizeof(double));
        int32_t *result = calloc(1, size);
        if (!context || !result) return -2;
        int32_t *tokens = result + 2, *parents = tokens + max_nodes;
        double *probs = (double *)(parents + max_nodes);
        result[0] = dresd_suffix_context_tree(context, bytes / 8, max_depth, factor, offset,
                                              max_nodes, min_prob, max_len, single_path, tokens,
                                              parents, probs, &result[1]);
        int status = result[0] < 0 ? -2 : write_file(out, result, size);
        free(context); free(result);
        return status;
    }
    if (!strcmp(kind, "lookup")) {
        int max_ngram, min_ngram, draft_len, num_drafts;
        if (sscanf(line, "%*s %d %d %d %d %511s %511s", &max_ngram, &min_ngram, &draft_len,
                   &num_drafts, a[0], out) != 6) return -1;
        long bytes;
        int64_t *tokens = read_file(a[0], &bytes);
        size_t size = sizeof(int32_t) * (1 + (size_t)num_drafts * (draft_len + 1));
        int32_t *result = calloc(1, size);
        if (!tokens || !result) return -2;
        result[0] = dresd_prompt_lookup(tokens, bytes / 8, max_ngram, min_ngram, draft_len,
                                        num_drafts, result + 1,
                                        result + 1 + (size_t)num_drafts * draft_len);
        int status = write_file(out, result, size);
        free(tokens); free(result);
        return status;
    }
    if (!strcmp(kind, "moe")) return moe_job(line);
    if (!strcmp(kind, "delta")) {
        int rows, heads, key_heads, dk, dv, tiled, threads;
        char b[3][512];
        if (sscanf(line, "%*s %d %d %d %d %d %d %d %511s %511s %511s %511s %511s %511s %511s "
                   "%511s %511s", &rows, &heads, &key_heads, &dk, &dv, &tiled, &threads, a[0],
                   a[1], a[2], a[3], b[0], b[1], b[2], out) != 15) return -1;
        int32_t *parents = read_file(a[0], NULL);
        float *q = read_file(a[1], NULL), *k = read_file(a[2], NULL), *v = read_file(a[3], NULL);
        float *beta = read_file(b[0], NULL), *g = read_file(b[1], NULL),
              *state = read_file(b[2], NULL);
        size_t outputs = (size_t)rows * heads * dv, states = (size_t)heads * dk * dv;
        float *result = malloc(sizeof(float) * (outputs + states));
        if (!parents || !q || !k || !v || !beta || !g || !state || !result) return -2;
        int status = dresd_delta_rule(rows, parents, heads, key_heads, dk, dv, tiled, q, k, v,
                                      beta, g, state, result, result + outputs, threads);
        if (status == 0) status = write_file(out, result, sizeof(float) * (outputs + states));
        free(parents); free(q); free(k); free(v); free(beta); free(g); free(state);
        free(result);
        return status;
    }
    if (!strcmp(kind, "densekey")) {
        int d, dim, bf16;
        if (sscanf(line, "%*s %d %d %d %511s %511s %511s %511s", &d, &dim, &bf16, a[0], a[1],
                   a[2], out) != 7) return -1;
        void *hidden = read_file(a[0], NULL);
        float *weight_t = read_file(a[1], NULL), *bias = read_file(a[2], NULL);
        float *key = malloc(sizeof(float) * dim);
        if (!hidden || !weight_t || !bias || !key) return -2;
        dresd_dense_key(hidden, bf16, d, weight_t, bias, dim, key);
        int status = write_file(out, key, sizeof(float) * dim);
        free(hidden); free(weight_t); free(bias); free(key);
        return status;
    }
    return -1;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s JOBS\n", argv[0]);
        return 2;
    }
    FILE *jobs = fopen(argv[1], "r");
    if (!jobs) {
        fprintf(stderr, "cannot read %s\n", argv[1]);
        return 2;
    }
    char line[16384];
    int number = 0, failed = 0;
    while (fgets(line, sizeof line, jobs)) {
        number++;
        int status = run(line);
        if (status != 0) {
            fprintf(stderr, "line %d: status %d: %s", number, status, line);
            failed = 1;
        }
    }
    fclose(jobs);
    return failed;
}
