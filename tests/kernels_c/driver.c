/* A driver for dresd's C kernels outside Python: it runs the jobs of a job file, one a line,
 * reading its inputs from files and writing its outputs to files, so that the same kernels
 * built for another machine (aarch64, run under qemu-aarch64) compute on the same inputs as
 * an x86 build of this driver (tests/kernels_c/harness.py writes the jobs and compares).
 *
 * It compiles the kernels' sources into itself, as decoder.c does (one translation unit):
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
 * Exit status 0 when every job ran; else a message on stderr naming the line. */
#include "quant.c"
#include "linear.c"
#include "attention.c"

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
        int status = dresd_quant_pack(layout, raw, raw_bytes / n, n, k, packed, threads);
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
    char line[4096];
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
