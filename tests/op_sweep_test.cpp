// The op sweep (#26), PyTorch's test_dtensor_ops.py for dtp: every overload
// in dtp::supported_ops() runs on its samples (tests/op_sweep_samples.h)
// with every placement combination of its tensor arguments, on meshes (2),
// (4) and (2,2), forward and, where the op is differentiable, backward,
// against the same call on one device in float64. Each case is one of
//  - pass: right, and the op issued no collective;
//  - redistributed: right, with collectives (an input moved, or the op's own
//    reduction, e.g. a norm);
//  - no rule: a c10::Error from dtp that names an op.
// Anything else fails the test: a wrong value or shape on any rank (each
// rank compares its own shard), an error that names no op, a crash.
// Prints the op x placement-class table; with DTP_OP_SWEEP_MARKDOWN=path
// set, also writes it as markdown (scripts/op-table.sh puts it in README).
#include "dist.h"
#include "op_sweep_samples.h"

#include "dtp/comm_counter.h"
#include "dtp/dtensor.h"
#include "dtp/random.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

using namespace dtp;
using namespace dtp::test::sweep;

namespace {

// NOTE: [Sweep tolerance] Most cases are exact: a shard runs the same
// kernel on the same numbers. Three things change the order of float64
// sums: a reduction over a sharded dim (partial sums, then an all-reduce), a
// Partial(sum) input (made of W <= 4 pieces below 2.5 whose sum is the
// value, see distribute(): 4 · 2.5 · 1.1e-16 ≈ 1.1e-15 at most), and
// matrix products on shards. A sum of n terms in any
// order is within (n-1)·eps·Σ|x| of the exact one; the samples have n <= 36
// terms of |x| <= 1.5 (products of two such), so the bound is
// 35 · 1.1e-16 · 36 · 2.25 ≈ 3.2e-13 in absolute terms; the ops after the
// sum (exp, division by values >= 0.5, the variance's square) at most
// triple it. 1e-12 relative to max(1, |reference|) covers that.
constexpr double kTol = 1e-12;
constexpr uint64_t kSeed = 4321;

enum class Outcome { Pass, Redistributed, NoRule, Wrong };
enum Cls { kR, kS, kP, kNumCls };  // all inputs replicated; some sharded; some Partial

// What one device computed for a sample.
struct Reference {
  std::vector<IV> outs;            // flattened outputs (tensor-list elements each)
  std::vector<size_t> grad_outs;   // indices into outs of the outputs backward starts from
  std::vector<at::Tensor> grad_seeds;
  std::vector<size_t> grad_slots;  // tensor slots whose gradient is compared
  std::vector<at::Tensor> grads;   // one per grad_slots entry (undefined: unused)
};

struct OpRow {  // one op's line of the table
  std::array<std::array<int64_t, 3>, kNumCls> n{};  // per class: pass, redistributed, no rule
  int64_t samples = 0;
  bool backward = false;
  double max_err = 0;
  std::string no_rule;  // the first named error
};

bool writesArgs(const c10::FunctionSchema& schema) {
  for (const auto& a : schema.arguments())
    if (a.alias_info() != nullptr && a.alias_info()->isWrite()) return true;
  return false;
}

// Calls f on every tensor argument (Tensor, Tensor[], Tensor?[] elements) in
// order and puts its result in place.
void mapTensors(std::vector<IV>& args, const std::function<at::Tensor(size_t, const at::Tensor&)>& f) {
  size_t slot = 0;
  for (auto& v : args) {
    if (v.isTensor()) {
      v = f(slot++, v.toTensor());
    } else if (v.isTensorList()) {
      std::vector<at::Tensor> l;
      for (const at::Tensor& t : v.toTensorList()) l.push_back(f(slot++, t));
      v = l;
    } else if (v.isList()) {
      const auto& elems = v.toListRef();
      if (std::none_of(elems.begin(), elems.end(), [](const IV& e) { return e.isTensor(); })) continue;
      c10::List<c10::optional<at::Tensor>> l;
      for (const IV& e : elems) l.push_back(e.isTensor() ? c10::optional<at::Tensor>(f(slot++, e.toTensor())) : c10::nullopt);
      v = l;
    }
  }
}

std::vector<at::Tensor> tensorsOf(std::vector<IV> args) {
  std::vector<at::Tensor> ts;
  mapTensors(args, [&](size_t, const at::Tensor& t) {
    ts.push_back(t);
    return t;
  });
  return ts;
}

// Runs the overload on `args` (kDef() -> the schema's default); the outputs,
// tensor lists flattened.
std::vector<IV> callOp(const c10::OperatorHandle& op, const std::vector<IV>& args) {
  const auto& schema = op.schema();
  torch::jit::Stack stack;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    if (i < args.size() && !isDef(args[i])) {
      stack.push_back(args[i]);
    } else {
      const auto& d = schema.arguments()[i].default_value();
      TORCH_CHECK(d.has_value(), "op sweep: sample for ", schema.name(), " lacks argument '",
                  schema.arguments()[i].name(), "', which has no default");
      stack.push_back(*d);
    }
  }
  op.callBoxed(&stack);
  std::vector<IV> outs;
  for (const auto& v : stack) {
    if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) outs.emplace_back(t);
    } else {
      outs.push_back(v);
    }
  }
  return outs;
}

