// Mixtures of experts: all_to_all_single with uneven splits (values, counts,
// autograd), the MoE layer against a token-by-token reference, expert
// parallelism against one device in float64 (outputs and every gradient),
// uneven routing (experts without tokens, a rank that sends nothing), the
// collectives per layer in closed form, the load-balancing loss, and the
// errors. Logits of Mixtral and Qwen3-MoE folders against an independent
// Python reference: tests/hf (HfInterop.PythonReferenceAndExport).
#include "close.h"
#include "dist.h"
#include "files.h"
#include "llama_util.h"

#include "dtp/comm_counter.h"
#include "dtp/dcp/checkpoint.h"
#include "dtp/dtensor.h"
#include "dtp/ep/all_to_all.h"
#include "dtp/models/llama.h"
#include "dtp/models/moe.h"
#include "dtp/models/parallelize.h"

#include <map>
#include <mutex>

using namespace dtp;
using namespace dtp::models;
using dtp::test::expect_error;
using dtp::test::run_ranks;

namespace {

// Rank r sends (r + q) % 3 rows to rank q, each row [r, q, i]; rank q gets
// from r what r sent it, in rank order. Some pairs send nothing (r + q = 3).
TEST(AllToAllSingleTest, UnevenSplitsArriveInRankOrderAndBackwardReturnsThem) {
  constexpr int W = 3;
  run_ranks(W, [&](int r) {
    ProcessGroup g = init_device_mesh("cpu", {W}, {"ep"}).get_group(0);
    std::vector<int64_t> send, recv;
    std::vector<at::Tensor> rows;
    for (int q = 0; q < W; ++q) {
      send.push_back((r + q) % 3);
      recv.push_back((q + r) % 3);
      for (int64_t i = 0; i < send.back(); ++i) rows.push_back(at::tensor({double(r), double(q), double(i)}).view({1, 3}));
    }
    at::Tensor input = rows.empty() ? at::zeros({0, 3}, at::kDouble) : at::cat(rows);
    input.requires_grad_(true);
    CommCounter comm;
    at::Tensor out = ep::all_to_all_single_autograd(input, recv, send, g);
    EXPECT_EQ(comm.count(CollectiveType::AllToAll), 1);
    EXPECT_EQ(comm.bytes(CollectiveType::AllToAll), input.numel() * 8);
    std::vector<at::Tensor> want;
    for (int src = 0; src < W; ++src) {
      for (int64_t i = 0; i < (src + r) % 3; ++i) want.push_back(at::tensor({double(src), double(r), double(i)}).view({1, 3}));
    }
    ASSERT_EQ(out.size(0), static_cast<int64_t>(want.size()));
    if (!want.empty()) EXPECT_TRUE(at::equal(out, at::cat(want))) << out;
    // The gradient of sum(out * out) is 2 out, sent back to the rows' owners.
    (out * out).sum().backward();
    EXPECT_TRUE(at::equal(input.grad(), 2 * input.detach())) << "rank " << r;
    EXPECT_EQ(comm.count(CollectiveType::AllToAll), 2) << "one more in backward";
  });
}

TEST(AllToAllSingleTest, SplitsThatDoNotAddUpAreNamedErrors) {
  run_ranks(2, [&](int) {
    ProcessGroup g = init_device_mesh("cpu", {2}, {"ep"}).get_group(0);
    expect_error([&] { g.all_to_all_single(at::zeros({3, 2}), {1, 1}, {1, 1}); },
                 {"all_to_all_single", "3 rows", "add up to 2"});
  });
}

// shared > 0: with a gated shared expert of that width (Qwen2-MoE's).
MoEConfig moeConfig(int64_t experts, int64_t top_k, bool norm, int64_t shared = 0) {
  MoEConfig c;
  c.num_experts = experts;
  c.top_k = top_k;
  c.hidden = 12;
  c.norm_topk_prob = norm;
  c.shared_hidden = shared;
  return c;
}

// A MoE layer with float64 weights drawn from `seed`.
MoE makeMoE(int64_t dim, const MoEConfig& c, uint64_t seed) {
  MoE m(dim, c);
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) p.set_data(at::normal(0.0, 0.3, p.sizes(), g).to(at::kDouble));
  return m;
}

