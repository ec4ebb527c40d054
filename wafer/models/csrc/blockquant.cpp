// Block-quantised matrix-vector products for decode on AVX-512 VNNI CPUs.
//
// Weights are kept in llama.cpp's block formats, 32 input elements per block:
//   q4: 16 bytes of nibbles (element j in the low nibble of byte j, element j+16 in the high one),
//       one scale d and one minimum m per block: w = d * q + m, q in 0..15   (GGUF Q4_1)
//   q8: 32 signed bytes and one scale d per block: w = d * q                 (GGUF Q8_0)
// Activations are quantised per block of 32 to int8 with one scale (as llama.cpp's Q8_1), so a
// block's dot product is one VNNI instruction on integers, scaled once in float.
// Output rows are split between threads; a block of weights is unpacked once for all rows of x.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstring>

namespace {

constexpr int QK = 32;
constexpr int MAX_ROWS = 8;  // rows of x handled together (more are done in groups)

inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

using half_t = uint16_t;  // weight scales are float16, as in the GGUF blocks

inline float h2f(half_t h) { return _cvtsh_ss(h); }

// [a0 * b0 in lanes 0-7, a1 * b1 in lanes 8-15]: the scales of two adjacent blocks, one per dot lane.
inline __m512 pair_scale(const half_t* a, const float* b) {
    int32_t two;
    std::memcpy(&two, a, sizeof(two));
    const __m128 p = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(two)),
                                _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
    return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                 _mm512_castps128_ps512(p));
}

// x [M, K] float -> qx [M, K] int8, dx [M, K/32] scales, sx [M, K/32] = dx * sum(qx of the block)
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* qx, float* dx, float* sx) {
    const int64_t nb = K / QK;
    for (int64_t r = 0; r < M; ++r) {
        for (int64_t b = 0; b < nb; ++b) {
            const float* p = x + r * K + b * QK;
            __m512 a = _mm512_loadu_ps(p), c = _mm512_loadu_ps(p + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
            float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
            __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));  // round to nearest even
            __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(id)));
            int8_t* out = qx + r * K + b * QK;
            _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(qa));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtsepi32_epi8(qc));
            dx[r * nb + b] = d;
            sx[r * nb + b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc)));
        }
    }
}

void check(const torch::Tensor& x, const torch::Tensor& scales, int64_t n) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous [M, K] float32");
    TORCH_CHECK(x.size(1) % QK == 0, "K must be a multiple of 32");
    TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() && scales.size(0) == n &&
                scales.size(1) == x.size(1) / QK, "scales: contiguous [N, K/32] float16");
}

// x quantised per block, as both kernels read it.
struct QuantizedRows {
    torch::Tensor q, d, s;  // [M, K] int8, [M, K/32] scales, [M, K/32] scale * sum of codes
    explicit QuantizedRows(const torch::Tensor& x)
        : q(torch::empty({x.size(0), x.size(1)}, torch::kInt8)),
          d(torch::empty({x.size(0), x.size(1) / QK}, torch::kFloat32)),
          s(torch::empty({x.size(0), x.size(1) / QK}, torch::kFloat32)) {
        quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), q.data_ptr<int8_t>(), d.data_ptr<float>(),
                      s.data_ptr<float>());
    }
};

}  // namespace