bool differentiable(const at::Tensor& t) { return t.defined() && at::isFloatingType(t.scalar_type()); }

Reference referenceOnce(const c10::OperatorHandle& op, const Sample& s, bool& backward, bool try_backward);

// What one device computes, with input gradients where libtorch has them.
Reference reference(const c10::OperatorHandle& op, const Sample& s, bool& backward) {
  if (s.opts.backward && !writesArgs(op.schema())) {
    // libtorch refuses the derivative for some arguments (nll_loss's
    // weight) or the op's backward (silu_backward): then forward only.
    try {
      return referenceOnce(op, s, backward, /*try_backward=*/true);
    } catch (const std::exception&) {  // libtorch refuses the derivative (nll_loss's weight, silu_backward)
    }
  }
  return referenceOnce(op, s, backward, /*try_backward=*/false);
}

Reference referenceOnce(const c10::OperatorHandle& op, const Sample& s, bool& backward, bool try_backward) {
  Reference ref;
  backward = try_backward && s.opts.backward && !writesArgs(op.schema());
  std::vector<IV> args = s.args;
  std::vector<at::Tensor> inputs;
  mapTensors(args, [&](size_t slot, const at::Tensor& t) {
    at::Tensor c = t.clone();
    const bool plain = std::find(s.opts.plain.begin(), s.opts.plain.end(), static_cast<int>(slot)) != s.opts.plain.end();
    if (backward && !plain && differentiable(c)) {
      c.requires_grad_(true);
      inputs.push_back(c);
      ref.grad_slots.push_back(slot);
    }
    return c;
  });
  if (s.opts.seeded) at::manual_seed(kSeed);
  ref.outs = callOp(op, args);
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < ref.outs.size(); ++i) {
    if (!ref.outs[i].isTensor() || !ref.outs[i].toTensor().requires_grad()) continue;
    if (!s.opts.seeds.empty() && std::find(s.opts.seeds.begin(), s.opts.seeds.end(), i) == s.opts.seeds.end()) continue;
    const at::Tensor& o = ref.outs[i].toTensor();
    ref.grad_outs.push_back(i);
    ref.grad_seeds.push_back(dtp::test::data(o.sizes().vec(), 0.5 + static_cast<double>(i)));
    outs.push_back(o);
  }
  backward = backward && !outs.empty();
  if (backward) {
    ref.grads = torch::autograd::grad(outs, inputs, ref.grad_seeds, /*retain_graph=*/false,
                                      /*create_graph=*/false, /*allow_unused=*/true);
  } else {
    ref.grad_outs.clear();
    ref.grad_seeds.clear();
    ref.grad_slots.clear();
  }
  for (auto& v : ref.outs)
    if (v.isTensor() && v.toTensor().defined()) v = v.toTensor().detach();
  return ref;
}