// Token by token: softmax, top-k (renormalized), the chosen experts' SwiGLU
// weighted, plus the shared expert's SwiGLU times sigmoid of its gate's dot
// product with the token. Written apart from MoEImpl's sorted dispatch.
at::Tensor reference(MoE& m, const at::Tensor& x) {
  const at::Tensor flat = x.reshape({-1, x.size(-1)});
  at::Tensor out = at::zeros_like(flat);
  for (int64_t t = 0; t < flat.size(0); ++t) {
    const at::Tensor probs = at::softmax(at::matmul(m->gate->weight, flat[t]), 0);
    auto [w, e] = probs.topk(m->config.top_k);
    if (m->config.norm_topk_prob) w = w / w.sum();
    for (int64_t j = 0; j < m->config.top_k; ++j) {
      const int64_t k = e[j].item<int64_t>();
      const at::Tensor h = at::silu(at::matmul(m->experts->w1[k], flat[t])) * at::matmul(m->experts->w3[k], flat[t]);
      out[t] += w[j] * at::matmul(m->experts->w2[k], h);
    }
    if (m->shared_expert) {
      const auto& s = m->shared_expert;
      const at::Tensor h = at::silu(at::matmul(s->w1->weight, flat[t])) * at::matmul(s->w3->weight, flat[t]);
      out[t] += at::sigmoid(at::dot(m->shared_expert_gate->weight[0], flat[t])) * at::matmul(s->w2->weight, h);
    }
  }
  return out.view(x.sizes());
}

TEST(MoETest, EqualsATokenByTokenReferenceForBothRoutingsWithAndWithoutASharedExpert) {
  for (bool norm : {true, false}) {
    for (int64_t shared : {0, 10}) {
      SCOPED_TRACE(c10::str(norm ? "norm_topk_prob (Mixtral)" : "no renormalization (Qwen3-MoE's default)",
                            shared ? ", shared expert (Qwen2-MoE)" : ""));
      MoE m = makeMoE(8, moeConfig(6, 2, norm, shared), 1);
      EXPECT_EQ(static_cast<bool>(m->shared_expert), shared > 0);
      const at::Tensor x = at::randn({3, 5, 8}, at::kDouble);
      torch::NoGradGuard no_grad;
      EXPECT_CLOSE(m(x), reference(m, x), 0.0, 1e-14);
    }
  }
}

struct Grads {
  at::Tensor out;
  std::map<std::string, at::Tensor> grads;  // full
};

// Forward and backward of sum(out * target) on one device for the whole x.
Grads oneDevice(MoE& m, const at::Tensor& x, const at::Tensor& target) {
  at::Tensor xr = x.clone().requires_grad_(true);
  at::Tensor out = m(xr);
  (out * target).sum().backward();
  Grads g{out.detach(), {{"x", xr.grad()}}};
  for (auto& p : m->named_parameters()) g.grads[p.key()] = p.value().grad().clone();
  for (auto& p : m->parameters()) p.mutable_grad() = at::Tensor();
  return g;
}

