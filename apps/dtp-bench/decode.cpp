#include "decode.h"

#include "groups.h"
#include "stats.h"

#include "dtp/comm_counter.h"
#include "dtp/device_mesh.h"
#include "dtp/dtensor.h"
#include "dtp/inference/sampling.h"
#include "dtp/models/generate.h"
#include "dtp/inference/kv_cache.h"
#include "dtp/models/hf_llama.h"
#include "dtp/models/llama.h"
#include "dtp/nn/modules.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cstdio>
#include <memory>
#include <optional>
#include <string>

namespace dtp::bench {
namespace {

using namespace dtp::models;

// Decode is memory-bound: at batch 1 each token reads every weight once, the
// 32000-row head included, so the small sizes show per-op overhead and the
// largest the weights' bandwidth.
struct DecodeSize {
  const char* name;
  int64_t dim, layers, heads, kv_heads, vocab;
};
constexpr DecodeSize kDecodeSizes[] = {{"d64", 64, 2, 4, 4, 512},
                                       {"d256", 256, 4, 8, 4, 32000},
                                       {"d512", 512, 4, 8, 4, 32000},
                                       {"d1024", 1024, 2, 16, 4, 32000}};

LlamaConfig configOf(const DecodeSize& s, int64_t max_seq) {
  LlamaConfig c;
  c.vocab_size = s.vocab;
  c.dim = s.dim;
  c.n_layers = s.layers;
  c.n_heads = s.heads;
  c.n_kv_heads = s.kv_heads;
  c.max_seq_len = max_seq;
  c.seed = 1;
  return c;
}

// One way to decode: the prefill of [B, P] prompts, then one token per step.
class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual std::vector<int64_t> prefill(const at::Tensor& prompts) = 0;
  virtual std::vector<int64_t> step(const std::vector<int64_t>& tokens) = 0;
};

// dtp's model as a user runs it: the KV-cache forward and inference::sample,
// the loop of models::generate.
class DtpDecoder : public Decoder {
 public:
  DtpDecoder(Llama model, int64_t batch, int64_t max_seq) : model_(std::move(model)), cache_(batch, max_seq) {}
  std::vector<int64_t> prefill(const at::Tensor& prompts) override {
    const int64_t batch = prompts.size(0);
    cache_.reset(batch);
    return next(model_->forward(prompts, cache_, std::vector<int64_t>(batch, prompts.size(1))));
  }
  std::vector<int64_t> step(const std::vector<int64_t>& tokens) override {
    const int64_t batch = static_cast<int64_t>(tokens.size());
    return next(model_->forward(at::tensor(tokens, at::kLong).view({batch, 1}).to(model_->config.device), cache_,
                                std::vector<int64_t>(batch, 1)));
  }

