// Weight-only Linear layers (NOTE: [Weight-only linears] in
// include/dtp/nn/quantize.h): bf16 / float16 / int8 weights against float
// math within bounds derived from the storage step, greedy continuations of
// every family's HF folder against float32's (the fraction of identical
// tokens printed), int8 at TP=2 equal to int8 at TP=1, and the errors.
#include "dist.h"
#include "files.h"

#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/models/generate.h"
#include "dtp/models/hf_llama.h"
#include "dtp/models/parallelize.h"
#include "dtp/module_utils.h"
#include "dtp/nn/quantize.h"
#include "nn/quantized_linear.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <cstdio>
#include <mutex>

using namespace dtp;
using namespace dtp::models;
using dtp::test::expect_error;
using dtp::test::run_ranks;
using LinearImpl = dtp::nn::HookedImpl<torch::nn::LinearImpl>;

namespace {

const std::string kData = DTP_TEST_DATA_DIR;

// Unit roundoffs: float32, float64; bfloat16 and float16 storage (8 and 11
// significant bits).
constexpr double kU32 = 5.960464477539063e-8, kU64 = 1.1102230246251565e-16;
constexpr double kUBf16 = 1.0 / 256, kUHalf = 1.0 / 2048;
// float16's smallest normal is 2^-14: below it the spacing is 2^-24, so a
// stored value is off by at most 2^-25 absolutely.
constexpr double kHalfSubnormalStep = 2.98023223876953125e-8;

// NOTE: [Dot product rounding] A sum of n products computed in floating
// point (any order, FMA or not) is within gamma_n * sum |x_i w_i| of the
// exact sum, gamma_n = n u / (1 - n u) (Higham, Accuracy and Stability of
// Numerical Algorithms, 3.1). A weight-only linear adds, per output, k
// products, one multiplication by a scale (int8: the group sum times its
// scale, or the widened q * scale before BLAS) and the bias: gamma_{k+2}.
double gamma(int64_t n, double u) { return n * u / (1 - n * u); }

double unitRoundoff(at::ScalarType t) { return t == at::kDouble ? kU64 : kU32; }

// |stored - w| per element: what the storage step may change in a weight
// (int8: half a scale, NOTE: [Weight-only linears]).
at::Tensor storageError(const LinearImpl& lin, const at::Tensor& w64) {
  const at::ScalarType t = lin.weight.scalar_type();
  if (t == at::kBFloat16) return w64.abs() * kUBf16;
  if (t == at::kHalf) return w64.abs() * kUHalf + kHalfSubnormalStep;
  const at::Tensor& s = lin.weight_scales;
  const at::Tensor per = s.dim() == 1 ? s.to(at::kDouble).unsqueeze(1).expand(w64.sizes())
                                      : s.to(at::kDouble).repeat_interleave(w64.size(1) / s.size(1), 1);
  return per / 2;
}

struct LinearCase {
  at::ScalarType weight;
  int64_t group, out, in, rows;
  at::ScalarType x;
  at::ScalarType scale = at::kHalf;  // int8's scales
};

std::string describe(const LinearCase& c) {
  return c10::str(c.weight, " group ", c.group, " [", c.out, ", ", c.in, "], x ", c.x, "[", c.rows, ", ", c.in, "]",
                  c.weight == at::kChar ? c10::str(", ", c.scale, " scales") : "");
}

// Max over elements of |a - b| - bound (<= 0 when within).
double excess(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bound) {
  return ((a.to(at::kDouble) - b.to(at::kDouble)).abs() - bound).max().item<double>();
}

double maxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

at::Tensor plain(const at::Tensor& t) { return is_dtensor(t) ? full_tensor(t) : t; }

// Tiny HF folders of every family: the checked-in Llama ones (the HF
// reference's own files) and one per other family written by save_hf from a
// random model (dim 64, so that int8 groups of 32 fit every layer's width).
struct Folder {
  std::string name, dir;
};

std::vector<Folder> familyFolders(const std::string& root) {
  std::vector<Folder> out = {{"hf_tiny (llama)", kData + "/hf_tiny"}, {"hf_tiny_tied (llama)", kData + "/hf_tiny_tied"}};
  auto base = [] {
    LlamaConfig c;
    c.vocab_size = 96;
    c.dim = 64;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.ffn_hidden = 128;
    c.max_seq_len = 32;
    c.seed = 11;
    return c;
  };
  std::vector<std::pair<std::string, LlamaConfig>> configs;
  {
    LlamaConfig c = base();
    c.family = "mistral";
    c.sliding_window = 4;
    configs.emplace_back("mistral", c);
  }
  {
    LlamaConfig c = base();
    c.family = "qwen2";
    c.qkv_bias = true;
    c.tie_embeddings = true;
    configs.emplace_back("qwen2 (tied)", c);
  }
  {
    LlamaConfig c = base();
    c.family = "qwen3";
    c.qk_norm = true;
    c.explicit_head_dim = 32;
    configs.emplace_back("qwen3", c);
  }
  {
    LlamaConfig c = base();
    c.family = "qwen2_moe";
    c.qkv_bias = true;
    c.moe.num_experts = 4;
    c.moe.top_k = 2;
    c.moe.hidden = 32;
    c.moe.shared_hidden = 64;
    configs.emplace_back("qwen2_moe", c);
  }
  for (auto& [name, c] : configs) {
    const std::string dir = root + "/" + c.family;
    Llama model(c);
    // Init std 0.02 leaves near-uniform logits; x8 gives greedy picks margins.
    {
      at::NoGradGuard no_grad;
      for (auto& p : model->parameters()) {
        if (p.dim() >= 2) p.mul_(8);
      }
    }
    save_hf(model, dir);
    out.push_back({name, dir});
  }
  return out;
}

Llama loadAs(const std::string& dir, at::ScalarType dtype, std::optional<nn::WeightOnlyOptions> weight_only,
             const std::function<void(Llama&)>& parallelize = {}) {
  LlamaConfig c = llama_config_from_hf(dir);
  c.dtype = dtype;
  HFLoadOptions o;
  o.weight_only = weight_only;
  Llama model = load_hf_model(c, dir, parallelize, o);
  model->eval();
  return model;
}

// The widest of Q8_0's 32, 16 and 8 that every converted layer's share of a
// row holds whole at `tp` ranks (hf_tiny_tied's MLP is 48 wide).
int64_t groupFor(const std::string& dir, int64_t tp) {
  const LlamaConfig c = llama_config_from_hf(dir);
  for (const int64_t g : {32, 16, 8}) {
    bool fits = true;
    for (const int64_t width : {c.dim, c.hidden(), c.n_heads * c.head_dim(), c.moe.shared_hidden})
      fits = fits && width % (tp * g) == 0;
    if (fits) return g;
  }
  return 0;
}

const std::vector<int64_t> kPrompt = {1, 5, 9, 3, 17};

std::vector<int64_t> greedy(Llama& model, int64_t tokens) {
  GenerateOptions o;
  o.max_new_tokens = tokens;
  return generate(model, {kPrompt}, o)[0];
}

// The final norm's output on kPrompt (the head's input) and the logits.
std::pair<at::Tensor, at::Tensor> headInputAndLogits(Llama& model) {
  at::NoGradGuard no_grad;
  const at::Tensor ids = at::tensor(kPrompt).view({1, -1});
  at::Tensor h = model->tok_embeddings(ids);
  for (const auto& layer : *model->layers) h = layer->as<nn::HookedImpl<TransformerBlockImpl>>()->forward(h);
  h = model->norm(h);
  return {h, model->output(h)};
}

LinearImpl& linearAt(Llama& model, const std::string& fqn) {
  auto* lin = dynamic_cast<LinearImpl*>(model->named_modules("", false)[fqn].get());
  TORCH_INTERNAL_ASSERT(lin != nullptr, fqn);
  return *lin;
}

// A float64 model of `dir` whose converted Linears hold `quantized`'s
// dequantized weights: the function the weight-only model computes.
Llama dequantizedTwin(const std::string& dir, Llama& quantized) {
  Llama twin = loadAs(dir, at::kDouble, std::nullopt);
  at::NoGradGuard no_grad;
  for (const auto& item : quantized->named_modules("", false)) {
    auto* lin = dynamic_cast<LinearImpl*>(item.value().get());
    if (lin == nullptr || !lin->weight_only) continue;
    // Set apart, not copied into: a tied head's copy would change the embedding.
    set_parameter(linearAt(twin, item.key()), "weight", nn::dequantized_weight(*lin, at::kDouble));
  }
  return twin;
}

class QuantizedInferenceTest : public dtp::test::TempDirTest {};

}  // namespace