// Each ep rank feeds its slice of x (rows of dim 0); the outputs and x's
// gradients equal one device's rows, the experts' gradients (Shard(0))
// equal one device's, the router's and the shared expert's (replicated)
// summed over ranks equal one device's.
void expectExpertParallelEqualsOneDevice(int P, MoE& one, const at::Tensor& x, const at::Tensor& target,
                                         int64_t dispatch_rows_total) {
  const Grads want = oneDevice(one, x, target);
  const int64_t rows = x.size(0) / P;
  std::mutex mu;
  int64_t dispatched = 0;
  run_ranks(P, [&](int r) {
    MoE m = makeMoE(x.size(-1), one->config, 0);
    {
      torch::NoGradGuard no_grad;
      for (auto& p : m->named_parameters()) p.value().copy_(one->named_parameters()[p.key()]);
    }
    auto mesh = init_device_mesh("cpu", {P}, {"ep"});
    distribute_experts(*m, mesh);
    EXPECT_TRUE(placements(m->experts->w1).at(0).is_shard()) << dtensor_spec(m->experts->w1).str();
    EXPECT_EQ(dtensor_spec(m->experts->w1).shape, one->experts->w1.sizes().vec());
    at::Tensor xs = x.narrow(0, r * rows, rows).clone().requires_grad_(true);
    CommCounter comm;
    at::Tensor out = m(xs);
    EXPECT_EQ(comm.count(CollectiveType::AllGather), 1) << "the token counts";
    EXPECT_EQ(comm.count(CollectiveType::AllToAll), 2) << "dispatch and combine";
    {
      std::lock_guard<std::mutex> lock(mu);
      dispatched += comm.bytes(CollectiveType::AllToAll);
    }
    (out * target.narrow(0, r * rows, rows)).sum().backward();
    EXPECT_EQ(comm.count(CollectiveType::AllToAll), 4) << "and both again in backward";
    EXPECT_CLOSE(out, want.out.narrow(0, r * rows, rows), 0.0, 1e-13);
    EXPECT_CLOSE(xs.grad(), want.grads.at("x").narrow(0, r * rows, rows), 0.0, 1e-13);
    for (const char* w : {"experts.w1", "experts.w2", "experts.w3"}) {
      const at::Tensor grad = m->named_parameters()[w].grad();
      EXPECT_EQ(dtensor_spec(grad).str(), dtensor_spec(m->named_parameters()[w]).str()) << w;
      EXPECT_CLOSE(full_tensor(grad), want.grads.at(w), 0.0, 1e-13) << w;
    }
    for (auto& p : m->named_parameters()) {
      if (p.key().rfind("experts.", 0) == 0) continue;
      at::Tensor grad = p.value().grad().clone();
      mesh.get_group(0).all_reduce(grad).wait();
      EXPECT_CLOSE(grad, want.grads.at(p.key()), 0.0, 1e-13) << p.key();
    }
  });
  // Each rank's dispatch and combine move its routed rows (top_k per token).
  EXPECT_EQ(dispatched, 2 * dispatch_rows_total * x.size(-1) * 8);
}

TEST(MoETest, ExpertParallelEqualsOneDeviceInFloat64) {
  for (int P : {2, 4}) {
    SCOPED_TRACE(c10::str("ep ", P, P == 4 ? ", shared expert" : ""));
    MoE one = makeMoE(8, moeConfig(8, 2, true, P == 4 ? 10 : 0), 2);
    const at::Tensor x = at::randn({4, 6, 8}, at::kDouble), target = at::randn({4, 6, 8}, at::kDouble);
    expectExpertParallelEqualsOneDevice(P, one, x, target, 4 * 6 * 2);
  }
}

// Positive inputs and a router whose rows for experts 0 and 1 are positive,
// for 2 and 3 negative: every token picks experts 0 and 1 (rank 0's at ep 2),
// so experts 2 and 3 get nothing, rank 0 sends nothing to rank 1 and rank 1
// receives nothing. Still exact, no hang.
TEST(MoETest, UnevenRoutingStaysExact) {
  MoE one = makeMoE(8, moeConfig(4, 2, true), 3);
  {
    torch::NoGradGuard no_grad;
    one->gate->weight.abs_();
    one->gate->weight.narrow(0, 2, 2).neg_();
  }
  const at::Tensor x = at::rand({2, 5, 8}, at::kDouble) + 0.1, target = at::randn({2, 5, 8}, at::kDouble);
  expectExpertParallelEqualsOneDevice(2, one, x, target, 2 * 5 * 2);
  // The experts without tokens get zero gradients, as on one device.
  const Grads g = oneDevice(one, x, target);
  EXPECT_EQ(g.grads.at("experts.w1").narrow(0, 2, 2).abs().max().item<double>(), 0.0);
}

