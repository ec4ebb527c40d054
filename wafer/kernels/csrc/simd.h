// The small SIMD layer that wafer's CPU kernels are written against: 16 lanes of float (F), of int32
// (I), and 64 bytes of weight codes (W: 4 consecutive inputs of 16 output channels), with the few
// operations the kernels need. The instruction set is the compiler's target: the same kernel source
// is compiled once per variant (kernels.py passes the flags), and each variant maps the 16 lanes onto
// what it has:
//   avx512-vnni: one 512-bit register; integer dot products with VPDPBUSD
//   avx2-vnni:   two 256-bit registers; VPDPBUSD on 256 bits (AVX-VNNI, Alder Lake, Zen 4 and later)
//   avx2:        two 256-bit registers; VPMADDUBSW + VPMADDWD, as llama.cpp does on AVX2
//   neon-i8mm:   four 128-bit registers; USDOT (unsigned codes times signed activations)
//   neon-dotprod: four 128-bit registers; SDOT on codes made signed
//   portable:    arrays of 16 and plain loops, for any C++17 compiler (the floor, never the Python path)
// A lane of F or I is an output channel wherever the kernels use them for matrix products, so no
// variant needs horizontal sums there. Integer dot products are exact in every variant.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define WAFER_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define WAFER_AVX2 1
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define WAFER_NEON 1
#include <arm_neon.h>
#else
#define WAFER_PORTABLE 1
#endif

namespace simd {

#if defined(WAFER_AVX512)
constexpr const char* kVariant = "avx512-vnni";
#elif defined(WAFER_AVX2) && defined(__AVXVNNI__)
constexpr const char* kVariant = "avx2-vnni";
#elif defined(WAFER_AVX2)
constexpr const char* kVariant = "avx2";
#elif defined(WAFER_NEON) && defined(__ARM_FEATURE_MATMUL_INT8)
constexpr const char* kVariant = "neon-i8mm";
#elif defined(WAFER_NEON)
constexpr const char* kVariant = "neon-dotprod";
#else
constexpr const char* kVariant = "portable";
#endif

// Half-precision bits to float, for the portable variant (the others convert in hardware).
inline float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: normalise
        int e = -1;
        do { ++e; man <<= 1; } while (!(man & 0x400));
        bits = sign | static_cast<uint32_t>(112 - e) << 23 | ((man & 0x3FF) << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// bfloat16 bits to float: the top half of a float32.
inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// =====================================================================================================
#if defined(WAFER_AVX512)

struct F { __m512 v; };
constexpr int kRegisters = 32;  // F values the register file holds
struct I { __m512i v; };
struct W { __m512i v; };
struct Mask { __mmask16 k; };

inline __mmask16 first_n(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

inline F zero() { return {_mm512_setzero_ps()}; }
inline F set1(float a) { return {_mm512_set1_ps(a)}; }
inline F load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline F load_n(const float* p, int64_t n, float fill = 0.0f) { return {_mm512_mask_loadu_ps(_mm512_set1_ps(fill), first_n(n), p)}; }
inline void store(float* p, F a) { _mm512_storeu_ps(p, a.v); }
inline void store_n(float* p, F a, int64_t n) { _mm512_mask_storeu_ps(p, first_n(n), a.v); }
inline F load_half(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
// 16 int8 codes (the KV cache's int8 rows), and 16 bfloat16 values, as floats.
inline F load_i8(const int8_t* p) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))}; }
inline F load_bf16(const uint16_t* p) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16))};
}
inline F operator+(F a, F b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F operator-(F a, F b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F operator*(F a, F b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F operator/(F a, F b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F fma(F a, F b, F c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }   // a b + c
inline F fnma(F a, F b, F c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; } // c - a b
inline F max(F a, F b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F min(F a, F b) { return {_mm512_min_ps(a.v, b.v)}; }
inline F abs(F a) { return {_mm512_abs_ps(a.v)}; }
inline F keep_n(F a, int64_t n) { return {_mm512_maskz_mov_ps(first_n(n), a.v)}; }
inline float sum(F a) { return _mm512_reduce_add_ps(a.v); }
// Lane k: the sum of v[k]'s lanes, for 16 vectors at once (a transposed reduction: 45 operations
// where 16 horizontal sums take about 130). Every lane's sum is added up in the same order.
inline F sums16(const F* v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)  // 256-bit halves of two vectors: [v2i's 8 partials | v2i+1's]
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i].v, v[2 * i + 1].v, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * i].v, v[2 * i + 1].v, _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; ++i)  // quarter j: vector 4i+j's 4 partials
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; ++i)  // quarter j: 2 partials of vectors 8i+j and 8i+4+j
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // Lane 4j+t: vector 4t+j; permuted into place.
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return {_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r)};
}
inline float hmax(F a) { return _mm512_reduce_max_ps(a.v); }
inline F round_even(F a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline F scale2(F y, F n) { return {_mm512_scalef_ps(y.v, n.v)}; }  // y 2^n, n integral
inline I to_int(F a) { return {_mm512_cvtps_epi32(a.v)}; }  // round to nearest even
inline F to_float(I a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline I operator+(I a, I b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline I iset1(int32_t a) { return {_mm512_set1_epi32(a)}; }
inline I iota(int32_t a) { return {_mm512_add_epi32(_mm512_set1_epi32(a), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))}; }
inline int32_t isum(I a) { return _mm512_reduce_add_epi32(a.v); }
inline void istore(int32_t* p, I a) { _mm512_storeu_si512(p, a.v); }
inline Mask gt(F a, F b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ)}; }
inline Mask is_nan(F a) { return {_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q)}; }
inline bool any(Mask m) { return m.k != 0; }
inline F select(Mask m, F a, F b) { return {_mm512_mask_mov_ps(b.v, m.k, a.v)}; }
inline I select(Mask m, I a, I b) { return {_mm512_mask_mov_epi32(b.v, m.k, a.v)}; }
// int32 lanes to int8, saturating
inline void store_i8(int8_t* p, I a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(a.v)); }