// One converted Linear against float64 math: (a) the kernel computes the
// dequantized weight's product, within NOTE: [Dot product rounding]; (b) the
// storage step moves each weight by at most its bound (int8 scale / 2,
// bf16 2^-8 and float16 2^-11 relative), so the output moves by at most
// sum_k |x_k| * that. Both matrix-vector (<= 8 rows) and blocked paths, the
// Q8_0 groups of 32, other groups, per-row scales and widths off the SIMD
// step, with each instruction set's kernel this CPU runs.
TEST(QuantizedLinearTest, OutputsWithinTheBoundsOfTheStorageStep) {
  const std::vector<LinearCase> cases = {
      {at::kChar, 32, 40, 96, 1, at::kFloat},   {at::kChar, 32, 40, 96, 13, at::kFloat},
      {at::kChar, 0, 33, 100, 2, at::kFloat},   {at::kChar, 20, 10, 60, 1, at::kFloat},
      {at::kChar, 16, 24, 48, 3, at::kDouble},  {at::kChar, 0, 24, 48, 9, at::kDouble},
      {at::kBFloat16, 0, 40, 100, 1, at::kFloat}, {at::kBFloat16, 0, 40, 100, 12, at::kFloat},
      {at::kHalf, 0, 40, 100, 4, at::kFloat},   {at::kBFloat16, 0, 17, 33, 2, at::kDouble},
      // rows of 8192 inputs and more: four weight rows at a time, then the
      // rows left (NOTE: [Four weight rows at a time])
      {at::kChar, 32, 10, 8224, 1, at::kFloat}, {at::kChar, 0, 9, 8193, 2, at::kFloat},
      {at::kBFloat16, 0, 10, 8200, 3, at::kFloat}, {at::kHalf, 0, 6, 8195, 1, at::kFloat},
      // float32 scales (NOTE: [Float16 scales]: float16 is the default)
      {at::kChar, 32, 40, 96, 1, at::kFloat, at::kFloat},  {at::kChar, 0, 33, 100, 10, at::kFloat, at::kFloat},
      {at::kChar, 32, 10, 8224, 1, at::kFloat, at::kFloat}, {at::kChar, 16, 24, 48, 3, at::kDouble, at::kFloat},
  };
  const int best = nn::detail::weight_only_best_isa();
  for (int isa = 0; isa <= best; ++isa) {  // each kernel this CPU runs: portable, AVX2, AVX-512
  nn::detail::set_weight_only_isa(isa);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  for (const LinearCase& c : cases) {
    SCOPED_TRACE(describe(c) + " isa " + std::to_string(isa));
    nn::Linear lin(torch::nn::LinearOptions(c.in, c.out).bias(true));
    const at::Tensor w = at::randn({c.out, c.in}, gen), b = at::randn({c.out}, gen);
    {
      at::NoGradGuard no_grad;
      lin->weight.copy_(w);
      lin->bias.copy_(b);
    }
    nn::to_weight_only(*lin, nn::WeightOnlyOptions().dtype(c.weight).group_size(c.group).scale_dtype(c.scale),
                       "case");
    EXPECT_EQ(lin->weight.scalar_type(), c.weight);
    if (c.weight == at::kChar) EXPECT_EQ(lin->weight_scales.scalar_type(), c.scale);
    EXPECT_FALSE(lin->weight.requires_grad());
    if (c.x == at::kDouble) lin->bias.set_data(lin->bias.data().to(at::kDouble));
    const at::Tensor x = at::randn({c.rows, c.in}, gen).to(c.x);
    at::Tensor y;
    {
      at::NoGradGuard no_grad;
      y = lin(x);
    }
    ASSERT_EQ(y.scalar_type(), c.x);
    const at::Tensor x64 = x.to(at::kDouble), w64 = w.to(at::kDouble), b64 = b.to(at::kDouble);
    const at::Tensor d64 = nn::dequantized_weight(*lin, at::kDouble);
    const double g = gamma(c.in + 2, unitRoundoff(c.x));
    // (a) the kernel: float math on the stored weights
    const at::Tensor rounding = g * (at::mm(x64.abs(), d64.abs().t()) + b64.abs());
    const double kernel = excess(y, at::mm(x64, d64.t()) + b64, rounding);
    EXPECT_LE(kernel, 0.0) << "the kernel is further from float64 math on the stored weights than gamma_{k+2}";
    // (b) the storage step
    const at::Tensor step = storageError(*lin, w64);
    EXPECT_LE(excess(d64, w64, step), 0.0) << "a stored weight moved more than its bound";
    const at::Tensor bound = at::mm(x64.abs(), step.t()) + rounding;
    const double err = maxAbsDiff(y, at::mm(x64, w64.t()) + b64);
    EXPECT_LE(excess(y, at::mm(x64, w64.t()) + b64, bound), 0.0) << "max |y - x w^T - b| " << err;
    std::printf("isa %d, %s: max |y - float64| %.3g (bound at that element's scale: max %.3g)\n", isa,
                describe(c).c_str(), err, bound.max().item<double>());
  }
  }
  nn::detail::set_weight_only_isa(-1);
}