// A small float64 Mixtral-shaped model: 4 experts, top-2, aux loss 0.02;
// with `shared`, Qwen2-MoE-shaped: a gated shared expert of that width too.
LlamaConfig mixtralConfig(int64_t shared = 0) {
  LlamaConfig c = dtp::test::small_llama_config(2);
  c.dtype = at::kDouble;
  c.family = shared > 0 ? "qwen2_moe" : "mixtral";
  c.moe = moeConfig(4, 2, true, shared);
  c.moe.aux_loss_coef = 0.02;
  return c;
}

// A Mixtral-shaped model (MoE in every block) with its load-balancing loss
// trains under TP (the experts replicated), FSDP and DDP like one device;
// and so does a Qwen2-MoE-shaped one, its shared expert cut over tp as the
// dense MLP.
TEST(MoETest, MoEModelUnderTpFsdpAndDdpTrainsLikeOneDevice) {
  for (int64_t shared : {0, 10}) {
    SCOPED_TRACE(shared ? "with a shared expert" : "routed experts only");
    const LlamaConfig c = mixtralConfig(shared);
    // 3 AdamW steps of the whole batch with the load-balancing loss.
    const dtp::test::TrainLoop withAux = [](Llama& model, torch::optim::AdamW& opt, int from, int to) {
      std::vector<double> losses;
      for (int step = from; step < to; ++step) {
        at::Tensor batch = dtp::test::llama_batch(model->config.vocab_size, step);
        at::Tensor loss = llama_loss(model(batch.narrow(1, 0, dtp::test::kSeq)), batch.narrow(1, 1, dtp::test::kSeq));
        loss = loss + moe_load_balancing_loss(model);
        opt.zero_grad();
        loss.backward();
        opt.step();
        losses.push_back(loss.item<double>());
      }
      return losses;
    };
    auto train = [&](Llama& model) { return dtp::test::train_trace(model, 3, withAux); };
    Llama one(c);
    const dtp::test::Trace want = train(one);
    // Experts replicated over tp, or cut (shard_experts: ExpertTensorParallel,
    // 12 hidden units as 6 + 6, or 4 + 4 + 4 at tp 3).
    for (bool sp : {true, false}) {
      for (bool cut : {false, true}) {
        for (int tp : {2, 3}) {
          if (tp == 3 && (!cut || sp)) continue;
          SCOPED_TRACE(c10::str("tp ", tp, sp ? ", sp" : "", cut ? ", experts cut" : ""));
          LlamaConfig ct = c;
          if (tp == 3) {  // heads divisible by 3
            ct.dim = 36;
            ct.n_heads = ct.n_kv_heads = 3;
          }
          Llama one3(ct);
          const dtp::test::Trace want3 = tp == 3 ? train(one3) : want;
          run_ranks(tp, [&](int) {
            Llama model(ct);
            TensorParallelOptions o{sp, dtp::test::kSeq};
            o.shard_experts = cut;
            apply_tensor_parallel(model, init_device_mesh("cpu", {tp}, {"tp"}), o);
            const auto& experts = model->layers[0]->as<TransformerBlockImpl>()->moe->experts;
            EXPECT_EQ(placements(experts->w2), Placements{cut ? Shard(2) : Replicate()});
            if (const auto& se = model->layers[0]->as<TransformerBlockImpl>()->moe->shared_expert) {
              EXPECT_EQ(placements(se->w1->weight), Placements{Shard(0)});
              EXPECT_EQ(placements(se->w2->weight), Placements{Shard(1)});
            }
            dtp::test::expect_same_trace(train(model), want3, 1e-12, 3e-11);
          });
        }
      }
    }
    // Data parallel over a replicated batch (every dp rank the whole batch):
    // the mean of equal gradients is each one, so the steps equal one device's.
    for (bool ddp : {false, true}) {
      SCOPED_TRACE(ddp ? "dp 2 x tp 2, DDP, experts cut" : "dp 2 x tp 2, FSDP");
      run_ranks(4, [&](int) {
        auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
        Llama model(c);
        TensorParallelOptions o{true, dtp::test::kSeq};
        o.shard_experts = ddp;
        apply_tensor_parallel(model, mesh, o);
        if (ddp) apply_ddp(model, mesh);
        else apply_fsdp(model, mesh);
        dtp::test::expect_same_trace(train(model), want, 1e-12, 3e-11);
      });
    }
  }
}