inline W wload(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline W low_nibbles(W a) { return {_mm512_and_si512(a.v, _mm512_set1_epi8(0x0F))}; }
inline W high_nibbles(W a) { return {_mm512_and_si512(_mm512_srli_epi16(a.v, 4), _mm512_set1_epi8(0x0F))}; }

// Lane c: sum over j < 8, t < 4 of w[j] byte (c, t) times x byte (j, t): one block of 32 inputs.
// Codes are unsigned, below 2^CODE_BITS (4, 5 or 8), which some variants exploit. xsum, the block's
// sum of x codes, is for variants that work on codes made signed.
template <int CODE_BITS>
inline I dot_block(const W* w, const int32_t* xq, int32_t /*xsum*/) {
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    for (int j = 0; j < 8; j += 2) {  // two chains, for the latency of VNNI
        s0 = _mm512_dpbusd_epi32(s0, w[j].v, _mm512_set1_epi32(xq[j]));
        s1 = _mm512_dpbusd_epi32(s1, w[j + 1].v, _mm512_set1_epi32(xq[j + 1]));
    }
    return {_mm512_add_epi32(s0, s1)};
}

// Codes above 4 bits: lo's low nibbles with hi shifted so that its bit S lands on bit 4, masked
// (MASK 0x30: bits S, S + 1 for 6-bit codes; 0x10: bit S for 5-bit ones).
template <int S, int MASK>
inline W top_bits(W lo, W hi) {
    __m512i h;
    if constexpr (S <= 4) h = _mm512_slli_epi16(hi.v, 4 - S);
    else h = _mm512_srli_epi16(hi.v, S - 4);
    return {_mm512_or_si512(lo.v, _mm512_and_si512(h, _mm512_set1_epi8(MASK)))};
}
// 16 int8 scales, one a channel, in the form dot_block6 takes them.
inline I scales16(const int8_t* p) { return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
// Lane c: s0[c] times the dot of w[0..4) (inputs 0..15) plus s1[c] times that of w[4..8) (16..31),
// for codes below 64: a block of 32 whose two halves have scales of their own.
inline I dot_block6(const W* w, const int32_t* xq, I s0, I s1) {
    __m512i a = _mm512_setzero_si512(), b = a;
    for (int j = 0; j < 4; ++j) {
        a = _mm512_dpbusd_epi32(a, w[j].v, _mm512_set1_epi32(xq[j]));
        b = _mm512_dpbusd_epi32(b, w[j + 4].v, _mm512_set1_epi32(xq[j + 4]));
    }
    return {_mm512_add_epi32(_mm512_mullo_epi32(a, s0.v), _mm512_mullo_epi32(b, s1.v))};
}

// =====================================================================================================
#elif defined(WAFER_AVX2)

struct F { __m256 a, b; };
constexpr int kRegisters = 8;
struct I { __m256i a, b; };
struct W { __m256i a, b; };
struct Mask { __m256 a, b; };

inline __m256i first_n_i(int64_t n, int offset) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n > 16 ? 16 : n) - offset), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline F zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline F load_n(const float* p, int64_t n, float fill = 0.0f) {
    const __m256i ka = first_n_i(n, 0), kb = first_n_i(n, 8);
    const __m256 f = _mm256_set1_ps(fill);
    return {_mm256_blendv_ps(f, _mm256_maskload_ps(p, ka), _mm256_castsi256_ps(ka)),
            _mm256_blendv_ps(f, _mm256_maskload_ps(p + 8, kb), _mm256_castsi256_ps(kb))};
}
inline void store(float* p, F x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
inline void store_n(float* p, F x, int64_t n) {
    _mm256_maskstore_ps(p, first_n_i(n, 0), x.a);
    _mm256_maskstore_ps(p + 8, first_n_i(n, 8), x.b);
}
inline F load_half(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline F load_i8(const int8_t* p) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))};
}
inline F load_bf16(const uint16_t* p) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16)),
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16))};
}
inline F operator+(F x, F y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline F operator-(F x, F y) { return {_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
inline F operator*(F x, F y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline F operator/(F x, F y) { return {_mm256_div_ps(x.a, y.a), _mm256_div_ps(x.b, y.b)}; }
inline F fma(F x, F y, F z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline F fnma(F x, F y, F z) { return {_mm256_fnmadd_ps(x.a, y.a, z.a), _mm256_fnmadd_ps(x.b, y.b, z.b)}; }
inline F max(F x, F y) { return {_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)}; }
inline F min(F x, F y) { return {_mm256_min_ps(x.a, y.a), _mm256_min_ps(x.b, y.b)}; }
inline F abs(F x) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return {_mm256_and_ps(x.a, m), _mm256_and_ps(x.b, m)};
}
inline F keep_n(F x, int64_t n) {
    return {_mm256_and_ps(x.a, _mm256_castsi256_ps(first_n_i(n, 0))), _mm256_and_ps(x.b, _mm256_castsi256_ps(first_n_i(n, 8)))};
}
inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
inline float sum(F x) { return sum8(_mm256_add_ps(x.a, x.b)); }
// Lane k of 8: the sum of t[k]'s lanes (a transposed reduction, the same order for every lane).
inline __m256 sums8(const __m256* t) {
    __m256 u[4], w[2];
    for (int i = 0; i < 4; ++i)  // per 128-bit half: [t2i: 0+2, t2i+1: 0+2, t2i: 1+3, t2i+1: 1+3]
        u[i] = _mm256_add_ps(_mm256_unpacklo_ps(t[2 * i], t[2 * i + 1]), _mm256_unpackhi_ps(t[2 * i], t[2 * i + 1]));
    for (int i = 0; i < 2; ++i)  // per half: vectors 4i..4i+3, each (0+2)+(1+3)
        w[i] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_permute2f128_ps(w[0], w[1], 0x20), _mm256_permute2f128_ps(w[0], w[1], 0x31));
}
// Lane k: the sum of v[k]'s lanes, for 16 vectors at once.
inline F sums16(const F* v) {
    __m256 t[16];
    for (int k = 0; k < 16; ++k) t[k] = _mm256_add_ps(v[k].a, v[k].b);
    return {sums8(t), sums8(t + 8)};
}
inline float hmax(F x) {
    __m256 v = _mm256_max_ps(x.a, x.b);
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
inline F round_even(F x) {
    return {_mm256_round_ps(x.a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
            _mm256_round_ps(x.b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// y 2^n for integral n in [-254, 254], as two exact power-of-two factors (each a normal float).
inline __m256 pow2(__m256i k) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23)); }
inline __m256 scale2_8(__m256 y, __m256 n) {
    const __m256i k = _mm256_cvtps_epi32(n), k1 = _mm256_srai_epi32(k, 1), k2 = _mm256_sub_epi32(k, k1);
    return _mm256_mul_ps(_mm256_mul_ps(y, pow2(k1)), pow2(k2));
}
inline F scale2(F y, F n) { return {scale2_8(y.a, n.a), scale2_8(y.b, n.b)}; }
inline I to_int(F x) { return {_mm256_cvtps_epi32(x.a), _mm256_cvtps_epi32(x.b)}; }
inline F to_float(I x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
inline I operator+(I x, I y) { return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
inline I iset1(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
inline I iota(int32_t x) {
    const __m256i s = _mm256_set1_epi32(x);
    return {_mm256_add_epi32(s, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
            _mm256_add_epi32(s, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15))};
}
inline int32_t isum(I x) {
    __m256i v = _mm256_add_epi32(x.a, x.b);
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}
inline void istore(int32_t* p, I x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x.a);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 8), x.b);
}
inline Mask gt(F x, F y) { return {_mm256_cmp_ps(x.a, y.a, _CMP_GT_OQ), _mm256_cmp_ps(x.b, y.b, _CMP_GT_OQ)}; }
inline Mask is_nan(F x) { return {_mm256_cmp_ps(x.a, x.a, _CMP_UNORD_Q), _mm256_cmp_ps(x.b, x.b, _CMP_UNORD_Q)}; }
inline bool any(Mask m) { return _mm256_movemask_ps(_mm256_or_ps(m.a, m.b)) != 0; }
inline F select(Mask m, F x, F y) { return {_mm256_blendv_ps(y.a, x.a, m.a), _mm256_blendv_ps(y.b, x.b, m.b)}; }
inline I select(Mask m, I x, I y) {
    return {_mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(y.a), _mm256_castsi256_ps(x.a), m.a)),
            _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(y.b), _mm256_castsi256_ps(x.b), m.b))};
}
inline void store_i8(int8_t* p, I x) {
    // packs interleave 128-bit lanes: 32->16 gives (a0 b0 a1 b1), 16->8 then needs a lane permute
    const __m256i w16 = _mm256_packs_epi32(x.a, x.b);           // a0..3 b0..3 a4..7 b4..7
    const __m256i w8 = _mm256_packs_epi16(w16, w16);            // same, as bytes, twice per lane
    const __m256i ord = _mm256_permutevar8x32_epi32(w8, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(ord));
}

