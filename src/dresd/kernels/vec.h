/* One register of float32 (or int32) lanes, per kernel tier, for linear.c and quant.c: the
 * tier's compiler flags (dresd/kernels/__init__.py, TIERS) pick the width.
 *   AVX-512 (avx512bf16, avx512vnni): 16 lanes;  AVX2 (avx2vnni, avx2): 8 lanes;
 *   NEON (neon, neoni8mm; aarch64): 4 lanes, a panel four registers.
 * Each helper does per lane what its AVX-512 instruction does, so a kernel written with them
 * computes every output with the same float operations on both widths; only the reductions
 * across lanes (vf_reduce_max, vi_reduce_add) differ in order, and those are exact.
 * The kernels' packed layouts keep 16 lanes a panel; on AVX2 a panel is two registers
 * ("slices"), the second reading bytes 32..63 of each 64-byte row of the panel; on NEON four,
 * slice h reading bytes 16h..16h + 15. */
#ifndef DRESD_VEC_H
#define DRESD_VEC_H

#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if defined(__aarch64__) && defined(__ARM_NEON)
/* NEON (the neon tier: armv8.2-a+dotprod; neoni8mm: + i8mm). Every helper is the lane-wise
 * IEEE operation its x86 counterpart is: vfmaq_f32 the fused multiply-add (vfmadd), vcvtnq
 * float -> int32 to nearest, ties to even (vcvtps2dq under the default MXCSR), int32 -> float
 * and float16 -> float as exact or as rounded as x86's; AArch64 Linux runs with FPCR's FZ off,
 * as x86 with DAZ/FTZ off. So quant.c and linear.c compute each output with the same float
 * operations in the same order, and give the x86 tiers' bits (linear.c: the avx2 tier's). */
#define VLANES 4
typedef float32x4_t vf;
typedef int32x4_t vi;
static inline vf vf_zero(void) { return vdupq_n_f32(0.0f); }
#define vf_set1 vdupq_n_f32
#define vf_loadu vld1q_f32
#define vf_add vaddq_f32
#define vf_mul vmulq_f32
static inline vf vf_fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }  /* a b + c, fused */
#define vf_max vmaxq_f32
#define vf_abs vabsq_f32
#define vf_reduce_max vmaxvq_f32      /* exact in any order */
#define vf_from_i32 vcvtq_f32_s32
#define vf_to_i32 vcvtnq_s32_f32      /* to nearest, ties to even */
#define vf_negate vnegq_f32           /* the sign bit flipped (0 -> -0) */
#define vf_from_bits vreinterpretq_f32_s32
static inline vi vi_zero(void) { return vdupq_n_s32(0); }
static inline vi vi_set1_8(int value) { return vreinterpretq_s32_s8(vdupq_n_s8((int8_t)value)); }
#define vi_set1_32 vdupq_n_s32
#define vi_and vandq_s32
#define vi_or vorrq_s32
#define vi_add32 vaddq_s32
/* Shifts by a count in a register (vshlq: a negative count shifts right, logically for
 * unsigned lanes): the counts here are constants, which GCC turns into immediate shifts. */
static inline vi vi_srli16(vi v, int n) {
    return vreinterpretq_s32_u16(vshlq_u16(vreinterpretq_u16_s32(v), vdupq_n_s16((int16_t)-n)));
}
static inline vi vi_slli16(vi v, int n) {
    return vreinterpretq_s32_u16(vshlq_u16(vreinterpretq_u16_s32(v), vdupq_n_s16((int16_t)n)));
}
static inline vi vi_slli32(vi v, int n) {
    return vreinterpretq_s32_u32(vshlq_u32(vreinterpretq_u32_s32(v), vdupq_n_s32(n)));
}
#define vi_reduce_add vaddvq_s32      /* exact in any order */
static inline vi vi_load(const void *from) {
    return vreinterpretq_s32_u8(vld1q_u8((const uint8_t *)from));
}
/* VLANES float16 / unsigned or signed bytes / bf16 -> float32 (exact) */
static inline vf vf_load_f16(const void *from) {
    return vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8((const uint8_t *)from)));
}
static inline vf vf_load_u8(const uint8_t *from, int is_signed) {
    uint32_t four;
    memcpy(&four, from, sizeof four);  /* the four bytes only */
    uint8x8_t raw = vcreate_u8((uint64_t)four);
    if (is_signed)
        return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u8(raw)))));
    return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(raw))));
}
/* VLANES E8M0 bytes e -> 2^(e - 128), half the E8M0 value (ggml's ggml_e8m0_to_fp32_half),
 * as 2^(e - 126), the float32 whose bits are (e + 1) << 23, times 2^-2: exact for e <= 253,
 * the subnormals 2^-128 and 2^-127 of e = 0, 1 included (a power of two times 2^-2 is exact
 * down to 2^-149). e = 254 gives inf and 255 -0 (ggml: 2^126, 2^127): quant.c's products
 * overflow from e = 239 in any case (its header). */
