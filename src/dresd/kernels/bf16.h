/* bf16 rounding shared by the kernels (linear.c, quant.c; decoder.c through them). */
#ifndef DRESD_BF16_H
#define DRESD_BF16_H

#include <immintrin.h>

/* bf16(value) for 16 floats, to nearest, ties to even (as torch's .to(torch.bfloat16)); NaN
 * stays a quiet NaN. */
static inline __m256i round_to_bf16(__m512 value) {
    __m512i bits = _mm512_castps_si512(value);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

#endif