inline W wload(const uint8_t* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline W low_nibbles(W x) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    return {_mm256_and_si256(x.a, m), _mm256_and_si256(x.b, m)};
}
inline W high_nibbles(W x) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    return {_mm256_and_si256(_mm256_srli_epi16(x.a, 4), m), _mm256_and_si256(_mm256_srli_epi16(x.b, 4), m)};
}

template <int CODE_BITS>
inline I dot_block(const W* w, const int32_t* xq, int32_t xsum) {
#if defined(__AVXVNNI__)
    (void)xsum;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, b0 = a0, b1 = a0;
    for (int j = 0; j < 8; j += 2) {
        const __m256i x0 = _mm256_set1_epi32(xq[j]), x1 = _mm256_set1_epi32(xq[j + 1]);
        a0 = _mm256_dpbusd_avx_epi32(a0, w[j].a, x0);
        b0 = _mm256_dpbusd_avx_epi32(b0, w[j].b, x0);
        a1 = _mm256_dpbusd_avx_epi32(a1, w[j + 1].a, x1);
        b1 = _mm256_dpbusd_avx_epi32(b1, w[j + 1].b, x1);
    }
    return {_mm256_add_epi32(a0, a1), _mm256_add_epi32(b0, b1)};
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (CODE_BITS == 4) {
        // Codes below 16 against |x| <= 128: a pair is at most 3840 and eight of them 30720, so the
        // block's pairs add up in int16 and widen once.
        __m256i sa = _mm256_setzero_si256(), sb = sa;
        for (int j = 0; j < 8; ++j) {
            const __m256i x = _mm256_set1_epi32(xq[j]);
            sa = _mm256_add_epi16(sa, _mm256_maddubs_epi16(w[j].a, x));
            sb = _mm256_add_epi16(sb, _mm256_maddubs_epi16(w[j].b, x));
        }
        return {_mm256_madd_epi16(sa, ones), _mm256_madd_epi16(sb, ones)};
    } else if constexpr (CODE_BITS == 5) {
        // Below 32: a pair is at most 7936, so four inputs' pairs add up in int16 before each widening.
        __m256i ra = _mm256_setzero_si256(), rb = ra;
        for (int h = 0; h < 8; h += 4) {
            __m256i sa = _mm256_setzero_si256(), sb = sa;
            for (int j = h; j < h + 4; ++j) {
                const __m256i x = _mm256_set1_epi32(xq[j]);
                sa = _mm256_add_epi16(sa, _mm256_maddubs_epi16(w[j].a, x));
                sb = _mm256_add_epi16(sb, _mm256_maddubs_epi16(w[j].b, x));
            }
            ra = _mm256_add_epi32(ra, _mm256_madd_epi16(sa, ones));
            rb = _mm256_add_epi32(rb, _mm256_madd_epi16(sb, ones));
        }
        return {ra, rb};
    } else if constexpr (CODE_BITS == 6) {
        // Below 64: a pair is at most 16128, so two inputs' pairs add up in int16 before each widening.
        __m256i ra = _mm256_setzero_si256(), rb = ra;
        for (int j = 0; j < 8; j += 2) {
            const __m256i x0 = _mm256_set1_epi32(xq[j]), x1 = _mm256_set1_epi32(xq[j + 1]);
            const __m256i pa = _mm256_add_epi16(_mm256_maddubs_epi16(w[j].a, x0), _mm256_maddubs_epi16(w[j + 1].a, x1));
            const __m256i pb = _mm256_add_epi16(_mm256_maddubs_epi16(w[j].b, x0), _mm256_maddubs_epi16(w[j + 1].b, x1));
            ra = _mm256_add_epi32(ra, _mm256_madd_epi16(pa, ones));
            rb = _mm256_add_epi32(rb, _mm256_madd_epi16(pb, ones));
        }
        return {ra, rb};
    } else {
        // Codes up to 255 would saturate VPMADDUBSW's pairs: make them signed (code - 128), take
        // their magnitude (up to 128) as the unsigned operand and move their sign onto x (|x| <= 127),
        // and add back 128 times x's block sum.
        const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
        __m256i sa = _mm256_set1_epi32(128 * xsum), sb = sa;
        for (int j = 0; j < 8; ++j) {
            const __m256i x = _mm256_set1_epi32(xq[j]);
            const __m256i qa = _mm256_xor_si256(w[j].a, flip), qb = _mm256_xor_si256(w[j].b, flip);
            const __m256i pa = _mm256_maddubs_epi16(_mm256_abs_epi8(qa), _mm256_sign_epi8(x, qa));
            const __m256i pb = _mm256_maddubs_epi16(_mm256_abs_epi8(qb), _mm256_sign_epi8(x, qb));
            sa = _mm256_add_epi32(sa, _mm256_madd_epi16(pa, ones));
            sb = _mm256_add_epi32(sb, _mm256_madd_epi16(pb, ones));
        }
        return {sa, sb};
    }
#endif
}

