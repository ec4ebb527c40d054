// wafer's CPU kernels as a PyTorch extension: the tensors' checks and pointers around blockquant.h
// and decode.h. kernels.py compiles this one file once per instruction-set variant (simd.h).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#define WAFER_PARALLEL_FOR at::parallel_for
#define WAFER_NUM_THREADS at::get_num_threads
#define WAFER_THREAD_NUM at::get_thread_num
#include "decode.h"

namespace {

// The record's size names the format (blockquant.h).
int format_of(const torch::Tensor& packed) {
    const int64_t rec = packed.size(2);
    for (int fmt : {wafer::Q4, wafer::Q5, wafer::Q8, wafer::K4, wafer::K6})
        if (rec == wafer::record_bytes(fmt)) return fmt;
    TORCH_CHECK(false, "a record of 320 (4-bit), 384 (5-bit), 576 (8-bit), 2368 (K4) or 3360 (K6) bytes, not ", rec);
    return 0;
}

void check_packed(const torch::Tensor& packed, int64_t k, int64_t n) {
    TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 3,
                "packed: contiguous uint8 [ceil(n/16), K / inputs of a record, record]");
    const int64_t per = wafer::record_inputs(format_of(packed));
    TORCH_CHECK(k % per == 0 && packed.size(0) == (n + 15) / 16 && packed.size(1) == k / per,
                "packed: [ceil(n/16), K / inputs of a record, record] for this K and n");
}

}  // namespace

// y [M, n] = x [M, K] @ W.T, W packed by blockquant.py: uint8 [ceil(n/16), K / inputs of a record, record].
torch::Tensor block_linear(torch::Tensor x, torch::Tensor packed, int64_t n) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous [M, K] float32");
    TORCH_CHECK(x.size(1) % wafer::QK == 0, "K must be a multiple of 32");
    check_packed(packed, x.size(1), n);
    auto y = torch::empty({x.size(0), n}, torch::kFloat32);
    wafer::block_linear(x.data_ptr<float>(), x.size(0), x.size(1), packed.data_ptr<uint8_t>(), format_of(packed), n,
                        y.data_ptr<float>());
    return y;
}

