// NOTE: [One-row linear] (src/dtensor/local_linear.cpp): a linear of one
// row on the CPU runs as a matrix-vector product where dtp computes it
// (nn::Linear, the local op of DTensor's linear and matmul), and only there.
// Values against at::linear and a float64 reference within the summation
// bound; which kernel ran, read from the ops RecordFunction sees on this
// thread; the collectives of the sharded layers; a decode step at TP 1 and
// 2 without a one-row aten::mm.
#include "dist.h"

#include "dtensor/local_linear.h"

#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/models/generate.h"
#include "dtp/nn/modules.h"
#include "dtp/tp/parallelize.h"

#include <ATen/record_function.h>

#include <cmath>
#include <limits>
#include <string>

using namespace dtp;
using dtp::test::run_ranks;

namespace {

// The products this thread ran while a KernelCount lives, outermost only
// (at::mv runs addmv inside): mm and addmm of a first matrix of one row, of
// more rows, and matrix-vector products: mv / addmv, or the one-row path's
// Eigen GEMV (its span "dtp::gemv") where dtp was built with Eigen.
struct Kernels {
  int64_t mm_one_row = 0, mm_rows = 0, mv = 0;  // mv: either kind of matrix-vector product
  int64_t eigen = 0;                            // of which dtp::gemv's
};
thread_local Kernels* g_kernels = nullptr;
thread_local int g_depth = 0;  // products open on this thread

bool isProduct(const std::string& name) {
  return name == "aten::mm" || name == "aten::addmm" || name == "aten::mv" || name == "aten::addmv" ||
         name == "dtp::gemv";
}

std::unique_ptr<at::ObserverContext> countKernel(const at::RecordFunction& fn) {
  const std::string name = fn.name();
  if (g_kernels == nullptr || !isProduct(name)) return nullptr;
  if (g_depth++ > 0) return nullptr;
  // Sharding propagation runs an op once on meta tensors of the global
  // shapes to learn its output's (a decision cache miss): no computation.
  const auto inputs = fn.inputs();
  for (const auto& v : inputs)
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().is_meta()) return nullptr;
  if (name == "aten::mv" || name == "aten::addmv" || name == "dtp::gemv") {
    ++g_kernels->mv;
    g_kernels->eigen += name == "dtp::gemv";
    return nullptr;
  }
  const size_t first = name == "aten::addmm" ? 1 : 0;
  if (inputs.size() > first && inputs[first].isTensor() && inputs[first].toTensor().size(0) == 1)
    ++g_kernels->mm_one_row;
  else
    ++g_kernels->mm_rows;
  return nullptr;
}

void endKernel(const at::RecordFunction& fn, at::ObserverContext*) {
  if (g_kernels != nullptr && isProduct(fn.name())) --g_depth;
}

class KernelCount {
 public:
  KernelCount()
      : handle_(at::addThreadLocalCallback(at::RecordFunctionCallback(&countKernel, &endKernel).needsInputs(true))) {
    g_kernels = &k;
    g_depth = 0;
  }
  ~KernelCount() {
    g_kernels = nullptr;
    at::removeCallback(handle_);
  }
  Kernels k;

 private:
  at::CallbackHandle handle_;
};

double unitRoundoff(at::ScalarType t) {
  return t == at::kDouble ? std::numeric_limits<double>::epsilon() / 2 : std::numeric_limits<float>::epsilon() / 2;
}

// Higham's gamma_m = m u / (1 - m u): any order of summing m terms (FMA or
// not, blocked or pairwise) lands within gamma_m * sum |term| of the exact
// sum. x [.., k] times w [n, k] plus b is k products and one bias per
// output: m = k + 1 terms.
at::Tensor summationBound(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::ScalarType t) {
  const double m = static_cast<double>(w.size(1) + 1), u = unitRoundoff(t);
  at::Tensor mag = at::linear(x.abs().to(at::kDouble), w.abs().to(at::kDouble));
  if (b.defined()) mag = mag + b.abs().to(at::kDouble);
  return mag * (m * u / (1 - m * u));
}

// max |a - b| / bound over the elements (<= 1 passes), printed on failure.
double worstRatio(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bound) {
  return ((a.to(at::kDouble) - b.to(at::kDouble)).abs() / bound).max().item<double>();
}

at::Tensor values(std::vector<int64_t> shape, double seed, at::ScalarType t) {
  // Mixed signs and magnitudes, the same on every rank.
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  at::Tensor i = at::arange(n, at::kDouble);
  return (at::sin(i * 0.7 + seed) * at::cos(i * 0.013 * seed)).view(shape).to(t);
}

}  // namespace

