// One step of a Llama-family model in C++ for a few tokens: every layer, each token at its own
// (slot, position), whether they are decode steps of different sequences or consecutive tokens of
// one (a draft to verify, a short prompt chunk): all keys are written before any token attends. At 135M parameters the Python and dispatch cost of ~40 small torch calls per layer
// is as large as the matrix work; here a step is one call. Matrix products are the block kernels of
// blockquant.cpp; norms, rotary embedding, the KV-cache write and attention are plain loops.
// The Python model (llama.py) stays the reference: tests compare the logits of both.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <immintrin.h>
#include <vector>

torch::Tensor block_linear(torch::Tensor x, torch::Tensor packed, int64_t n);  // blockquant.cpp

namespace {

// e^x, 16 lanes: 2^n e^r with r in [-ln2/2, ln2/2] and Cephes' polynomial for e^r (about 1 ulp).
// std::exp one element at a time took a third of a step at 16 rows.
inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }

// y = rms_norm(x) * w, row by row
void rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * n;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            const __m512 v = _mm512_maskz_loadu_ps(tail_mask(n - i), xr + i);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) + eps));
        float* yr = y + r * n;
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 k = tail_mask(n - i);
            _mm512_mask_storeu_ps(yr + i, k, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, xr + i), inv),
                                                             _mm512_maskz_loadu_ps(k, w + i)));
        }
    }
}

// y = silu(gate) * up for rows of [gate | up]
void silu_mul(const float* gu, float* y, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        for (int64_t i = 0; i < inter; i += 16) {
            const __mmask16 k = tail_mask(inter - i);
            const __m512 gv = _mm512_maskz_loadu_ps(k, g + i);
            const __m512 sig = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            _mm512_mask_storeu_ps(y + r * inter + i, k, _mm512_mul_ps(sig, _mm512_maskz_loadu_ps(k, u + i)));
        }
    }
}

// p[0..n) = exp(p - max p); returns their sum
float softmax_exp(float* p, int64_t n) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, tail_mask(n - j), p + j));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 k = tail_mask(n - j);
        const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + j), m)));
        _mm512_mask_storeu_ps(p + j, k, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

// Rotate-half RoPE of one head vector in place; cos/sin rows hold [freqs, freqs].
void rope(float* v, const float* c, const float* s, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
    }
}

// q . k over one head; 16 lanes at a time when the head size allows (it is 64 or 128 in practice).
inline float dot(const float* q, const float* k, int64_t n) {
    if (n % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t e = 0; e < n; e += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + e), _mm512_loadu_ps(k + e), acc);
        return _mm512_reduce_add_ps(acc);
    }
    float s = 0.0f;
    for (int64_t e = 0; e < n; ++e) s += q[e] * k[e];
    return s;
}

// o = scale * sum_j p[j] v[j] over `count` value rows of size n
inline void weighted_sum(const float* p, const float* v, int64_t count, float scale, float* o, int64_t n) {
    if (n == 64) {  // four registers hold the whole output row
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < count; ++j) {
            const __m512 w = _mm512_set1_ps(p[j]);
            const float* r = v + j * 64;
            a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(r), a0);
            a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(r + 16), a1);
            a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(r + 32), a2);
            a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(r + 48), a3);
        }
        const __m512 s = _mm512_set1_ps(scale);
        _mm512_storeu_ps(o, _mm512_mul_ps(a0, s));
        _mm512_storeu_ps(o + 16, _mm512_mul_ps(a1, s));
        _mm512_storeu_ps(o + 32, _mm512_mul_ps(a2, s));
        _mm512_storeu_ps(o + 48, _mm512_mul_ps(a3, s));
        return;
    }
    for (int64_t e = 0; e < n; ++e) o[e] = 0.0f;
    for (int64_t j = 0; j < count; ++j)
        for (int64_t e = 0; e < n; ++e) o[e] += p[j] * v[j * n + e];
    for (int64_t e = 0; e < n; ++e) o[e] *= scale;
}

struct Linear {
    torch::Tensor packed, bias;  // bias undefined: none
    int64_t n;
    torch::Tensor operator()(const torch::Tensor& x) const {
        torch::Tensor y = block_linear(x, packed, n);
        return bias.defined() ? y.add_(bias) : y;
    }
};

// Two entries per linear layer: its packed blocks and its bias (or an empty tensor).
Linear linear(const std::vector<torch::Tensor>& t, size_t i, int64_t n) {
    return {t[i], t[i + 1].numel() ? t[i + 1] : torch::Tensor(), n};
}

}  // namespace