 private:
  std::vector<int64_t> next(const at::Tensor& logits) { return inference::sample(logits, greedy_, gen_); }
  Llama model_;
  KVCache cache_;
  inference::SamplingOptions greedy_;
  at::Generator gen_ = at::make_generator<at::CPUGeneratorImpl>(0);
};

// What a user writes without dtp, on the model's weights (this rank's shards
// under TP, gpt-fast style): plain tensors, linear, rms norm, a SwiGLU
// MLP, the same KVCache and cached_attention as the model, and with a group
// of more than one rank the collectives of Megatron TP written out: one
// all-reduce after the embedding (each rank looks up its vocabulary rows,
// zero elsewhere), each attention and each MLP, and the greedy pick from
// vocabulary-sharded logits with one all-gather of [B, 2] (max, index) per
// rank.
class HandDecoder : public Decoder {
 public:
  HandDecoder(const Llama& model, ProcessGroup group, int64_t batch, int64_t max_seq)
      : group_(group.valid() && group.size() > 1 ? group : ProcessGroup()), cache_(batch, max_seq),
        eps_(model->config.norm_eps) {
    const auto params = model->named_parameters();
    const auto buffers = model->named_buffers();
    auto get = [&](const std::string& name, const Placement& want) {
      const at::Tensor* p = params.find(name);
      TORCH_CHECK(p != nullptr, "dtp-bench --decode: the model has no parameter '", name, "'.");
      if (!is_dtensor(*p)) return p->detach();
      const Placements& have = placements(*p);
      TORCH_CHECK(have.size() == 1 && have[0] == want, "dtp-bench --decode: parameter '", name, "' is ",
                  dtensor_spec(*p).str(), ", expected ", want.str(), ": the hand-written TP decode assumes "
                  "apply_tensor_parallel_for_inference's plan.");
      return to_local(p->detach());
    };
    // The first vocabulary row (embedding) and column (head) of this rank's shard.
    auto offset = [&](const std::string& name) {
      const at::Tensor& p = *params.find(name);
      return is_dtensor(p) ? dtensor_spec(p).local_offset()[0] : 0;
    };
    embedding_ = get("tok_embeddings.weight", Shard(0));
    vocab_offset_ = offset("tok_embeddings.weight");
    // A Linear converted by to_weight_only: its narrow weight and, for int8,
    // the scales buffer beside it, this rank's rows (kv: one head's rows).
    auto linearWeight = [&](const std::string& name, const Placement& want, int64_t row0 = -1, int64_t rows = 0) {
      Weight w{get(name, want), at::Tensor()};
      if (const at::Tensor* s = buffers.find(name + "_scales")) w.scales = is_dtensor(*s) ? to_local(*s) : *s;
      if (row0 >= 0) {
        w.w = w.w.narrow(0, row0, rows);
        if (w.scales.defined()) w.scales = w.scales.narrow(0, row0, rows);
      }
      return w;
    };
    const int64_t head_dim = model->config.head_dim();
    for (int64_t i = 0; i < model->config.n_layers; ++i) {
      const std::string l = "layers." + std::to_string(i) + ".";
      // With more ranks than KV heads, wk and wv stay replicated and this
      // rank projects onto its one KV head only (vLLM's rule).
      const int64_t kv_head = model->layers->ptr(i)->as<dtp::nn::HookedImpl<TransformerBlockImpl>>()->attention->kv_head;
      auto kv = [&](const std::string& name) {
        if (kv_head < 0) return linearWeight(name, Shard(0));
        return linearWeight(name, Replicate(), kv_head * head_dim, head_dim);
      };
      layers_.push_back({get(l + "attention_norm.weight", Replicate()), linearWeight(l + "attention.wq.weight", Shard(0)),
                         kv(l + "attention.wk.weight"), kv(l + "attention.wv.weight"),
                         linearWeight(l + "attention.wo.weight", Shard(1)), get(l + "ffn_norm.weight", Replicate()),
                         linearWeight(l + "feed_forward.w1.weight", Shard(0)),
                         linearWeight(l + "feed_forward.w2.weight", Shard(1)),
                         linearWeight(l + "feed_forward.w3.weight", Shard(0))});
    }
    norm_ = get("norm.weight", Replicate());
    output_ = linearWeight("output.weight", Shard(0));
    head_offset_ = offset("output.weight");
    auto buffer = [&](const std::string& name) {
      const at::Tensor* t = buffers.find(name);
      TORCH_CHECK(t != nullptr, "dtp-bench --decode: the model has no buffer '", name, "'.");
      return is_dtensor(*t) ? to_local(*t) : *t;
    };
    rope_cos_ = buffer("layers.0.attention.rope_cos");
    rope_sin_ = buffer("layers.0.attention.rope_sin");
    head_dim_ = head_dim;
  }

  std::vector<int64_t> prefill(const at::Tensor& prompts) override {
    cache_.reset(prompts.size(0));
    return greedy(forward(prompts));
  }
  std::vector<int64_t> step(const std::vector<int64_t>& tokens) override {
    return greedy(forward(
        at::tensor(tokens, at::kLong).view({static_cast<int64_t>(tokens.size()), 1}).to(embedding_.device())));
  }

 private:
  struct Weight {
    at::Tensor w, scales;  // scales: int8 weights only
  };
  struct Layer {
    at::Tensor attention_norm;
    Weight wq, wk, wv, wo;
    at::Tensor ffn_norm;
    Weight w1, w2, w3;
  };

