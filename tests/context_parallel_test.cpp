// Context parallelism (#58): ring attention and all-to-all (Ulysses)
// attention on cp 2 and 4 (ranks as threads) against one device's attention
// in float64, values and gradients of q, k and v, causal and not, both
// layouts, uneven sequences (a rank with no positions too), GQA and a value
// dim other than the key's; their send/recv and all_to_all counts against
// the closed form; the layouts (segments, shard/unshard, rotary positions,
// the causal work per rank) and the errors.
//
// The bound: every result is a softmax-weighted sum of at most S = 19
// values, each weight from a D = 8 dot product, inputs ~N(0, 1). In float64
// (unit roundoff u = 1.1e-16) one device's and the ring's results each carry
// an error of a few tens of u relative to the largest value (the dot
// products, the sum of at most 19 exponentials, at most 2*cp log-sum-exp
// merges, the backward's three matmuls): ~40u = 5e-15. 1e-12 leaves a margin
// of 200 and is still ten orders below what a wrong mask, merge, scale or
// head grouping moves (>= 1e-3 here).
#include "dist.h"

#include "cp/attention_block.h"

#include "dtp/comm_counter.h"
#include "dtp/cp/context_parallel.h"
#include "dtp/device_mesh.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <time.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <limits>
#include <string>
#include <utility>
#include <vector>

using namespace dtp;
using dtp::test::expect_error;
using dtp::test::run_ranks;

namespace {

constexpr double kRelTol = 1e-12;  // see the bound above

enum class Method { Ring, AllToAll };
const char* name(Method m) { return m == Method::Ring ? "ring" : "all_to_all"; }

struct Case {
  int64_t batch = 2, heads = 4, kv_heads = 4, seq = 16, head_dim = 8, v_dim = 8;
  bool causal = false;
  CpLayout layout = CpLayout::Contiguous;
  int64_t window = 0;  // a sliding window (with causal); 0: none
  std::string str() const {
    return c10::str("B=", batch, " H=", heads, " H_kv=", kv_heads, " S=", seq, " D=", head_dim, " Dv=", v_dim,
                    causal ? " causal " : " full ", to_string(layout), window > 0 ? c10::str(" window ", window) : "");
  }
};

at::Tensor randn(std::vector<int64_t> shape, uint64_t seed) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, g, at::kDouble);
}

// max |a - ref| / max |full|: the error relative to the largest value of
// the whole reference `full` (a rank's part may be all zeros: the query at
// position 0 under a causal mask has dq = 0 up to rounding). Where `full` is
// all zeros (a window of 1: each query sees itself alone, so dq = dk = 0),
// the absolute error.
double rel_err(const at::Tensor& a, const at::Tensor& ref, const at::Tensor& full) {
  EXPECT_EQ(a.sizes(), ref.sizes());
  if (a.sizes() != ref.sizes()) return 1.0;
  if (ref.numel() == 0) return 0.0;
  const double diff = (a - ref).abs().max().item<double>(), largest = full.abs().max().item<double>();
  return largest > 0 ? diff / largest : diff;
}
double rel_err(const at::Tensor& a, const at::Tensor& ref) { return rel_err(a, ref, ref); }

// The largest error a test measured (all ranks, all cases), printed at its
// end: the figure behind kRelTol's margin.
std::mutex worst_mu;
double worst_err = 0;
double noted(double err) {
  std::lock_guard<std::mutex> lock(worst_mu);
  worst_err = std::max(worst_err, err);
  return err;
}
struct PrintWorst {
  PrintWorst() { worst_err = 0; }
  ~PrintWorst() { std::printf("  largest relative error measured: %.3g (bound %.0e)\n", worst_err, kRelTol); }
};

// One device: softmax(q k^T * scale) v with key/value head h / (H / H_kv)
// for query head h (repeat_interleave) and the causal mask of the whole
// sequence (with `window` > 0 also the keys window or more positions back,
// as the Llama's one-device attention hides them), written independently of
// src/cp/.
at::Tensor one_device_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                                int64_t window = 0) {
  const int64_t g = q.size(1) / k.size(1), S = q.size(2);
  const at::Tensor kr = k.repeat_interleave(g, 1), vr = v.repeat_interleave(g, 1);
  at::Tensor s = at::matmul(q, kr.transpose(-1, -2)) / std::sqrt(static_cast<double>(q.size(3)));
  if (causal) {
    at::Tensor hidden = at::ones({S, S}, at::kBool).triu(1);
    if (window > 0) hidden = hidden.logical_or(at::ones({S, S}, at::kBool).tril(-window));
    s = s.masked_fill(hidden, -std::numeric_limits<double>::infinity());
  }
  return at::matmul(s.softmax(-1), vr);
}