template <int S, int MASK>
inline W top_bits(W lo, W hi) {
    const __m256i m = _mm256_set1_epi8(MASK);
    __m256i ha, hb;
    if constexpr (S <= 4) ha = _mm256_slli_epi16(hi.a, 4 - S), hb = _mm256_slli_epi16(hi.b, 4 - S);
    else ha = _mm256_srli_epi16(hi.a, S - 4), hb = _mm256_srli_epi16(hi.b, S - 4);
    return {_mm256_or_si256(lo.a, _mm256_and_si256(ha, m)), _mm256_or_si256(lo.b, _mm256_and_si256(hb, m))};
}
#if defined(__AVXVNNI__)
inline I scales16(const int8_t* p) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))};
}
inline I dot_block6(const W* w, const int32_t* xq, I s0, I s1) {
    __m256i a0 = _mm256_setzero_si256(), b0 = a0, a1 = a0, b1 = a0;
    for (int j = 0; j < 4; ++j) {
        const __m256i x0 = _mm256_set1_epi32(xq[j]), x1 = _mm256_set1_epi32(xq[j + 4]);
        a0 = _mm256_dpbusd_avx_epi32(a0, w[j].a, x0);
        b0 = _mm256_dpbusd_avx_epi32(b0, w[j].b, x0);
        a1 = _mm256_dpbusd_avx_epi32(a1, w[j + 4].a, x1);
        b1 = _mm256_dpbusd_avx_epi32(b1, w[j + 4].b, x1);
    }
    return {_mm256_add_epi32(_mm256_mullo_epi32(a0, s0.a), _mm256_mullo_epi32(a1, s1.a)),
            _mm256_add_epi32(_mm256_mullo_epi32(b0, s0.b), _mm256_mullo_epi32(b1, s1.b))};
}
#else
// Each channel's scale twice as int16 in its 32-bit lane: VPMADDWD then sums a channel's two
// partial sums and applies its scale in one instruction.
inline I scales16(const int8_t* p) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i low16 = _mm256_set1_epi32(0xFFFF);
    const __m256i a = _mm256_cvtepi8_epi32(v), b = _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8));
    return {_mm256_or_si256(_mm256_and_si256(a, low16), _mm256_slli_epi32(a, 16)),
            _mm256_or_si256(_mm256_and_si256(b, low16), _mm256_slli_epi32(b, 16))};
}
inline I dot_block6(const W* w, const int32_t* xq, I s0, I s1) {
    // Codes below 64 against |x| <= 128: a VPMADDUBSW pair is at most 16128, two of them 32256, so
    // two inputs' pairs add in int16 before each widening.
    __m256i ra = _mm256_setzero_si256(), rb = ra;
    for (int j = 0; j < 8; j += 2) {
        const __m256i x0 = _mm256_set1_epi32(xq[j]), x1 = _mm256_set1_epi32(xq[j + 1]);
        const __m256i pa = _mm256_add_epi16(_mm256_maddubs_epi16(w[j].a, x0), _mm256_maddubs_epi16(w[j + 1].a, x1));
        const __m256i pb = _mm256_add_epi16(_mm256_maddubs_epi16(w[j].b, x0), _mm256_maddubs_epi16(w[j + 1].b, x1));
        const I& s = j < 4 ? s0 : s1;
        ra = _mm256_add_epi32(ra, _mm256_madd_epi16(pa, s.a));
        rb = _mm256_add_epi32(rb, _mm256_madd_epi16(pb, s.b));
    }
    return {ra, rb};
}
#endif