static inline vf vf_load_e8m0_half(const uint8_t *from) {
    uint32_t four;
    memcpy(&four, from, sizeof four);
    uint32x4_t e = vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8((uint64_t)four))));
    uint32x4_t bits = vshlq_n_u32(vaddq_u32(e, vdupq_n_u32(1)), 23);
    return vmulq_f32(vreinterpretq_f32_u32(bits), vdupq_n_f32(0.25f));
}
/* a 16-byte table in every 16 bytes of a register, and each byte's entry (index 0..15) */
static inline vi vi_table16(const uint8_t table[16]) {
    return vreinterpretq_s32_u8(vld1q_u8(table));
}
static inline vi vi_lookup16(vi table, vi index) {
    return vreinterpretq_s32_u8(vqtbl1q_u8(vreinterpretq_u8_s32(table),
                                           vreinterpretq_u8_s32(index)));
}
static inline vf vf_load_bf16(const uint16_t *from) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(from), 16));
}
static inline vf vf_load_part(const float *from, int count) {
    float lanes[VLANES] = {0};
    memcpy(lanes, from, sizeof(float) * (count < VLANES ? count : VLANES));
    return vld1q_f32(lanes);
}
static inline void vf_store_part(float *to, vf value, int count) {
    float lanes[VLANES];
    vst1q_f32(lanes, value);
    memcpy(to, lanes, sizeof(float) * (count < VLANES ? count : VLANES));
}
static inline void bf16_store_part(uint16_t *to, vf value, int count) {
    uint16_t lanes[VLANES];
    vst1_u16(lanes, round_to_bf16(value));
    memcpy(to, lanes, sizeof(uint16_t) * (count < VLANES ? count : VLANES));
}
/* the four int8 of each lane's 32 bits, saturated (the values here always fit) */
static inline void vi_store_i8(int8_t *to, vi value) {
    int16x4_t words = vqmovn_s32(value);
    int8x8_t bytes = vqmovn_s16(vcombine_s16(words, words));
    memcpy(to, &bytes, VLANES);
}
#ifdef __ARM_FEATURE_MATMUL_INT8
/* usdot (i8mm): unsigned bytes of w times signed bytes of x, exact for every byte */
#define VDOT_ANY_BYTES 1
static inline vi vi_dot4(vi acc, vi w, vi x) {
    return vusdotq_s32(acc, vreinterpretq_u8_s32(w), vreinterpretq_s8_s32(x));
}
#else
/* sdot (dotprod) multiplies signed bytes: exact while each byte of w is at most 127, which
 * quant.c keeps (VDOT_ANY_BYTES 0: it splits Q8_0's full bytes, q + 128, into nibbles). */
#define VDOT_ANY_BYTES 0
static inline vi vi_dot4(vi acc, vi w, vi x) {
    return vdotq_s32(acc, vreinterpretq_s8_s32(w), vreinterpretq_s8_s32(x));
}
#endif