struct Reference {
  at::Tensor q, k, v, w, out, dq, dk, dv;  // w: the loss weights, loss = sum(out * w)
};

Reference reference(const Case& c, uint64_t seed) {
  Reference ref;
  ref.q = randn({c.batch, c.heads, c.seq, c.head_dim}, seed);
  ref.k = randn({c.batch, c.kv_heads, c.seq, c.head_dim}, seed + 1);
  ref.v = randn({c.batch, c.kv_heads, c.seq, c.v_dim}, seed + 2);
  ref.w = randn({c.batch, c.heads, c.seq, c.v_dim}, seed + 3);
  const at::Tensor q = ref.q.clone().requires_grad_(), k = ref.k.clone().requires_grad_(),
                   v = ref.v.clone().requires_grad_();
  const at::Tensor out = one_device_attention(q, k, v, c.causal, c.window);
  (out * ref.w).sum().backward();
  ref.out = out.detach(), ref.dq = q.grad(), ref.dk = k.grad(), ref.dv = v.grad();
  return ref;
}

// Runs `method` on cp ranks with each rank's part of the reference's inputs,
// and checks the output and the three gradients on every rank, the
// unsharded output, and the collectives each pass issues.
void expect_equals_one_device(Method method, int cp, const Case& c) {
  SCOPED_TRACE(c10::str(name(method), " cp=", cp, " ", c.str()));
  const Reference ref = reference(c, 17 + cp);  // drawn once, before the ranks start
  run_ranks(cp, [&](int r) {
    SCOPED_TRACE(c10::str(name(method), " cp=", cp, " rank ", r, " ", c.str()));  // traces are per thread
    const ProcessGroup group = default_process_group();
    const auto shard = [&](const at::Tensor& t) { return context_parallel_shard(t, 2, group, c.layout); };
    const at::Tensor q = shard(ref.q).clone().requires_grad_(), k = shard(ref.k).clone().requires_grad_(),
                     v = shard(ref.v).clone().requires_grad_();
    const auto opts = CpAttentionOptions().causal(c.causal).layout(c.layout).seq_len(c.seq).window(c.window);
    CommCounter comm;
    const at::Tensor out =
        method == Method::Ring ? ring_attention(q, k, v, group, opts) : all_to_all_attention(q, k, v, group, opts);
    // Ring: cp - 1 send/recv pairs (one k/v chunk each); all-to-all: q, k, v and the output.
    if (method == Method::Ring) {
      EXPECT_EQ(comm.count(CollectiveType::Send), cp - 1) << comm.str();
      EXPECT_EQ(comm.count(CollectiveType::Recv), cp - 1) << comm.str();
    } else {
      EXPECT_EQ(comm.count(CollectiveType::AllToAll), 4) << comm.str();
    }
    EXPECT_EQ(comm.total_count(), method == Method::Ring ? 2 * (cp - 1) : 4) << comm.str();
    comm.reset();
    (out * shard(ref.w)).sum().backward();
    // Ring backward: the k/v chunks again (cp - 1), the dk/dv accumulators
    // after each round (cp - 1) and home (1). All-to-all: the four back.
    if (method == Method::Ring) {
      EXPECT_EQ(comm.count(CollectiveType::Send), 2 * cp - 1) << comm.str();
      EXPECT_EQ(comm.count(CollectiveType::Recv), 2 * cp - 1) << comm.str();
    } else {
      EXPECT_EQ(comm.count(CollectiveType::AllToAll), 4) << comm.str();
    }
    EXPECT_EQ(comm.total_count(), method == Method::Ring ? 2 * (2 * cp - 1) : 4) << comm.str();
    EXPECT_LE(noted(rel_err(out.detach(), shard(ref.out), ref.out)), kRelTol) << "output";
    EXPECT_LE(noted(rel_err(q.grad(), shard(ref.dq), ref.dq)), kRelTol) << "dq";
    EXPECT_LE(noted(rel_err(k.grad(), shard(ref.dk), ref.dk)), kRelTol) << "dk";
    EXPECT_LE(noted(rel_err(v.grad(), shard(ref.dv), ref.dv)), kRelTol) << "dv";
    comm.reset();
    const at::Tensor full = context_parallel_unshard(out.detach(), 2, c.seq, group, c.layout);
    EXPECT_EQ(comm.count(CollectiveType::AllGather), 1) << comm.str();
    EXPECT_LE(noted(rel_err(full, ref.out)), kRelTol) << "unsharded output";
  });
}