// Plain tensors, float64 and float32, with and without bias, x [1, k] and
// [1, 1, k]: the path runs mv (no mm), and its value is within the bound
// of at::linear's twice (each within it of the exact product) and within
// it once, plus float64's own, of a float64 reference of the same inputs.
TEST(OneRowLinearTest, MatchesLinearWithinTheSummationBound) {
  for (at::ScalarType t : {at::kDouble, at::kFloat}) {
    for (int64_t k : {1000, 4099}) {
      for (bool bias : {false, true}) {
        for (std::vector<int64_t> lead : {std::vector<int64_t>{1}, std::vector<int64_t>{1, 1}}) {
          SCOPED_TRACE(c10::str(t, " k=", k, bias ? " bias" : " no bias", " x dims ", lead.size() + 1));
          const int64_t n = 37;
          std::vector<int64_t> xs = lead;
          xs.push_back(k);
          const at::Tensor x = values(xs, 1.0, t), w = values({n, k}, 2.0, t);
          const at::Tensor b = bias ? values({n}, 3.0, t) : at::Tensor();
          ASSERT_TRUE(dtp::detail::takes_one_row_path(x, w, b));
          at::Tensor y;
          {
            KernelCount c;
            y = dtp::detail::local_linear(x, w, b);
            EXPECT_EQ(c.k.mv, 1);
            EXPECT_EQ(c.k.mm_one_row + c.k.mm_rows, 0);
          }
          std::vector<int64_t> ys = lead;
          ys.push_back(n);
          ASSERT_EQ(y.sizes().vec(), ys);
          ASSERT_EQ(y.scalar_type(), t);
          const at::Tensor ref = at::linear(x, w, bias ? c10::optional<at::Tensor>(b) : c10::nullopt);
          const at::Tensor bound = summationBound(x, w, b, t);
          EXPECT_LE(worstRatio(y, ref, 2 * bound), 1.0) << "path against at::linear, |diff| / (2 gamma_(k+1) sum|w x|)";
          const at::Tensor ref64 = at::linear(x.to(at::kDouble), w.to(at::kDouble),
                                              bias ? c10::optional<at::Tensor>(b.to(at::kDouble)) : c10::nullopt);
          const at::Tensor bound64 = bound + summationBound(x, w, b, at::kDouble);
          EXPECT_LE(worstRatio(y, ref64, bound64), 1.0) << "path against a float64 reference";
          if (t == at::kFloat) EXPECT_GT((y.to(at::kDouble) - ref64).abs().max().item<double>(), 0.0)
              << "float32 equal to float64 to the last bit: the comparison would not see a float64 path";
        }
      }
    }
  }
}

// What does not take the path runs ATen's own op: two rows, a weight whose
// rows are not dense (a transposed storage), bfloat16, a mix of dtypes,
// and a recorded graph (training keeps at::linear). A user's own
// at::linear of one row is not touched (mm, as libtorch has it).
// The product runs Eigen's AVX2 GEMV where dtp was built with it and the
// CPU has AVX2 and FMA (NOTE: [Eigen GEMV] in src/dtensor/gemv.cpp): on one
// intra-op thread, and on two where dtp's kernels are built with OpenMP
// (else at::mv there); either within the summation bound of a float64 reference, also
// for a weight whose rows are a column shard's (row stride > k).
TEST(OneRowLinearTest, RunsEigensGemvWhereBuiltWithIt) {
  const int threads = at::get_num_threads();
#if defined(DTP_BUILT_WITH_EIGEN_GEMV)
  const bool eigen = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  const bool eigen = false;
#endif
#if defined(DTP_KERNELS_WITH_OPENMP)
  const int eigen_threads = 2;  // its rows split over the intra-op threads
#else
  const int eigen_threads = 1;  // at::mv's own threads above one
#endif
  for (int t_count : {1, 2}) {
    at::set_num_threads(t_count);
    for (at::ScalarType t : {at::kDouble, at::kFloat}) {
      for (bool shard : {false, true}) {
        for (bool bias : {false, true}) {
          SCOPED_TRACE(c10::str(t_count, " thread(s), ", t, shard ? ", column shard" : "", bias ? ", bias" : ""));
          const int64_t n = 301, k = 1029;
          const at::Tensor x = values({1, 1, k}, 1.0, t);
          const at::Tensor w = shard ? values({n, k + 7}, 2.0, t).narrow(1, 3, k) : values({n, k}, 2.0, t);
          const at::Tensor b = bias ? values({n}, 3.0, t) : at::Tensor();
          ASSERT_TRUE(dtp::detail::takes_one_row_path(x, w, b));
          KernelCount c;
          const at::Tensor y = dtp::detail::local_linear(x, w, b);
          EXPECT_EQ(c.k.mv, 1);
          EXPECT_EQ(c.k.eigen, eigen && t_count <= eigen_threads ? 1 : 0)
              << "Eigen's GEMV where built and supported, on one thread or on OpenMP's";
          const at::Tensor ref64 = at::linear(x.to(at::kDouble), w.to(at::kDouble),
                                              bias ? c10::optional<at::Tensor>(b.to(at::kDouble)) : c10::nullopt);
          const at::Tensor bound = summationBound(x, w, b, t) + summationBound(x, w, b, at::kDouble);
          EXPECT_LE(worstRatio(y, ref64, bound), 1.0) << "against a float64 reference";
        }
      }
    }
  }
  at::set_num_threads(threads);
  std::printf("  Eigen's GEMV %s here\n", eigen ? "built and supported" : "not built or not supported");
}