#elif defined(__AVX512F__)
#include <immintrin.h>
#define VLANES 16
typedef __m512 vf;
typedef __m512i vi;
#define vf_zero _mm512_setzero_ps
#define vf_set1 _mm512_set1_ps
#define vf_loadu _mm512_loadu_ps
#define vf_add _mm512_add_ps
#define vf_mul _mm512_mul_ps
#define vf_fma _mm512_fmadd_ps
#define vf_max _mm512_max_ps
#define vf_abs _mm512_abs_ps
#define vf_reduce_max _mm512_reduce_max_ps
#define vf_from_i32 _mm512_cvtepi32_ps
#define vf_to_i32 _mm512_cvtps_epi32      /* to nearest, ties to even */
#define vi_zero _mm512_setzero_si512
#define vi_set1_8 _mm512_set1_epi8
#define vi_set1_32 _mm512_set1_epi32
#define vi_and _mm512_and_si512
#define vi_or _mm512_or_si512
#define vi_add32 _mm512_add_epi32
#define vi_srli16 _mm512_srli_epi16
#define vi_slli16 _mm512_slli_epi16
#define vi_slli32 _mm512_slli_epi32
#define vi_reduce_add _mm512_reduce_add_epi32
#define vf_from_bits _mm512_castsi512_ps
static inline vf vf_negate(vf v) {  /* the sign bit flipped (0 -> -0, as -x) */
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v),
                                                _mm512_set1_epi32((int)0x80000000)));
}
static inline vi vi_load(const void *from) { return _mm512_loadu_si512(from); }
/* VLANES float16 / unsigned or signed bytes -> float32 (exact) */
static inline vf vf_load_f16(const void *from) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)from));
}
static inline vf vf_load_u8(const uint8_t *from, int is_signed) {
    __m128i raw = _mm_loadu_si128((const __m128i *)from);
    return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw));
}
/* VLANES E8M0 bytes e -> 2^(e - 128), exact for e <= 253 (as the NEON helper's comment says) */
static inline vf vf_load_e8m0_half(const uint8_t *from) {
    __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)from));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(1)), 23);
    return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0.25f));
}
/* a 16-byte table in every 16 bytes of a register, and each byte's entry (index 0..15) */
static inline vi vi_table16(const uint8_t table[16]) {
    return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)table));
}
static inline vi vi_lookup16(vi table, vi index) { return _mm512_shuffle_epi8(table, index); }
static inline vf vf_load_bf16(const uint16_t *from) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)from)), 16));
}
static inline __mmask16 first_lanes(int count) {
    return count >= VLANES ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1);
}
/* the first `count` lanes (0 < count): the others 0, and not read */
static inline vf vf_load_part(const float *from, int count) {
    return _mm512_maskz_loadu_ps(first_lanes(count), from);
}
static inline void vf_store_part(float *to, vf value, int count) {
    _mm512_mask_storeu_ps(to, first_lanes(count), value);
}
static inline void bf16_store_part(uint16_t *to, vf value, int count) {
    __m256i rounded = round_to_bf16(value);
    if (count >= VLANES) _mm256_storeu_si256((__m256i *)to, rounded);
    else _mm256_mask_storeu_epi16(to, first_lanes(count), rounded);
}
/* the four int8 of each lane's 32 bits, saturated (the values here always fit) */
static inline void vi_store_i8(int8_t *to, vi value) {
    _mm_storeu_si128((__m128i *)to, _mm512_cvtsepi32_epi8(value));
}
/* acc + per lane the four products of w's unsigned bytes with x's signed bytes (exact) */
#define VDOT_ANY_BYTES 1  /* exact for every unsigned byte */
static inline vi vi_dot4(vi acc, vi w, vi x) { return _mm512_dpbusd_epi32(acc, w, x); }