// NOTE: [Float16 scales]: each float16 scale is max|w| / 127 of its group
// rounded up (within 1 + 2^-10 of it where float16 is normal), so q never
// clamps and |w - q scale| <= scale / 2, at every magnitude float16 holds:
// groups whose scale is subnormal, normal, and near float16's largest. A
// weight whose scale overflows float16 is an error naming the layer and the
// float32 option, which converts it.
TEST(QuantizedLinearTest, Float16ScalesRoundUpAndNeverClamp) {
  auto holding = [](const at::Tensor& w) {  // a bias-free Linear with weight w
    nn::Linear lin(torch::nn::LinearOptions(w.size(1), w.size(0)).bias(false));
    at::NoGradGuard no_grad;
    lin->weight.copy_(w);
    return lin;
  };
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(9);
  // rows 0-3: groups of magnitude 1e-9 (scale under float16's smallest
  // subnormal), 1e-6 (subnormal), 1 and 8e6 (near 127 * 65504).
  const at::Tensor mag = at::tensor({1e-9, 1e-6, 1.0, 8e6}, at::kDouble).unsqueeze(1);
  const at::Tensor w = (at::rand({4, 256}, gen).to(at::kDouble) * 2 - 1) * mag;
  for (int64_t group : {32, 0}) {
    SCOPED_TRACE("group " + std::to_string(group));
    nn::Linear lin = holding(w);
    nn::to_weight_only(*lin, nn::WeightOnlyOptions().group_size(group), "case");
    ASSERT_EQ(lin->weight_scales.scalar_type(), at::kHalf) << "float16 scales by default";
    const int64_t groups = group == 0 ? 1 : 256 / group;
    const at::Tensor w32 = w.to(at::kFloat).to(at::kDouble).view({4, groups, -1});  // what the Linear held
    const at::Tensor exact = w32.abs().amax({-1}) / 127;
    const at::Tensor s = lin->weight_scales.to(at::kDouble).view({4, groups});
    EXPECT_TRUE((s >= exact).all().item<bool>()) << "a scale rounded down: q could clamp";
    constexpr double kHalfMinNormal = 6.103515625e-05;
    const at::Tensor normal = exact >= kHalfMinNormal;
    EXPECT_TRUE(at::where(normal, s <= exact * (1 + std::ldexp(1.0, -10)), at::ones_like(normal)).all().item<bool>())
        << "a normal scale more than one float16 step above max|w| / 127";
    const at::Tensor q = lin->weight.to(at::kDouble).view({4, groups, -1});
    EXPECT_LE(q.abs().max().item<double>(), 127);
    EXPECT_LE(excess(q * s.unsqueeze(-1), w32, (s / 2).unsqueeze(-1).expand_as(w32)), 0.0)
        << "|w - q scale| > scale / 2";
  }
  const at::Tensor big = at::full({2, 64}, 1e7);
  nn::Linear lin16 = holding(big);
  expect_error([&] { nn::to_weight_only(*lin16, nn::WeightOnlyOptions(), "layers.3.big"); },
               {"'layers.3.big'", "scale_dtype(at::kFloat)"});
  nn::Linear lin32 = holding(big);
  nn::to_weight_only(*lin32, nn::WeightOnlyOptions().scale_dtype(at::kFloat), "layers.3.big");
  ASSERT_EQ(lin32->weight_scales.scalar_type(), at::kFloat);
  const double s32 = lin32->weight_scales.max().item<double>();
  EXPECT_LE(maxAbsDiff(nn::dequantized_weight(*lin32), big), s32 / 2) << "float32 scales hold a weight of 1e7";
}