// Candidate placements of one argument on one mesh dim.
std::vector<Placement> candidates(const at::Tensor& t, bool partial) {
  std::vector<Placement> c;
  for (int64_t d = 0; d < t.dim(); ++d) c.push_back(Shard(d));
  c.push_back(Replicate());
  if (partial && differentiable(t)) c.push_back(Partial());
  return c;
}

// Every combination: one candidate per non-plain slot (tied slots follow
// the first of their group).
std::vector<std::vector<Placement>> combinations(const std::vector<at::Tensor>& ts, const Opts& o) {
  auto leader = [&](int i) {
    for (const auto& g : o.tied)
      if (std::find(g.begin() + 1, g.end(), i) != g.end()) return g.front();
    return i;
  };
  std::vector<std::vector<Placement>> out{{}};
  for (size_t i = 0; i < ts.size(); ++i) {
    const int lead = leader(static_cast<int>(i));
    const bool plain = std::find(o.plain.begin(), o.plain.end(), static_cast<int>(i)) != o.plain.end();
    const auto cands = plain ? std::vector<Placement>{Replicate()} : candidates(ts[i], o.partial);
    std::vector<std::vector<Placement>> next;
    for (const auto& prefix : out) {
      if (lead != static_cast<int>(i)) {
        next.push_back(prefix);
        next.back().push_back(prefix[static_cast<size_t>(lead)]);
        continue;
      }
      for (const auto& p : cands) {
        next.push_back(prefix);
        next.back().push_back(p);
      }
    }
    out = std::move(next);
  }
  return out;
}

Cls classOf(const std::vector<Placement>& combo) {
  Cls c = kR;
  for (const auto& p : combo) {
    if (p.is_partial()) return kP;
    if (p.is_shard()) c = kS;
  }
  return c;
}

// This rank's piece of `full` as a DTensor with placements `pl`. A
// Partial(sum) is W non-zero pieces: coordinate 0 holds full - (W-1)·k,
// the others k, so a rule that treats a Partial as a Replicate shows. k is
// a multiple of 1/16 below 1 (4 bits), so (W-1)·k is exact and a zero of
// `full` sums back to exactly zero in any order (sign, relu' and abs' at 0).
at::Tensor distribute(const at::Tensor& full, const DeviceMesh& mesh, const Placements& pl) {
  if (std::none_of(pl.begin(), pl.end(), [](const Placement& p) { return p.is_partial(); }))
    return distribute_tensor(full.clone(), mesh, pl, /*src_data_rank=*/std::nullopt);  // not a view: in-place ops write it
  const auto coord = mesh.get_coordinate();
  at::Tensor t = full;
  for (size_t m = 0; m < pl.size(); ++m) {
    const int64_t n = mesh.size(static_cast<int64_t>(m));
    if (pl[m].is_shard()) {
      const auto sizes = dtp::test::chunk_sizes(t.size(pl[m].dim), n);
      int64_t start = 0;
      for (int64_t k = 0; k < coord[m]; ++k) start += sizes[k];
      t = t.narrow(pl[m].dim, start, sizes[coord[m]]);
    } else if (pl[m].is_partial()) {
      const at::Tensor k = at::round(dtp::test::data(t.sizes().vec(), 0.37 + static_cast<double>(m)) * 8) / 16;
      t = coord[m] == 0 ? t - k * static_cast<double>(n - 1) : k;
    }
  }
  return from_local(t.contiguous(), mesh, pl, /*run_check=*/false, full.sizes().vec());
}

