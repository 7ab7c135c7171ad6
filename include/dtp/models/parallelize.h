// The reference Llama's parallelisms composed in torchtitan's order, as its
// parallelize_llama and pipeline_llama do:
//   apply_tensor_parallel -> apply_ac -> apply_fsdp / apply_ddp -> pipeline.
//
//   auto mesh = dtp::init_device_mesh("cpu", {2, 2, 2}, {"pp", "dp", "tp"});
//   Llama model(config);                                  // every rank: the whole model
//   auto pipe = pipeline_llama(model, mesh, {"1f1b", 4}, {/*tp*/ {}, ACOptions{}});
//   at::Tensor loss = pipe.pipeline->step(tokens, targets);  // defined on the last stage
//
// Each mesh dimension is found by name: "tp" (tensor parallelism), "dp"
// (data parallelism), or HSDP's "dp_replicate" and "dp_shard", "ep" (expert
// parallelism, borrowed from data parallelism: a (dp, ep[, tp]) mesh, NOTE:
// [Expert parallelism with data parallelism]), and "pp".
#pragma once

#include "dtp/dcp/state_dict.h"
#include "dtp/models/llama.h"
#include "dtp/pp/pipeline.h"

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dtp::models {

enum class DataParallel : uint8_t { FSDP, DDP };

struct ParallelizeOptions {
  TensorParallelOptions tp;
  std::optional<ACOptions> ac;  // none: no activation checkpointing
  DataParallel data_parallel = DataParallel::FSDP;
  FullyShardOptions fsdp;
  ReplicateOptions ddp;
};

// On a whole model or a pipeline stage, on a mesh without "pp": tensor
// parallelism over "tp" if the mesh has it, then activation checkpointing if
// asked, then FSDP or DDP over the data-parallel dimensions if it has any.
void parallelize_llama(Llama& model, const DeviceMesh& mesh, const ParallelizeOptions& options = {});

// The ranks that train on slices of one batch, for the data loader and
// moe_load_balancing_loss: "dp", HSDP's dp_replicate x dp_shard, or
// dp x ep. Collective the first time (it may make the group); `mesh` has
// no "pp" (pass a stage's mesh) and at least one of these dimensions.
ProcessGroup data_parallel_group(const DeviceMesh& mesh);

struct PipelineOptions {
  std::string schedule = "1f1b";   // gpipe, 1f1b, or interleaved (interleaved 1F1B)
  int microbatches = 0;            // per step; 0: as many as stages
  int stages_per_rank = 1;         // interleaved: virtual stages per pp rank
  std::vector<int64_t> split;      // each stage's first layer; empty: even
};

// This pp rank's part of a pipeline over mesh["pp"].
struct LlamaPipeline {
  std::vector<Llama> stages;                // this rank's, parallelized
  std::shared_ptr<pp::Pipeline> pipeline;   // step(tokens, targets)
  bool has_last_stage = false;              // this rank computes the loss
  // This rank's parameters, each once (for the optimizer).
  std::vector<at::Tensor> parameters() const;
  // For `model` built with deferred_init: allocates and sets this rank's
  // parameters only (one device's values), the rest of the model staying on
  // the meta device (init_weights(model, parameters())).
  void init_weights(Llama model) const;
  // A checkpoint of this rank's stages named as the whole model's (`model`:
  // what pipeline_llama cut): their parameters and `optimizer`'s state of
  // them, for dcp::save or dcp::AsyncSaver. Every rank saving its own, the
  // folder holds the whole model.
  dcp::StateDict state_dict(Llama model, torch::optim::Optimizer* optimizer) const;
  // Fills this rank's stages and `optimizer`'s state from a checkpoint folder
  // of the whole model: saved by state_dict at any pp layout and split, or
  // by dcp::save_state of the whole model at any (dp, tp) layout. Returns its
  // metadata. Collective over every rank of the pipeline.
  std::map<std::string, std::string> load_state(const std::string& dir, Llama model,
                                                torch::optim::Optimizer* optimizer) const;
};

// Cuts `model` into pp * stages_per_rank stages (llama_pipeline_stage), keeps
// this rank's, parallelizes each with parallelize_llama over the mesh's other
// dimensions and runs them under the schedule with llama_loss. Stages get
// tensor parallelism without sequence parallelism, as KempnerForge does:
// activations between stages are then plain tensors, each tp rank sending
// its (replicated) copy to the same tp rank of the next stage. The model's
// modules are shared, not copied: model->named_parameters() names them as
// the whole model does.
LlamaPipeline pipeline_llama(const Llama& model, const DeviceMesh& mesh, const PipelineOptions& pipeline,
                             ParallelizeOptions options = {});

}  // namespace dtp::models
