// wafer's CPU kernels as a PyTorch extension: the tensors' checks and pointers around blockquant.h
// and decode.h. kernels.py compiles this one file once per instruction-set variant (simd.h).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#define WAFER_PARALLEL_FOR at::parallel_for
#define WAFER_NUM_THREADS at::get_num_threads
#define WAFER_THREAD_NUM at::get_thread_num
#include "decode.h"
#include "probe.h"
#include "sampling.h"

namespace {

// The record's size names the format (blockquant.h).
int format_of(const torch::Tensor& packed) {
    const int64_t rec = packed.size(2);
    for (int fmt : {wafer::Q4, wafer::Q5, wafer::Q6, wafer::Q8, wafer::K4, wafer::K6})
        if (rec == wafer::record_bytes(fmt)) return fmt;
    TORCH_CHECK(false, "a record of 320 (4-bit), 384 (5-bit), 448 (6-bit), 576 (8-bit), 2368 (K4) or 3360 (K6) bytes, not ", rec);
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
// ahead: the weights' prefetch distance in bytes (negative: the prefetch table's for this shape).
torch::Tensor block_linear(torch::Tensor x, torch::Tensor packed, int64_t n, int64_t ahead) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous [M, K] float32");
    TORCH_CHECK(x.size(1) % wafer::QK == 0, "K must be a multiple of 32");
    check_packed(packed, x.size(1), n);
    auto y = torch::empty({x.size(0), n}, torch::kFloat32);
    wafer::block_linear(x.data_ptr<float>(), x.size(0), x.size(1), packed.data_ptr<uint8_t>(), format_of(packed), n,
                        y.data_ptr<float>(), ahead);
    return y;
}

// Seconds of block_linear over each of `copies` (records of one shape) in turn, prefetching `ahead`
// bytes on: copies that together outsize the caches time the weights' stream from memory, as in a step.
double stream_linear(std::vector<torch::Tensor> copies, torch::Tensor x, int64_t n, int64_t ahead) {
    TORCH_CHECK(!copies.empty(), "copies: at least one");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous [M, K] float32");
    for (const auto& c : copies) check_packed(c, x.size(1), n);
    auto y = torch::empty({x.size(0), n}, torch::kFloat32);
    const int fmt = format_of(copies[0]);
    const double t0 = wafer::seconds_now();
    for (const auto& c : copies)
        wafer::block_linear(x.data_ptr<float>(), x.size(0), x.size(1), c.data_ptr<uint8_t>(), fmt, n, y.data_ptr<float>(), ahead);
    return wafer::seconds_now() - t0;
}

// The prefetch table (blockquant.h): (format, out, in) -> bytes ahead, replacing what it held.
void set_prefetch(const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>>& rows) {
    std::map<std::tuple<int, int64_t, int64_t>, int64_t> table;
    for (const auto& [fmt, n, k, ahead] : rows) {
        TORCH_CHECK(ahead >= 0, "a prefetch distance is 0 or more bytes");
        table[std::make_tuple(static_cast<int>(fmt), n, k)] = ahead;
    }
    wafer::prefetch_table().replace(std::move(table));
}

int64_t prefetch_ahead(int64_t fmt, int64_t n, int64_t k) { return wafer::prefetch_table().ahead(static_cast<int>(fmt), n, k); }

// Seconds of one read of buf (uint8, 64-byte aligned, at least 256 bytes a thread) by every thread,
// prefetching `ahead` bytes on (0: none).
double read_pass(torch::Tensor buf, int64_t ahead) {
    TORCH_CHECK(buf.scalar_type() == torch::kUInt8 && buf.is_contiguous() && buf.numel() >= 256 * at::get_num_threads(),
                "buf: contiguous uint8, 256 bytes a thread or more");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(buf.data_ptr()) % 64 == 0, "buf: 64-byte aligned");
    float sink = 0.0f;
    TORCH_CHECK(ahead >= 0, "ahead: 0 or more bytes");
    const double took =
        wafer::read_pass(reinterpret_cast<const float*>(buf.data_ptr<uint8_t>()), buf.numel(), ahead, &sink);
    volatile float keep = sink;
    (void)keep;
    return took;
}