Case causal(Case c, CpLayout layout) {
  c.causal = true;
  c.layout = layout;
  return c;
}
Case with_seq(Case c, int64_t seq) {
  c.seq = seq;
  return c;
}
Case windowed(Case c, int64_t window) {
  c.window = window;
  return c;
}
Case gqa(Case c) {  // 6 query heads over 2 key/value heads, a value dim of 5
  c.heads = 6, c.kv_heads = 2, c.v_dim = 5;
  return c;
}

// ---------------------------------------------------------------- ring

TEST(RingAttentionTest, FullAttentionEqualsOneDevice) {
  const PrintWorst print;
  for (int cp : {2, 4}) {
    expect_equals_one_device(Method::Ring, cp, Case{});
    expect_equals_one_device(Method::Ring, cp, causal(Case{}, CpLayout::HeadTail));
  }
}

TEST(RingAttentionTest, CausalEqualsOneDeviceBothLayouts) {
  const PrintWorst print;
  for (int cp : {2, 4})
    for (CpLayout layout : {CpLayout::Contiguous, CpLayout::HeadTail})
      expect_equals_one_device(Method::Ring, cp, causal(Case{}, layout));
}

// 13 over cp 4: torch.chunk's 4,4,4,1 (Contiguous); chunks 1,1,1,2,2,2,2,2
// (HeadTail: 3,3,3,4 per rank); 3 over cp 4: 1,1,1,0, a rank with nothing.
TEST(RingAttentionTest, UnevenSequenceEqualsOneDevice) {
  const PrintWorst print;
  for (int cp : {2, 4}) {
    for (bool is_causal : {false, true}) {
      Case c = with_seq(Case{}, 13);
      c.causal = is_causal;
      expect_equals_one_device(Method::Ring, cp, c);
      c.layout = CpLayout::HeadTail;
      expect_equals_one_device(Method::Ring, cp, c);
    }
  }
  expect_equals_one_device(Method::Ring, 4, causal(with_seq(Case{}, 3), CpLayout::Contiguous));
  expect_equals_one_device(Method::Ring, 4, causal(with_seq(Case{}, 19), CpLayout::HeadTail));
}

TEST(RingAttentionTest, GroupedQueryHeadsEqualOneDevice) {
  const PrintWorst print;
  for (int cp : {2, 4}) {
    expect_equals_one_device(Method::Ring, cp, gqa(Case{}));
    expect_equals_one_device(Method::Ring, cp, causal(gqa(Case{}), CpLayout::HeadTail));
    expect_equals_one_device(Method::Ring, cp, causal(gqa(with_seq(Case{}, 11)), CpLayout::Contiguous));
  }
}

// Mistral's sliding window: windows of 1 (each query sees itself), shorter
// than a chunk, longer than one, and as long as the sequence; even and
// uneven sequences, both layouts, GQA. The chunks still travel the whole
// ring (the counts above hold).
TEST(RingAttentionTest, SlidingWindowEqualsOneDevice) {
  const PrintWorst print;
  for (int cp : {2, 4})
    for (CpLayout layout : {CpLayout::Contiguous, CpLayout::HeadTail})
      for (int64_t window : {1, 3, 6, 16}) {
        expect_equals_one_device(Method::Ring, cp, windowed(causal(Case{}, layout), window));
        expect_equals_one_device(Method::Ring, cp, windowed(causal(gqa(with_seq(Case{}, 19)), layout), window));
      }
}