// x [M, hidden]: the tokens' embeddings. positions, slots [M] int64. cos, sin [rows, head_dim]:
// a token's rotary angles are the row of its position, or, when rope_rows [M] int64 is not empty,
// the row it names (tables made for the step); cos_local, sin_local (empty: none) are the tables of
// the layers with local_rope (Gemma 3's windowed layers). tables [groups, slots, max_blocks] int64:
// each slot's blocks in position order, per group of layers (kv_cache.py: windowed layers have
// pools and tables of their own).
// layers: per layer 2 norm weights (before attention, before the MLP), 4 linears (qkv, o, gate_up,
// down) of 2 tensors each (packed blocks, bias or an empty tensor), then the layer's K and V pools
// [kv_heads, blocks, block, head_dim] (float32 or bfloat16; int8 rows carry 4 more bytes, their
// float32 scale): 12 tensors a layer; with per_layer 16 (Gemma 3), 4 more: the query and key head
// norms and the norms of the attention's and the MLP's outputs. After the last layer the output
// head's 2. out_features: each linear's output size, in the same order. windows: each layer's
// attention window (0: none); local_rope: whether it takes cos_local and sin_local; groups: its group
// (of tables; every layer of a group has pools of one size). norm: the final
// norm's weight. gelu: the MLP's gate is GELU (tanh form), not SiLU. attn_scale: the queries' scale
// (0: 1 / sqrt(head_dim)). Returns logits [len(logit_rows), vocab] for those rows of x (none when it
// is empty: a prompt chunk before the last). Without the head's 2 tensors (a pipeline stage before
// the last) it returns every row's hidden state [M, hidden] after the layers, for the next stage.
torch::Tensor decode_step(torch::Tensor x, torch::Tensor positions, torch::Tensor slots, torch::Tensor cos,
                          torch::Tensor sin, torch::Tensor cos_local, torch::Tensor sin_local, torch::Tensor rope_rows,
                          torch::Tensor tables, std::vector<torch::Tensor> layers, std::vector<int64_t> out_features,
                          torch::Tensor norm, double eps, int64_t n_heads, int64_t n_kv, int64_t head_dim,
                          std::vector<int64_t> windows, std::vector<int64_t> local_rope, std::vector<int64_t> groups,
                          int64_t per_layer, bool gelu,
                          double attn_scale, torch::Tensor logit_rows) {
    TORCH_CHECK(per_layer == 12 || per_layer == 16, "12 tensors per layer (16 with Gemma 3's norms)");
    TORCH_CHECK(layers.size() % per_layer == 2 || layers.size() % per_layer == 0, "tensors per layer, and 2 for the head, if any");
    const bool has_head = static_cast<int64_t>(layers.size()) % per_layer == 2;
    const int64_t n_layers = static_cast<int64_t>(layers.size()) / per_layer;
    TORCH_CHECK(static_cast<int64_t>(out_features.size()) == 4 * n_layers + (has_head ? 1 : 0), "an output size per linear");
    TORCH_CHECK(static_cast<int64_t>(windows.size()) == n_layers && static_cast<int64_t>(local_rope.size()) == n_layers &&
                static_cast<int64_t>(groups.size()) == n_layers, "a window, a RoPE choice and a group per layer");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: [M, hidden] float32");
    TORCH_CHECK(positions.scalar_type() == torch::kInt64 && slots.scalar_type() == torch::kInt64 &&
                positions.numel() == x.size(0) && slots.numel() == x.size(0), "positions, slots: [M] int64");
    x = x.contiguous();
    const int64_t hidden = x.size(1), q_dim = n_heads * head_dim;
    TORCH_CHECK(n_kv > 0 && n_heads % n_kv == 0, "query heads: a whole number per KV head");
    TORCH_CHECK(n_layers > 0 && layers[10].dim() == 4, "KV pools: [kv_heads, blocks, block, head_dim]");
    const int64_t block = layers[10].size(2);
    TORCH_CHECK(block > 0 && (block & (block - 1)) == 0, "KV blocks: a power of two of positions");
    const auto kv_dtype = layers[10].scalar_type();
    TORCH_CHECK(kv_dtype == torch::kFloat32 || kv_dtype == torch::kBFloat16 || kv_dtype == torch::kInt8,
                "KV caches: float32, bfloat16 or int8");
    const wafer::KVType kv_type = kv_dtype == torch::kFloat32    ? wafer::KVType::f32
                                  : kv_dtype == torch::kBFloat16 ? wafer::KVType::bf16
                                                                 : wafer::KVType::i8;
    const int64_t row = kv_type == wafer::KVType::i8 ? head_dim + 4 : head_dim;
    TORCH_CHECK(tables.scalar_type() == torch::kInt64 && tables.dim() == 3 && tables.is_contiguous(),
                "tables: contiguous [groups, slots, max_blocks] int64");
    const int64_t n_groups = tables.size(0), n_slots = tables.size(1), stride = tables.size(2);
    std::vector<int64_t> n_blocks(n_groups, 0);  // each group's pool size, from its layers' pools
    for (int64_t l = 0; l < n_layers; ++l) {
        TORCH_CHECK(groups[l] >= 0 && groups[l] < n_groups, "a layer's group has tables");
        const int64_t have = layers[per_layer * l + 10].size(1);
        TORCH_CHECK(n_blocks[groups[l]] == 0 || n_blocks[groups[l]] == have, "the pools of a group's layers have the same blocks");
        n_blocks[groups[l]] = have;
    }
    cos = cos.contiguous();
    sin = sin.contiguous();
    TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && cos.dim() == 2 && cos.size(1) == head_dim && sin.sizes() == cos.sizes() &&
                sin.scalar_type() == torch::kFloat32, "cos, sin: [rows, head_dim] float32");
    const bool two_bases = cos_local.numel() > 0;
    if (two_bases) {
        cos_local = cos_local.contiguous();
        sin_local = sin_local.contiguous();
        TORCH_CHECK(cos_local.sizes() == cos.sizes() && sin_local.sizes() == cos.sizes() &&
                    cos_local.scalar_type() == torch::kFloat32 && sin_local.scalar_type() == torch::kFloat32,
                    "cos_local, sin_local: as cos");
    }
    const bool own_rows = rope_rows.numel() > 0;
    if (own_rows) {
        TORCH_CHECK(rope_rows.scalar_type() == torch::kInt64 && rope_rows.numel() == x.size(0), "rope_rows: [M] int64");
        rope_rows = rope_rows.contiguous();
        const int64_t* r = rope_rows.data_ptr<int64_t>();
        for (int64_t m = 0; m < x.size(0); ++m) TORCH_CHECK(r[m] >= 0 && r[m] < cos.size(0), "rope_rows: a row of cos");
    }
    {  // every block a token writes or reads must lie in the pools
        const int64_t *pos = positions.data_ptr<int64_t>(), *slot = slots.data_ptr<int64_t>();
        const int64_t* t = tables.data_ptr<int64_t>();
        for (int64_t m = 0; m < x.size(0); ++m) {
            TORCH_CHECK(slot[m] >= 0 && slot[m] < n_slots && pos[m] >= 0 && (own_rows || pos[m] < cos.size(0)) &&
                        pos[m] / block < stride, "a token's slot or position lies outside the tables");
            for (int64_t g = 0; g < n_groups; ++g) {
                if (n_blocks[g] == 0) continue;  // a group with none of this stage's layers
                const int64_t* r = t + (g * n_slots + slot[m]) * stride;
                for (int64_t i = 0; i <= pos[m] / block; ++i)
                    TORCH_CHECK(r[i] >= 0 && r[i] < n_blocks[g], "a table names a block outside the pools");
            }
        }
    }
    auto lin = [&](size_t i, int64_t in, int64_t out) {
        const torch::Tensor& packed = layers[i];
        check_packed(packed, in, out);
        const torch::Tensor& bias = layers[i + 1];
        return wafer::Linear{packed.data_ptr<uint8_t>(), format_of(packed), bias.numel() ? bias.data_ptr<float>() : nullptr,
                             in, out};
    };
    auto weight = [&](const torch::Tensor& w, int64_t n) {
        TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.numel() == n, "a norm's weight: float32 [n]");
        return w.data_ptr<float>();
    };
    std::vector<wafer::Layer> ls;
    for (int64_t l = 0; l < n_layers; ++l) {
        const size_t b = per_layer * l;
        const int64_t* nout = out_features.data() + 4 * l;
        torch::Tensor kc = layers[b + 10], vc = layers[b + 11];
        TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.dim() == 4 && kc.size(0) == n_kv &&
                    kc.size(2) == block && kc.size(3) == row && vc.sizes() == kc.sizes() &&
                    kc.scalar_type() == kv_dtype && vc.scalar_type() == kv_dtype,
                    "KV caches: contiguous [kv_heads, blocks, block, head_dim (+4 for int8's scale)], all of one dtype");

        wafer::Layer L{weight(layers[b], hidden), weight(layers[b + 1], hidden), lin(b + 2, hidden, nout[0]),
                       lin(b + 4, q_dim, nout[1]), lin(b + 6, hidden, nout[2]), lin(b + 8, nout[2] / 2, nout[3]),
                       kc.data_ptr(), vc.data_ptr()};
        if (per_layer == 16) {
            L.q_norm = weight(layers[b + 12], head_dim);
            L.k_norm = weight(layers[b + 13], head_dim);
            L.attn_out_norm = weight(layers[b + 14], hidden);
            L.mlp_out_norm = weight(layers[b + 15], hidden);
        }
        TORCH_CHECK(windows[l] >= 0, "a window is 0 (none) or more");
        L.window = windows[l];
        L.local_rope = local_rope[l] != 0;
        L.table = tables.data_ptr<int64_t>() + groups[l] * n_slots * stride;
        L.blocks = n_blocks[groups[l]];
        TORCH_CHECK(!L.local_rope || two_bases, "a layer takes cos_local, which is empty");
        ls.push_back(L);
    }
    const wafer::Linear head = has_head ? lin(per_layer * n_layers, hidden, out_features.back()) : wafer::Linear{nullptr, 8, nullptr, hidden, hidden};
    TORCH_CHECK(logit_rows.scalar_type() == torch::kInt64 && logit_rows.dim() == 1, "logit_rows: [R] int64");
    logit_rows = logit_rows.contiguous();
    const int64_t* rows = logit_rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < logit_rows.numel(); ++i) TORCH_CHECK(rows[i] >= 0 && rows[i] < x.size(0), "logit_rows: a row of x");
    auto logits = has_head ? torch::empty({logit_rows.numel(), head.out}, torch::kFloat32)
                           : torch::empty({x.size(0), hidden}, torch::kFloat32);
    wafer::Dims dims{hidden, n_heads, n_kv, head_dim, 0, static_cast<float>(eps), kv_type};
    dims.gelu = gelu;
    dims.attn_scale = static_cast<float>(attn_scale);
    wafer::Rope rope;
    if (two_bases) {
        rope.cos_local = cos_local.data_ptr<float>();
        rope.sin_local = sin_local.data_ptr<float>();
    }
    if (own_rows) rope.row = rope_rows.data_ptr<int64_t>();
    wafer::decode_step(x.data_ptr<float>(), x.size(0), positions.data_ptr<int64_t>(), slots.data_ptr<int64_t>(),
                       wafer::Tables{tables.data_ptr<int64_t>(), stride, block, n_blocks[groups[0]]},
                       cos.data_ptr<float>(), sin.data_ptr<float>(), ls, weight(norm, hidden), head, dims, rows,
                       logit_rows.numel(), logits.data_ptr<float>(), rope);
    return logits;
}