// Expert parallelism borrowed from data parallelism (NOTE: [Expert
// parallelism with data parallelism]): each (dp, ep) rank trains on its
// quarter of a batch of 4 sequences, with the load-balancing loss over
// every rank's tokens. Steps of AdamW equal one device on the whole batch:
// the router, the experts (reduced over dp, divided by dp x ep) and the rest
// (data parallel over dp x ep), under FSDP and DDP, with TP or not.
TEST(MoETest, ExpertParallelWithDataParallelTrainsLikeOneDevice) {
  for (int64_t shared : {0, 10}) {
    SCOPED_TRACE(shared ? "with a shared expert" : "routed experts only");
    const LlamaConfig c = mixtralConfig(shared);
    constexpr int64_t B = 4, S = dtp::test::kSeq;
    auto batchOf = [&](int step) {
      at::Generator g = at::make_generator<at::CPUGeneratorImpl>(100 + step);
      return at::randint(c.vocab_size, {B, S + 1}, g, at::kLong);
    };
    // Losses are each rank's (its slice's mean); one device's is the whole batch's.
    auto train = [&](Llama& model, const std::optional<ProcessGroup>& dp) {
      torch::optim::AdamW opt(model->unique_parameters(), torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < 3; ++step) {
        at::Tensor batch = batchOf(step);
        if (dp) batch = batch.narrow(0, dp->rank() * (B / dp->size()), B / dp->size());
        at::Tensor loss = llama_loss(model(batch.narrow(1, 0, S)), batch.narrow(1, 1, S));
        loss = loss + moe_load_balancing_loss(model, dp);
        opt.zero_grad();
        loss.backward();
        opt.step();
      }
      return dtp::test::full_named_params(model);
    };
    Llama one(c);
    const auto want = train(one, std::nullopt);
    struct Layout {
      std::vector<int64_t> shape;
      bool ddp;
    };
    for (const Layout& l : {Layout{{2, 2}, false}, Layout{{2, 2}, true}, Layout{{1, 2, 2}, false},
                            Layout{{1, 2, 2}, true}, Layout{{1, 4}, false}}) {
      const bool tp = l.shape.size() == 3;
      SCOPED_TRACE(c10::str("(dp, ep", tp ? ", tp" : "", ") = ", l.shape, l.ddp ? " DDP" : " FSDP"));
      run_ranks(4, [&](int) {
        auto mesh = init_device_mesh("cpu", l.shape, tp ? std::vector<std::string>{"dp", "ep", "tp"}
                                                         : std::vector<std::string>{"dp", "ep"});
        Llama model(c);
        ParallelizeOptions options;
        options.tp = TensorParallelOptions{true, S};
        options.data_parallel = l.ddp ? DataParallel::DDP : DataParallel::FSDP;
        CommCounter comm;
        parallelize_llama(model, mesh, options);
        const ProcessGroup dp = data_parallel_group(mesh);
        EXPECT_EQ(dp.size(), l.shape[0] * l.shape[1]);
        EXPECT_EQ(to_local(model->layers[0]->as<TransformerBlockImpl>()->moe->experts->w1).size(0) * l.shape[1] *
                      (l.ddp ? 1 : l.shape[0]),
                  4)
            << "each ep rank's experts, under FSDP cut over dp";
        const auto got = train(model, dp);
        // Per step and MoE layer: dispatch and combine, forward and backward.
        EXPECT_EQ(comm.count(CollectiveType::AllToAll), 3 * 4 * c.n_layers);
        ASSERT_EQ(got.size(), want.size());
        for (size_t i = 0; i < want.size(); ++i) {
          EXPECT_EQ(got[i].first, want[i].first);
          EXPECT_CLOSE(got[i].second, want[i].second, 0.0, 1e-11) << want[i].first;
        }
      });
    }
  }
}