  at::Tensor rmsNorm(const at::Tensor& x, const at::Tensor& w) const {
    return x * at::rsqrt(x.pow(2).mean({-1}, /*keepdim=*/true) + eps_) * w;
  }
  // The model's own kernels, so dtp - hand stays DTensor's cost: at::linear
  // with dtp's one-row path (NOTE: [One-row linear]), or the weight-only
  // kernel of a narrow weight (NOTE: [Weight-only linears]).
  static at::Tensor linear(const at::Tensor& x, const Weight& w) {
    if (at::isFloatingType(w.w.scalar_type()) && w.w.scalar_type() == x.scalar_type())
      return dtp::nn::detail::linear(x, w.w, {});
    return dtp::nn::weight_only_linear(x, w.w, w.scales, {});
  }
  at::Tensor allReduce(at::Tensor t) const {
    if (group_.valid()) group_.all_reduce(t);
    return t;
  }
  at::Tensor embed(const at::Tensor& tokens) const {
    if (!group_.valid()) return at::embedding(embedding_, tokens);
    const at::Tensor outside = (tokens < vocab_offset_).logical_or_(tokens >= vocab_offset_ + embedding_.size(0));
    at::Tensor h = at::embedding(embedding_, (tokens - vocab_offset_).masked_fill_(outside, 0));
    return allReduce(h.masked_fill_(outside.unsqueeze(-1), 0.0));
  }

  // tokens [B, S], all valid -> this rank's logits of the last token, [B, 1, vocab / W].
  at::Tensor forward(const at::Tensor& tokens) {
    const int64_t batch = tokens.size(0), seq = tokens.size(1);
    const std::vector<int64_t> valid(batch, seq);
    cache_.begin(valid, seq);
    at::Tensor h = embed(tokens);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      at::Tensor x = rmsNorm(h, l.attention_norm);
      const at::Tensor q = linear(x, l.wq).view({batch, seq, -1, head_dim_});
      const at::Tensor k = linear(x, l.wk).view({batch, seq, -1, head_dim_});
      const at::Tensor v = linear(x, l.wv).view({batch, seq, -1, head_dim_});
      const at::Tensor a = cached_attention(q, k, v, rope_cos_, rope_sin_, cache_, static_cast<int64_t>(i));
      h = h + allReduce(linear(a, l.wo));
      x = rmsNorm(h, l.ffn_norm);
      h = h + allReduce(linear(at::silu(linear(x, l.w1)) * linear(x, l.w3), l.w2));
    }
    cache_.end(valid);
    return linear(rmsNorm(h.narrow(1, seq - 1, 1), norm_), output_);
  }

  // The largest logit, the lowest vocabulary index among equals (sample's order).
  std::vector<int64_t> greedy(const at::Tensor& logits) const {
    const int64_t batch = logits.size(0);
    auto [val, idx] = logits.view({batch, -1}).max(-1);
    at::Tensor cand = at::stack({val.to(at::kDouble), idx.to(at::kDouble) + static_cast<double>(head_offset_)}, -1)
                          .view({batch, 1, 2});
    if (group_.valid()) cand = group_.all_gather(cand, 1, std::vector<int64_t>(group_.size(), 1)).wait();
    cand = cand.cpu();
    const auto c = cand.accessor<double, 3>();
    std::vector<int64_t> out(batch);
    for (int64_t b = 0; b < batch; ++b) {
      int64_t best = 0;
      for (int64_t r = 1; r < c.size(1); ++r)
        if (c[b][r][0] > c[b][best][0] || (c[b][r][0] == c[b][best][0] && c[b][r][1] < c[b][best][1])) best = r;
      out[b] = static_cast<int64_t>(c[b][best][1]);
    }
    return out;
  }

  ProcessGroup group_;  // invalid: one rank, no collectives
  KVCache cache_;
  double eps_;
  int64_t head_dim_ = 0, vocab_offset_ = 0, head_offset_ = 0;
  at::Tensor embedding_, norm_, rope_cos_, rope_sin_;
  Weight output_;
  std::vector<Layer> layers_;
};