// y [M, N] = x [M, K] @ W.T for W in q4 blocks: qs [N, K/2] uint8, d and m [N, K/32] float16.
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m) {
    const int64_t N = qs.size(0), M = x.size(0), K = x.size(1), nb = K / QK;
    check(x, d, N);
    TORCH_CHECK(qs.scalar_type() == torch::kUInt8 && qs.is_contiguous() && qs.size(1) == K / 2, "qs: [N, K/2] uint8");
    TORCH_CHECK(m.sizes() == d.sizes() && m.is_contiguous() && m.scalar_type() == torch::kHalf, "m like d");
    const QuantizedRows qx(x);
    auto y = torch::empty({M, N}, torch::kFloat32);
    const uint8_t* W = qs.data_ptr<uint8_t>();
    const half_t* D = reinterpret_cast<const half_t*>(d.data_ptr<at::Half>());
    const half_t* Mn = reinterpret_cast<const half_t*>(m.data_ptr<at::Half>());
    const int8_t* X = qx.q.data_ptr<int8_t>();
    const float *DX = qx.d.data_ptr<float>(), *SX = qx.s.data_ptr<float>();
    float* Y = y.data_ptr<float>();
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS) {
        const int64_t rows = std::min<int64_t>(MAX_ROWS, M - r0);
        at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
            for (int64_t n = n0; n < n1; ++n) {
                __m512 acc[MAX_ROWS];
                for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
                const uint8_t* wrow = W + n * nb * 16;
                const half_t* drow = D + n * nb;
                int64_t b = 0;
                // Four blocks per step from a 64-byte group (see repack_q4 in blockquant.py): the low
                // nibbles are blocks b and b+1, the high nibbles blocks b+2 and b+3, in x's order.
                const __m512i low4 = _mm512_set1_epi8(0x0F);
                const __m512i first = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
                const __m512i second = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
                for (; b + 4 <= nb; b += 4) {
                    const __m512i v = _mm512_loadu_si512(wrow + b * 16);
                    const __m512i w01 = _mm512_and_si512(v, low4);
                    const __m512i w23 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                    int64_t four;
                    std::memcpy(&four, drow + b, sizeof(four));
                    const __m128 dw = _mm_cvtph_ps(_mm_cvtsi64_si128(four));
                    for (int r = 0; r < rows; ++r) {
                        const int64_t row = r0 + r;
                        const int8_t* xb = X + row * K + b * QK;
                        const __m512 s4 = _mm512_castps128_ps512(_mm_mul_ps(dw, _mm_loadu_ps(DX + row * nb + b)));
                        const __m512i d01 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w01, _mm512_loadu_si512(xb));
                        const __m512i d23 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w23, _mm512_loadu_si512(xb + 64));
                        acc[r] = _mm512_fmadd_ps(_mm512_permutexvar_ps(first, s4), _mm512_cvtepi32_ps(d01), acc[r]);
                        acc[r] = _mm512_fmadd_ps(_mm512_permutexvar_ps(second, s4), _mm512_cvtepi32_ps(d23), acc[r]);
                    }
                }
                // The rest (fewer than four blocks) keep GGUF's 16-byte layout.
                for (; b + 2 <= nb; b += 2) {
                    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + b * 16));
                    const __m256i lo = _mm256_and_si256(packed, low);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
                    // [lo0 hi0 | lo1 hi1]: block b's 32 codes, then block b+1's.
                    const __m256i w0 = _mm256_permute2x128_si256(lo, hi, 0x20);
                    const __m256i w1 = _mm256_permute2x128_si256(lo, hi, 0x31);
                    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);
                    for (int r = 0; r < rows; ++r) {
                        const int64_t row = r0 + r;
                        const __m512i xv = _mm512_loadu_si512(X + row * K + b * QK);
                        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);
                        const __m512 scale = pair_scale(drow + b, DX + row * nb + b);
                        acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot), acc[r]);
                    }
                }
                float tail[MAX_ROWS] = {0};
                for (; b < nb; ++b) {  // an odd last block
                    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow + b * 16));
                    const __m128i l = _mm_set1_epi8(0x0F);
                    const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), l),
                                                       _mm_and_si128(packed, l));
                    for (int r = 0; r < rows; ++r) {
                        const int64_t row = r0 + r;
                        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(X + row * K + b * QK));
                        const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, xv);
                        tail[r] += h2f(drow[b]) * DX[row * nb + b] * hsum(_mm256_cvtepi32_ps(dot));
                    }
                }
                // The minimums' share: sum over blocks of m * (dx * sum of x's codes).
                const half_t* mrow = Mn + n * nb;
                for (int r = 0; r < rows; ++r) {
                    const float* s = SX + (r0 + r) * nb;
                    float mins = 0.0f;
                    for (int64_t j = 0; j < nb; ++j) mins += h2f(mrow[j]) * s[j];
                    Y[(r0 + r) * N + n] = _mm512_reduce_add_ps(acc[r]) + tail[r] + mins;
                }
            }
        });
    }
    return y;
}