// =====================================================================================================
#elif defined(WAFER_NEON)

struct F { float32x4_t v[4]; };
constexpr int kRegisters = 8;
struct I { int32x4_t v[4]; };
struct W { uint8x16_t v[4]; };
struct Mask { uint32x4_t v[4]; };

inline uint32x4_t first_n_q(int64_t n, int offset) {
    const int32_t lanes[4] = {0, 1, 2, 3};
    return vcltq_s32(vld1q_s32(lanes), vdupq_n_s32(static_cast<int32_t>(n > 16 ? 16 : n) - offset));
}
#define WAFER_EACH(expr) { for (int i = 0; i < 4; ++i) r.v[i] = (expr); } return r
inline F zero() { F r; WAFER_EACH(vdupq_n_f32(0.0f)); }
inline F set1(float x) { F r; WAFER_EACH(vdupq_n_f32(x)); }
inline F load(const float* p) { F r; WAFER_EACH(vld1q_f32(p + 4 * i)); }
inline F load_n(const float* p, int64_t n, float fill = 0.0f) {
    if (n >= 16) return load(p);
    float buf[16];
    for (int i = 0; i < 16; ++i) buf[i] = i < n ? p[i] : fill;
    return load(buf);
}
inline void store(float* p, F x) { for (int i = 0; i < 4; ++i) vst1q_f32(p + 4 * i, x.v[i]); }
inline void store_n(float* p, F x, int64_t n) {
    if (n >= 16) return store(p, x);
    float buf[16];
    store(buf, x);
    for (int64_t i = 0; i < n; ++i) p[i] = buf[i];
}
inline F load_half(const uint16_t* p) { F r; WAFER_EACH(vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * i)))); }
inline F load_i8(const int8_t* p) {
    const int8x16_t v = vld1q_s8(p);
    const int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_s8(vget_high_s8(v));
    F r;
    r.v[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
    r.v[1] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo)));
    r.v[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
    r.v[3] = vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)));
    return r;
}
inline F load_bf16(const uint16_t* p) { F r; WAFER_EACH(vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p + 4 * i), 16))); }
inline F operator+(F x, F y) { F r; WAFER_EACH(vaddq_f32(x.v[i], y.v[i])); }
inline F operator-(F x, F y) { F r; WAFER_EACH(vsubq_f32(x.v[i], y.v[i])); }
inline F operator*(F x, F y) { F r; WAFER_EACH(vmulq_f32(x.v[i], y.v[i])); }
inline F operator/(F x, F y) { F r; WAFER_EACH(vdivq_f32(x.v[i], y.v[i])); }
inline F fma(F x, F y, F z) { F r; WAFER_EACH(vfmaq_f32(z.v[i], x.v[i], y.v[i])); }
inline F fnma(F x, F y, F z) { F r; WAFER_EACH(vfmsq_f32(z.v[i], x.v[i], y.v[i])); }
inline F max(F x, F y) { F r; WAFER_EACH(vmaxq_f32(x.v[i], y.v[i])); }
inline F min(F x, F y) { F r; WAFER_EACH(vminq_f32(x.v[i], y.v[i])); }
inline F abs(F x) { F r; WAFER_EACH(vabsq_f32(x.v[i])); }
inline F keep_n(F x, int64_t n) { F r; WAFER_EACH(vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(x.v[i]), first_n_q(n, 4 * i)))); }
inline float sum(F x) { return vaddvq_f32(vaddq_f32(vaddq_f32(x.v[0], x.v[1]), vaddq_f32(x.v[2], x.v[3]))); }
// Lane k: the sum of v[k]'s lanes, for 16 vectors at once (pairwise adds, the same order for every lane).
inline F sums16(const F* v) {
    F r;
    for (int i = 0; i < 4; ++i) {
        float32x4_t t[4];
        for (int k = 0; k < 4; ++k) {
            const F& x = v[4 * i + k];
            t[k] = vaddq_f32(vaddq_f32(x.v[0], x.v[1]), vaddq_f32(x.v[2], x.v[3]));
        }
        r.v[i] = vpaddq_f32(vpaddq_f32(t[0], t[1]), vpaddq_f32(t[2], t[3]));
    }
    return r;
}
inline float hmax(F x) { return vmaxvq_f32(vmaxq_f32(vmaxq_f32(x.v[0], x.v[1]), vmaxq_f32(x.v[2], x.v[3]))); }
inline F round_even(F x) { F r; WAFER_EACH(vrndnq_f32(x.v[i])); }
inline F scale2(F y, F n) {
    F r;
    for (int i = 0; i < 4; ++i) {
        const int32x4_t k = vcvtnq_s32_f32(n.v[i]), k1 = vshrq_n_s32(k, 1), k2 = vsubq_s32(k, k1);
        const float32x4_t p1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k1, vdupq_n_s32(127)), 23));
        const float32x4_t p2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k2, vdupq_n_s32(127)), 23));
        r.v[i] = vmulq_f32(vmulq_f32(y.v[i], p1), p2);
    }
    return r;
}
inline I to_int(F x) { I r; WAFER_EACH(vcvtnq_s32_f32(x.v[i])); }
inline F to_float(I x) { F r; WAFER_EACH(vcvtq_f32_s32(x.v[i])); }
inline I operator+(I x, I y) { I r; WAFER_EACH(vaddq_s32(x.v[i], y.v[i])); }
inline I iset1(int32_t x) { I r; WAFER_EACH(vdupq_n_s32(x)); }
inline I iota(int32_t x) {
    const int32_t lanes[4] = {0, 1, 2, 3};
    I r; WAFER_EACH(vaddq_s32(vld1q_s32(lanes), vdupq_n_s32(x + 4 * i)));
}
inline int32_t isum(I x) { return vaddvq_s32(vaddq_s32(vaddq_s32(x.v[0], x.v[1]), vaddq_s32(x.v[2], x.v[3]))); }
inline void istore(int32_t* p, I x) { for (int i = 0; i < 4; ++i) vst1q_s32(p + 4 * i, x.v[i]); }
inline Mask gt(F x, F y) { Mask r; WAFER_EACH(vcgtq_f32(x.v[i], y.v[i])); }
inline Mask is_nan(F x) { Mask r; WAFER_EACH(vmvnq_u32(vceqq_f32(x.v[i], x.v[i]))); }
inline bool any(Mask m) { return vmaxvq_u32(vorrq_u32(vorrq_u32(m.v[0], m.v[1]), vorrq_u32(m.v[2], m.v[3]))) != 0; }
inline F select(Mask m, F x, F y) { F r; WAFER_EACH(vbslq_f32(m.v[i], x.v[i], y.v[i])); }
inline I select(Mask m, I x, I y) { I r; WAFER_EACH(vbslq_s32(m.v[i], x.v[i], y.v[i])); }
inline void store_i8(int8_t* p, I x) {
    const int16x8_t lo = vcombine_s16(vqmovn_s32(x.v[0]), vqmovn_s32(x.v[1]));
    const int16x8_t hi = vcombine_s16(vqmovn_s32(x.v[2]), vqmovn_s32(x.v[3]));
    vst1q_s8(p, vcombine_s8(vqmovn_s16(lo), vqmovn_s16(hi)));
}