#else /* AVX2, FMA, F16C */
#include <immintrin.h>
#define VLANES 8
typedef __m256 vf;
typedef __m256i vi;
#define vf_zero _mm256_setzero_ps
#define vf_set1 _mm256_set1_ps
#define vf_loadu _mm256_loadu_ps
#define vf_add _mm256_add_ps
#define vf_mul _mm256_mul_ps
#define vf_fma _mm256_fmadd_ps
#define vf_max _mm256_max_ps
#define vf_from_i32 _mm256_cvtepi32_ps
#define vf_to_i32 _mm256_cvtps_epi32
#define vi_zero _mm256_setzero_si256
#define vi_set1_8 _mm256_set1_epi8
#define vi_set1_32 _mm256_set1_epi32
#define vi_and _mm256_and_si256
#define vi_or _mm256_or_si256
#define vi_add32 _mm256_add_epi32
#define vi_srli16 _mm256_srli_epi16
#define vi_slli16 _mm256_slli_epi16
#define vi_slli32 _mm256_slli_epi32
#define vf_from_bits _mm256_castsi256_ps
static inline vf vf_negate(vf v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.0f)); }
static inline vi vi_load(const void *from) { return _mm256_loadu_si256((const __m256i *)from); }
static inline vf vf_abs(vf value) {
    return _mm256_and_ps(value, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
}
static inline float vf_reduce_max(vf value) {  /* exact in any order */
    __m128 four = _mm_max_ps(_mm256_castps256_ps128(value), _mm256_extractf128_ps(value, 1));
    four = _mm_max_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_max_ss(four, _mm_movehdup_ps(four)));
}
static inline int32_t vi_reduce_add(vi value) {  /* exact in any order */
    __m128i four = _mm_add_epi32(_mm256_castsi256_si128(value),
                                 _mm256_extracti128_si256(value, 1));
    four = _mm_add_epi32(four, _mm_shuffle_epi32(four, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(four, _mm_shuffle_epi32(four, 0xb1)));
}
static inline vf vf_load_f16(const void *from) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)from));
}
static inline vf vf_load_u8(const uint8_t *from, int is_signed) {
    __m128i raw = _mm_loadl_epi64((const __m128i *)from);
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw));
}
/* VLANES E8M0 bytes e -> 2^(e - 128), exact for e <= 253 (as the NEON helper's comment says) */
static inline vf vf_load_e8m0_half(const uint8_t *from) {
    __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)from));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(1)), 23);
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0.25f));
}
/* a 16-byte table in every 16 bytes of a register, and each byte's entry (index 0..15) */
static inline vi vi_table16(const uint8_t table[16]) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table));
}
static inline vi vi_lookup16(vi table, vi index) { return _mm256_shuffle_epi8(table, index); }
static inline vf vf_load_bf16(const uint16_t *from) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)from)), 16));
}
/* Partial loads and stores through a buffer: AVX2 has no masked 16-bit store, and this runs
 * once per output register of a whole row's sum. */
static inline vf vf_load_part(const float *from, int count) {
    float lanes[VLANES] = {0};
    memcpy(lanes, from, sizeof(float) * (count < VLANES ? count : VLANES));
    return _mm256_loadu_ps(lanes);
}
static inline void vf_store_part(float *to, vf value, int count) {
    float lanes[VLANES];
    _mm256_storeu_ps(lanes, value);
    memcpy(to, lanes, sizeof(float) * (count < VLANES ? count : VLANES));
}
static inline void bf16_store_part(uint16_t *to, vf value, int count) {
    uint16_t lanes[VLANES];
    _mm_storeu_si128((__m128i *)lanes, round_to_bf16(value));
    memcpy(to, lanes, sizeof(uint16_t) * (count < VLANES ? count : VLANES));
}
static inline void vi_store_i8(int8_t *to, vi value) {
    __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(value),
                                    _mm256_extracti128_si256(value, 1));
    _mm_storel_epi64((__m128i *)to, _mm_packs_epi16(words, words));
}
#ifdef __AVXVNNI__
#define VDOT_ANY_BYTES 1
static inline vi vi_dot4(vi acc, vi w, vi x) { return _mm256_dpbusd_avx_epi32(acc, w, x); }
#else
/* vpmaddubsw adds pairs of products into 16 bits with saturation: exact while each byte of
 * w is at most 128 (2 x 128 x 127 < 2^15), which quant.c keeps (VDOT_ANY_BYTES 0: it splits
 * a layout of full bytes into nibbles). */
#define VDOT_ANY_BYTES 0
static inline vi vi_dot4(vi acc, vi w, vi x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x),
                                                   _mm256_set1_epi16(1)));
}
/* acc + vi_dot4(w[r], x[r]) for r = 0..3, every byte of w at most 31 (nibbles, or quant.c's
 * five bits): the four vpmaddubsw summed in 16 bits (|sum| <= 4 x 2 x 31 x 128 < 2^15: exact;
 * Q6_K's 63 could overflow), then widened once. The same integer as four vi_dot4, in 8
 * instructions instead of 12. */
#define VDOT_NIBBLES4 1
static inline vi vi_dot4_nibbles4(vi acc, const vi w[4], const vi x[4]) {
    __m256i sum = _mm256_add_epi16(
        _mm256_add_epi16(_mm256_maddubs_epi16(w[0], x[0]), _mm256_maddubs_epi16(w[1], x[1])),
        _mm256_add_epi16(_mm256_maddubs_epi16(w[2], x[2]), _mm256_maddubs_epi16(w[3], x[3])));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(sum, _mm256_set1_epi16(1)));
}
#endif
#endif

#endif
