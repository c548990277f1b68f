/* bf16 rounding shared by the kernels (linear.c, quant.c; decoder.c through them). */
#ifndef DRESD_BF16_H
#define DRESD_BF16_H

/* bf16(value) for a register of floats, to nearest, ties to even (as torch's
 * .to(torch.bfloat16)); NaN stays a quiet NaN. The same integer steps on every tier, so the
 * same bits. */
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
static inline uint16x4_t round_to_bf16(float32x4_t value) {  /* 4 floats */
    uint32x4_t bits = vreinterpretq_u32_f32(value);
    uint32x4_t odd = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
    uint32x4_t rounded = vaddq_u32(bits, vaddq_u32(odd, vdupq_n_u32(0x7fff)));
    uint32x4_t number = vceqq_f32(value, value);  /* all ones where not NaN */
    rounded = vbslq_u32(number, rounded, vorrq_u32(bits, vdupq_n_u32(0x400000)));
    return vshrn_n_u32(rounded, 16);
}
#elif defined(__AVX512F__)
#include <immintrin.h>
static inline __m256i round_to_bf16(__m512 value) {  /* 16 floats */
    __m512i bits = _mm512_castps_si512(value);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}
#else
#include <immintrin.h>
static inline __m128i round_to_bf16(__m256 value) {  /* 8 floats */
    __m256i bits = _mm256_castps_si256(value);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(value, value, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x400000)),
                                 nan);
    __m256i top = _mm256_srli_epi32(rounded, 16);  /* 0..65535: packing it saturates nothing */
    return _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
}
#endif

#endif