// The matrix-vector rows split over the intra-op threads where dtp's kernels
// are built with OpenMP (NOTE: [OpenMP in dtp's kernels] in
// cmake/openmp_kernels.cmake; serial in objects built without it, whatever
// at::set_num_threads says), and each output is the same sum on any number
// of threads: equal bit for bit to one thread's.
TEST(QuantizedLinearTest, MatrixVectorRowsSplitOverIntraOpThreads) {
#if defined(DTP_KERNELS_WITH_OPENMP)
  const int expected = 2;
#else
  const int expected = 1;
#endif
  const int threads = at::get_num_threads();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  // [out, in]: one row at a time, and four (NOTE: [Four weight rows at a time]) with rows left
  for (const auto& [out, in] : std::vector<std::pair<int64_t, int64_t>>{{4096, 256}, {1030, 8192}}) {
  for (at::ScalarType weight : {at::kChar, at::kBFloat16}) {
    SCOPED_TRACE(c10::str(weight, " [", out, ", ", in, "]"));
    nn::Linear lin(torch::nn::LinearOptions(in, out).bias(false));
    {
      at::NoGradGuard no_grad;
      lin->weight.copy_(at::randn({out, in}, gen));
    }
    nn::to_weight_only(*lin, nn::WeightOnlyOptions().dtype(weight).group_size(weight == at::kChar ? 32 : 0), "case");
    const at::Tensor x = at::randn({1, in}, gen);
    at::NoGradGuard no_grad;
    at::set_num_threads(1);
    nn::detail::weight_only_threads_seen();
    const at::Tensor one = lin(x);
    EXPECT_EQ(nn::detail::weight_only_threads_seen(), 1);
    at::set_num_threads(2);
    const at::Tensor two = lin(x);
    EXPECT_EQ(nn::detail::weight_only_threads_seen(), expected) << "threads the rows ran on";
    EXPECT_TRUE(two.equal(one)) << "one output, one thread's sum";
  }
  }
  at::set_num_threads(threads);
}