// The largest difference relative to max(1, |ref|) (NOTE: [Sweep
// tolerance]), or infinity for a mismatch of shape or dtype, or of values
// where exactness is required (integers, booleans, NaN places).
double difference(const at::Tensor& got, const at::Tensor& ref, bool values, std::string& why) {
  if (got.sizes() != ref.sizes() || got.scalar_type() != ref.scalar_type()) {
    why = "got " + std::string(c10::toString(got.scalar_type())) + c10::str(got.sizes()) + ", expected " +
          c10::toString(ref.scalar_type()) + c10::str(ref.sizes());
    return INFINITY;
  }
  if (!values || ref.numel() == 0) return 0;
  if (!at::isFloatingType(ref.scalar_type())) {
    if (got.equal(ref)) return 0;
    why = "values differ";
    return INFINITY;
  }
  const at::Tensor nan_ok = at::isnan(got) == at::isnan(ref);
  if (!nan_ok.all().item<bool>()) {
    why = "NaNs differ";
    return INFINITY;
  }
  const at::Tensor g = at::nan_to_num(got, 0), r = at::nan_to_num(ref, 0);
  const double scale = std::max(1.0, r.abs().max().item<double>());
  const double d = (g - r).abs().max().item<double>() / scale;
  // A cast to float32 of a Partial (its W pieces, each within 2.5) rounds
  // each piece: W·2.5·eps32/2 <= 6e-7 for W = 4.
  const double tol = ref.scalar_type() == at::kFloat ? 8 * 1.19e-7 : kTol;
  if (d > tol) why = "differs by " + std::to_string(d) + " (relative)";
  return d;
}

// Compares this rank's shard of the DTensor `got` with the same shard of the
// reference: no collective (a wrong replica on one rank shows), except an
// all-reduce for a Partial output.
double difference(const IV& got, const IV& ref, bool values, std::string& why) {
  if (ref.isTensor()) {
    const at::Tensor& r = ref.toTensor();
    const at::Tensor g = got.isTensor() ? got.toTensor() : at::Tensor();
    if (!r.defined() || !g.defined()) {
      if (r.defined() != g.defined()) why = "definedness differs";
      return r.defined() == g.defined() ? 0 : INFINITY;
    }
    if (!is_dtensor(g)) {
      why = "not a DTensor";
      return INFINITY;
    }
    if (g.sizes() != r.sizes()) {
      why = "global shape " + c10::str(g.sizes()) + ", expected " + c10::str(r.sizes());
      return INFINITY;
    }
    const Placements& pl = placements(g);
    if (std::any_of(pl.begin(), pl.end(), [](const Placement& p) { return p.is_partial() || p.is_mask_partial(); }))
      return difference(full_tensor(g), r, values, why);
    const at::Tensor mine = to_local(g).detach();
    const at::Tensor expected = to_local(distribute_tensor(r, device_mesh(g), pl, /*src_data_rank=*/std::nullopt));
    return difference(mine, expected, values, why);
  }
  if (ref.isScalar() || ref.isDouble() || ref.isInt() || ref.isBool()) {
    const double a = got.toScalar().toDouble(), b = ref.toScalar().toDouble();
    const double d = std::abs(a - b) / std::max(1.0, std::abs(b));
    if (!(d <= kTol)) why = "scalar " + std::to_string(a) + ", expected " + std::to_string(b);
    return d;
  }
  return 0;
}

// A dtp error that names an op, "dtp: no sharding rule for aten::x (inputs:
// ...", as "no sharding rule for aten::x"; "" for any other error.
std::string namedError(const std::string& msg) {
  if (msg.rfind("dtp: ", 0) != 0 || msg.find("aten::") == std::string::npos) return "";
  const size_t cut = std::min({msg.find(" (inputs"), msg.find('\n'), msg.find(". ")});
  return msg.substr(5, cut == std::string::npos ? std::string::npos : cut - 5);
}

struct Case {
  Outcome outcome = Outcome::Pass;
  std::string detail;
  double err = 0;
};

