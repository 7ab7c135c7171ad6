#include "dtp/nn/multihead_attention.h"

#include "dtp/dtensor.h"
#include "dtp/module_utils.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

namespace dtp::nn {

void MultiheadAttentionImpl::shard_heads(const DeviceMesh& mesh, std::optional<int> src_data_rank,
                                         const std::string& fqn) {
  const int64_t heads = options.num_heads(), tp = mesh.size(), e = options.embed_dim();
  TORCH_CHECK(!mesh_.valid(), "PairwiseParallel: the MultiheadAttention at '", fqn,
              "' has its heads split already. Parallelize each module once.");
  TORCH_CHECK(heads % tp == 0, "PairwiseParallel: num_heads of the MultiheadAttention at '", fqn, "': got ",
              heads, " heads for ", tp, " ranks, expected a multiple of ", tp,
              ". Each rank owns whole heads: choose num_heads divisible by the mesh size, or a smaller mesh.");
  TORCH_CHECK(!options.add_bias_kv() && !options.add_zero_attn(),
              "PairwiseParallel: NYI: add_bias_kv / add_zero_attn on the MultiheadAttention at '", fqn,
              "'. Build it without them to split its heads.");
  auto shard = [&](torch::nn::Module& m, const std::string& name, at::Tensor& field, at::IntArrayRef shape,
                   Placement p) {
    if (!field.defined()) return;
    at::Tensor full = field.detach().reshape(shape).requires_grad_(field.requires_grad());
    field = distribute_tensor(full, mesh, {p}, src_data_rank);
    replace_parameter(m, name, field);
  };
  // Rows of q (and of k, v) are head-major, so Shard over them hands out whole heads.
  if (_qkv_same_embed_dim) {
    shard(*this, "in_proj_weight", in_proj_weight, {3, e, e}, Shard(1));
  } else {
    shard(*this, "q_proj_weight", q_proj_weight, q_proj_weight.sizes().vec(), Shard(0));
    shard(*this, "k_proj_weight", k_proj_weight, k_proj_weight.sizes().vec(), Shard(0));
    shard(*this, "v_proj_weight", v_proj_weight, v_proj_weight.sizes().vec(), Shard(0));
  }
  shard(*this, "in_proj_bias", in_proj_bias, {3, e}, Shard(1));
  shard(*out_proj, "weight", out_proj->weight, out_proj->weight.sizes().vec(), Shard(1));
  shard(*out_proj, "bias", out_proj->bias, out_proj->bias.sizes().vec(), Replicate());
  mesh_ = mesh;
}

// q, k or v (which = 0, 1, 2) of this rank's heads: [L, N, E/tp], plain; its
// gradient returns as Shard(2).
at::Tensor MultiheadAttentionImpl::projectLocal(const at::Tensor& x, int64_t which) {
  const at::Tensor* separate[] = {&q_proj_weight, &k_proj_weight, &v_proj_weight};
  at::Tensor w = _qkv_same_embed_dim ? in_proj_weight.select(0, which) : *separate[which];
  at::Tensor b = in_proj_bias.defined() ? in_proj_bias.select(0, which) : at::Tensor();
  return to_local(at::linear(x, w, b));
}

std::tuple<at::Tensor, at::Tensor> MultiheadAttentionImpl::forward(const at::Tensor& query, const at::Tensor& key,
                                                                   const at::Tensor& value,
                                                                   const at::Tensor& key_padding_mask,
                                                                   bool need_weights, const at::Tensor& attn_mask,
                                                                   bool average_attn_weights) {
  if (!mesh_.valid()) {
    return torch::nn::MultiheadAttentionImpl::forward(query, key, value, key_padding_mask, need_weights,
                                                      attn_mask, average_attn_weights);
  }
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3,
              "MultiheadAttention (heads split): query, key and value must be [L, N, E]; got ", query.sizes(),
              ", ", key.sizes(), ", ", value.sizes(), ".");
  TORCH_CHECK(!attn_mask.defined() || (attn_mask.dim() == 2 && at::isFloatingType(attn_mask.scalar_type())),
              "MultiheadAttention (heads split): NYI: attn_mask ", attn_mask.sizes(), " of ",
              attn_mask.scalar_type(), "; pass a float [L, S] mask (-inf where attention is not allowed).");
  // One replicated DTensor per distinct input: self-attention's x then gets
  // one gradient all-reduce for q, k and v together.
  auto replicated = [&](const at::Tensor& t) {
    return is_dtensor(t) ? redistribute(t, mesh_, {Replicate()}) : from_local(t, mesh_, {Replicate()});
  };
  const at::Tensor q_in = replicated(query);
  const at::Tensor k_in = key.is_same(query) ? q_in : replicated(key);
  const at::Tensor v_in = value.is_same(key) ? k_in : value.is_same(query) ? q_in : replicated(value);

  const at::Tensor q = projectLocal(q_in, 0) * (1.0 / std::sqrt(static_cast<double>(head_dim)));
  const at::Tensor k = projectLocal(k_in, 1), v = projectLocal(v_in, 2);
  const int64_t tgt = q.size(0), batch = q.size(1), src = k.size(0), local_heads = q.size(2) / head_dim;
  // [L, N, h*d] -> [N*h, L, d], the stock layout for this rank's h heads.
  auto byHead = [&](const at::Tensor& t) {
    return t.contiguous().view({t.size(0), batch * local_heads, head_dim}).transpose(0, 1);
  };
  at::Tensor w = at::bmm(byHead(q), byHead(k).transpose(1, 2));
  if (attn_mask.defined()) w = w + attn_mask;
  if (key_padding_mask.defined()) {
    w = w.view({batch, local_heads, tgt, src})
            .masked_fill(key_padding_mask.view({batch, 1, 1, src}), -std::numeric_limits<double>::infinity())
            .view({batch * local_heads, tgt, src});
  }
  w = at::softmax(w, -1);
  if (is_training() && options.dropout() > 0) {
    // As a DTensor of the global [N, H, L, S]: the mask equals one device's.
    at::Tensor global = from_local(w.view({batch, local_heads, tgt, src}), mesh_, {Shard(1)});
    w = to_local(at::dropout(global, options.dropout(), /*train=*/true)).view({batch * local_heads, tgt, src});
  }
  at::Tensor out = at::bmm(w, byHead(v)).transpose(0, 1).contiguous().view({tgt, batch, local_heads * head_dim});
  out = at::linear(from_local(out, mesh_, {Shard(2)}), out_proj->weight, out_proj->bias);
  out = to_local(redistribute(out, mesh_, {Replicate()}));
  if (!need_weights) return {out, at::Tensor()};
  at::Tensor w4 = w.view({batch, local_heads, tgt, src});
  at::Tensor weights = average_attn_weights
                           ? full_tensor(from_local(w4.sum(1) / options.num_heads(), mesh_, {Partial()}))
                           : full_tensor(from_local(w4, mesh_, {Shard(1)}));
  return {out, weights};
}

}  // namespace dtp::nn