inline W wload(const uint8_t* p) { W r; WAFER_EACH(vld1q_u8(p + 16 * i)); }
inline W low_nibbles(W x) { W r; WAFER_EACH(vandq_u8(x.v[i], vdupq_n_u8(0x0F))); }
inline W high_nibbles(W x) { W r; WAFER_EACH(vshrq_n_u8(x.v[i], 4)); }
#undef WAFER_EACH

template <int CODE_BITS>
inline I dot_block(const W* w, const int32_t* xq, int32_t xsum) {
    I r;
#if defined(__ARM_FEATURE_MATMUL_INT8)
    (void)xsum;
    for (int i = 0; i < 4; ++i) r.v[i] = vdupq_n_s32(0);
    for (int j = 0; j < 8; ++j) {
        const int8x16_t x = vreinterpretq_s8_s32(vdupq_n_s32(xq[j]));
        for (int i = 0; i < 4; ++i) r.v[i] = vusdotq_s32(r.v[i], w[j].v[i], x);
    }
#else
    // SDOT multiplies signed bytes: codes of up to 6 bits are already; 8-bit ones are made so (code - 128),
    // and 128 times x's block sum is added back.
    constexpr bool SMALL = CODE_BITS < 8;
    for (int i = 0; i < 4; ++i) r.v[i] = vdupq_n_s32(SMALL ? 0 : 128 * xsum);
    const uint8x16_t flip = vdupq_n_u8(SMALL ? 0 : 0x80);
    for (int j = 0; j < 8; ++j) {
        const int8x16_t x = vreinterpretq_s8_s32(vdupq_n_s32(xq[j]));
        for (int i = 0; i < 4; ++i) r.v[i] = vdotq_s32(r.v[i], vreinterpretq_s8_u8(veorq_u8(w[j].v[i], flip)), x);
    }
#endif
    return r;
}