// One placement combination on this rank: forward, backward, compare. Every
// rank takes the same path (the decisions that steer it are global), so the
// collectives of full_tensor and of the backward pair up; a wrong shard is
// noted and the case goes on.
Case runCase(const c10::OperatorHandle& op, const Sample& s, const Reference& ref, const DeviceMesh& mesh,
             const std::vector<Placement>& combo) {
  const bool two_d = mesh.ndim() == 2;
  std::vector<IV> args = s.args;
  std::vector<at::Tensor> dist_inputs(combo.size());
  std::vector<bool> plain(combo.size(), false);
  for (int i : s.opts.plain) plain[static_cast<size_t>(i)] = true;
  mapTensors(args, [&](size_t slot, const at::Tensor& t) {
    if (plain[slot]) return t.clone();
    const Placements pl = two_d ? Placements{combo[slot], combo[slot]} : Placements{combo[slot]};
    at::Tensor d = distribute(t, mesh, pl);
    if (std::find(ref.grad_slots.begin(), ref.grad_slots.end(), slot) != ref.grad_slots.end()) d.set_requires_grad(true);
    dist_inputs[slot] = d;
    return d;
  });
  Case c;
  auto wrong = [&](const std::string& detail) {
    if (c.outcome == Outcome::Wrong) return;
    c.outcome = Outcome::Wrong;
    c.detail = detail;
  };
  auto named = [&](const c10::Error& e, const char* where) {
    const std::string msg = e.what_without_backtrace();
    const std::string head = namedError(msg);
    c.outcome = head.empty() ? Outcome::Wrong : Outcome::NoRule;
    c.detail = head.empty() ? std::string(where) + " raised an error that names no op: " + msg
                            : (std::string(where) == "backward" ? "backward: " : "") + head;
    return c;
  };
  int64_t comms = 0;
  std::vector<IV> outs;
  try {
    if (s.opts.seeded) dtp::manual_seed(kSeed);
    CommCounter counter;
    outs = callOp(op, args);
    comms += counter.total_count();
  } catch (const c10::Error& e) {
    return named(e, "forward");
  }
  if (outs.size() != ref.outs.size()) {
    wrong("forward gave " + std::to_string(outs.size()) + " outputs, expected " + std::to_string(ref.outs.size()));
    return c;
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    std::string why;
    const double d = difference(outs[i], ref.outs[i], s.opts.values, why);
    c.err = std::max(c.err, std::isfinite(d) ? d : 0.0);
    if (!why.empty()) wrong("forward output " + std::to_string(i) + ": " + why);
  }
  if (!ref.grad_outs.empty()) {
    std::vector<at::Tensor> roots, seeds, inputs;
    for (size_t j = 0; j < ref.grad_outs.size(); ++j) {
      const IV& v = outs[ref.grad_outs[j]];
      if (!v.isTensor() || !is_dtensor(v.toTensor()) || !v.toTensor().requires_grad()) {
        wrong("output " + std::to_string(ref.grad_outs[j]) + " is no DTensor that requires grad");
        return c;
      }
      const at::Tensor& o = v.toTensor();
      Placements pl = placements(o);
      for (auto& p : pl)
        if (p.is_partial() || p.is_mask_partial()) p = Replicate();
      roots.push_back(o);
      seeds.push_back(distribute_tensor(ref.grad_seeds[j], mesh, pl, /*src_data_rank=*/std::nullopt));
    }
    for (size_t slot : ref.grad_slots) inputs.push_back(dist_inputs[slot]);
    std::vector<at::Tensor> grads;
    try {
      CommCounter counter;
      grads = torch::autograd::grad(roots, inputs, seeds, /*retain_graph=*/false, /*create_graph=*/false,
                                    /*allow_unused=*/true);
      comms += counter.total_count();
    } catch (const c10::Error& e) {
      if (c.outcome == Outcome::Wrong) return c;
      return named(e, "backward");
    }
    for (size_t j = 0; j < grads.size(); ++j) {
      std::string why;
      const double d = difference(IV(grads[j]), IV(ref.grads[j]), true, why);
      c.err = std::max(c.err, std::isfinite(d) ? d : 0.0);
      if (!why.empty()) wrong("gradient of tensor argument " + std::to_string(ref.grad_slots[j]) + ": " + why);
    }
  }
  if (c.outcome != Outcome::Wrong) c.outcome = comms > 0 ? Outcome::Redistributed : Outcome::Pass;
  return c;
}