// A model's layers for decode steps, checked once when it is made: passing and checking its few
// hundred tensors on every step cost ~60 us a step, its caches cold after the step's weights.
// layers: per layer 2 norm weights (before attention, before the MLP), 4 linears (qkv, o, gate_up,
// down) of 2 tensors each (packed blocks, bias or an empty tensor), then the layer's K and V pools
// [kv_heads, blocks, block, head_dim] (float32 or bfloat16; int8 rows carry 4 more bytes, their
// float32 scale): 12 tensors a layer; with per_layer 16 (Gemma 3), 4 more: the query and key head
// norms and the norms of the attention's and the MLP's outputs. After the last layer the output
// head's 2. out_features: each linear's output size, in the same order. windows: each layer's
// attention window (0: none); local_rope: whether it takes cos_local and sin_local; groups: its group
// (of tables; every layer of a group has pools of one size). norm: the final norm's weight [hidden].
// gelu: the MLP's gate is GELU (tanh form), not SiLU. attn_scale: the queries' scale (0: 1 /
// sqrt(head_dim)). It holds the tensors, so they live as long as it.
class Model {
  public:
    Model(std::vector<torch::Tensor> layers, std::vector<int64_t> out_features, torch::Tensor norm, double eps,
          int64_t n_heads, int64_t n_kv, int64_t head_dim, std::vector<int64_t> windows,
          std::vector<int64_t> local_rope, std::vector<int64_t> groups, int64_t per_layer, bool gelu,
          double attn_scale)
        : keep_(std::move(layers)), norm_tensor_(norm), groups_(std::move(groups)) {
        const std::vector<torch::Tensor>& t = keep_;
        TORCH_CHECK(per_layer == 12 || per_layer == 16, "12 tensors per layer (16 with Gemma 3's norms)");
        const int64_t n = static_cast<int64_t>(t.size());
        TORCH_CHECK(n % per_layer == 2 || n % per_layer == 0, "tensors per layer, and 2 for the head, if any");
        has_head_ = n % per_layer == 2;
        const int64_t n_layers = n / per_layer;
        TORCH_CHECK(static_cast<int64_t>(out_features.size()) == 4 * n_layers + (has_head_ ? 1 : 0),
                    "an output size per linear");
        TORCH_CHECK(static_cast<int64_t>(windows.size()) == n_layers && static_cast<int64_t>(local_rope.size()) == n_layers &&
                    static_cast<int64_t>(groups_.size()) == n_layers, "a window, a RoPE choice and a group per layer");
        TORCH_CHECK(n_kv > 0 && n_heads % n_kv == 0, "query heads: a whole number per KV head");
        TORCH_CHECK(n_layers > 0 && t[10].dim() == 4, "KV pools: [kv_heads, blocks, block, head_dim]");
        TORCH_CHECK(norm.dim() == 1, "norm: [hidden]");
        hidden_ = norm.numel();
        const int64_t q_dim = n_heads * head_dim;
        block_ = t[10].size(2);
        TORCH_CHECK(block_ > 0 && (block_ & (block_ - 1)) == 0, "KV blocks: a power of two of positions");
        const auto kv_dtype = t[10].scalar_type();
        TORCH_CHECK(kv_dtype == torch::kFloat32 || kv_dtype == torch::kBFloat16 || kv_dtype == torch::kInt8,
                    "KV caches: float32, bfloat16 or int8");
        const wafer::KVType kv_type = kv_dtype == torch::kFloat32    ? wafer::KVType::f32
                                      : kv_dtype == torch::kBFloat16 ? wafer::KVType::bf16
                                                                     : wafer::KVType::i8;
        const int64_t row = kv_type == wafer::KVType::i8 ? head_dim + 4 : head_dim;
        for (int64_t l = 0; l < n_layers; ++l) {
            TORCH_CHECK(groups_[l] >= 0, "a layer's group is 0 or more");
            if (groups_[l] >= static_cast<int64_t>(n_blocks_.size())) n_blocks_.resize(groups_[l] + 1, 0);
            const int64_t have = t[per_layer * l + 10].size(1);
            TORCH_CHECK(n_blocks_[groups_[l]] == 0 || n_blocks_[groups_[l]] == have,
                        "the pools of a group's layers have the same blocks");
            n_blocks_[groups_[l]] = have;
        }
        auto lin = [&](size_t i, int64_t in, int64_t out) {
            const torch::Tensor& packed = t[i];
            check_packed(packed, in, out);
            const torch::Tensor& bias = t[i + 1];
            // The prefetch distance is the table's when the model is made (kernels/tuner.py sets it at load).
            return wafer::Linear{packed.data_ptr<uint8_t>(), format_of(packed), bias.numel() ? bias.data_ptr<float>() : nullptr,
                                 in, out, wafer::prefetch_table().ahead(format_of(packed), out, in)};
        };
        auto weight = [&](const torch::Tensor& w, int64_t size) {
            TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.numel() == size,
                        "a norm's weight: float32 [n]");
            return w.data_ptr<float>();
        };
        for (int64_t l = 0; l < n_layers; ++l) {
            const size_t b = per_layer * l;
            const int64_t* nout = out_features.data() + 4 * l;
            const torch::Tensor &kc = t[b + 10], &vc = t[b + 11];
            TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.dim() == 4 && kc.size(0) == n_kv &&
                        kc.size(2) == block_ && kc.size(3) == row && vc.sizes() == kc.sizes() &&
                        kc.scalar_type() == kv_dtype && vc.scalar_type() == kv_dtype,
                        "KV caches: contiguous [kv_heads, blocks, block, head_dim (+4 for int8's scale)], all of one dtype");
            wafer::Layer L{weight(t[b], hidden_), weight(t[b + 1], hidden_), lin(b + 2, hidden_, nout[0]),
                           lin(b + 4, q_dim, nout[1]), lin(b + 6, hidden_, nout[2]), lin(b + 8, nout[2] / 2, nout[3]),
                           kc.data_ptr(), vc.data_ptr()};
            if (per_layer == 16) {
                L.q_norm = weight(t[b + 12], head_dim);
                L.k_norm = weight(t[b + 13], head_dim);
                L.attn_out_norm = weight(t[b + 14], hidden_);
                L.mlp_out_norm = weight(t[b + 15], hidden_);
            }
            TORCH_CHECK(windows[l] >= 0, "a window is 0 (none) or more");
            L.window = windows[l];
            L.local_rope = local_rope[l] != 0;
            two_bases_ = two_bases_ || L.local_rope;
            L.blocks = n_blocks_[groups_[l]];
            layers_.push_back(L);
        }
        head_ = has_head_ ? lin(per_layer * n_layers, hidden_, out_features.back()) : wafer::Linear{nullptr, 8, nullptr, hidden_, hidden_};
        norm_ = weight(norm, hidden_);
        dims_ = wafer::Dims{hidden_, n_heads, n_kv, head_dim, 0, static_cast<float>(eps), kv_type};
        dims_.gelu = gelu;
        dims_.attn_scale = static_cast<float>(attn_scale);
    }

    // One step. x [M, hidden]: the tokens' embeddings. positions, slots [M] int64. cos, sin [rows,
    // head_dim]: a token's rotary angles are the row of its position, or, when rope_rows [M] int64 is
    // not empty, the row it names (tables made for the step); cos_local, sin_local (empty: none) are
    // the tables of the layers with local_rope (Gemma 3's windowed layers). tables [groups, slots,
    // max_blocks] int64: each slot's blocks in position order, per group of layers (kv_cache.py:
    // windowed layers have pools and tables of their own). Returns logits [len(logit_rows), vocab]
    // for those rows of x (none when it is empty: a prompt chunk before the last). Without a head (a
    // pipeline stage before the last) it returns every row's hidden state [M, hidden] after the
    // layers, for the next stage. tree [M, width] int64 (empty: none): draft trees' rows (decode.h's
    // Tree): token m's positions from tree[m][0] up to its own lie at tree[m][1...].
    torch::Tensor step(torch::Tensor x, torch::Tensor positions, torch::Tensor slots, torch::Tensor cos,
                       torch::Tensor sin, torch::Tensor cos_local, torch::Tensor sin_local, torch::Tensor rope_rows,
                       torch::Tensor tables, torch::Tensor logit_rows, torch::Tensor tree) const {
        TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) == hidden_, "x: [M, hidden] float32");
        TORCH_CHECK(positions.scalar_type() == torch::kInt64 && slots.scalar_type() == torch::kInt64 &&
                    positions.numel() == x.size(0) && slots.numel() == x.size(0), "positions, slots: [M] int64");
        x = x.contiguous();
        positions = positions.contiguous();
        slots = slots.contiguous();
        const int64_t head_dim = dims_.head_dim;
        TORCH_CHECK(tables.scalar_type() == torch::kInt64 && tables.dim() == 3 && tables.is_contiguous(),
                    "tables: contiguous [groups, slots, max_blocks] int64");
        const int64_t n_groups = tables.size(0), n_slots = tables.size(1), stride = tables.size(2);
        TORCH_CHECK(n_groups >= static_cast<int64_t>(n_blocks_.size()), "a layer's group has tables");
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
        TORCH_CHECK(two_bases || !two_bases_, "a layer takes cos_local, which is empty");
        const bool own_rows = rope_rows.numel() > 0;
        if (own_rows) {
            TORCH_CHECK(rope_rows.scalar_type() == torch::kInt64 && rope_rows.numel() == x.size(0), "rope_rows: [M] int64");
            rope_rows = rope_rows.contiguous();
            const int64_t* r = rope_rows.data_ptr<int64_t>();
            for (int64_t m = 0; m < x.size(0); ++m) TORCH_CHECK(r[m] >= 0 && r[m] < cos.size(0), "rope_rows: a row of cos");
        }
        wafer::Tree remap;
        if (tree.numel() > 0) {
            TORCH_CHECK(tree.scalar_type() == torch::kInt64 && tree.dim() == 2 && tree.size(0) == x.size(0) &&
                        tree.size(1) >= 1, "tree: [M, width] int64");
            tree = tree.contiguous();
            remap = wafer::Tree{tree.data_ptr<int64_t>(), tree.size(1)};
        }
        {  // every block a token writes or reads must lie in the pools
            const int64_t *pos = positions.data_ptr<int64_t>(), *slot = slots.data_ptr<int64_t>();
            const int64_t* t = tables.data_ptr<int64_t>();
            for (int64_t m = 0; m < x.size(0); ++m) {
                TORCH_CHECK(slot[m] >= 0 && slot[m] < n_slots && pos[m] >= 0 && (own_rows || pos[m] < cos.size(0)) &&
                            pos[m] / block_ < stride, "a token's slot or position lies outside the tables");
                int64_t reach = pos[m];  // the furthest position it reads or writes
                if (remap.rows != nullptr && remap.base(m) <= pos[m]) {
                    TORCH_CHECK(remap.base(m) >= 0 && pos[m] - remap.base(m) + 1 < remap.width, "tree: a row shorter than its path");
                    for (int64_t p = remap.base(m); p <= pos[m]; ++p) {
                        TORCH_CHECK(remap.place(m, p) >= 0 && remap.place(m, p) / block_ < stride, "tree: a position outside the tables");
                        reach = std::max(reach, remap.place(m, p));
                    }
                }
                for (int64_t g = 0; g < static_cast<int64_t>(n_blocks_.size()); ++g) {
                    if (n_blocks_[g] == 0) continue;  // a group with none of this stage's layers
                    const int64_t* r = t + (g * n_slots + slot[m]) * stride;
                    for (int64_t i = 0; i <= reach / block_; ++i)
                        TORCH_CHECK(r[i] >= 0 && r[i] < n_blocks_[g], "a table names a block outside the pools");
                }
            }
        }
        std::vector<wafer::Layer> ls = layers_;
        for (size_t l = 0; l < ls.size(); ++l) ls[l].table = tables.data_ptr<int64_t>() + groups_[l] * n_slots * stride;
        TORCH_CHECK(logit_rows.scalar_type() == torch::kInt64 && logit_rows.dim() == 1, "logit_rows: [R] int64");
        logit_rows = logit_rows.contiguous();
        const int64_t* rows = logit_rows.data_ptr<int64_t>();
        for (int64_t i = 0; i < logit_rows.numel(); ++i) TORCH_CHECK(rows[i] >= 0 && rows[i] < x.size(0), "logit_rows: a row of x");
        auto logits = has_head_ ? torch::empty({logit_rows.numel(), head_.out}, torch::kFloat32)
                                : torch::empty({x.size(0), hidden_}, torch::kFloat32);
        wafer::Rope rope;
        if (two_bases) {
            rope.cos_local = cos_local.data_ptr<float>();
            rope.sin_local = sin_local.data_ptr<float>();
        }
        if (own_rows) rope.row = rope_rows.data_ptr<int64_t>();
        wafer::decode_step(x.data_ptr<float>(), x.size(0), positions.data_ptr<int64_t>(), slots.data_ptr<int64_t>(),
                           wafer::Tables{tables.data_ptr<int64_t>(), stride, block_, n_blocks_[groups_[0]]},
                           cos.data_ptr<float>(), sin.data_ptr<float>(), ls, norm_, head_, dims_, rows,
                           logit_rows.numel(), logits.data_ptr<float>(), rope, remap);
        return logits;
    }

  private:
    std::vector<torch::Tensor> keep_;  // the layers' tensors and the head's
    torch::Tensor norm_tensor_;
    std::vector<int64_t> groups_, n_blocks_;  // each layer's group; each group's pool size (0: no layer of it)
    std::vector<wafer::Layer> layers_;  // all but their tables, which come with each step
    wafer::Linear head_{};
    bool has_head_ = false;
    bool two_bases_ = false;  // some layer takes cos_local (Gemma 3's windowed layers)
    const float* norm_ = nullptr;
    wafer::Dims dims_{};
    int64_t block_ = 0, hidden_ = 0;
};