// x [M, hidden]: the tokens' embeddings. positions, slots [M] int64. cos, sin [max_pos, head_dim].
// layers: per layer 2 norm weights, 4 linears (qkv, o, gate_up, down) of 2 tensors each, then the
// layer's K and V caches [slots, kv_heads, max_len, head_dim]: 12 tensors a layer; after the last
// layer the output head's 2. out_features: each linear's output size, in the same order.
// norm: the final norm's weight. Returns logits [M, vocab].
torch::Tensor decode_step(torch::Tensor x, torch::Tensor positions, torch::Tensor slots, torch::Tensor cos,
                          torch::Tensor sin, std::vector<torch::Tensor> layers,
                          std::vector<int64_t> out_features, torch::Tensor norm, double eps,
                          int64_t n_heads, int64_t n_kv, int64_t head_dim, int64_t window) {
    TORCH_CHECK(layers.size() % 12 == 2, "12 tensors per layer and 2 for the head");
    const int64_t M = x.size(0), hidden = x.size(1), n_layers = layers.size() / 12;
    TORCH_CHECK(static_cast<int64_t>(out_features.size()) == 4 * n_layers + 1, "an output size per linear");
    const int64_t* nout = out_features.data();
    const int64_t group = n_heads / n_kv, q_dim = n_heads * head_dim, kv_dim = n_kv * head_dim;
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim)), feps = static_cast<float>(eps);
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    const float* C = cos.data_ptr<float>();
    const float* S = sin.data_ptr<float>();
    torch::Tensor h = x.contiguous().clone();
    torch::Tensor xn = torch::empty_like(h);
    torch::Tensor attn = torch::empty({M, q_dim}, torch::kFloat32);
    int64_t max_ctx = 0;
    for (int64_t m = 0; m < M; ++m) max_ctx = std::max(max_ctx, pos[m] + 1);
    for (int64_t l = 0; l < n_layers; ++l) {
        const auto& t = layers;
        const size_t base = l * 12;
        torch::Tensor k_cache = t[base + 10], v_cache = t[base + 11];
        const int64_t max_len = k_cache.size(2);
        float* KC = k_cache.data_ptr<float>();
        float* VC = v_cache.data_ptr<float>();
        const int64_t slot_stride = n_kv * max_len * head_dim, head_stride = max_len * head_dim;

        rms_norm(h.data_ptr<float>(), t[base].data_ptr<float>(), xn.data_ptr<float>(), M, hidden, feps);
        torch::Tensor qkv = linear(t, base + 2, nout[4 * l])(xn);  // [M, q_dim + 2 kv_dim]
        float* QKV = qkv.data_ptr<float>();
        const int64_t row = q_dim + 2 * kv_dim;
        for (int64_t m = 0; m < M; ++m) {
            float* r = QKV + m * row;
            const float* c = C + pos[m] * head_dim;
            const float* s = S + pos[m] * head_dim;
            for (int64_t hd = 0; hd < n_heads + n_kv; ++hd) rope(r + hd * head_dim, c, s, head_dim);
            for (int64_t kh = 0; kh < n_kv; ++kh) {
                float* kd = KC + slot[m] * slot_stride + kh * head_stride + pos[m] * head_dim;
                float* vd = VC + slot[m] * slot_stride + kh * head_stride + pos[m] * head_dim;
                std::memcpy(kd, r + q_dim + kh * head_dim, head_dim * sizeof(float));
                std::memcpy(vd, r + q_dim + kv_dim + kh * head_dim, head_dim * sizeof(float));
            }
        }
        float* A = attn.data_ptr<float>();
        at::parallel_for(0, M * n_heads, 1, [&](int64_t i0, int64_t i1) {
            std::vector<float> p(max_ctx);
            for (int64_t i = i0; i < i1; ++i) {
                const int64_t m = i / n_heads, hq = i % n_heads, kh = hq / group;
                const float* q = QKV + m * row + hq * head_dim;
                const float* K = KC + slot[m] * slot_stride + kh * head_stride;
                const float* V = VC + slot[m] * slot_stride + kh * head_stride;
                const int64_t end = pos[m] + 1, start = window > 0 ? std::max<int64_t>(0, end - window) : 0;
                for (int64_t j = start; j < end; ++j) p[j] = dot(q, K + j * head_dim, head_dim) * scale;
                const float sum = softmax_exp(p.data() + start, end - start);
                float* o = A + m * q_dim + hq * head_dim;
                weighted_sum(p.data() + start, V + start * head_dim, end - start, 1.0f / sum, o, head_dim);
            }
        });
        h.add_(linear(t, base + 4, nout[4 * l + 1])(attn));
        rms_norm(h.data_ptr<float>(), t[base + 1].data_ptr<float>(), xn.data_ptr<float>(), M, hidden, feps);
        torch::Tensor gu = linear(t, base + 6, nout[4 * l + 2])(xn);  // [M, 2 inter]: gate then up
        const int64_t inter = gu.size(1) / 2;
        torch::Tensor act = torch::empty({M, inter}, torch::kFloat32);
        silu_mul(gu.data_ptr<float>(), act.data_ptr<float>(), M, inter);
        h.add_(linear(t, base + 8, nout[4 * l + 3])(act));
    }
    rms_norm(h.data_ptr<float>(), norm.data_ptr<float>(), xn.data_ptr<float>(), M, hidden, feps);
    return linear(layers, 12 * n_layers, nout[4 * n_layers])(xn);
}

