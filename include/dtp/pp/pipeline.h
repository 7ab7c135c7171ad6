// Pipeline parallelism: runs a Schedule (schedule.h) on this rank's stages,
// microbatch by microbatch, sending activations forward and their gradients
// back as plain tensors between the pp ranks (ProcessGroup's isend/irecv).
//
//   dtp::pp::Pipeline pipe(Schedule::one_f_one_b(4, 8), {stage}, pp_group, loss_fn);
//   at::Tensor loss = pipe.step(tokens, targets);   // defined on the last stage's rank
//   optimizer.step();
//
// NOTE: [Pipeline step] For each action of this rank, in order:
//  - F(s, mb): the input is microbatch mb of `inputs` (stage 0) or received
//    from stage s-1's rank; the stage runs; the last stage computes
//    loss_fn(output, targets[mb]) / microbatches, others send the output to
//    stage s+1's rank (isend: the rank goes on).
//  - B(s, mb): backward from the loss (last stage) or from the output's
//    gradient received from stage s+1's rank; stages > 0 send their input's
//    gradient back. Parameter gradients accumulate over the microbatches,
//    so with loss_fn a mean, they are the whole batch's.
// Messages carry tag 2*stage (+1 for gradients) of the receiving stage, so
// each (sender, receiver, tag) sees its messages in microbatch order.
// NOTE: [Pipeline boundaries] In every step each boundary's shape and dtype
// travel once ahead of its first activation (one 80-byte message), so the
// receiver allocates what this step sends (a step at another batch or
// sequence length than the last works), and are checked against the
// receiving stage's input_shape when it gives one: a split whose boundary
// shapes disagree is an error naming both stages and shapes, not a failure
// inside the stage. Activations are plain tensors; a DTensor output (TP
// inside a stage) is NYI here.
#pragma once

#include "dtp/pp/schedule.h"
#include "dtp/process_group.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace dtp::pp {

struct PipelineStage {
  int index = 0;                                         // the stage number in the schedule
  std::function<at::Tensor(const at::Tensor&)> forward;  // its computation
  std::vector<int64_t> input_shape;  // per microbatch, checked when received; empty: any
};

using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& targets)>;

struct StepStats {
  double seconds = 0;       // the whole step on this rank
  double wait_seconds = 0;  // waiting for a peer's message: this rank's share of the bubble
  int64_t sends = 0, recvs = 0;
};

class Pipeline {
 public:
  // `stages`: this rank's (schedule.rank_of(index) == pp.rank()), any order.
  // Collective over `pp`: the schedule is simulated (a deadlock is an error
  // naming where) and every pp rank must pass the same one.
  Pipeline(Schedule schedule, std::vector<PipelineStage> stages, ProcessGroup pp, LossFn loss);

  // One step over `inputs` (used by stage 0) and `targets` (by the last
  // stage), each split along dim 0 into schedule.microbatches() equal
  // microbatches. Returns the mean loss on the rank of the last stage, an
  // undefined tensor elsewhere. Collective over the pp group.
  at::Tensor step(const at::Tensor& inputs, const at::Tensor& targets);
  const StepStats& last_stats() const { return stats_; }
  const Schedule& schedule() const { return schedule_; }
  const ProcessGroup& group() const { return pp_; }
  // A term of the step's loss over the whole batch (every stage, every
  // microbatch), such as the MoE load-balancing loss: `term` runs once per
  // step on every rank, after its last forward and before its first
  // backward (it may call collectives over the pp group: every rank gets
  // there), and returns the term's value, 0-dim and the same on every rank,
  // which step() adds to the loss it returns. Its gradient the term gives
  // itself, into the graphs the forwards built. Needs every rank's forwards
  // before its backwards (GPipe): another schedule is an error naming the
  // backward that comes first. NOTE: [Pipeline loss terms].
  void add_loss_term(std::function<at::Tensor()> term);

 private:
  Schedule schedule_;
  std::vector<PipelineStage> stages_;
  ProcessGroup pp_;
  LossFn loss_;
  std::vector<std::function<at::Tensor()>> terms_;
  StepStats stats_;
};

}  // namespace dtp::pp
