/* Throughput of the instructions the kernels' rows are made of (vector_pipes.py loads it):
 * each loop runs `count` rounds of 12 independent chains, so latency never limits it, and
 * returns a value that depends on every result (the compiler cannot drop the work). */
#include <immintrin.h>
#include <stdint.h>

#define CHAINS 12

/* pipes_NAME(count): CHAINS chains of acc = STEP(acc) (acc of type T, started at START(i)),
 * `count` rounds; `touch` is an operand the compiler must assume changes every round. */
#define PIPES(NAME, T, TOUCH_T, TOUCH, START, STEP, REDUCE)                    \
    float pipes_##NAME(int64_t count) {                                         \
        T acc[CHAINS];                                                          \
        TOUCH_T touch = TOUCH;                                                  \
        for (int i = 0; i < CHAINS; i++) acc[i] = START(i);                     \
        for (int64_t n = 0; n < count; n++) {                                   \
            _Pragma("GCC unroll 12")                                            \
            for (int i = 0; i < CHAINS; i++) acc[i] = STEP(acc[i], touch);      \
            __asm__ volatile("" : "+v"(touch));                                 \
        }                                                                       \
        float sum = 0.0f;                                                       \
        for (int i = 0; i < CHAINS; i++) sum += (float)REDUCE(acc[i]);          \
        return sum;                                                             \
    }

#define INT_START(i) _mm512_set1_epi32(i)
#define FLOAT_START(i) _mm512_set1_ps((float)(i))
/* vpdpbusd: 64 int8 multiply-adds (quant.c's dot products) */
#define DPBUSD(acc, w) _mm512_dpbusd_epi32(acc, w, w)
/* vdpbf16ps: 32 bf16 multiply-adds (linear.c's and attention.c's dot products) */
#define DPBF16(acc, w) _mm512_dpbf16_ps(acc, w, w)
/* vfmadd231ps: 16 float32 multiply-adds (quant.c's scaling of each block's dot) */
#define FMA(acc, w) _mm512_fmadd_ps(acc, w, w)

PIPES(dpbusd, __m512i, __m512i, _mm512_set1_epi8(3), INT_START, DPBUSD, _mm512_reduce_add_epi32)
PIPES(dpbf16, __m512, __m512bh, (__m512bh)_mm512_set1_epi16(0x3f80), FLOAT_START, DPBF16,
      _mm512_reduce_add_ps)
PIPES(fma, __m512, __m512, _mm512_set1_ps(0.5f), FLOAT_START, FMA, _mm512_reduce_add_ps)

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