// The greedy token of each row of logits [M, V] (argmax_rows in blockquant.h).
torch::Tensor argmax_rows(torch::Tensor x) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1, "x: [M, V] float32, rows contiguous");
    TORCH_CHECK(x.size(1) > 0 && x.size(1) < (int64_t{1} << 31) - 16, "V must be in 1..2^31-17");
    auto out = torch::empty({x.size(0)}, torch::kInt64);
    wafer::argmax_rows(x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), out.data_ptr<int64_t>());
    return out;
}

// Rows `ids` of an embedding table kept in GGUF's Q8_0 blocks (raw [vocab, row bytes] uint8: for
// each 32 values a float16 scale d and 32 int8 codes q), as float32 [len(ids), dim]: d * q, the one
// rounding of gguf-py's arithmetic. One call where PyTorch took several: between decode steps the
// caches hold none of their code.
torch::Tensor embed_q8_0(torch::Tensor raw, torch::Tensor ids) {
    constexpr int64_t kBlock = 2 + wafer::QK;
    TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kUInt8 && raw.stride(1) == 1 && raw.size(1) % kBlock == 0,
                "raw: [vocab, row bytes] uint8, rows contiguous, of whole Q8_0 blocks");
    TORCH_CHECK(ids.scalar_type() == torch::kInt64, "ids: int64");
    ids = ids.contiguous();
    const int64_t n = ids.numel(), blocks = raw.size(1) / kBlock;
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < raw.size(0), "ids: a row of the table");
    auto out = torch::empty({n, blocks * wafer::QK}, torch::kFloat32);
    float* o = out.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
        const uint8_t* block = raw.data_ptr<uint8_t>() + id[i] * raw.stride(0);
        for (int64_t b = 0; b < blocks; ++b, block += kBlock, o += wafer::QK) {
            uint16_t bits;
            std::memcpy(&bits, block, 2);
            const float d = simd::half_to_float(bits);
            const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
            for (int64_t j = 0; j < wafer::QK; ++j) o[j] = d * static_cast<float>(q[j]);
        }
    }
    return out;
}

// All four run without the GIL, as PyTorch's own operators do: other Python threads of the process
// (an application that runs the server in a thread, the tests' clients) go on while a step computes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
    mod.attr("variant") = simd::kVariant;
    mod.def("decode_step", &decode_step, "one step of every layer for a few tokens (decode.h)",
            py::call_guard<py::gil_scoped_release>());
    mod.def("block_linear", &block_linear, "x @ W.T, W in wafer's block records (blockquant.py)",
            py::call_guard<py::gil_scoped_release>());
    mod.def("argmax_rows", &argmax_rows, "each row's first largest value's index, as torch.max(dim=-1)",
            py::call_guard<py::gil_scoped_release>());
    mod.def("embed_q8_0", &embed_q8_0, "rows of an embedding table in GGUF's Q8_0 blocks, as float32",
            py::call_guard<py::gil_scoped_release>());
}
