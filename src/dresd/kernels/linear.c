/* Batch-invariant bf16 linear layer for CPUs with AVX-512 bf16, or AVX-512 F or AVX2 with FMA,
 * or aarch64 NEON (its fused multiply-adds: the avx2 tier's sums) (dresd/kernels/linear.py
 * loads it).
 *
 *   y[m, n] = bf16( (sum_k x[m, k] W[n, k]) + bias[n] ),   sum and bias add in float32,
 *   bf16(): round to nearest, ties to even (as torch's .to(torch.bfloat16)).
 *
 * The promise: y[m, n] depends only on row m of x, on W and on the bias; not on how many rows
 * came with it, which rows they were, nor on the thread count. So a decode step's row and the
 * same row inside a verify forward or a prompt chunk are bit for bit the same.
 *
 * The reduction order, the same for every (m, n) whatever M or the threads:
 *   acc = +0.0f (float32)
 *   for p = 0, 1, ..., K2 - 1 (K2 = ceil(K / 2); K padded to even with one zero column):
 *       acc = vdpbf16ps(acc; x[m, 2p], x[m, 2p + 1]; W[n, 2p], W[n, 2p + 1])
 *             (one instruction lane: the two bf16 products, exact in float32, added to acc
 *             in the order the hardware defines for that lane; DAZ/FTZ, round to nearest)
 *   y[m, n] = bf16(acc + bias[n])   (no bias: bf16(acc))
 * Without AVX-512 bf16 (the avx512vnni and avx2 tiers: vec.h), the same loop with two float32
 * multiply-adds in place of vdpbf16ps (the products exact, each add rounded):
 *       acc = fma(x[m, 2p + 1], W[n, 2p + 1], fma(x[m, 2p], W[n, 2p], acc))
 * so these tiers' sums differ from the bf16 tier's, and are as fixed.
 * The vector lanes run over outputs n (16 per register, 8 with AVX2), never over k: an output's whole sum
 * is one lane of one register, one instruction per pair of k, in increasing k. Rows m and
 * outputs n are independent of each other, so how the work is tiled (rows sharing a weight
 * load, panels of outputs per thread) changes which lanes and registers compute at the same
 * time, never the instructions applied to one output. Threads split the outputs (panels of
 * 32) and the rows (tiles of up to MAX_TILE); never k.
 *
 * The weight layout (packed once by linear.py, so that a panel streams contiguously):
 *   packed[panel][p][part][lane][2] = W[panel * 32 + part * 16 + lane][2p + (0, 1)]
 * panels of PANEL = 32 outputs (N padded to a multiple of 32 with zero rows, outputs dropped),
 * 2 parts of 16 lanes: 128 bytes per pair of k, read once per row tile in address order.
 *
 * Why these sizes: a verify forward's rows (a draft tree, or a batch's rows) should cost what one
 * row does, and they do while every row shares one read of the weights. With 2 registers of
 * outputs a panel, 14 rows' accumulators (28 registers) fit beside the weights and the
 * broadcast input, so up to 14 rows take one pass; 4 registers a panel fit only 6. And a tile
 * of 7+ rows prefetches 16 KB ahead: 4 KB ahead left a one-core stream short of its bandwidth
 * (benchmarks/results/linear_tiles.md: 576->3072 at 8 rows 125 -> 99 us, 1 row 97). Smaller
 * tiles keep 4 KB: 16 KB made a one-row decode step's linears ~3% slower in the model (perf).
 */
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define LANES 16                /* outputs of a part (one AVX-512 register's float32 lanes) */
/* PARTS, MAX_TILE (at most MAX_CASE), PREFETCH and PREFETCH_FEW can be set with -D to try
 * others (benchmarks/micro/linear_tiles.py); linear.py packs for PARTS = 2. */
#ifndef PARTS
#define PARTS 2                 /* registers per panel: independent accumulators */
#endif
#define PANEL (PARTS * LANES)   /* outputs per panel */
#define SLICES (PANEL / VLANES) /* registers of outputs per panel (vec.h: 2, or 4 with AVX2) */
#ifndef MAX_TILE
#if defined(__AVX512BF16__)
#define MAX_TILE 14             /* rows sharing each weight load (14 x 2 accumulators) */
#elif defined(__AVX512F__)
#define MAX_TILE 12             /* 24 accumulators beside 4 registers of weights (even, odd) */
#else
#define MAX_TILE 2              /* AVX2's 16 registers: 8 accumulators, 8 of weights */
#endif
#endif
#define MAX_CASE 14             /* the largest tile panel_tile has a case for (MAX_TILE <= it) */
#ifndef PREFETCH
#define PREFETCH 128            /* pairs of k ahead (128: 16 KB) that each step prefetches */
#endif
#ifndef PREFETCH_FEW
#define PREFETCH_FEW 32         /* the same for tiles of up to FEW_ROWS rows (32: 4 KB) */
#endif
#define FEW_ROWS 6

