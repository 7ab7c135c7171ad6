// ParallelDims: a training run's parallel degrees, as torchtitan's
// ParallelDims (torchtitan/distributed/parallel_dims.py), the mesh they make,
// and the one place where dtp decides which mesh dimension plays which part.
//
//   auto dims = dtp::ParallelDims().dp_replicate(2).tp(2).world_size(8);  // dp_shard -1: inferred, 2
//   dtp::DeviceMesh mesh = dims.build_mesh("cpu");  // (dp_replicate=2, dp_shard=2, tp=2)
//   mesh["dp"];                  // (dp=4): flattened, the batch's ranks
//   mesh[{"dp_shard_cp", "tp"}]  // (dp_shard_cp=2, tp=2)
//   parallelize_llama(model, mesh);
//
// See NOTE: [Mesh dimension names] in src/mesh/parallel_dims.cpp.
#pragma once

#include "dtp/device_mesh.h"
#include "dtp/process_group.h"

#include <torch/arg.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dtp {

struct ParallelDims {
  TORCH_ARG(int64_t, dp_replicate) = 1;  // DDP, or HSDP's replicas
  TORCH_ARG(int64_t, dp_shard) = -1;     // FSDP; -1: world_size / (dp_replicate * cp * tp * pp)
  TORCH_ARG(int64_t, cp) = 1;            // context parallelism (parallelize_llama: apply_context_parallel)
  TORCH_ARG(int64_t, tp) = 1;
  TORCH_ARG(int64_t, pp) = 1;
  // Expert parallelism, borrowed from dp_shard (and cp), as torchtitan's
  // with etp = tp: the MoE layers' experts are spread over ep ranks of the
  // data-parallel ones. Under TP dtp keeps the experts replicated over tp.
  TORCH_ARG(int64_t, ep) = 1;
  TORCH_ARG(int64_t, world_size) = 0;

 public:  // TORCH_ARG leaves its fields private
  // torchtitan's _validate: every degree >= 1 (dp_shard may be -1, then
  // inferred and set), dp_replicate * dp_shard * cp * tp * pp == world_size,
  // and with ep > 1: ep % cp == 0 and (dp_shard * cp) % ep == 0. The errors
  // name the product. Returns *this.
  ParallelDims& validate();

  // torchtitan's properties, of validated degrees (dp_shard -1 is an error).
  bool dp_enabled() const;            // dp_replicate > 1 or dp_shard > 1
  bool dp_replicate_enabled() const;  // dp_replicate > 1
  bool dp_shard_enabled() const;      // dp_shard > 1
  bool cp_enabled() const;
  bool dp_cp_enabled() const;         // dp_enabled or cp_enabled
  bool fsdp_enabled() const;          // dp_shard_enabled or cp_enabled
  bool tp_enabled() const;
  bool pp_enabled() const;
  bool ep_enabled() const;
  int64_t fsdp_gradient_divide_factor() const;  // dp_replicate * dp_shard * cp
  int64_t non_data_parallel_size() const;       // cp * tp * pp
  int64_t seq_len_divisor() const;              // tp * cp * 2

  // The mesh build_mesh makes, without communication: its dimensions in
  // torchtitan's order (those of degree > 1), and the flattened names with
  // the dimensions each covers. Without ep:
  //   (pp, dp_replicate, dp_shard, cp, tp)
  //   dp = (dp_replicate, dp_shard), dp_shard_cp = (dp_shard, cp), dp_cp = (dp_replicate, dp_shard, cp)
  // With ep, dp_shard is cut in two, dp_shard_mod_ep (always there, as
  // torchtitan's) and dp_shard_in_ep = ep / cp (there too, of size 1 when
  // ep = cp, so that the mesh names expert parallelism; torchtitan drops it):
  //   (pp, dp_replicate, dp_shard_mod_ep, dp_shard_in_ep, cp, tp)
  //   dp, dp_shard_cp and dp_cp as above over both, ep = (dp_shard_in_ep, cp)
  // (the experts over ep x cp: NOTE: [Context parallelism with expert
  // parallelism] in src/models/llama_parallelize.cpp)
  // A flattened name is registered when one of its dimensions is there. All
  // degrees 1: a 1-D mesh (dp_shard=1).
  std::vector<std::string> mesh_dim_names() const;
  std::vector<int64_t> mesh_shape() const;
  std::vector<std::pair<std::string, std::vector<std::string>>> flattened_dims() const;

  // init_device_mesh over `world` (default: this thread's) with the shape and
  // names above, then every flattened name registered (DeviceMesh::flatten):
  // collective, every rank calls it. Validates first.
  DeviceMesh build_mesh(const std::string& device_type = "cpu",
                        std::optional<ProcessGroup> world = std::nullopt) const;
};

// Which dimension of a mesh plays each part: the one reading of mesh
// dimension names that parallelize_llama, fully_shard / replicate, expert
// parallelism and data_parallel_group share. A hand-built mesh and a
// ParallelDims one read alike (NOTE: [Mesh dimension names]):
//   part          hand-built        ParallelDims::build_mesh
//   pp            pp                pp
//   dp_replicate  dp_replicate      dp_replicate
//   dp_shard      dp, dp_shard      dp_shard, or dp_shard_mod_ep with ep; a slice's
//                                   flattened dp or dp_shard_cp
//   ep            ep                dp_shard_in_ep; a slice's flattened ep
//   cp            cp                cp
//   tp            tp                tp
// Each field holds the dimension's name in `mesh`. Two names for one part
// (e.g. "dp" and "dp_shard") are an error.
struct ParallelMeshDims {
  std::optional<std::string> pp, dp_replicate, dp_shard, cp, tp, ep;
  std::vector<std::string> others;  // names that play none of these parts
  // The data-parallel dimensions, in mesh order: every rank that trains on
  // its own slice of a batch (dp_replicate, dp_shard, ep; not cp).
  std::vector<std::string> batch;
};
ParallelMeshDims parallel_mesh_dims(const DeviceMesh& mesh);

}  // namespace dtp
