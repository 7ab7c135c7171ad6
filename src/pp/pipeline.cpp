#include "dtp/pp/pipeline.h"

#include "comm/agree.h"
#include "dtp/dtensor.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <set>
#include <utility>

namespace dtp::pp {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kMaxDims = 8;

int activationTag(int receiving_stage) { return 2 * receiving_stage; }
int gradientTag(int receiving_stage) { return 2 * receiving_stage + 1; }

std::string shapeText(c10::IntArrayRef shape, c10::ScalarType dtype) {
  return c10::str(shape, " (", c10::toString(dtype), ")");
}

// What each (stage, microbatch) keeps between its forward and backward.
struct Saved {
  at::Tensor input, output;  // output: the loss on the last stage
};

}  // namespace

Pipeline::Pipeline(Schedule schedule, std::vector<PipelineStage> stages, ProcessGroup pp, LossFn loss)
    : schedule_(std::move(schedule)), stages_(std::move(stages)), pp_(std::move(pp)), loss_(std::move(loss)) {
  TORCH_CHECK(pp_.valid() && pp_.size() == schedule_.ranks(), "Pipeline: the ", schedule_.name(), " schedule has ",
              schedule_.ranks(), " ranks, but the pp group has ", pp_.valid() ? pp_.size() : 0,
              ". Build the schedule for the pp mesh dimension's size (mesh.get_group(\"pp\")).");
  std::vector<bool> have(schedule_.stages(), false);
  for (const auto& s : stages_) {
    TORCH_CHECK(s.index >= 0 && s.index < schedule_.stages(), "Pipeline: stage ", s.index, " is not one of the ",
                schedule_.stages(), " stages of the schedule.");
    TORCH_CHECK(schedule_.rank_of(s.index) == pp_.rank(), "Pipeline: stage ", s.index, " runs on pp rank ",
                schedule_.rank_of(s.index), " (stage s on rank s % ", schedule_.ranks(), "), but was given to pp rank ",
                pp_.rank(), ".");
    TORCH_CHECK(!have[s.index], "Pipeline: stage ", s.index, " given twice.");
    TORCH_CHECK(s.forward, "Pipeline: stage ", s.index, " has no forward function.");
    have[s.index] = true;
  }
  for (int s = 0; s < schedule_.stages(); ++s)
    TORCH_CHECK(schedule_.rank_of(s) != pp_.rank() || have[s], "Pipeline: pp rank ", pp_.rank(), " runs stage ", s,
                " in the ", schedule_.name(), " schedule, but was not given it.");
  TORCH_CHECK(loss_, "Pipeline: no loss function (the last stage computes loss_fn(output, targets)).");
  // A schedule whose ranks would deadlock is refused here, not after
  // DTP_TIMEOUT_S; ranks built with other schedules are named (NOTE: [Ranks
  // agree on arguments]), before the first step would stall.
  schedule_.simulate();
  agree_on_value(pp_, "Pipeline", "schedules",
                 c10::str(schedule_.name(), ": ", schedule_.stages(), " stages, ", schedule_.microbatches(),
                          " microbatches\n", schedule_.str()));
}

// NOTE: [Pipeline loss terms] A loss over the whole batch that is not a sum
// of per-microbatch losses (HF's MoE load-balancing loss multiplies two
// sums over every token) has a gradient that needs every microbatch's
// forward first. Under GPipe each rank runs all its forwards, then all its
// backwards, so the term runs in between: every rank reaches that point
// after sending its last activation (sends are non-blocking), so a
// collective over pp there cannot deadlock. Under 1F1B the last stage's
// first backward precedes its second forward: refused.
void Pipeline::add_loss_term(std::function<at::Tensor()> term) {
  TORCH_CHECK(term, "Pipeline::add_loss_term: an empty function.");
  for (int r = 0; r < schedule_.ranks(); ++r) {
    const std::vector<Action>& actions = schedule_.actions(r);
    const auto backward = std::find_if(actions.begin(), actions.end(),
                                       [](const Action& a) { return a.kind == Action::Backward; });
    const auto forward = std::find_if(backward, actions.end(), [](const Action& a) { return a.kind == Action::Forward; });
    TORCH_CHECK(forward == actions.end(), "Pipeline::add_loss_term: the ", schedule_.name(), " schedule runs ",
                backward->str(), " on pp rank ", r, " before ", forward->str(), ", but a loss term over the whole "
                "batch needs every forward before the first backward. Use a GPipe schedule (Schedule::gpipe, "
                "PipelineOptions{\"gpipe\", m}), or leave the term out.");
  }
  terms_.push_back(std::move(term));
}