struct Counts {
  int64_t collectives = 0, bytes = 0, dtensor_ops = 0;
};

double cpuMs() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

struct Time {
  double ms = 0;      // per token, on the slowest rank
  double cpu_ms = 0;  // per token, CPU time of all ranks' processes (every thread)
};

// One generation: the prefill (untimed), then `steps` decode steps, timed.
// `tokens` gets all steps + 1.
Time decodeOnce(Decoder& d, const at::Tensor& prompts, int64_t steps, const ProcessGroup& world,
                std::vector<int64_t>& tokens, Counts* counts = nullptr) {
  std::vector<int64_t> next = d.prefill(prompts);
  tokens = next;
  double cpu = 0;
  const double ms = timed_max(world, [&] {
    const double cpu0 = cpuMs();
    std::optional<CommCounter> comm;
    std::optional<DTensorOpCounter> ops;
    if (counts) {
      comm.emplace();
      ops.emplace();
    }
    for (int64_t s = 0; s < steps; ++s) {
      next = d.step(next);
      tokens.insert(tokens.end(), next.begin(), next.end());
    }
    if (counts) *counts = {comm->total_count(), comm->total_bytes(), ops->ops()};
    cpu = cpuMs() - cpu0;
  });
  at::Tensor all = at::full({1}, cpu, at::kDouble);
  world.all_reduce(all);
  const double n = static_cast<double>(steps);
  return {ms / n, all.item<double>() / n};
}

struct Row {
  std::vector<double> dtp_ms, hand_ms, dtp_cpu, hand_cpu;
  Counts dtp, hand;
  bool tokens_agree = true;
};

// dtp against the hand-written decode, interleaved: even reps dtp first, odd
// reps the hand-written one first. Every run's tokens must equal the first
// dtp run's (so also: dtp's loop must equal models::generate's).
Row compare(Llama model, Decoder& hand, const at::Tensor& prompts, const DecodeOptions& o, const ProcessGroup& world,
            const char* what) {
  const int64_t batch = prompts.size(0), max_seq = o.prompt + o.steps;
  DtpDecoder dtp(model, batch, max_seq);
  Row row;
  std::vector<int64_t> want, got;
  decodeOnce(dtp, prompts, o.steps, world, want, &row.dtp);
  auto check = [&](const char* who, const std::string& run) {
    if (got == want) return;
    if (row.tokens_agree && world.rank() == 0) {
      size_t i = 0;
      while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
      std::fprintf(stderr, "dtp-bench --decode: %s, batch %lld: %s's greedy tokens differ from dtp's (%s, "
                   "first at step %lld, sequence %lld)\n", what, static_cast<long long>(batch), who, run.c_str(),
                   static_cast<long long>(i / batch), static_cast<long long>(i % batch));
    }
    row.tokens_agree = false;
  };
  decodeOnce(hand, prompts, o.steps, world, got, &row.hand);
  check("the hand-written decode", "first run");
  {
    GenerateOptions g;
    g.max_new_tokens = o.steps + 1;
    std::vector<std::vector<int64_t>> rows;
    for (int64_t b = 0; b < batch; ++b) {
      const at::Tensor p = prompts[b].cpu().contiguous();
      rows.emplace_back(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + p.numel());
    }
    const auto out = generate(model, rows, g);
    got.clear();
    for (int64_t s = 0; s <= o.steps; ++s)
      for (int64_t b = 0; b < batch; ++b) got.push_back(out[b][s]);
    check("models::generate", "first run");
  }
  for (int r = 0; r < o.warmup + o.reps; ++r) {
    for (int k = 0; k < 2; ++k) {
      const bool dtp_turn = (k == 0) == (r % 2 == 0);
      const Time t = decodeOnce(dtp_turn ? static_cast<Decoder&>(dtp) : hand, prompts, o.steps, world, got);
      check(dtp_turn ? "dtp (again)" : "the hand-written decode", "rep " + std::to_string(r));
      if (r < o.warmup) continue;
      (dtp_turn ? row.dtp_ms : row.hand_ms).push_back(t.ms);
      (dtp_turn ? row.dtp_cpu : row.hand_cpu).push_back(t.cpu_ms);
    }
  }
  return row;
}