// Every family's folder loaded in float32, with bf16 Linear weights and with
// int8 ones: greedy continuations against float32's (the fraction of
// identical tokens printed, not asserted: a changed near-tie is allowed),
// and asserted: (a) the int8 model is float math on its dequantized weights
// (computing in float64, its logits equal a float64 model holding those
// weights, to float64 rounding), (b) its head's logits are within the
// storage step's bound of float64 math on the folder's float weights, at
// the hidden state the model computed.
TEST_F(QuantizedInferenceTest, EveryFamilyAgainstFloat32) {
  constexpr int64_t kTokens = 16;
  for (const Folder& f : familyFolders(dir_.string())) {
    SCOPED_TRACE(f.name);
    Llama f32 = loadAs(f.dir, at::kFloat, std::nullopt);
    const std::vector<int64_t> want = greedy(f32, kTokens);
    const at::Tensor logits32 = headInputAndLogits(f32).second;
    std::string line = f.name + ": greedy tokens equal to float32's:";
    for (const char* format : {"bfloat16", "int8"}) {
      const nn::WeightOnlyOptions o = nn::weight_only_options(format, groupFor(f.dir, 1));
      Llama q = loadAs(f.dir, at::kFloat, o);
      EXPECT_TRUE(linearAt(q, "layers.0.attention.wq").weight_only);
      EXPECT_EQ(linearAt(q, "layers.0.attention.wq").weight.scalar_type(), o.dtype());
      // The head is converted, tied or not; the embedding stays float32.
      EXPECT_EQ(linearAt(q, "output").weight.scalar_type(), o.dtype());
      EXPECT_EQ(q->tok_embeddings->weight.scalar_type(), at::kFloat);
      const std::vector<int64_t> got = greedy(q, kTokens);
      int64_t same = 0;
      for (size_t i = 0; i < got.size() && i < want.size(); ++i) same += got[i] == want[i];
      auto [h, logits] = headInputAndLogits(q);
      line += c10::str(" ", format, " ", same, "/", want.size(), " (max |logits - float32's| ",
                       maxAbsDiff(logits, logits32), ")");
      // (b) the head at its own input
      LinearImpl& head = linearAt(q, "output");
      const at::Tensor w64 = linearAt(f32, "output").weight.to(at::kDouble);
      const at::Tensor h64 = h.to(at::kDouble).flatten(0, 1), l64 = logits.to(at::kDouble).flatten(0, 1);
      const at::Tensor d64 = nn::dequantized_weight(head, at::kDouble);
      const at::Tensor bound = at::mm(h64.abs(), (head.weight_only ? storageError(head, w64) : at::zeros_like(w64)).t()) +
                               gamma(h64.size(1) + 2, kU32) * at::mm(h64.abs(), d64.abs().t());
      EXPECT_LE(excess(l64, at::mm(h64, w64.t()), bound), 0.0) << format << " head";
    }
    // (a) int8 computing in float64 against its dequantized float64 twin
    Llama q64 = loadAs(f.dir, at::kDouble, nn::weight_only_options("int8", groupFor(f.dir, 1)));
    Llama twin = dequantizedTwin(f.dir, q64);
    at::NoGradGuard no_grad;
    const at::Tensor ids = at::tensor(kPrompt).view({1, -1});
    const at::Tensor got = q64(ids), ref = twin(ids);
    // float64: sums of at most ~200 terms, each rounding 2^-53 relative:
    // 1e-12 of the logits' scale leaves a 50x margin.
    EXPECT_LE(maxAbsDiff(got, ref), 1e-12 * std::max(1.0, ref.abs().max().item<double>()));
    std::printf("%s; int8 in float64 vs its dequantized twin: %.2g\n", line.c_str(), maxAbsDiff(got, ref));
  }
}

