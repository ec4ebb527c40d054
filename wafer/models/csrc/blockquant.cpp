// Block-quantised matrix products for decode on AVX-512 VNNI CPUs.
//
// Weights are llama.cpp's block formats, 32 input elements per block, each block w = d * q + m:
//   4 bits: codes q in 0..15 with a scale d and a minimum m (GGUF Q4_1)
//   8 bits: codes q + 128 in 0..255 with m = -128 d, which is GGUF Q8_0 (w = d * q) made unsigned
// Activations are quantised per block of 32 to int8 with one scale dx (as llama.cpp's Q8_1), so
//   sum over a block of w x = d dx (sum of codes * x codes) + m (dx * sum of x codes)
// and the first sum is integer work for VNNI.
//
// Layout (blockquant.py, pack_blocks): output channels in groups of 16, and for each group and
// block one record: the 16 channels' 32 codes, then d[16] and m[16] as float16. The codes are
// ordered so that each 512-bit register holds four consecutive inputs of all 16 channels: one
// VNNI instruction against four of x's bytes broadcast gives 16 outputs' partial sums at once.
// Every result lane is an output channel, so no horizontal sums are needed, a record is unpacked
// once for up to eight rows of x, and each thread reads one contiguous run of records.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <vector>

namespace {

constexpr int QK = 32;
constexpr int TILE = 8;  // rows of x that share one unpacking of a record

int64_t record_bytes(int bits) { return (bits == 4 ? 256 : 512) + 64; }

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

struct Rows {  // x quantised, as the kernel reads it
    const int8_t* q;
    const float *d, *s;
    int64_t K, nb;
};

// y[rows, channel groups g0..g1) for R rows starting at x row 0 of `x`.
template <int BITS, int R>
void tile(const uint8_t* P, int64_t nb, const Rows& x, float* Y, int64_t N, int64_t g0, int64_t g1) {
    const int64_t rec = record_bytes(BITS);
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t g = g0; g < g1; ++g) {
        __m512 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
        const uint8_t* p = P + g * nb * rec;
#pragma GCC unroll 1
        for (int64_t b = 0; b < nb; ++b, p += rec) {
            // The next group's record at this block: fetched while this one computes.
            for (int64_t line = 0; line < rec; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p + nb * rec + line), _MM_HINT_T0);
            __m512i w[8];
            if constexpr (BITS == 4) {
                for (int i = 0; i < 4; ++i) {
                    const __m512i v = _mm512_loadu_si512(p + 64 * i);
                    w[2 * i] = _mm512_and_si512(v, low);
                    w[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                }
            } else {
                for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(p + 64 * j);
            }
            const uint8_t* sc = p + rec - 64;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 32)));
            // Unrolled, so that the accumulators live in registers (rolled, GCC kept them on the stack).
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const int32_t* xi = reinterpret_cast<const int32_t*>(x.q + r * x.K + b * QK);
                __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
                for (int j = 0; j < 8; j += 2) {  // two chains, for the latency of VNNI
                    s0 = _mm512_dpbusd_epi32(s0, w[j], _mm512_set1_epi32(xi[j]));
                    s1 = _mm512_dpbusd_epi32(s1, w[j + 1], _mm512_set1_epi32(xi[j + 1]));
                }
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
                acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(x.d[r * nb + b])), acc[r]);
                acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s[r * nb + b]), acc[r]);
            }
        }
        const int64_t n0 = g * 16;
        const __mmask16 keep = n0 + 16 <= N ? 0xFFFF : static_cast<__mmask16>((1u << (N - n0)) - 1);
        for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(Y + r * N + n0, keep, acc[r]);
    }
}

template <int BITS>
void tile_rows(int rows, const uint8_t* P, int64_t nb, const Rows& x, float* Y, int64_t N, int64_t g0, int64_t g1) {
    switch (rows) {
        case 1: return tile<BITS, 1>(P, nb, x, Y, N, g0, g1);
        case 2: return tile<BITS, 2>(P, nb, x, Y, N, g0, g1);
        case 3: return tile<BITS, 3>(P, nb, x, Y, N, g0, g1);
        case 4: return tile<BITS, 4>(P, nb, x, Y, N, g0, g1);
        case 5: return tile<BITS, 5>(P, nb, x, Y, N, g0, g1);
        case 6: return tile<BITS, 6>(P, nb, x, Y, N, g0, g1);
        case 7: return tile<BITS, 7>(P, nb, x, Y, N, g0, g1);
        default: return tile<BITS, 8>(P, nb, x, Y, N, g0, g1);
    }
}

}  // namespace