TEST(RingAttentionTest, OnAOneDimensionalMesh) {
  const Case c = causal(Case{}, CpLayout::HeadTail);
  const Reference ref = reference(c, 5);
  run_ranks(2, [&](int) {
    const DeviceMesh mesh = init_device_mesh("cpu", {2}, {"cp"});
    const ProcessGroup group = mesh.get_group(0);
    const auto shard = [&](const at::Tensor& t) { return context_parallel_shard(t, 2, group, c.layout); };
    const auto opts = CpAttentionOptions().causal(true).layout(c.layout);  // seq_len: 2 * 8, even
    const at::Tensor out = ring_attention(shard(ref.q), shard(ref.k), shard(ref.v), mesh, opts);
    EXPECT_LE(rel_err(out, shard(ref.out), ref.out), kRelTol);
  });
  run_ranks(4, [&](int) {
    const DeviceMesh mesh = init_device_mesh("cpu", {2, 2}, {"dp", "cp"});
    const at::Tensor t = at::zeros({1, 1, 4, 2}, at::kDouble);
    expect_error([&] { ring_attention(t, t, t, mesh); },
                 {"ring_attention: expected a 1-D mesh over the cp ranks", "(dp=2, cp=2)", "mesh[\"cp\"]"});
  });
}

// Models hand attention q, k, v as [B, S, H, D].transpose(1, 2): strided
// views, and under the contiguous layout a rank's part stays one.
TEST(RingAttentionTest, StridedInputsEqualOneDevice) {
  const Case c = causal(gqa(with_seq(Case{}, 13)), CpLayout::Contiguous);
  const Reference ref = reference(c, 31);
  const auto strided = [](const at::Tensor& t) { return t.transpose(1, 2).contiguous().transpose(1, 2); };
  const at::Tensor q_full = strided(ref.q), k_full = strided(ref.k), v_full = strided(ref.v);
  run_ranks(4, [&](int r) {
    SCOPED_TRACE(c10::str("rank ", r));
    const ProcessGroup group = default_process_group();
    const auto shard = [&](const at::Tensor& t) { return context_parallel_shard(t, 2, group, c.layout); };
    const at::Tensor q = shard(q_full).requires_grad_(), k = shard(k_full).requires_grad_(),
                     v = shard(v_full).requires_grad_();
    EXPECT_FALSE(q.is_contiguous() && q.numel() > 1);
    const at::Tensor out = ring_attention(q, k, v, group, CpAttentionOptions().causal(true).seq_len(c.seq));
    (out * shard(ref.w)).sum().backward();
    EXPECT_LE(rel_err(out.detach(), shard(ref.out), ref.out), kRelTol);
    EXPECT_LE(rel_err(q.grad(), shard(ref.dq), ref.dq), kRelTol);
    EXPECT_LE(rel_err(k.grad(), shard(ref.dk), ref.dk), kRelTol);
    EXPECT_LE(rel_err(v.grad(), shard(ref.dv), ref.dv), kRelTol);
  });
}

// bfloat16 inputs: the ring's softmax, lse and merges run in float32 (NOTE:
// [Ring attention]), so against the float64 truth on the same (rounded)
// inputs it is no further than one device's bfloat16 attention, up to one
// more bfloat16 rounding.
TEST(RingAttentionTest, BFloat16StaysAsCloseAsOneDevice) {
  const Case c = causal(with_seq(Case{}, 16), CpLayout::HeadTail);
  Reference ref = reference(c, 41);
  const auto bf16 = [](const at::Tensor& t) { return t.to(at::kBFloat16); };
  // The truth on the rounded inputs, and one device's bf16 attention.
  const at::Tensor truth = one_device_attention(bf16(ref.q).to(at::kDouble), bf16(ref.k).to(at::kDouble),
                                                bf16(ref.v).to(at::kDouble), true);
  const at::Tensor one_device = one_device_attention(bf16(ref.q), bf16(ref.k), bf16(ref.v), true).to(at::kDouble);
  const double one_device_err = rel_err(one_device, truth);
  std::vector<double> ring_err(4);
  run_ranks(4, [&](int r) {
    const ProcessGroup group = default_process_group();
    const auto shard = [&](const at::Tensor& t) { return context_parallel_shard(t, 2, group, c.layout); };
    const at::Tensor out = ring_attention(bf16(shard(ref.q)), bf16(shard(ref.k)), bf16(shard(ref.v)), group,
                                          CpAttentionOptions().causal(true).layout(c.layout));
    EXPECT_EQ(out.scalar_type(), at::kBFloat16);
    ring_err[r] = rel_err(out.to(at::kDouble), shard(truth), truth);
  });
  const double worst = *std::max_element(ring_err.begin(), ring_err.end());
  std::printf("  bf16 relative error vs float64: one device %.3g, ring cp=4 %.3g\n", one_device_err, worst);
  // Both round the scores and P V to bfloat16 once; the ring also rounds
  // each block's output once before its float32 merge: one more unit
  // roundoff (2^-9) on top of one device's error. (Blocks with a bfloat16
  // softmax and lse measured 6.5e-3 here, one device 3.5e-3: this fails.)
  EXPECT_LE(worst, one_device_err + std::ldexp(1.0, -9));
}