struct Target {
  int met = 0, rows = 0;
};

bool report(const DecodeSize& s, int64_t batch, const std::string& tp, const Row& row, const DecodeOptions& o,
            const ProcessGroup& world, Target& target) {
  bool ok = row.tokens_agree;
  if (row.dtp.collectives != row.hand.collectives || row.dtp.bytes != row.hand.bytes) {
    if (world.rank() == 0)
      std::fprintf(stderr, "dtp-bench --decode: %s, batch %lld, tp %s: dtp issues %lld collectives (%lld bytes) in "
                   "%lld steps, the hand-written decode %lld (%lld bytes)\n", s.name, static_cast<long long>(batch),
                   tp.c_str(), static_cast<long long>(row.dtp.collectives), static_cast<long long>(row.dtp.bytes),
                   static_cast<long long>(o.steps), static_cast<long long>(row.hand.collectives),
                   static_cast<long long>(row.hand.bytes));
    ok = false;
  }
  std::vector<double> paired;
  for (size_t k = 0; k < row.dtp_ms.size(); ++k) paired.push_back(row.dtp_ms[k] / row.hand_ms[k]);
  const double a = median(row.dtp_ms), b = median(row.hand_ms), ratio = a / b;
  const bool met = ratio <= 1.05;
  target.met += met;
  ++target.rows;
  if (world.rank() == 0) {
    const double per = static_cast<double>(o.steps);
    const double ca = median(row.dtp_cpu), cb = median(row.hand_cpu);
    std::printf("| %s | %lld | %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.1f | %.1f | %s |\n", s.name,
                static_cast<long long>(batch), tp.c_str(), a, b, ratio, median(paired), a - b, ca / cb, ca - cb,
                row.dtp.collectives / per, row.dtp.dtensor_ops / per, met ? "yes" : "no");
    std::fflush(stdout);
  }
  return ok;
}

}  // namespace

std::vector<std::string> decode_size_names() {
  std::vector<std::string> names;
  for (const DecodeSize& s : kDecodeSizes) names.push_back(s.name);
  return names;
}