std::string comboStr(const std::vector<Placement>& combo) {
  std::string s;
  for (const auto& p : combo) s += (s.empty() ? "" : ",") + p.str();
  return s;
}

std::vector<std::string> supportedOps() {
  auto ops = supported_ops();
  std::sort(ops.begin(), ops.end());
  ops.erase(std::unique(ops.begin(), ops.end()), ops.end());
  return ops;
}

// NOTE: [Op sweep] The whole sweep runs once per process (both tests read it).
struct Sweep {
  std::map<std::string, OpRow> rows;
  std::vector<std::string> failures;
  std::vector<std::string> skipped;  // samples of overloads this build does not support
  int64_t cases = 0;
  double seconds = 0;
};

const Sweep& sweep() {
  static const Sweep result = [] {
    Sweep sw;
    const auto t0 = std::chrono::steady_clock::now();
    const auto ops = supportedOps();
    const std::set<std::string> supported(ops.begin(), ops.end());
    struct Prepared {
      const Sample* sample;
      c10::OperatorHandle op;
      Reference ref;
      std::vector<std::vector<Placement>> combos;
    };
    std::vector<Prepared> work;
    // DTP_OP_SWEEP_ONLY=<substring> sweeps only the matching overloads (for
    // debugging; the test then fails, as other ops lack their cases).
    const char* only = std::getenv("DTP_OP_SWEEP_ONLY");
    const char* verbose_env = std::getenv("DTP_OP_SWEEP_VERBOSE");
    const int verbose = verbose_env == nullptr ? 0 : std::atoi(verbose_env);  // 1: per sample, 2: per case
    for (const Sample& s : samples()) {
      if (only != nullptr && s.op.find(only) == std::string::npos) continue;
      if (!supported.count(s.op)) {
        sw.skipped.push_back(s.op);
        continue;
      }
      const auto dot = s.op.find('.');
      const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(
          s.op.substr(0, dot).c_str(), dot == std::string::npos ? "" : s.op.substr(dot + 1).c_str());
      OpRow& row = sw.rows[s.op];
      ++row.samples;
      bool backward = false;
      Reference ref;
      try {
        ref = reference(handle, s, backward);
      } catch (const std::exception& e) {
        sw.failures.push_back(s.op + ": the sample fails on one device: " + e.what());
        continue;
      }
      row.backward |= backward;
      work.push_back({&s, handle, std::move(ref), combinations(tensorsOf(s.args), s.opts)});
    }
    if (verbose) {
      size_t n = 0;
      for (const auto& w : work) n += w.combos.size();
      std::printf("op sweep: %zu samples, %zu placement combinations per mesh\n", work.size(), n);
    }
    std::mutex mu;
    for (const std::vector<int64_t>& shape : {std::vector<int64_t>{2}, {4}, {2, 2}}) {
      int world = 1;
      for (auto d : shape) world *= static_cast<int>(d);
      std::string mesh_name = "mesh(" + std::to_string(shape[0]) + (shape.size() > 1 ? "," + std::to_string(shape[1]) : "") + ")";
      dtp::test::run_ranks(world, [&](int rank) {
        const auto mesh = init_device_mesh("cpu", shape);
        for (const Prepared& w : work) {
          const auto s0 = std::chrono::steady_clock::now();
          for (const auto& combo : w.combos) {
            if (verbose > 1) {
              std::printf("rank %d: %s %s with %s\n", rank, mesh_name.c_str(), w.sample->op.c_str(), comboStr(combo).c_str());
              std::fflush(stdout);
            }
            Case c;
            try {
              c = runCase(w.op, *w.sample, w.ref, mesh, combo);
            } catch (const std::exception& e) {
              c.outcome = Outcome::Wrong;
              c.detail = std::string("crashed: ") + e.what();
            }
            if (verbose > 1 && !c.detail.empty()) {
              std::printf("rank %d: %s\n", rank, c.detail.c_str());
              std::fflush(stdout);
            }
            if (rank != 0 && c.outcome != Outcome::Wrong) continue;
            std::lock_guard<std::mutex> lock(mu);
            const std::string where = w.sample->op + " on " + mesh_name + " with " + comboStr(combo);
            if (c.outcome == Outcome::Wrong) {
              sw.failures.push_back(where + " (rank " + std::to_string(rank) + "): " + c.detail);
              if (rank != 0) continue;
            }
            OpRow& row = sw.rows[w.sample->op];
            row.max_err = std::max(row.max_err, c.err);
            ++sw.cases;
            const Cls cls = classOf(combo);
            if (c.outcome == Outcome::Pass) ++row.n[cls][0];
            if (c.outcome == Outcome::Redistributed) ++row.n[cls][1];
            if (c.outcome == Outcome::NoRule) {
              ++row.n[cls][2];
              if (row.no_rule.empty()) row.no_rule = c.detail;
            }
          }
          if (verbose && rank == 0) {
            std::printf("%s %s: %zu cases, %.3f s\n", mesh_name.c_str(), w.sample->op.c_str(), w.combos.size(),
                        std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count());
            std::fflush(stdout);
          }
        }
      }, std::chrono::seconds(30));
    }
    sw.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return sw;
  }();
  return result;
}