// int8 (groups as wide as each rank's share allows, and one scale per row:
// its row maxima reduced over the ranks) and bf16 at TP=2 against TP=1, computing in float64: the stored
// weights equal bit for bit (scales follow the rows they scale, groups never
// straddle a shard), the logits to float64 rounding, and the forward issues
// the collectives the float model's does.
TEST_F(QuantizedInferenceTest, Tp2EqualsTp1) {
  const std::vector<Folder> folders = {{"hf_tiny", kData + "/hf_tiny"}, {"hf_tiny_tied", kData + "/hf_tiny_tied"}};
  const at::Tensor ids = at::tensor(kPrompt).view({1, -1});
  for (const Folder& f : folders) {
    const int64_t group = groupFor(f.dir, 2);
    ASSERT_GT(group, 0);
    const std::vector<std::pair<std::string, nn::WeightOnlyOptions>> formats = {
        {"int8 group " + std::to_string(group), nn::weight_only_options("int8", group)},
        {"int8 per row", nn::weight_only_options("int8", 0)},
        {"bfloat16", nn::weight_only_options("bfloat16")}};
    for (const auto& [name, o] : formats) {
      SCOPED_TRACE(f.name + " " + name);
      Llama one = loadAs(f.dir, at::kDouble, o);
      at::Tensor want;
      {
        at::NoGradGuard no_grad;
        want = one(ids);
      }
      std::map<std::string, at::Tensor> stored;
      for (const auto& item : one->named_modules("", false)) {
        if (auto* lin = dynamic_cast<LinearImpl*>(item.value().get()); lin != nullptr && lin->weight_only)
          stored[item.key()] = nn::dequantized_weight(*lin, at::kDouble);
      }
      std::mutex mu;
      run_ranks(2, [&](int rank) {
        auto mesh = init_device_mesh("cpu", {2}, {"tp"});
        auto tp = [&](Llama& m) { apply_tensor_parallel_for_inference(m, mesh); };
        Llama q = loadAs(f.dir, at::kDouble, o, tp), ref = loadAs(f.dir, at::kDouble, std::nullopt, tp);
        at::NoGradGuard no_grad;
        // The first call of the op on this mesh checks that the ranks agree
        // on its sharding rule (NOTE: [Ranks agree on sharding rules]): one
        // all_gather; from then on, the float model's collectives.
        CommCounter comm;
        at::Tensor got = q(ids);
        const int64_t first = comm.total_count(), firstGathers = comm.count(CollectiveType::AllGather);
        comm.reset();
        got = q(ids);
        const int64_t quantized = comm.total_count();
        comm.reset();
        ref(ids);
        const int64_t floats = comm.total_count(), floatGathers = comm.count(CollectiveType::AllGather);
        got = plain(got);
        std::map<std::string, at::Tensor> gathered;  // collectives: every rank, outside the lock
        for (const auto& [fqn, w] : stored) gathered[fqn] = plain(nn::dequantized_weight(linearAt(q, fqn), at::kDouble));
        std::lock_guard<std::mutex> lock(mu);
        EXPECT_EQ(quantized, floats) << "rank " << rank << ": collectives of the weight-only forward vs the float one";
        EXPECT_EQ(first, floats + 1) << "rank " << rank << ": the first forward, with the rule check";
        EXPECT_EQ(firstGathers, floatGathers + 1) << "rank " << rank;
        EXPECT_GT(floats, 0);
        EXPECT_LE(maxAbsDiff(got, want), 1e-12 * std::max(1.0, want.abs().max().item<double>())) << "rank " << rank;
        int64_t checked = 0;
        for (const auto& [fqn, w] : stored) {
          const LinearImpl& lin = linearAt(q, fqn);
          EXPECT_TRUE(is_dtensor(lin.weight)) << fqn;
          if (lin.weight_scales.defined()) EXPECT_TRUE(is_dtensor(lin.weight_scales)) << fqn;
          EXPECT_EQ(maxAbsDiff(gathered.at(fqn), w), 0.0) << fqn;
          ++checked;
        }
        EXPECT_GE(checked, 7) << "rank " << rank;  // wq wk wv wo w1 w2 w3 of a layer at least
      });
    }
  }
}