// HF's load_balancing_loss_func written out for one layer: E * sum over the
// top-k slots and experts of (fraction routed) * (mean probability).
TEST(MoETest, LoadBalancingLossIsHfsFormula) {
  LlamaConfig c = dtp::test::small_llama_config(2);
  c.dtype = at::kDouble;
  c.n_layers = 1;
  c.moe = moeConfig(4, 2, true);
  c.moe.aux_loss_coef = 0.5;
  Llama model(c);
  const at::Tensor tokens = dtp::test::llama_batch(c.vocab_size, 0).narrow(1, 0, dtp::test::kSeq);
  model(tokens);
  auto* moe = model->layers[0]->as<TransformerBlockImpl>()->moe.get();
  const at::Tensor probs = moe->router_probs;
  const int64_t T = probs.size(0);
  double want = 0;
  for (int64_t e = 0; e < 4; ++e) {
    for (int64_t j = 0; j < 2; ++j) {
      const double routed = (moe->selected.select(1, j) == e).sum().item<double>() / T;
      want += routed * probs.select(1, e).mean().item<double>();
    }
  }
  EXPECT_NEAR(moe_load_balancing_loss(model).item<double>(), 0.5 * 4 * want, 1e-15);
}

// The load-balancing loss's gradient reaches the routers through the MoE
// outputs (NOTE: [Load-balancing loss gradient]): it equals autograd's
// gradient of HF's formula written here on the layers' probabilities, with
// and without activation checkpointing (whose first pass keeps no graph);
// a loss without the term gives the routers nothing of it.
TEST(MoETest, LoadBalancingLossGradientEqualsAutogradOfTheFormulaAlsoUnderCheckpointing) {
  LlamaConfig c = dtp::test::small_llama_config(2);
  c.dtype = at::kDouble;
  c.moe = moeConfig(4, 2, true);
  c.moe.aux_loss_coef = 0.3;
  const at::Tensor batch = dtp::test::llama_batch(c.vocab_size, 0);
  const at::Tensor in = batch.narrow(1, 0, dtp::test::kSeq), target = batch.narrow(1, 1, dtp::test::kSeq);
  auto grads = [&](Llama& m) {
    std::map<std::string, at::Tensor> out;
    for (auto& p : m->named_parameters()) out[p.key()] = p.value().grad().clone();
    return out;
  };
  auto formula = [&](Llama& m) {
    std::vector<at::Tensor> probs, masks;
    for (const auto& layer : *m->layers) {
      auto& moe = layer->as<TransformerBlockImpl>()->moe;
      probs.push_back(moe->router_probs);
      masks.push_back(at::one_hot(moe->selected, 4).to(at::kDouble));
    }
    const at::Tensor p = at::cat(probs), routed = at::cat(masks).sum(0);  // [top_k, E]
    const double n = static_cast<double>(p.size(0));
    return 0.3 * 4 * ((routed / n) * (p.sum(0) / n).unsqueeze(0)).sum();
  };
  Llama a(c);
  at::Tensor la = llama_loss(a(in), target);
  (la + formula(a)).backward();
  const auto want = grads(a);
  for (const char* mode : {"none", "full", "selective"}) {
    SCOPED_TRACE(mode);
    Llama b(c);
    if (std::string(mode) != "none")
      apply_ac(b, ACOptions{std::string(mode) == "full" ? ACMode::Full : ACMode::Selective, 1});
    at::Tensor lb = llama_loss(b(in), target);
    const at::Tensor aux = moe_load_balancing_loss(b);
    EXPECT_NEAR(aux.item<double>(), formula(a).item<double>(), 1e-15);
    (lb + aux).backward();
    const auto got = grads(b);
    for (const auto& [name, g] : want)
      EXPECT_LE((got.at(name) - g).abs().max().item<double>(), 1e-15 * (1 + g.abs().max().item<double>())) << name;
  }
  // The loss computed (for a log) but left out of backward: the routers get
  // the language-model loss's gradient only.
  Llama d(c), e(c);
  llama_loss(d(in), target).backward();
  at::Tensor le = llama_loss(e(in), target);
  (void)moe_load_balancing_loss(e);
  le.backward();
  const auto only = grads(d), left_out = grads(e);
  for (const auto& [name, g] : only) EXPECT_TRUE(at::equal(left_out.at(name), g)) << name;
  EXPECT_FALSE(at::equal(only.at("layers.0.moe.gate.weight"), want.at("layers.0.moe.gate.weight")))
      << "the aux term must change the router's gradient, or this test checks nothing";
}