TEST(OneRowLinearTest, OtherProductsKeepAtenLinear) {
  const int64_t k = 64, n = 16;
  const at::Tensor w = values({n, k}, 2.0, at::kFloat), one = values({1, k}, 1.0, at::kFloat);
  auto expectMm = [&](const at::Tensor& x, const at::Tensor& weight, const char* what) {
    SCOPED_TRACE(what);
    EXPECT_FALSE(dtp::detail::takes_one_row_path(x, weight, at::Tensor()));
    KernelCount c;
    const at::Tensor y = dtp::detail::local_linear(x, weight, at::Tensor());
    EXPECT_EQ(c.k.mv, 0);
    EXPECT_EQ(c.k.mm_one_row + c.k.mm_rows, 1);
    EXPECT_TRUE(y.equal(at::linear(x, weight))) << "not the path: at::linear's value bit for bit";
  };
  expectMm(values({2, k}, 1.0, at::kFloat), w, "two rows");
  expectMm(values({1, 2, k}, 1.0, at::kFloat), w, "two rows in a 3-d input");
  expectMm(one, w.t().contiguous().t(), "weight stored transposed");
  expectMm(one.to(at::kBFloat16), w.to(at::kBFloat16), "bfloat16");
  {
    SCOPED_TRACE("a recorded graph");
    const at::Tensor wg = w.clone().requires_grad_(true);
    EXPECT_FALSE(dtp::detail::takes_one_row_path(one, wg, at::Tensor()));
    KernelCount c;
    at::Tensor y = dtp::detail::local_linear(one, wg, at::Tensor());
    EXPECT_EQ(c.k.mv, 0);
    EXPECT_EQ(c.k.mm_one_row, 1);
    y.sum().backward();
    EXPECT_TRUE(wg.grad().equal(one.expand({n, k}))) << "d(sum w x)/dw is x on every row";
  }
  EXPECT_FALSE(dtp::detail::takes_one_row_path(one.to(at::kDouble), w, at::Tensor())) << "x float64, w float32";
  {
    SCOPED_TRACE("a user's at::linear");
    KernelCount c;
    (void)at::linear(one, w);
    EXPECT_EQ(c.k.mv, 0);
    EXPECT_EQ(c.k.mm_one_row, 1);
  }
  {
    SCOPED_TRACE("nn::Linear under NoGradGuard");
    dtp::nn::Linear lin(k, n);
    at::NoGradGuard no_grad;
    KernelCount c;
    const at::Tensor y = lin(one.view({1, 1, k}));
    EXPECT_EQ(c.k.mv, 1);
    EXPECT_EQ(c.k.mm_one_row + c.k.mm_rows, 0);
    EXPECT_EQ(y.sizes().vec(), (std::vector<int64_t>{1, 1, n}));
  }
}