// ---------------------------------------------------------- all-to-all

TEST(AllToAllAttentionTest, EqualsOneDevice) {
  const PrintWorst print;
  for (int cp : {2, 4}) {
    expect_equals_one_device(Method::AllToAll, cp, Case{});
    for (CpLayout layout : {CpLayout::Contiguous, CpLayout::HeadTail}) {
      expect_equals_one_device(Method::AllToAll, cp, causal(Case{}, layout));
      expect_equals_one_device(Method::AllToAll, cp, causal(with_seq(Case{}, 13), layout));
    }
  }
}

// H_kv = 4 over cp 2 splits the key/value heads; H_kv = 2 over cp 4 repeats
// them to one per query head first.
TEST(AllToAllAttentionTest, GroupedQueryHeadsEqualOneDevice) {
  const PrintWorst print;
  Case c;
  c.heads = 8, c.kv_heads = 4, c.v_dim = 5;
  for (int cp : {2, 4}) {
    expect_equals_one_device(Method::AllToAll, cp, causal(c, CpLayout::HeadTail));
    Case fewer = c;
    fewer.kv_heads = 2;
    expect_equals_one_device(Method::AllToAll, cp, causal(with_seq(fewer, 11), CpLayout::Contiguous));
  }
}

TEST(AllToAllAttentionTest, SlidingWindowEqualsOneDevice) {
  const PrintWorst print;
  for (int cp : {2, 4})
    for (CpLayout layout : {CpLayout::Contiguous, CpLayout::HeadTail})
      for (int64_t window : {1, 5}) expect_equals_one_device(Method::AllToAll, cp, windowed(causal(with_seq(Case{}, 13), layout), window));
}

TEST(AllToAllAttentionTest, HeadsNotDividingCpIsAnError) {
  run_ranks(4, [&](int) {
    const at::Tensor q = at::zeros({1, 6, 4, 2}, at::kDouble), kv = at::zeros({1, 2, 4, 2}, at::kDouble);
    CommCounter comm;
    expect_error([&] { all_to_all_attention(q, kv, kv, default_process_group()); },
                 {"all_to_all_attention: 6 query heads do not divide over cp 4", "ring_attention"});
    EXPECT_EQ(comm.total_count(), 0) << comm.str();
  });
}

// ------------------------------------------------------------- layouts

std::string segments_str(int64_t seq, int64_t cp, CpLayout layout) {
  std::string s;
  for (int64_t r = 0; r < cp; ++r) {
    s += r ? " | " : "";
    for (const auto& seg : context_parallel_segments(seq, cp, r, layout))
      s += c10::str("[", seg.start, ",", seg.start + seg.length, ")");
  }
  return s;
}