at::Tensor Pipeline::step(const at::Tensor& inputs, const at::Tensor& targets) {
  const auto t0 = Clock::now();
  stats_ = StepStats{};
  const int m = schedule_.microbatches(), last = schedule_.stages() - 1;
  auto microbatches = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.defined() && t.dim() >= 1 && t.size(0) % m == 0, "Pipeline: ", what, " of shape ",
                t.defined() ? c10::str(t.sizes()) : "undefined", " cannot be split into ", m,
                " equal microbatches along dim 0. Use a batch that is a multiple of ", m, ".");
    return t.chunk(m, 0);
  };
  std::map<int, const PipelineStage*> mine;
  for (const auto& s : stages_) mine[s.index] = &s;
  std::vector<at::Tensor> input_mbs, target_mbs;
  if (mine.count(0)) input_mbs = microbatches(inputs, "the inputs");
  if (mine.count(last)) target_mbs = microbatches(targets, "the targets");

  std::map<std::pair<int, int>, Saved> saved;
  std::vector<Work> sends;
  std::map<int, std::deque<at::Tensor>> to_self;  // by tag: messages between stages of this rank
  const at::TensorOptions options = (inputs.defined() ? inputs : targets.defined() ? targets : at::empty({0})).options();
  auto waitFor = [&](Work w) {
    const auto start = Clock::now();
    at::Tensor t = w.wait();
    stats_.wait_seconds += std::chrono::duration<double>(Clock::now() - start).count();
    return t;
  };
  auto send = [&](const at::Tensor& t, int to_stage, int tag) {
    const int to = schedule_.rank_of(to_stage);
    if (to == pp_.rank()) {
      to_self[tag].push_back(t);
      return;
    }
    sends.push_back(pp_.isend(t.contiguous(), to, tag));
    ++stats_.sends;
  };
  auto recv = [&](at::Tensor into, int from_stage, int tag) {
    const int from = schedule_.rank_of(from_stage);
    if (from == pp_.rank()) {
      TORCH_INTERNAL_ASSERT(!to_self[tag].empty(), "the schedule receives from this rank before it sent");
      into.copy_(to_self[tag].front());
      to_self[tag].pop_front();
      return into;
    }
    ++stats_.recvs;
    return waitFor(pp_.irecv(into, from, tag));
  };
  // NOTE: [Pipeline boundaries]: this step's, told and received once each.
  std::set<int> announced;
  std::map<int, std::pair<std::vector<int64_t>, c10::ScalarType>> boundary;
  auto announce = [&](const at::Tensor& t, int to_stage) {
    if (announced.count(to_stage) || schedule_.rank_of(to_stage) == pp_.rank()) return;
    TORCH_CHECK(t.dim() <= kMaxDims, "Pipeline: stage ", to_stage - 1, "'s output has ", t.dim(),
                " dims; at most ", kMaxDims, " travel between stages.");
    at::Tensor meta = at::zeros({kMaxDims + 2}, at::kLong);
    meta[0] = t.dim();
    meta[1] = static_cast<int64_t>(t.scalar_type());
    for (int64_t d = 0; d < t.dim(); ++d) meta[d + 2] = t.size(d);
    send(meta, to_stage, activationTag(to_stage));
    announced.insert(to_stage);
  };
  auto recvInput = [&](const PipelineStage& st, const at::Tensor* local_shape_of) {
    const int from = schedule_.rank_of(st.index - 1), tag = activationTag(st.index);
    auto it = boundary.find(st.index);
    if (it == boundary.end()) {
      std::vector<int64_t> shape;
      c10::ScalarType dtype;
      if (local_shape_of != nullptr) {
        shape = local_shape_of->sizes().vec();
        dtype = local_shape_of->scalar_type();
      } else {
        at::Tensor meta = recv(at::empty({kMaxDims + 2}, at::kLong), st.index - 1, tag);
        shape.assign(meta.data_ptr<int64_t>() + 2, meta.data_ptr<int64_t>() + 2 + meta[0].item<int64_t>());
        dtype = static_cast<c10::ScalarType>(meta[1].item<int64_t>());
      }
      TORCH_CHECK(st.input_shape.empty() || st.input_shape == shape, "Pipeline: stage ", st.index, " expects inputs of ",
                  c10::IntArrayRef(st.input_shape), " per microbatch, but stage ", st.index - 1, " (pp rank ", from,
                  ") sends ", shapeText(shape, dtype), ". Make the stages' boundary shapes agree (the split's sizes, "
                  "or input_shape).");
      it = boundary.emplace(st.index, std::make_pair(shape, dtype)).first;
    }
    return recv(at::empty(it->second.first, options.dtype(it->second.second)), st.index - 1, tag);
  };

  at::Tensor loss_sum, term_sum;
  bool terms_done = terms_.empty();
  for (const Action& a : schedule_.actions(pp_.rank())) {
    const PipelineStage& st = *mine.at(a.stage);
    const auto key = std::make_pair(a.stage, a.microbatch);
    if (a.kind == Action::Backward && !terms_done) {  // NOTE: [Pipeline loss terms]
      for (const auto& term : terms_) {
        const at::Tensor v = term();
        TORCH_CHECK(v.defined() && v.numel() == 1, "Pipeline: a loss term returned ", v.defined() ? c10::str(v.sizes())
                    : std::string("an undefined tensor"), ", expected its value (0-dim).");
        term_sum = term_sum.defined() ? term_sum + v.detach().reshape({}) : v.detach().reshape({});
      }
      terms_done = true;
    }
    if (a.kind == Action::Forward) {
      const auto& self_queue = to_self[activationTag(a.stage)];
      at::Tensor x = a.stage == 0 ? input_mbs[a.microbatch]
                                  : recvInput(st, self_queue.empty() ? nullptr : &self_queue.front()).requires_grad_(true);
      at::Tensor y = st.forward(x);
      TORCH_CHECK(!is_dtensor(y), "Pipeline: stage ", a.stage, "'s output is a DTensor: NYI (TP inside a pipeline "
                  "stage). Return a plain tensor (to_local of a Replicate output) from the stage.");
      if (a.stage == last) {
        y = loss_(y, target_mbs[a.microbatch]);
        TORCH_CHECK(y.defined() && y.numel() == 1, "Pipeline: loss_fn returned ",
                    y.defined() ? "a tensor of shape " + c10::str(y.sizes()) : std::string("an undefined tensor"),
                    " for microbatch ", a.microbatch, " on stage ", a.stage, ": got a non-scalar loss, expected one "
                    "value per microbatch (0-dim), which the pipeline scales by 1/", m, " and backpropagates from. "
                    "Reduce it inside loss_fn, e.g. with .mean() or .sum().");
        y = y / m;
        loss_sum = loss_sum.defined() ? loss_sum + y.detach() : y.detach();
      } else {
        announce(y, a.stage + 1);
        send(y.detach(), a.stage + 1, activationTag(a.stage + 1));
      }
      saved[key] = {x, y};
    } else {
      auto it = saved.find(key);
      TORCH_INTERNAL_ASSERT(it != saved.end(), "the schedule runs ", a.str(), " before its forward");
      const Saved mine_saved = std::move(it->second);
      saved.erase(it);
      if (a.stage == last) {
        mine_saved.output.backward();
      } else {
        at::Tensor g = recv(at::empty_like(mine_saved.output, at::MemoryFormat::Contiguous), a.stage + 1, gradientTag(a.stage));
        mine_saved.output.backward(g);
      }
      if (a.stage > 0) {
        TORCH_CHECK(mine_saved.input.grad().defined(), "Pipeline: stage ", a.stage, "'s input got no gradient: its "
                    "output does not depend on its input. A stage must compute from what it receives.");
        send(mine_saved.input.grad(), a.stage - 1, gradientTag(a.stage - 1));
      }
    }
  }
  for (auto& w : sends) waitFor(std::move(w));
  stats_.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (loss_sum.defined() && term_sum.defined()) return loss_sum + term_sum.to(loss_sum.scalar_type());
  return loss_sum;
}

}  // namespace dtp::pp
