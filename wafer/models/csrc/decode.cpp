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

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m);
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d);

namespace {

// y = rms_norm(x) * w, row by row
void rms_norm(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * n;
        float ss = 0.0f;
        for (int64_t i = 0; i < n; ++i) ss += xr[i] * xr[i];
        const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
        float* yr = y + r * n;
        for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] * inv * w[i];
    }
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
    torch::Tensor codes, scales, mins, bias;  // mins undefined: 8-bit blocks
    torch::Tensor operator()(const torch::Tensor& x) const {
        torch::Tensor y = mins.defined() ? q4_linear(x, codes, scales, mins) : q8_linear(x, codes, scales);
        return bias.defined() ? y.add_(bias) : y;
    }
};

Linear linear(const std::vector<torch::Tensor>& t, size_t i) {
    // Four entries per linear layer: codes, scales, mins (or empty), bias (or empty).
    Linear l{t[i], t[i + 1], t[i + 2], t[i + 3]};
    if (l.mins.numel() == 0) l.mins = torch::Tensor();
    if (l.bias.numel() == 0) l.bias = torch::Tensor();
    return l;
}

}  // namespace

// x [M, hidden]: the tokens' embeddings. positions, slots [M] int64. cos, sin [max_pos, head_dim].
// layers: per layer 2 norm weights then 4 linears (qkv, o, gate_up, down) of 4 tensors each, then
// the layer's K and V caches [slots, kv_heads, max_len, head_dim]: 20 tensors a layer.
// head: 4 tensors (the output head), norm: final norm weight. Returns logits [M, vocab].
torch::Tensor decode_step(torch::Tensor x, torch::Tensor positions, torch::Tensor slots, torch::Tensor cos,
                          torch::Tensor sin, std::vector<torch::Tensor> layers, torch::Tensor norm,
                          std::vector<torch::Tensor> head, int64_t n_heads, int64_t n_kv, int64_t head_dim,
                          double eps, int64_t window) {
    TORCH_CHECK(layers.size() % 20 == 0, "20 tensors per layer");
    const int64_t M = x.size(0), hidden = x.size(1), n_layers = layers.size() / 20;
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
        const size_t base = l * 20;
        torch::Tensor k_cache = t[base + 18], v_cache = t[base + 19];
        const int64_t max_len = k_cache.size(2);
        float* KC = k_cache.data_ptr<float>();
        float* VC = v_cache.data_ptr<float>();
        const int64_t slot_stride = n_kv * max_len * head_dim, head_stride = max_len * head_dim;

        rms_norm(h.data_ptr<float>(), t[base].data_ptr<float>(), xn.data_ptr<float>(), M, hidden, feps);
        torch::Tensor qkv = linear(t, base + 2)(xn);  // [M, q_dim + 2 kv_dim]
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
                float mx = -INFINITY;
                for (int64_t j = start; j < end; ++j) {
                    p[j] = dot(q, K + j * head_dim, head_dim) * scale;
                    mx = std::max(mx, p[j]);
                }
                float sum = 0.0f;
                for (int64_t j = start; j < end; ++j) {
                    p[j] = std::exp(p[j] - mx);
                    sum += p[j];
                }
                float* o = A + m * q_dim + hq * head_dim;
                weighted_sum(p.data() + start, V + start * head_dim, end - start, 1.0f / sum, o, head_dim);
            }
        });
        h.add_(linear(t, base + 6)(attn));
        rms_norm(h.data_ptr<float>(), t[base + 1].data_ptr<float>(), xn.data_ptr<float>(), M, hidden, feps);
        torch::Tensor gu = linear(t, base + 10)(xn);  // [M, 2 inter]: gate then up
        const int64_t inter = gu.size(1) / 2;
        torch::Tensor act = torch::empty({M, inter}, torch::kFloat32);
        const float* G = gu.data_ptr<float>();
        float* Y = act.data_ptr<float>();
        for (int64_t m = 0; m < M; ++m)
            for (int64_t i = 0; i < inter; ++i) {
                const float g = G[m * 2 * inter + i];
                Y[m * inter + i] = g / (1.0f + std::exp(-g)) * G[m * 2 * inter + inter + i];
            }
        h.add_(linear(t, base + 14)(act));
    }
    rms_norm(h.data_ptr<float>(), norm.data_ptr<float>(), xn.data_ptr<float>(), M, hidden, feps);
    return linear(head, 0)(xn);
}