TEST(ContextParallelLayoutTest, SegmentsGolden) {
  EXPECT_EQ(segments_str(16, 4, CpLayout::Contiguous), "[0,4) | [4,8) | [8,12) | [12,16)");
  EXPECT_EQ(segments_str(10, 4, CpLayout::Contiguous), "[0,3) | [3,6) | [6,9) | [9,10)");  // torch.chunk
  EXPECT_EQ(segments_str(3, 4, CpLayout::Contiguous), "[0,1) | [1,2) | [2,3) | [3,3)");
  EXPECT_EQ(segments_str(16, 4, CpLayout::HeadTail), "[0,2)[14,16) | [2,4)[12,14) | [4,6)[10,12) | [6,8)[8,10)");
  // 9 over 8 chunks: 2,1,1,1,1,1,1,1 (NOTE: [Head-tail chunk lengths]).
  EXPECT_EQ(segments_str(9, 4, CpLayout::HeadTail), "[0,2)[8,9) | [2,3)[7,8) | [3,4)[6,7) | [4,5)[5,6)");
  EXPECT_EQ(segments_str(5, 2, CpLayout::HeadTail), "[0,2)[4,5) | [2,3)[3,4)");
  // 15 over 8 chunks: 1,2,2,2,2,2,2,2 (the short one a head).
  EXPECT_EQ(segments_str(15, 4, CpLayout::HeadTail), "[0,1)[13,15) | [1,3)[11,13) | [3,5)[9,11) | [5,7)[7,9)");
  expect_error([] { context_parallel_segments(7, 4, 0, CpLayout::HeadTail); },
               {"HeadTail layout cuts the sequence into 2*cp = 8 chunks, but seq_len is 7", "CpLayout::Contiguous"});
}

TEST(ContextParallelLayoutTest, ShardUnshardAndPositionIds) {
  for (int cp : {2, 4}) {
    for (CpLayout layout : {CpLayout::Contiguous, CpLayout::HeadTail}) {
      for (int64_t seq : {16, 13, 9}) {
        SCOPED_TRACE(c10::str("cp=", cp, " ", to_string(layout), " S=", seq));
        const at::Tensor x = randn({3, seq, 2}, 3);
        run_ranks(cp, [&](int r) {
          const ProcessGroup group = default_process_group();
          const at::Tensor local = context_parallel_shard(x, 1, group, layout);
          const at::Tensor pos = context_parallel_position_ids(seq, group, layout);
          EXPECT_EQ(local.size(1), context_parallel_local_len(seq, cp, r, layout));
          // The positions are the rows this rank holds: rotary tables indexed
          // by them rotate each token by its global position.
          EXPECT_TRUE(at::equal(local, x.index_select(1, pos)));
          CommCounter comm;
          const at::Tensor back = context_parallel_unshard(local, 1, seq, group, layout);
          EXPECT_EQ(comm.count(CollectiveType::AllGather), 1) << comm.str();
          EXPECT_TRUE(at::equal(back, x));
        });
      }
    }
  }
}

// Under a causal mask the work of a rank is the (q, k) pairs it computes:
// its query segments against every rank's key segments, a block skipped
// when every key follows every query (as ring attention does), counted
// whole otherwise (the diagonal block is computed whole, then masked); and
// the pairs the mask keeps. HeadTail: equal when 2*cp divides S; otherwise
// within one chunk's block (c x c, c = ceil(S / (2*cp))) or one query row
// (S pairs), whichever is larger (NOTE: [Head-tail chunk lengths]: the
// leftover positions are one per chunk). Contiguous: the last rank does
// about cp times the first's work.
// A block is skipped exactly when the mask hides all of it, and dense
// exactly when it hides none: every pair of segments in [0, 12) against
// the element-wise mask, without a window and with windows 1 to 12.
TEST(ContextParallelLayoutTest, BlockKindAgreesWithTheMask) {
  int64_t skipped = 0, windowed_skips = 0;
  for (int64_t window = 0; window <= 12; ++window)
    for (int64_t qa = 0; qa < 12; ++qa)
      for (int64_t ql = 1; qa + ql <= 12; ++ql)
        for (int64_t ka = 0; ka < 12; ++ka)
          for (int64_t kl = 1; ka + kl <= 12; ++kl) {
            const SeqSegment q{qa, ql}, k{ka, kl};
            const at::Tensor hidden = cp::causalMask(q, k, at::kCPU, window);
            const cp::BlockKind kind = cp::blockKind(q, k, /*causal=*/true, window);
            const bool all = hidden.all().item<bool>(), none = !hidden.any().item<bool>();
            SCOPED_TRACE(c10::str("q [", qa, ",", qa + ql, ") k [", ka, ",", ka + kl, ") window ", window));
            ASSERT_EQ(kind == cp::BlockKind::Skip, all);
            ASSERT_EQ(kind == cp::BlockKind::Full, none);
            skipped += all;
            windowed_skips += all && ka <= qa + ql - 1;  // hidden by the window, not the diagonal
          }
  EXPECT_GT(windowed_skips, 0);
  std::printf("  %lld skipped blocks, %lld of them by the window alone\n", static_cast<long long>(skipped),
              static_cast<long long>(windowed_skips));
}