bool run_decode(const DecodeOptions& o, const ProcessGroup& world) {
  torch::NoGradGuard no_grad;
  const int w = world.size();
  DeviceMesh mesh = init_device_mesh(o.device, {w}, {"tp"});
  // Side by side in one run with more than one rank on the CPU: TP=1 on rank
  // 0 alone with all the job's threads (its own one-rank group; the others
  // wait), and TP=W over Gloo alone (a world made with DTP_SHM=0) besides the
  // default (shared memory on one host).
  std::optional<DeviceMesh> gloo_mesh;
  ProcessGroup alone = world;
  if (w > 1) {
    if (o.device == "cpu") gloo_mesh.emplace(init_device_mesh(o.device, {w}, {"tp"}, whole_group_with(world, "0")));
    alone = world.new_group({0});
  }
  if (world.rank() == 0) {
    std::printf("\n## Decode with a KV cache: ms per token (prompt %lld tokens, untimed; %lld greedy steps timed), "
                "%s weights on %s, median of %d reps interleaved; %d threads per rank\n\n",
                static_cast<long long>(o.prompt), static_cast<long long>(o.steps), o.weights.c_str(),
                mesh.device().str().c_str(), o.reps,
                at::get_num_threads());
    std::printf("tp=1: dtp's model on plain tensors vs plain libtorch%s; tp=%d%s: apply_tensor_parallel_for_inference "
                "vs hand-written TP on the same local shards%s\n\n", w > 1 ? " (rank 0 alone, with the threads of all ranks)" : "",
                w, w == 1 ? " (mesh)" : "", w == 1 ? " (a one-rank mesh: DTensor's cost alone)"
                : o.device == "cpu" ? ", with CPU collectives through shared memory (shm, the default on one host) and "
                                      "through Gloo alone (gloo, DTP_SHM=0)" : "");
    std::printf("paired: the median of per-rep ratios; CPU: process CPU time of all ranks (steadier than wall time "
                "on a shared machine); DTensor ops: ATen ops through dtp's DTensor fallback\n\n");
    std::printf("| size | batch | tp | dtp ms/token | hand ms/token | dtp / hand | paired | dtp - hand ms | "
                "CPU dtp / hand | CPU dtp - hand ms | collectives/token | DTensor ops/token | dtp <= 1.05x |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    std::fflush(stdout);
  }
  bool ok = true;
  Target target;
  for (const std::string& name : o.sizes) {
    const DecodeSize* found = nullptr;
    for (const DecodeSize& s : kDecodeSizes) found = name == s.name ? &s : found;
    TORCH_CHECK(found != nullptr, "dtp-bench --decode: unknown size '", name, "'. Use one of d64, d256, d512, d1024.");
    const DecodeSize& s = *found;
    // + 1: models::generate's check (compare()) counts the last of its
    // steps + 1 new tokens, which the decoders never feed back.
    LlamaConfig c = configOf(s, o.prompt + o.steps + 1);
    c.device = mesh.device();
    c.dtype = o.dtype;
    // --dtype bfloat16 / float16, --quantize int8: each model's Linear
    // weights converted after TP, as dtp-generate's load does. The plain
    // model last: the first conversion registers the weight-only ops'
    // sharding rules, which every rank must have before it parallelizes
    // (NOTE: [Ranks agree on sharding rules]).
    auto narrow = [&](Llama& m) {
      if (o.weight_only) to_weight_only(m, *o.weight_only);
    };
    std::optional<Llama> plain, tp_gloo;
    if (alone.valid()) plain.emplace(c);
    Llama tp(c);
    apply_tensor_parallel_for_inference(tp, mesh);
    narrow(tp);
    if (gloo_mesh) {
      tp_gloo.emplace(c);
      apply_tensor_parallel_for_inference(*tp_gloo, *gloo_mesh);
      narrow(*tp_gloo);
    }
    if (plain) narrow(*plain);
    for (int64_t batch : o.batches) {
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
      const at::Tensor prompts = at::randint(s.vocab, {batch, o.prompt}, gen).to(c.device);  // the same on every rank
      if (plain) {
        const int threads = at::get_num_threads();
        at::set_num_threads(threads * w);
        HandDecoder hand(*plain, ProcessGroup(), batch, o.prompt + o.steps);
        ok &= report(s, batch, w == 1 ? "1" : "1 (rank 0, all threads)",
                     compare(*plain, hand, prompts, o, alone, s.name), o, alone, target);
        at::set_num_threads(threads);
      }
      world.barrier();
      HandDecoder hand(tp, mesh.get_group(0), batch, o.prompt + o.steps);
      ok &= report(s, batch, w == 1 ? "1 (mesh)" : std::to_string(w) + (gloo_mesh ? " shm" : ""),
                   compare(tp, hand, prompts, o, world, s.name), o, world, target);
      if (tp_gloo) {
        HandDecoder hand_gloo(*tp_gloo, gloo_mesh->get_group(0), batch, o.prompt + o.steps);
        ok &= report(s, batch, std::to_string(w) + " gloo", compare(*tp_gloo, hand_gloo, prompts, o, world, s.name), o,
                     world, target);
      }
    }
  }
  at::Tensor agree = at::full({1}, ok ? 1 : 0, at::kInt);
  world.all_reduce(agree, ReduceOp::Min);
  ok = agree.item<int>() == 1;
  if (world.rank() == 0) {
    std::printf("\nTarget dtp <= 1.05x the hand-written decode (median ratio; not a check): met in %d of %d rows\n",
                target.met, target.rows);
    std::printf(ok ? "dtp-bench --decode: checks passed (the hand-written decodes pick dtp's greedy tokens with "
                     "dtp's collectives)\n"
                   : "dtp-bench --decode: CHECKS FAILED (see above)\n");
  }
  return ok;
}

}  // namespace dtp::bench