// y [M, N] = x [M, K] @ W.T for W in q8 blocks: qs [N, K] int8, d [N, K/32] float16.
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d) {
    const int64_t N = qs.size(0), M = x.size(0), K = x.size(1), nb = K / QK;
    check(x, d, N);
    TORCH_CHECK(qs.scalar_type() == torch::kInt8 && qs.is_contiguous() && qs.size(1) == K, "qs: [N, K] int8");
    const QuantizedRows qx(x);
    auto y = torch::empty({M, N}, torch::kFloat32);
    const int8_t* W = qs.data_ptr<int8_t>();
    const half_t* D = reinterpret_cast<const half_t*>(d.data_ptr<at::Half>());
    const int8_t* X = qx.q.data_ptr<int8_t>();
    const float* DX = qx.d.data_ptr<float>();
    float* Y = y.data_ptr<float>();
    for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS) {
        const int64_t rows = std::min<int64_t>(MAX_ROWS, M - r0);
        at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
            for (int64_t n = n0; n < n1; ++n) {
                __m256 acc[MAX_ROWS];
                for (int r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
                __m512 acc2[MAX_ROWS];
                for (int r = 0; r < rows; ++r) acc2[r] = _mm512_setzero_ps();
                int64_t b = 0;
                const __m512i zero = _mm512_setzero_si512();
                for (; b + 2 <= nb; b += 2) {  // two blocks per step
                    const __m512i w = _mm512_loadu_si512(W + n * K + b * QK);
                    const __m512i aw = _mm512_abs_epi8(w);  // q8 blocks never hold -128
                    const __mmask64 neg = _mm512_movepi8_mask(w);
                    for (int r = 0; r < rows; ++r) {
                        const int64_t row = r0 + r;
                        const __m512i xv = _mm512_loadu_si512(X + row * K + b * QK);
                        // VNNI multiplies unsigned by signed bytes: move w's sign onto x.
                        const __m512i sx = _mm512_mask_sub_epi8(xv, neg, zero, xv);
                        const __m512i dot = _mm512_dpbusd_epi32(zero, aw, sx);
                        const __m512 scale = pair_scale(D + n * nb + b, DX + row * nb + b);
                        acc2[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot), acc2[r]);
                    }
                }
                for (; b < nb; ++b) {  // an odd last block
                    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(W + n * K + b * QK));
                    const __m256i aw = _mm256_sign_epi8(w, w);
                    const float dw = h2f(D[n * nb + b]);
                    for (int r = 0; r < rows; ++r) {
                        const int64_t row = r0 + r;
                        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(X + row * K + b * QK));
                        const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, _mm256_sign_epi8(xv, w));
                        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * DX[row * nb + b]), _mm256_cvtepi32_ps(dot), acc[r]);
                    }
                }
                for (int r = 0; r < rows; ++r) Y[(r0 + r) * N + n] = hsum(acc[r]) + _mm512_reduce_add_ps(acc2[r]);
            }
        });
    }
    return y;
}

torch::Tensor decode_step(torch::Tensor x, torch::Tensor positions, torch::Tensor slots, torch::Tensor cos,
                          torch::Tensor sin, std::vector<torch::Tensor> layers, torch::Tensor norm,
                          std::vector<torch::Tensor> head, int64_t n_heads, int64_t n_kv, int64_t head_dim,
                          double eps, int64_t window);  // decode.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
    mod.def("decode_step", &decode_step, "one decode step of every layer for a few sequences (decode.cpp)");
    mod.def("q4_linear", &q4_linear, "x @ W.T, W in 4-bit blocks of 32 with scale and minimum (Q4_1)");
    mod.def("q8_linear", &q8_linear, "x @ W.T, W in 8-bit blocks of 32 with a scale (Q8_0)");
}
