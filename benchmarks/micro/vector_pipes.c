/* Throughput of the instructions the kernels' rows are made of (vector_pipes.py loads it):
 * each loop runs `count` rounds of 12 independent chains, so latency never limits it, and
 * returns a value that depends on every result (the compiler cannot drop the work). */
#include <immintrin.h>
#include <stdint.h>

#define CHAINS 12

/* vpdpbusd: 64 int8 multiply-adds (quant.c's dot products). */
float pipes_dpbusd(int64_t count) {
    __m512i acc[CHAINS], w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_set1_epi32(i);
    for (int64_t n = 0; n < count; n++) {
        #pragma GCC unroll 12
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], w, x);
        __asm__ volatile("" : "+v"(w));
    }
    int32_t sum = 0;
    for (int i = 0; i < CHAINS; i++) sum += _mm512_reduce_add_epi32(acc[i]);
    return (float)sum;
}

/* vdpbf16ps: 32 bf16 multiply-adds (linear.c's and attention.c's dot products). */
float pipes_dpbf16(int64_t count) {
    __m512 acc[CHAINS];
    __m512bh w = (__m512bh)_mm512_set1_epi16(0x3f80);
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_set1_ps((float)i);
    for (int64_t n = 0; n < count; n++) {
        #pragma GCC unroll 12
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_dpbf16_ps(acc[i], w, w);
        __asm__ volatile("" : "+v"(w));
    }
    float sum = 0.0f;
    for (int i = 0; i < CHAINS; i++) sum += _mm512_reduce_add_ps(acc[i]);
    return sum;
}

/* vfmadd231ps: 16 float32 multiply-adds (quant.c's scaling of each block's dot). */
float pipes_fma(int64_t count) {
    __m512 acc[CHAINS], w = _mm512_set1_ps(0.5f);
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_set1_ps((float)i);
    for (int64_t n = 0; n < count; n++) {
        #pragma GCC unroll 12
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_fmadd_ps(acc[i], w, w);
        __asm__ volatile("" : "+v"(w));
    }
    float sum = 0.0f;
    for (int i = 0; i < CHAINS; i++) sum += _mm512_reduce_add_ps(acc[i]);
    return sum;
}

/* CHAINS / 2 chains of vpdpbusd beside CHAINS / 2 of vfmadd231ps (CHAINS instructions a
 * round, as in each loop above): if the two share execution ports, the mix runs at the rate
 * each runs alone; if not, at up to twice it. */
float pipes_dpbusd_fma(int64_t count) {
    __m512i acc[CHAINS / 2], w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
    __m512 facc[CHAINS / 2], fw = _mm512_set1_ps(0.5f);
    for (int i = 0; i < CHAINS / 2; i++) {
        acc[i] = _mm512_set1_epi32(i);
        facc[i] = _mm512_set1_ps((float)i);
    }
    for (int64_t n = 0; n < count; n++) {
        #pragma GCC unroll 12
        for (int i = 0; i < CHAINS / 2; i++) {
            acc[i] = _mm512_dpbusd_epi32(acc[i], w, x);
            facc[i] = _mm512_fmadd_ps(facc[i], fw, fw);
        }
        __asm__ volatile("" : "+v"(w), "+v"(fw));
    }
    float sum = 0.0f;
    for (int i = 0; i < CHAINS / 2; i++)
        sum += (float)_mm512_reduce_add_epi32(acc[i]) + _mm512_reduce_add_ps(facc[i]);
    return sum;
}