TEST(ContextParallelLayoutTest, CausalWorkPerRankEqualWithinOneChunk) {
  const auto work = [](int64_t seq, int64_t cp, int64_t r, CpLayout layout) {
    int64_t blocks = 0, kept = 0;
    for (const auto& qs : context_parallel_segments(seq, cp, r, layout)) {
      for (int64_t p = qs.start; p < qs.start + qs.length; ++p) kept += p + 1;
      for (int64_t owner = 0; owner < cp; ++owner)
        for (const auto& ks : context_parallel_segments(seq, cp, owner, layout))
          if (qs.length > 0 && ks.length > 0 && ks.start <= qs.start + qs.length - 1) blocks += qs.length * ks.length;
    }
    return std::make_pair(blocks, kept);
  };
  const auto spread = [](const std::vector<int64_t>& x) {
    return *std::max_element(x.begin(), x.end()) - *std::min_element(x.begin(), x.end());
  };
  int64_t uneven_cases = 0;
  for (int64_t cp : {2, 3, 4, 8, 16}) {
    for (int64_t seq = 2 * cp; seq <= 80 * cp; ++seq) {
      SCOPED_TRACE(c10::str("cp=", cp, " S=", seq));
      const int64_t c = (seq + 2 * cp - 1) / (2 * cp), chunk_block = c * c;
      std::vector<int64_t> blocks, kept, naive;
      for (int64_t r = 0; r < cp; ++r) {
        blocks.push_back(work(seq, cp, r, CpLayout::HeadTail).first);
        kept.push_back(work(seq, cp, r, CpLayout::HeadTail).second);
        naive.push_back(work(seq, cp, r, CpLayout::Contiguous).second);
      }
      if (seq % (2 * cp) == 0) {
        ASSERT_EQ(spread(blocks), 0) << c10::str(c10::IntArrayRef(blocks));
        ASSERT_EQ(spread(kept), 0) << c10::str(c10::IntArrayRef(kept));
        ASSERT_EQ(blocks[0], (2 * cp + 1) * chunk_block);  // NOTE: [Ring attention]
        // The naive layout: rank r keeps about (2r + 1) / 2 of rank 0's
        // chunk-blocks of 2c x 2c; the last exceeds the first by (cp - 1) such.
        ASSERT_EQ(spread(naive), (cp - 1) * 4 * chunk_block) << c10::str(c10::IntArrayRef(naive));
      } else {
        ++uneven_cases;
        ASSERT_LE(spread(blocks), std::max(chunk_block, seq)) << c10::str(c10::IntArrayRef(blocks));
        ASSERT_LE(spread(kept), std::max(chunk_block, seq)) << c10::str(c10::IntArrayRef(kept));
      }
    }
  }
  EXPECT_GT(uneven_cases, 1000);
}