template <int S, int MASK>
inline W top_bits(W lo, W hi) {
    W r;
    for (int i = 0; i < 4; ++i) {
        uint8x16_t h;
        if constexpr (S <= 4) h = vshlq_n_u8(hi.v[i], 4 - S);
        else h = vshrq_n_u8(hi.v[i], S - 4);
        r.v[i] = vorrq_u8(lo.v[i], vandq_u8(h, vdupq_n_u8(MASK)));
    }
    return r;
}
inline I scales16(const int8_t* p) {
    const int8x16_t v = vld1q_s8(p);
    const int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_s8(vget_high_s8(v));
    I r;
    r.v[0] = vmovl_s16(vget_low_s16(lo));
    r.v[1] = vmovl_s16(vget_high_s16(lo));
    r.v[2] = vmovl_s16(vget_low_s16(hi));
    r.v[3] = vmovl_s16(vget_high_s16(hi));
    return r;
}
// Codes below 64 are non-negative as signed bytes too, so SDOT takes them as they are.
inline I dot_block6(const W* w, const int32_t* xq, I s0, I s1) {
    I r;
    for (int i = 0; i < 4; ++i) {
        int32x4_t a = vdupq_n_s32(0), b = a;
        for (int j = 0; j < 4; ++j) {
            const int8x16_t x0 = vreinterpretq_s8_s32(vdupq_n_s32(xq[j])), x1 = vreinterpretq_s8_s32(vdupq_n_s32(xq[j + 4]));
#if defined(__ARM_FEATURE_MATMUL_INT8)
            a = vusdotq_s32(a, w[j].v[i], x0);
            b = vusdotq_s32(b, w[j + 4].v[i], x1);
#else
            a = vdotq_s32(a, vreinterpretq_s8_u8(w[j].v[i]), x0);
            b = vdotq_s32(b, vreinterpretq_s8_u8(w[j + 4].v[i]), x1);
#endif
        }
        r.v[i] = vmlaq_s32(vmulq_s32(a, s0.v[i]), b, s1.v[i]);
    }
    return r;
}

// =====================================================================================================
#else  // portable

struct F { float v[16]; };
constexpr int kRegisters = 1;  // plain loops: no register file to plan for, one piece at a time
struct I { int32_t v[16]; };
struct W { uint8_t v[64]; };
struct Mask { bool v[16]; };

#define WAFER_EACH(expr) { for (int i = 0; i < 16; ++i) r.v[i] = (expr); } return r
inline F zero() { F r; WAFER_EACH(0.0f); }
inline F set1(float x) { F r; WAFER_EACH(x); }
inline F load(const float* p) { F r; WAFER_EACH(p[i]); }
inline F load_n(const float* p, int64_t n, float fill = 0.0f) { F r; WAFER_EACH(i < n ? p[i] : fill); }
inline void store(float* p, F x) { for (int i = 0; i < 16; ++i) p[i] = x.v[i]; }
inline void store_n(float* p, F x, int64_t n) { for (int i = 0; i < 16 && i < n; ++i) p[i] = x.v[i]; }
inline F load_half(const uint16_t* p) { F r; WAFER_EACH(half_to_float(p[i])); }
inline F load_i8(const int8_t* p) { F r; WAFER_EACH(static_cast<float>(p[i])); }
inline F load_bf16(const uint16_t* p) { F r; WAFER_EACH(bf16_to_float(p[i])); }
inline F operator+(F x, F y) { F r; WAFER_EACH(x.v[i] + y.v[i]); }
inline F operator-(F x, F y) { F r; WAFER_EACH(x.v[i] - y.v[i]); }
inline F operator*(F x, F y) { F r; WAFER_EACH(x.v[i] * y.v[i]); }
inline F operator/(F x, F y) { F r; WAFER_EACH(x.v[i] / y.v[i]); }
// std::fma is a library call per lane where the target has no fused multiply-add (x86-64's
// baseline): a multiply and an add there, which the compiler vectorises.
#if defined(__FP_FAST_FMAF)
inline F fma(F x, F y, F z) { F r; WAFER_EACH(std::fma(x.v[i], y.v[i], z.v[i])); }
inline F fnma(F x, F y, F z) { F r; WAFER_EACH(std::fma(-x.v[i], y.v[i], z.v[i])); }
#else
inline F fma(F x, F y, F z) { F r; WAFER_EACH(x.v[i] * y.v[i] + z.v[i]); }
inline F fnma(F x, F y, F z) { F r; WAFER_EACH(z.v[i] - x.v[i] * y.v[i]); }
#endif
inline F max(F x, F y) { F r; WAFER_EACH(x.v[i] > y.v[i] ? x.v[i] : y.v[i]); }
inline F min(F x, F y) { F r; WAFER_EACH(x.v[i] < y.v[i] ? x.v[i] : y.v[i]); }
inline F abs(F x) { F r; WAFER_EACH(std::fabs(x.v[i])); }
inline F keep_n(F x, int64_t n) { F r; WAFER_EACH(i < n ? x.v[i] : 0.0f); }
inline float sum(F x) { float s = 0.0f; for (float a : x.v) s += a; return s; }
inline F sums16(const F* v) { F r; WAFER_EACH(sum(v[i])); }  // lane k: the sum of v[k]'s lanes
inline float hmax(F x) { float s = x.v[0]; for (float a : x.v) s = a > s ? a : s; return s; }
inline F round_even(F x) { F r; WAFER_EACH(std::nearbyint(x.v[i])); }
inline F scale2(F y, F n) { F r; WAFER_EACH(std::ldexp(y.v[i], static_cast<int>(n.v[i]))); }
inline I to_int(F x) { I r; WAFER_EACH(static_cast<int32_t>(std::nearbyint(x.v[i]))); }
inline F to_float(I x) { F r; WAFER_EACH(static_cast<float>(x.v[i])); }
inline I operator+(I x, I y) { I r; WAFER_EACH(x.v[i] + y.v[i]); }
inline I iset1(int32_t x) { I r; WAFER_EACH(x); }
inline I iota(int32_t x) { I r; WAFER_EACH(x + i); }
inline int32_t isum(I x) { int32_t s = 0; for (int32_t a : x.v) s += a; return s; }
inline void istore(int32_t* p, I x) { for (int i = 0; i < 16; ++i) p[i] = x.v[i]; }
inline Mask gt(F x, F y) { Mask r; WAFER_EACH(x.v[i] > y.v[i]); }
inline Mask is_nan(F x) { Mask r; WAFER_EACH(std::isnan(x.v[i])); }
inline bool any(Mask m) { bool a = false; for (bool b : m.v) a = a || b; return a; }
inline F select(Mask m, F x, F y) { F r; WAFER_EACH(m.v[i] ? x.v[i] : y.v[i]); }
inline I select(Mask m, I x, I y) { I r; WAFER_EACH(m.v[i] ? x.v[i] : y.v[i]); }
inline void store_i8(int8_t* p, I x) {
    for (int i = 0; i < 16; ++i) p[i] = static_cast<int8_t>(x.v[i] > 127 ? 127 : x.v[i] < -128 ? -128 : x.v[i]);
}
inline W wload(const uint8_t* p) { W r; std::memcpy(r.v, p, 64); return r; }
inline W low_nibbles(W x) { for (auto& b : x.v) b &= 0x0F; return x; }
inline W high_nibbles(W x) { for (auto& b : x.v) b >>= 4; return x; }
#undef WAFER_EACH