// "6 pass, 2 redist, 1 no rule", or "-" without cases.
std::string cell(const std::array<int64_t, 3>& n) {
  std::vector<std::string> parts;
  if (n[0]) parts.push_back(std::to_string(n[0]) + " pass");
  if (n[1]) parts.push_back(std::to_string(n[1]) + " redist");
  if (n[2]) parts.push_back(std::to_string(n[2]) + " no rule");
  std::string s;
  for (const auto& p : parts) s += (s.empty() ? "" : ", ") + p;
  return s.empty() ? "-" : s;
}

struct Totals {
  int64_t ops = 0, cases = 0, pass = 0, redist = 0, no_rule = 0, all_pass_ops = 0;
};

Totals totals(const Sweep& sw) {
  Totals t;
  for (const auto& [op, row] : sw.rows) {
    ++t.ops;
    int64_t bad = 0;
    for (const auto& n : row.n) {
      t.pass += n[0];
      t.redist += n[1];
      t.no_rule += n[2];
      t.cases += n[0] + n[1] + n[2];
      bad += n[2];
    }
    t.all_pass_ops += bad == 0;
  }
  return t;
}

std::string markdown(const Sweep& sw) {
  const Totals t = totals(sw);
  std::ostringstream os;
  os << "Generated by `scripts/op-table.sh` from `OpSweep` (tests/op_sweep_test.cpp) on libtorch " << TORCH_VERSION
     << ": " << t.ops << " overloads, " << t.cases << " placement cases on meshes (2), (4) and (2,2) (forward, "
     << "and backward where the op is differentiable, against one device in float64): " << t.pass << " pass, "
     << t.redist << " redistributed, " << t.no_rule << " no rule (a named error). " << t.all_pass_ops
     << " overloads have a rule for every case. Columns: whether the backward is checked; the cases whose "
     << "inputs are all replicated (R), some sharded (S), some Partial (P); the first no-rule error (`backward:` "
     << "when an op of the backward raised it).\n\n";
  os << "| op | backward | R | S | P | first no-rule error |\n|---|---|---|---|---|---|\n";
  for (const auto& [op, row] : sw.rows) {
    const std::string err = row.no_rule.empty() ? "" : "`" + row.no_rule + "`";
    os << "| `" << op << "` | " << (row.backward ? "yes" : "-") << " | " << cell(row.n[kR]) << " | " << cell(row.n[kS])
       << " | " << cell(row.n[kP]) << " | " << err << " |\n";
  }
  return os.str();
}