TEST_F(QuantizedInferenceTest, ErrorsNameTheFormatTheLayerAndTheFix) {
  expect_error([] { nn::weight_only_options("int4"); }, {"unsupported weight format 'int4'", "\"int8\""});
  nn::Linear lin(torch::nn::LinearOptions(32, 8).bias(false));
  expect_error([&] { nn::to_weight_only(*lin, nn::WeightOnlyOptions().dtype(at::kInt), "fc"); },
               {"unsupported weight dtype", "'fc'"});
  expect_error([&] { nn::to_weight_only(*lin, nn::WeightOnlyOptions().group_size(24), "fc"); },
               {"group_size 24 does not divide in_features=32", "'fc'"});
  nn::to_weight_only(*lin, nn::WeightOnlyOptions(), "fc");
  expect_error([&] { nn::to_weight_only(*lin, nn::WeightOnlyOptions(), "fc"); }, "'fc' is converted already");
  const at::Tensor x = at::randn({2, 32}).requires_grad_(true);
  expect_error([&] { lin(x); }, "NYI: backward through a weight-only linear");
  // hf_tiny is 32 wide: at TP=2 each rank holds 16 of a rowwise row.
  run_ranks(2, [&](int) {
    auto mesh = init_device_mesh("cpu", {2}, {"tp"});
    expect_error([&] {
      loadAs(kData + "/hf_tiny", at::kFloat, nn::weight_only_options("int8", 32),
             [&](Llama& m) { apply_tensor_parallel_for_inference(m, mesh); });
    }, {"group_size 32 does not divide the shard of 'layers.0.", "holds inputs [0, 16)", "group_size 0"});
  });
  Llama q = loadAs(kData + "/hf_tiny", at::kFloat, nn::weight_only_options("int8"));
  expect_error([&] { save_hf(q, file("out")); }, {"NYI", "int8"});
}