// The greedy token of each row of logits [M, V] (argmax_rows in blockquant.h).
torch::Tensor argmax_rows(torch::Tensor x) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1, "x: [M, V] float32, rows contiguous");
    TORCH_CHECK(x.size(1) > 0 && x.size(1) < (int64_t{1} << 31) - 16, "V must be in 1..2^31-17");
    auto out = torch::empty({x.size(0)}, torch::kInt64);
    wafer::argmax_rows(x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), out.data_ptr<int64_t>());
    return out;
}

// Each row's k most probable tokens at its temperature, with their probabilities (sampling.h).
std::tuple<torch::Tensor, torch::Tensor> top_candidates(torch::Tensor x, torch::Tensor temps, int64_t k) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1, "x: [M, V] float32, rows contiguous");
    TORCH_CHECK(x.size(1) > 0, "V must be at least 1");
    TORCH_CHECK(temps.dim() == 1 && temps.scalar_type() == torch::kFloat32 && temps.size(0) == x.size(0),
                "temps: float32 [M]");
    temps = temps.contiguous();
    const float* t = temps.data_ptr<float>();
    for (int64_t r = 0; r < x.size(0); ++r) TORCH_CHECK(t[r] > 0.0f && std::isfinite(t[r]), "temperatures must be positive");
    k = std::min<int64_t>(k, x.size(1));
    TORCH_CHECK(k >= 1, "k must be at least 1");
    auto probs = torch::empty({x.size(0), k}, torch::kFloat32);
    auto idx = torch::empty({x.size(0), k}, torch::kInt64);
    wafer::top_candidates(x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), t, k, probs.data_ptr<float>(),
                          idx.data_ptr<int64_t>());
    return {probs, idx};
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