// Byte i of a record word is channel i / 4's weight for input 4 j + i % 4: the products go to 64
// lanes in the words' own order (contiguous, so the compiler vectorises them with what the target
// has), and each channel's four lanes are added once a block.
template <typename Lane>
inline void dot_lanes(const W& w, int32_t xq, Lane* lanes) {
    int32_t words[16];
    for (int i = 0; i < 16; ++i) words[i] = xq;  // the four input bytes in every word
    int8_t x[64];
    std::memcpy(x, words, 64);
    for (int i = 0; i < 64; ++i) lanes[i] = static_cast<Lane>(lanes[i] + w.v[i] * x[i]);
}
template <typename Lane>
inline I sum_lanes(const Lane* lanes) {
    I r;
    for (int c = 0; c < 16; ++c) r.v[c] = lanes[4 * c] + lanes[4 * c + 1] + lanes[4 * c + 2] + lanes[4 * c + 3];
    return r;
}

template <int CODE_BITS>
inline I dot_block(const W* w, const int32_t* xq, int32_t /*xsum*/) {
    // Codes of 5 bits or fewer: 8 products of at most 31 x 128 each fit 16-bit lanes, twice as many
    // a vector as 32-bit ones.
    using Lane = std::conditional_t<(CODE_BITS <= 5), int16_t, int32_t>;
    Lane lanes[64] = {};
    for (int j = 0; j < 8; ++j) dot_lanes(w[j], xq[j], lanes);
    return sum_lanes(lanes);
}

template <int S, int MASK>
inline W top_bits(W lo, W hi) {
    for (int i = 0; i < 64; ++i) {
        unsigned h;
        if constexpr (S <= 4) h = static_cast<unsigned>(hi.v[i]) << (4 - S);
        else h = static_cast<unsigned>(hi.v[i]) >> (S - 4);
        lo.v[i] = static_cast<uint8_t>(lo.v[i] | (h & MASK));
    }
    return lo;
}
inline I scales16(const int8_t* p) { I r; for (int i = 0; i < 16; ++i) r.v[i] = p[i]; return r; }
inline I dot_block6(const W* w, const int32_t* xq, I s0, I s1) {
    int32_t first[64] = {}, second[64] = {};  // the inputs under each half's scales
    for (int j = 0; j < 4; ++j) dot_lanes(w[j], xq[j], first);
    for (int j = 4; j < 8; ++j) dot_lanes(w[j], xq[j], second);
    const I a = sum_lanes(first), b = sum_lanes(second);
    I r;
    for (int c = 0; c < 16; ++c) r.v[c] = a.v[c] * s0.v[c] + b.v[c] * s1.v[c];
    return r;
}

#endif

// e^x for 16 lanes: 2^n e^r with r in [-ln2/2, ln2/2] and Cephes' polynomial for e^r (about 1 ulp).
inline F exp(F x) {
    // Below -87 the result would be subnormal, and arithmetic on subnormals is slow on many CPUs
    // (microcode assists): e^-87 = 1.6e-38 stands in for anything smaller, harmless in softmax and silu.
    x = max(min(x, set1(88.0f)), set1(-87.0f));
    const F n = round_even(x * set1(1.44269504088896341f));
    F r = fnma(n, set1(0.693359375f), x);
    r = fnma(n, set1(-2.12194440e-4f), r);
    F y = set1(1.9875691500e-4f);
    y = fma(y, r, set1(1.3981999507e-3f));
    y = fma(y, r, set1(8.3334519073e-3f));
    y = fma(y, r, set1(4.1665795894e-2f));
    y = fma(y, r, set1(1.6666665459e-1f));
    y = fma(y, r, set1(5.0000001201e-1f));
    y = fma(y, r * r, r + set1(1.0f));
    return scale2(y, n);
}

}  // namespace simd