// A measurement, not a check (run with --gtest_also_run_disabled_tests):
// each rank's CPU time (its own thread, ATen on one thread) for a causal
// ring attention forward and backward, Contiguous against HeadTail.
TEST(ContextParallelBench, DISABLED_CausalRingTimePerRank) {
  const int prev_threads = at::get_num_threads();
  at::set_num_threads(1);
  const int64_t B = 1, H = 4, S = 4096, D = 64;
  const int cp = 4;
  const at::Tensor q = randn({B, H, S, D}, 1).to(at::kFloat), k = randn({B, H, S, D}, 2).to(at::kFloat),
                   v = randn({B, H, S, D}, 3).to(at::kFloat);
  for (CpLayout layout : {CpLayout::Contiguous, CpLayout::HeadTail}) {
    std::vector<double> ms(cp);
    run_ranks(
        cp,
        [&](int r) {
          const ProcessGroup group = default_process_group();
          const auto shard = [&](const at::Tensor& t) {
            return context_parallel_shard(t, 2, group, layout).contiguous().requires_grad_();
          };
          const at::Tensor lq = shard(q), lk = shard(k), lv = shard(v);
          const auto opts = CpAttentionOptions().causal(true).layout(layout);
          ring_attention(lq, lk, lv, group, opts).sum().backward();  // warm-up
          timespec t0{}, t1{};
          clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
          for (int i = 0; i < 3; ++i) ring_attention(lq, lk, lv, group, opts).sum().backward();
          clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
          ms[r] = ((t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6) / 3;
        },
        std::chrono::seconds(600));
    std::printf("  %s, S=%lld, cp=%d, B=%lld, H=%lld, D=%lld, f32: CPU ms per rank (fwd+bwd):", to_string(layout),
                static_cast<long long>(S), cp, static_cast<long long>(B), static_cast<long long>(H),
                static_cast<long long>(D));
    for (double t : ms) std::printf(" %.0f", t);
    std::printf("\n");
  }
  at::set_num_threads(prev_threads);
}

// -------------------------------------------------------------- errors

TEST(ContextParallelErrorsTest, NamedBeforeAnyMessage) {
  run_ranks(2, [&](int) {
    const ProcessGroup group = default_process_group();
    const auto t = [](int64_t h, int64_t s, int64_t d) { return at::zeros({1, h, s, d}, at::kDouble); };
    CommCounter comm;
    // 13 over cp 2 gives ranks 7 and 6 positions; these hold 5.
    expect_error([&] { ring_attention(t(2, 5, 4), t(2, 5, 4), t(2, 5, 4), group, CpAttentionOptions().seq_len(13)); },
                 {"ring_attention: cp rank", "holds 5 positions, but the Contiguous layout of seq_len 13 over cp 2",
                  "context_parallel_shard"});
    expect_error([&] { ring_attention(t(4, 4, 4), t(3, 4, 4), t(3, 4, 4), group); },
                 "ring_attention: 4 query heads are not a multiple of 3 key/value heads");
    expect_error([&] { ring_attention(t(2, 4, 4), t(2, 3, 4), t(2, 3, 4), group); },
                 "ring_attention: q holds 4 local positions but k and v 3");
    expect_error([&] { ring_attention(t(2, 4, 4), t(2, 4, 3), t(2, 4, 4), group); },
                 "ring_attention: q's head dim is 4 but k's 3");
    expect_error([&] { ring_attention(t(2, 1, 4), t(2, 1, 4), t(2, 1, 4), group,
                                      CpAttentionOptions().layout(CpLayout::HeadTail).causal(true)); },
                 {"ring_attention: the HeadTail layout cuts the sequence into 2*cp = 4 chunks, but seq_len is 2"});
    expect_error([&] { all_to_all_attention(t(2, 4, 4).squeeze(0), t(2, 4, 4), t(2, 4, 4), group); },
                 "all_to_all_attention: expected q, k and v shaped [B, H, S_local, D]");
    expect_error([&] { ring_attention(t(2, 4, 4), t(2, 4, 4), t(2, 4, 4), group, CpAttentionOptions().window(3)); },
                 {"ring_attention: got window 3 without causal", "causal(true)"});
    expect_error([&] { all_to_all_attention(t(2, 4, 4), t(2, 4, 4), t(2, 4, 4), group,
                                            CpAttentionOptions().causal(true).window(-1)); },
                 {"all_to_all_attention: got window -1", "expected 0 (no sliding window)"});
    EXPECT_EQ(comm.total_count(), 0) << comm.str();
  });
}

// 13 over cp 2 without seq_len: rank 0 (7 positions) takes S as 14, rank 1
// (6) as 12; each expects its peer's chunk at its own length, and the recv
// refuses the message before any byte moves, naming both.
TEST(ContextParallelErrorsTest, UnevenSequenceWithoutSeqLenNamesTheMismatch) {
  const at::Tensor x = randn({1, 2, 13, 4}, 9);
  run_ranks(
      2,
      [&](int) {
        const ProcessGroup group = default_process_group();
        const at::Tensor t = context_parallel_shard(x, 2, group, CpLayout::Contiguous);
        expect_error([&] { ring_attention(t, t, t, group); },
                     {"ring_attention: receiving the keys and values of cp rank", "Every rank must pass the same "
                      "seq_len", "CpAttentionOptions::seq_len(S)"});
      },
      std::chrono::seconds(20));
}

}  // namespace