// The step and all three functions run without the GIL, as PyTorch's own operators do: other Python threads of the process
// (an application that runs the server in a thread, the tests' clients) go on while a step computes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
    mod.attr("variant") = simd::kVariant;
    // Local to each variant's module: a process may load several (the tests do), each with its Model.
    py::class_<Model>(mod, "Model", "a model's layers for decode steps (decode.h), checked once", py::module_local())
        .def(py::init<std::vector<torch::Tensor>, std::vector<int64_t>, torch::Tensor, double, int64_t, int64_t, int64_t,
                      std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, int64_t, bool, double>())
        .def("step", &Model::step, "one step of every layer for a few tokens", py::call_guard<py::gil_scoped_release>());
    mod.def("block_linear", &block_linear, "x @ W.T, W in wafer's block records (blockquant.py)", py::arg("x"),
            py::arg("packed"), py::arg("n"), py::arg("ahead") = -1, py::call_guard<py::gil_scoped_release>());
    mod.def("stream_linear", &stream_linear, "seconds of block_linear over each copy in turn",
            py::call_guard<py::gil_scoped_release>());
    mod.def("set_prefetch", &set_prefetch, "the weights' prefetch distance per (format, out, in), in bytes");
    mod.def("prefetch_ahead", &prefetch_ahead, "the prefetch distance block_linear takes for (format, out, in)");
    mod.def("read_pass", &read_pass, "seconds of one read of a buffer by every thread", py::arg("buf"),
            py::arg("ahead") = 0, py::call_guard<py::gil_scoped_release>());
    mod.def("int8_peak", &wafer::int8_peak, "int8 operations a second of the variant's dot product from registers",
            py::call_guard<py::gil_scoped_release>());
    mod.def("argmax_rows", &argmax_rows, "each row's first largest value's index, as torch.max(dim=-1)",
            py::call_guard<py::gil_scoped_release>());
    mod.def("top_candidates", &top_candidates, "each row's k most probable tokens at its temperature and their "
            "probabilities, as softmax(x / t) then topk", py::call_guard<py::gil_scoped_release>());
    mod.def("embed_q8_0", &embed_q8_0, "rows of an embedding table in GGUF's Q8_0 blocks, as float32",
            py::call_guard<py::gil_scoped_release>());
}