// The local op of DTensor's linear takes the path on the shards: a
// Linear(k, n) with bias, ColwiseParallel (no collective) and
// RowwiseParallel (one all-reduce of the partial sums) at TP=2, float32
// without a graph, x [1, 1, k], against the float64 reference of the same
// weights: within gamma_(k+1) (rowwise: k/2 + 1 terms a rank, plus the
// all-reduce's one addition and the bias: inside gamma_(k+1) too) plus
// float64's own. Uneven n and k (odd) included.
TEST(OneRowLinearTest, ShardedLinearTakesThePathOnEachRank) {
  for (const char* style : {"colwise", "rowwise"}) {
    for (int64_t k : {64, 67}) {
      run_ranks(2, [&](int rank) {
        SCOPED_TRACE(c10::str(style, " k=", k, " rank ", rank));
        const bool colwise = std::string(style) == "colwise";
        const int64_t n = 21;
        auto mesh = init_device_mesh("cpu", {2});
        dtp::nn::Linear m(k, n), ref(k, n);
        {
          at::NoGradGuard g;
          for (auto* l : {&m, &ref}) {
            (*l)->weight.copy_(values({n, k}, 2.0, at::kFloat));
            (*l)->bias.copy_(values({n}, 3.0, at::kFloat));
          }
        }
        if (colwise) parallelize_module(*m, mesh, ColwiseParallel());
        else parallelize_module(*m, mesh, RowwiseParallel(RowwiseParallelOptions().input_layouts(Replicate())));
        const at::Tensor x = values({1, 1, k}, 1.0, at::kFloat);
        at::NoGradGuard no_grad;
        CommCounter comm;
        at::Tensor y;
        Kernels seen;
        {
          KernelCount c;
          y = m(x);
          seen = c.k;
        }
        EXPECT_EQ(seen.mv, 1) << "the shard's product by mv";
        EXPECT_EQ(seen.mm_one_row + seen.mm_rows, 0) << "no mm on the shard";
        EXPECT_EQ(comm.count(CollectiveType::AllReduce), colwise ? 0 : 1) << comm.str();
        EXPECT_EQ(comm.total_count(), colwise ? 0 : 1) << comm.str();
        // Colwise returns this rank's columns (use_local_output); rowwise the
        // replicated sum.
        const at::Tensor& full = y;
        const at::Tensor ref64 = at::linear(x.to(at::kDouble), ref->weight.to(at::kDouble), ref->bias.to(at::kDouble));
        const at::Tensor bound = summationBound(x, ref->weight, ref->bias, at::kFloat) +
                                 summationBound(x, ref->weight, ref->bias, at::kDouble);
        if (colwise) {
          const int64_t start = rank == 0 ? 0 : (n + 1) / 2, len = rank == 0 ? (n + 1) / 2 : n / 2;
          ASSERT_EQ(full.size(-1), len);
          EXPECT_LE(worstRatio(full, ref64.narrow(-1, start, len), bound.narrow(-1, start, len)), 1.0);
        } else {
          ASSERT_EQ(full.sizes().vec(), (std::vector<int64_t>{1, 1, n}));
          EXPECT_LE(worstRatio(full, ref64, bound), 1.0);
        }
      });
    }
  }
}

// A tiny Llama's greedy decode at TP 1 and 2, float32: the decode steps
// (one row each) run no aten::mm of one row, every Linear's product is an
// mv, and the tokens are the same at TP 1 and 2. (The prompt's prefill
// has several rows: mm.)
TEST(OneRowLinearTest, DecodeStepsRunNoOneRowMm) {
  models::LlamaConfig c;
  c.vocab_size = 67;
  c.dim = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.ffn_hidden = 40;
  c.max_seq_len = 32;
  c.seed = 3;
  models::GenerateOptions o;
  o.max_new_tokens = 4;
  const std::vector<std::vector<int64_t>> prompt = {{5, 9, 2, 7}};
  // Products a step: wq, wk, wv, wo, w1, w3, w2 per layer, and the head.
  const int64_t per_step = 7 * c.n_layers + 1, steps = o.max_new_tokens - 1;
  std::vector<std::vector<int64_t>> want;
  for (int tp : {1, 2}) {
    run_ranks(tp, [&](int rank) {
      SCOPED_TRACE(c10::str("TP=", tp, " rank ", rank));
      models::Llama model(c);
      if (tp > 1) models::apply_tensor_parallel_for_inference(model, init_device_mesh("cpu", {tp}, {"tp"}));
      model->eval();
      Kernels seen;
      std::vector<std::vector<int64_t>> out;
      {
        KernelCount count;
        out = models::generate(model, prompt, o);
        seen = count.k;
      }
      EXPECT_EQ(seen.mm_one_row, 0) << "a one-row aten::mm in a decode step";
      // and the prefill's head, which reads the last position alone (one row).
      EXPECT_EQ(seen.mv, per_step * steps + 1) << "one mv per Linear per decode step";
      EXPECT_GT(seen.mm_rows, 0) << "the prefill's products (4 rows) stay mm";
      if (tp == 1) want = out;
      else if (rank == 0) EXPECT_EQ(out, want);
    });
  }
}