/* y rows [first, first + TILE) of one panel: see the header for the order of each sum. */
static inline __attribute__((always_inline)) void tile(
        const int TILE, const uint16_t *x, int64_t x_stride, const uint16_t *panel, int pairs,
        const float *bias, uint16_t *y, int64_t y_stride, int outputs) {
    vf acc[MAX_CASE][SLICES];
    for (int i = 0; i < TILE; i++)
        for (int part = 0; part < SLICES; part++) acc[i][part] = vf_zero();
    const int32_t *rows[MAX_CASE];
    for (int i = 0; i < TILE; i++) rows[i] = (const int32_t *)(x + i * x_stride);
    for (int p = 0; p < pairs; p++) {
        const uint16_t *w = panel + (int64_t)p * 2 * PANEL;
#if PREFETCH
        const int ahead = TILE <= FEW_ROWS ? PREFETCH_FEW : PREFETCH;
        for (int line = 0; line < PARTS; line++) /* one 64-byte line a part */
            __builtin_prefetch((const char *)(w + ahead * 2 * PANEL) + 64 * line, 0, 3);
#endif
#ifdef __AVX512BF16__
        __m512bh weights[SLICES];
        for (int part = 0; part < SLICES; part++)
            weights[part] = (__m512bh)_mm512_loadu_si512(w + part * 2 * VLANES);
        for (int i = 0; i < TILE; i++) {
            __m512bh pair = (__m512bh)_mm512_set1_epi32(rows[i][p]); /* x[2p], x[2p + 1] */
            for (int part = 0; part < SLICES; part++)
                acc[i][part] = _mm512_dpbf16_ps(acc[i][part], pair, weights[part]);
        }
#else
        vf even[SLICES], odd[SLICES];  /* W[n, 2p], W[n, 2p + 1] as floats (exact) */
        for (int part = 0; part < SLICES; part++) {
            vi words = vi_load(w + part * 2 * VLANES);
            even[part] = vf_from_bits(vi_slli32(words, 16));
            odd[part] = vf_from_bits(vi_and(words, vi_set1_32((int)0xffff0000u)));
        }
        for (int i = 0; i < TILE; i++) {
            int32_t pair = rows[i][p];  /* x[2p] low, x[2p + 1] high */
            vf x_even = vf_from_bits(vi_set1_32((int)((uint32_t)pair << 16)));
            vf x_odd = vf_from_bits(vi_set1_32((int)((uint32_t)pair & 0xffff0000u)));
            for (int part = 0; part < SLICES; part++)
                acc[i][part] = vf_fma(x_odd, odd[part], vf_fma(x_even, even[part], acc[i][part]));
        }
#endif
    }
    for (int i = 0; i < TILE; i++)
        for (int part = 0; part < SLICES; part++) {
            int first = part * VLANES;
            if (first >= outputs) break;
            vf value = acc[i][part];
            if (bias) value = vf_add(value, vf_loadu(bias + first));
            bf16_store_part(y + i * y_stride + first, value, outputs - first);
        }
}

/* One tile of `count` rows (1 to MAX_TILE) of one panel, its row count a constant in each
 * call so that the accumulators stay in registers. */
static void panel_tile(int count, const uint16_t *x, int64_t x_stride, const uint16_t *panel,
                       int pairs, const float *bias, uint16_t *y, int64_t y_stride,
                       int outputs) {
    switch (count) {
        case 14: tile(14, x, x_stride, panel, pairs, bias, y, y_stride, outputs); break;
        case 13: tile(13, x, x_stride, panel, pairs, bias, y, y_stride, outputs); break;
        case 12: tile(12, x, x_stride, panel, pairs, bias, y, y_stride, outputs); break;
        case 11: tile(11, x, x_stride, panel, pairs, bias, y, y_stride, outputs); break;
        case 10: tile(10, x, x_stride, panel, pairs, bias, y, y_stride, outputs); break;
        case 9: tile(9, x, x_stride, panel, pairs, bias, y, y_stride, outputs); break;
        case 8: tile(8, x, x_stride, panel, pairs, bias, y, y_stride, outputs); break;
        case 7: tile(7, x, x_stride, panel, pairs, bias, y, y_stride, outputs); break;
        case 6: tile(6, x, x_stride, panel, pairs, bias, y, y_stride, outputs); break;
        case 5: tile(5, x, x_stride, panel, pairs, bias, y, y_stride, outputs); break;
        case 4: tile(4, x, x_stride, panel, pairs, bias, y, y_stride, outputs); break;
        case 3: tile(3, x, x_stride, panel, pairs, bias, y, y_stride, outputs); break;
        case 2: tile(2, x, x_stride, panel, pairs, bias, y, y_stride, outputs); break;
        case 1: tile(1, x, x_stride, panel, pairs, bias, y, y_stride, outputs); break;
        default: break;
    }
}

/* x: rows x (2 * pairs) bf16, row stride x_stride (elements; a row of odd K padded with a zero
 * by the caller); packed: the layout of the header, ceil(n / 32) panels; bias: n_padded float32
 * or NULL; y: rows x n bf16, row stride y_stride. threads: OpenMP threads (1: no parallel
 * region). */
void dresd_linear(const uint16_t *x, int64_t x_stride, int rows, const uint16_t *packed,
                  int pairs, int n, const float *bias, uint16_t *y, int64_t y_stride,
                  int threads) {
    int panels = (n + PANEL - 1) / PANEL;
    int tiles = (rows + MAX_TILE - 1) / MAX_TILE;
    int items = panels * tiles;
    if (threads > items) threads = items; /* an idle thread would only add to the join */
    /* Work item = (panel, row tile), panel-major: a thread's items are consecutive row tiles
     * of one panel, so the panel's weights stay in cache across all its rows. The tiles are
     * as even as they can be (16 rows: 8 + 8, not 14 + 2): each pass over the panel then does
     * as many rows' work per byte read as it can. */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int item = 0; item < items; item++) {
        int panel = item / tiles, tile_index = item % tiles;
        int base = rows / tiles, longer = rows % tiles; /* the first `longer` tiles: base + 1 */
        int count = base + (tile_index < longer);
        int first = tile_index * base + (tile_index < longer ? tile_index : longer);
        int outputs = n - panel * PANEL < PANEL ? n - panel * PANEL : PANEL;
        panel_tile(count, x + first * x_stride, x_stride,
                   packed + (int64_t)panel * pairs * 2 * PANEL, pairs,
                   bias ? bias + panel * PANEL : NULL, y + panel * PANEL + first * y_stride,
                   y_stride, outputs);
    }
}