// CommDebugMode files expert parallelism's collectives under each MoE
// layer: forward one all_gather (the counts) and two all_to_alls (dispatch,
// combine), backward the two all_to_alls again; nothing elsewhere.
TEST(MoETest, CommDebugModeCountsTheAllToAllsPerMoELayer) {
  LlamaConfig c = dtp::test::small_llama_config(2);
  c.dtype = at::kDouble;
  c.moe = moeConfig(4, 2, true);
  run_ranks(2, [&](int r) {
    Llama model(c);
    apply_expert_parallel(model, init_device_mesh("cpu", {2}, {"ep"}));
    const at::Tensor batch = dtp::test::llama_batch(c.vocab_size, r);  // each rank its own tokens
    CommDebugMode comm;
    llama_loss(model(batch.narrow(1, 0, dtp::test::kSeq)), batch.narrow(1, 1, dtp::test::kSeq)).backward();
    using Counts = std::map<std::string, std::map<std::string, int64_t>>;
    const Counts forward{{"layers.0.moe", {{"all_gather", 1}, {"all_to_all", 2}}},
                         {"layers.1.moe", {{"all_gather", 1}, {"all_to_all", 2}}}};
    const Counts backward{{"layers.0.moe", {{"all_to_all", 2}}}, {"layers.1.moe", {{"all_to_all", 2}}}};
    EXPECT_EQ(comm.per_module(Pass::Forward), forward) << comm.tracing_table();
    EXPECT_EQ(comm.per_module(Pass::Backward), backward) << comm.tracing_table();
  });
}

class MoECheckpointTest : public dtp::test::TempDirTest {};

// A MoE model saved with its experts spread over ep 2 (each rank writes its
// experts) loads at ep 4 and on one device with every expert in place.
TEST_F(MoECheckpointTest, SavedAtOneEpDegreeLoadsAtAnother) {
  LlamaConfig c = dtp::test::small_llama_config(2);
  c.dtype = at::kDouble;
  c.moe = moeConfig(4, 2, true);
  Llama one(c);  // the values every layout must hold
  const auto want = dtp::test::full_named_params(one);
  const std::string dir = file("moe");
  run_ranks(2, [&](int) {
    Llama model(c);
    apply_expert_parallel(model, init_device_mesh("cpu", {2}, {"ep"}));
    dcp::save_state(dir, *model, nullptr, {}, llama_state_dict_options());
  });
  auto expectSame = [&](Llama& model) {
    const auto got = dtp::test::full_named_params(model);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(at::equal(got[i].second, want[i].second)) << want[i].first;
  };
  run_ranks(4, [&](int) {
    LlamaConfig other = c;
    other.seed = 99;  // other values, until the load
    Llama model(other);
    apply_expert_parallel(model, init_device_mesh("cpu", {4}, {"ep"}));
    dcp::load_state(dir, *model, nullptr, llama_state_dict_options());
    EXPECT_EQ(to_local(model->layers[0]->as<TransformerBlockImpl>()->moe->experts->w1).size(0), 1) << "one expert per rank";
    expectSame(model);
  });
  LlamaConfig other = c;
  other.seed = 99;
  Llama plain(other);
  dcp::load_state(dir, *plain, nullptr, llama_state_dict_options());
  expectSame(plain);
}