namespace {

struct Top {
    int64_t at;  // -1: the range is empty
    float value;
    bool nan;
};

// The first largest value of x[c0, c1) and its index, or the first NaN there (as torch.max treats one).
Top argmax_range(const float* x, int64_t c0, int64_t c1) {
    if (c1 <= c0) return {-1, -INFINITY, false};
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    __m512 best = neg_inf;
    __m512i best_at = _mm512_set1_epi32(static_cast<int32_t>(c0));
    __m512i at = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(c0)),
                                  _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i sixteen = _mm512_set1_epi32(16);
    for (int64_t i = c0; i < c1; i += 16) {
        const __mmask16 k = tail_mask(c1 - i);
        const __m512 v = _mm512_mask_loadu_ps(neg_inf, k, x + i);
        const __mmask16 nan = _mm512_mask_cmp_ps_mask(k, v, v, _CMP_UNORD_Q);
        if (nan) return {i + __builtin_ctz(nan), NAN, true};
        // Strictly greater: each lane keeps its first maximum.
        const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, gt, v);
        best_at = _mm512_mask_mov_epi32(best_at, gt, at);
        at = _mm512_add_epi32(at, sixteen);
    }
    const float top = _mm512_reduce_max_ps(best);
    const __mmask16 is_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    return {_mm512_mask_reduce_min_epi32(is_top, best_at), top, false};
}

}  // namespace

// The greedy token of each row of logits [M, V]. The columns are split among the threads exactly as
// block_linear split the vocabulary when it computed them (the same range of 16-column groups, the
// same grain), so each thread reads the part its own cache holds. PyTorch's max(dim=-1) reads every
// row on one thread (bench/step_parts.py times both).
torch::Tensor argmax_rows(torch::Tensor x) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1, "x: [M, V] float32, rows contiguous");
    TORCH_CHECK(x.size(1) > 0 && x.size(1) < (int64_t{1} << 31) - 16, "V must be in 1..2^31-17");
    const int64_t M = x.size(0), V = x.size(1), stride = x.stride(0), G = (V + 15) / 16;
    const int T = at::get_num_threads();
    std::vector<Top> parts(static_cast<size_t>(T) * M, Top{-1, -INFINITY, false});
    const float* X = x.data_ptr<float>();
    at::parallel_for(0, G, 4, [&](int64_t g0, int64_t g1) {
        Top* mine = parts.data() + static_cast<int64_t>(at::get_thread_num()) * M;
        for (int64_t r = 0; r < M; ++r) mine[r] = argmax_range(X + r * stride, 16 * g0, std::min(V, 16 * g1));
    });
    auto out = torch::empty({M}, torch::kInt64);
    int64_t* O = out.data_ptr<int64_t>();
    for (int64_t r = 0; r < M; ++r) {
        // Threads hold consecutive column ranges in thread order: the first NaN, else the first maximum.
        Top best{-1, -INFINITY, false};
        for (int t = 0; t < T; ++t) {
            const Top& p = parts[static_cast<size_t>(t) * M + r];
            if (p.at < 0) continue;
            if (p.nan) { best = p; break; }
            if (best.at < 0 || p.value > best.value) best = p;
        }
        O[r] = best.at;
    }
    return out;
}