// y [M, n] = x [M, K] @ W.T, W packed by blockquant.pack_blocks: uint8 [ceil(n/16), K/32, record].
torch::Tensor block_linear(torch::Tensor x, torch::Tensor packed, int64_t n) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous [M, K] float32");
    TORCH_CHECK(x.size(1) % QK == 0, "K must be a multiple of 32");
    const int64_t M = x.size(0), K = x.size(1), nb = K / QK, G = (n + 15) / 16;
    TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 3 &&
                packed.size(0) == G && packed.size(1) == nb, "packed: contiguous uint8 [ceil(n/16), K/32, record]");
    const int64_t rec = packed.size(2);
    TORCH_CHECK(rec == record_bytes(4) || rec == record_bytes(8), "record of 320 (4-bit) or 576 (8-bit) bytes");
    const int bits = rec == record_bytes(4) ? 4 : 8;
    // Scratch for x's codes, reused across calls (the engine steps from one thread).
    thread_local std::vector<int8_t> qbuf;
    thread_local std::vector<float> dbuf, sbuf;
    if (static_cast<int64_t>(qbuf.size()) < M * K) qbuf.resize(M * K);
    if (static_cast<int64_t>(dbuf.size()) < M * nb) dbuf.resize(M * nb), sbuf.resize(M * nb);
    quantize_rows(x.data_ptr<float>(), M, K, qbuf.data(), dbuf.data(), sbuf.data());
    auto y = torch::empty({M, n}, torch::kFloat32);
    const uint8_t* P = packed.data_ptr<uint8_t>();
    float* Y = y.data_ptr<float>();
    // Taken here: inside the lambda the names would be other threads' own (empty) buffers.
    const int8_t* Q = qbuf.data();
    const float *D = dbuf.data(), *S = sbuf.data();
    at::parallel_for(0, G, 4, [&](int64_t g0, int64_t g1) {
        // Every tile of rows over this thread's groups, group by group, so that a group's records
        // come from memory once and from cache for the other tiles.
        for (int64_t g = g0; g < g1; ++g)
            for (int64_t r0 = 0; r0 < M; r0 += TILE) {
                const Rows xr{Q + r0 * K, D + r0 * nb, S + r0 * nb, K, nb};
                const int rows = static_cast<int>(std::min<int64_t>(TILE, M - r0));
                if (bits == 4) tile_rows<4>(rows, P, nb, xr, Y + r0 * n, n, g, g + 1);
                else tile_rows<8>(rows, P, nb, xr, Y + r0 * n, n, g, g + 1);
            }
    });
    return y;
}

torch::Tensor decode_step(torch::Tensor x, torch::Tensor positions, torch::Tensor slots, torch::Tensor cos,
                          torch::Tensor sin, std::vector<torch::Tensor> layers, std::vector<int64_t> out_features,
                          torch::Tensor norm, double eps, int64_t n_heads, int64_t n_kv, int64_t head_dim,
                          int64_t window);  // decode.cpp
torch::Tensor argmax_rows(torch::Tensor x);  // decode.cpp

// Both run without the GIL, as PyTorch's own operators do: other Python threads of the process (an
// application that runs the server in a thread, the tests' clients) go on while a step computes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
    mod.def("decode_step", &decode_step, "one decode step of every layer for a few sequences (decode.cpp)",
            py::call_guard<py::gil_scoped_release>());
    mod.def("block_linear", &block_linear, "x @ W.T, W in 4- or 8-bit blocks of 32 (pack_blocks)",
            py::call_guard<py::gil_scoped_release>());
    mod.def("argmax_rows", &argmax_rows, "each row's first largest value's index, as torch.max(dim=-1) (decode.cpp)",
            py::call_guard<py::gil_scoped_release>());
}