TEST(MoETest, BadInputIsANamedError) {
  expect_error([] { MoE(8, moeConfig(4, 5, true)); }, {"top_k=5", "num_experts=4"});
  expect_error([] { MoE(8, moeConfig(4, 2, true, -1)); }, {"shared_hidden=-1", "Use 0 (no shared expert)"});
  LlamaConfig c = dtp::test::small_llama_config(2);
  c.moe = moeConfig(6, 2, true);
  run_ranks(4, [&](int) {
    Llama model(c);
    expect_error([&] { apply_expert_parallel(model, init_device_mesh("cpu", {4}, {"dp"})); }, {"no \"ep\" dimension"});
    expect_error([&] { apply_expert_parallel(model, init_device_mesh("cpu", {4}, {"ep"})); },
                 {"num_experts=6 is not divisible by the ep degree 4"});
  });
  run_ranks(2, [&](int) {
    Llama model(c);
    expect_error([&] {
      parallelize_module(*model, init_device_mesh("cpu", {2}, {"ep"}), {{"layers.*.feed_forward", ExpertParallel()}});
    }, {"matches no submodule"});
    expect_error([&] {
      parallelize_module(*model, init_device_mesh("cpu", {2}, {"ep"}), {{"layers.*.attention", ExpertParallel()}});
    }, {"ExpertParallel: expected a MoE module at 'layers.0.attention'"});
  });
  LlamaConfig dense = dtp::test::small_llama_config(2);
  run_ranks(2, [&](int) {
    Llama model(dense);
    expect_error([&] { apply_expert_parallel(model, init_device_mesh("cpu", {2}, {"ep"})); }, {"no MoE layers"});
  });
  // ExpertTensorParallel: on the experts only, not with expert parallelism.
  run_ranks(2, [&](int) {
    LlamaConfig m = dtp::test::small_llama_config(2);
    m.moe = moeConfig(4, 2, true);
    Llama model(m);
    const DeviceMesh tp = init_device_mesh("cpu", {2}, {"tp"});
    expect_error([&] { parallelize_module(*model, tp, {{"layers.0.moe", ExpertTensorParallel()}}); },
                 {"ExpertTensorParallel: expected the experts of a MoE layer at 'layers.0.moe'", "layers.*.moe.experts"});
    parallelize_module(*model, tp, {{"layers.*.moe.experts", ExpertTensorParallel()}});
    expect_error([&] { apply_expert_parallel(model, init_device_mesh("cpu", {2}, {"ep"})); },
                 {"distribute_experts: the experts are DTensors already"});
  });
  // parallelize_llama with "ep": (dp, ep[, tp]) in this order, dp present.
  LlamaConfig moe = dtp::test::small_llama_config(2);
  moe.moe = moeConfig(4, 2, true);
  run_ranks(4, [&](int) {
    for (const auto& names : {std::vector<std::string>{"ep", "dp"}, std::vector<std::string>{"ep", "tp"}}) {
      Llama model(moe);
      expect_error([&] { parallelize_llama(model, init_device_mesh("cpu", {2, 2}, names)); },
                   {"parallelize_llama", "(\"dp\", \"ep\", \"tp\") or (\"dp\", \"ep\"), in this order"});
    }
  });
}

}  // namespace