TEST(OpSweep, EverySupportedOpHasSamples) {
  std::set<std::string> sampled;
  for (const Sample& s : samples()) sampled.insert(s.op);
  for (const auto& op : supportedOps()) EXPECT_TRUE(sampled.count(op)) << op << " has no sample in tests/op_sweep_samples.h";
}

// NOTE: [Empty shards in the sweep] Each tensor argument of each op, in
// some sample, has a dim that leaves a rank of mesh (4) empty when sharded
// (f64[5,7](S(0)) on 4 ranks -> local rows 2,2,1,0; 9 -> 3,3,3,0; 10 ->
// 3,3,3,1 does not), so the sweep runs every op with an empty shard of
// every argument: an op that fails there (#55: embedding's lookup on a
// [0, D] vocabulary shard) shows. A zero-size dim (every rank empty) does
// not count.
TEST(OpSweep, EveryArgumentMeetsAnEmptyShard) {
  auto leaves_a_rank_empty = [](int64_t n) { return n > 0 && dtp::test::chunk_sizes(n, 4).back() == 0; };
  std::map<std::pair<std::string, size_t>, bool> met;  // (op, tensor slot) -> some sample's dim leaves one empty
  for (const Sample& s : samples()) {
    const std::vector<at::Tensor> ts = tensorsOf(s.args);
    for (size_t i = 0; i < ts.size(); ++i) {
      const bool plain = std::find(s.opts.plain.begin(), s.opts.plain.end(), static_cast<int>(i)) != s.opts.plain.end();
      if (plain || !ts[i].defined() || ts[i].dim() == 0) continue;
      bool any = false;
      for (int64_t d = 0; d < ts[i].dim(); ++d) any = any || leaves_a_rank_empty(ts[i].size(d));
      met[{s.op, i}] = met[{s.op, i}] || any;
    }
  }
  for (const auto& [key, ok] : met)
    EXPECT_TRUE(ok) << key.first << ": tensor argument " << key.second << " has no dim that leaves a rank of mesh (4) "
                    << "empty in any sample. Add a sample with such a size (5, 6 or 9: NOTE: [Empty shards in the sweep]).";
}

TEST(OpSweep, EveryCaseMatchesOneDeviceOrNamesItsOp) {
  const Sweep& sw = sweep();
  const Totals t = totals(sw);
  std::printf("%-58s %-4s %-30s %-30s %-30s %s\n", "op", "bwd", "R", "S", "P", "max err / no rule");
  for (const auto& [op, row] : sw.rows) {
    std::printf("%-58s %-4s %-30s %-30s %-30s %.1e %s\n", op.c_str(), row.backward ? "yes" : "-", cell(row.n[kR]).c_str(),
                cell(row.n[kS]).c_str(), cell(row.n[kP]).c_str(), row.max_err, row.no_rule.c_str());
  }
  std::printf("op sweep: %td ops, %td placement cases: %td pass, %td redistributed, %td no rule; %td ops with a rule "
              "for every case; %.1f s\n",
              t.ops, t.cases, t.pass, t.redist, t.no_rule, t.all_pass_ops, sw.seconds);
  for (const auto& s : std::set<std::string>(sw.skipped.begin(), sw.skipped.end()))
    std::printf("op sweep: %s is not supported by this build; its samples are skipped\n", s.c_str());
  for (const auto& f : sw.failures) ADD_FAILURE() << f;
  for (const auto& op : supportedOps()) EXPECT_GT(sw.rows.count(op) ? sw.rows.at(op).samples : 0, 0) << op;
  if (const char* path = std::getenv("DTP_OP_SWEEP_MARKDOWN")) {
    std::ofstream out(path);
    out << markdown(sw);
    EXPECT_TRUE(out.good()) << "could not write " << path;
  }
}

}  // namespace
