// PrepareModuleInput, PrepareModuleOutput and PrepareModuleInputOutput:
// layouts for a module's arguments (by position and by name) and outputs.
// See NOTE: [Argument positions] (tp/style.h), NOTE: [Forward slots]
// (nn/hooked.h).
#include "dtp/dtensor.h"
#include "dtp/tp/style.h"
#include "tp/style_util.h"

#include <c10/util/StringUtil.h>
#include <torch/nn/module.h>

namespace dtp {
namespace {

using namespace tp_detail;

std::string layoutText(const std::optional<Placement>& p) { return p ? to_string(Placements{*p}) : "nullopt"; }

// input_layouts and desired_input_layouts (or the output pair) side by side:
// the same length, and each entry given in both or in neither.
void checkPairs(const std::string& where, const char* given, const Layouts& a, const char* desired,
                const Layouts& b, const char* what) {
  TORCH_CHECK(a.size() == b.size(), where, ": got ", a.size(), " ", given, " but ", b.size(), " ", desired,
              ". Give one entry per ", what, " in both (nullopt to leave one alone).");
  for (size_t i = 0; i < a.size(); ++i)
    TORCH_CHECK(a[i].has_value() == b[i].has_value(), where, ": ", what, " ", i, " has ", given, " ",
                layoutText(a[i]), " but ", desired, " ", layoutText(b[i]), ". Give both or neither (nullopt).");
}

// One argument or output: from the given layout to the desired one.
struct Step {
  Placement given, desired;
};

// The name of argument `i` for errors: "argument 1 ('mask')".
std::string argText(size_t i, const std::vector<std::string>& names) {
  std::string s = "argument " + std::to_string(i);
  if (i < names.size()) s += " ('" + names[i] + "')";
  return s;
}

// Prepares slot `i` of `slots` (an argument or an output). Synchronous, as
// PyTorch's PrepareModuleInput and PrepareModuleOutput (only Colwise,
// Rowwise and SequenceParallel pass async_op=True there).
void prepare(nn::Slots& slots, size_t i, const Step& step, const DeviceMesh& mesh, bool use_local, bool boundary,
             const std::string& where, const std::string& what) {
  TORCH_CHECK(slots.is_tensor(i), where, ": ", what, " is not a tensor, but has the layout ",
              layoutText(step.given), ". Give nullopt for it.");
  at::Tensor& t = slots[i];
  if (!t.defined()) return;  // an absent std::optional<at::Tensor>, or a defaulted undefined tensor
  at::Tensor x = as_dtensor(t, mesh, step.given);
  if (boundary) x = redistribute(std::move(x), mesh, {step.desired});
  t = to_layout(std::move(x), mesh, step.desired, use_local);
}

}  // namespace

void PrepareModuleInput::apply(torch::nn::Module& m, const std::string& fqn, const DeviceMesh& mesh,
                               std::optional<int>) const {
  const auto o = options_;
  const std::string where = name() + " at '" + fqn + "'";
  checkPairs(where, "input_layouts", o.input_layouts(), "desired_input_layouts", o.desired_input_layouts(),
             "forward argument");
  for (const auto& [key, p] : o.input_kwarg_layouts())
    TORCH_CHECK(o.desired_input_kwarg_layouts().count(key), where, ": input_kwarg_layouts has '", key,
                "' but desired_input_kwarg_layouts does not. Give each name in both.");
  for (const auto& [key, p] : o.desired_input_kwarg_layouts())
    TORCH_CHECK(o.input_kwarg_layouts().count(key), where, ": desired_input_kwarg_layouts has '", key,
                "' but input_kwarg_layouts does not. Give each name in both.");
  auto& host = hooks_of(m, fqn, name());
  const std::vector<std::string> names = host.forward_arg_names();

  // Every argument's step, by position: input_layouts' entries, then the
  // keyword layouts at their names' positions.
  std::vector<std::optional<Step>> steps;
  for (size_t i = 0; i < o.input_layouts().size(); ++i)
    steps.push_back(o.input_layouts()[i] ? std::optional<Step>(Step{*o.input_layouts()[i], *o.desired_input_layouts()[i]})
                                         : std::nullopt);
  for (const auto& [key, given] : o.input_kwarg_layouts()) {
    TORCH_CHECK(!names.empty(), where, ": input_kwarg_layouts names '", key, "', but ", m.name(),
                " does not name its forward's arguments. Name them once in its Impl: "
                "DTP_FORWARD_ARGS(\"x\", \"", key, "\", ...) (dtp/nn/hooked.h), in forward's order.");
    const auto it = std::find(names.begin(), names.end(), key);
    TORCH_CHECK(it != names.end(), where, ": input_kwarg_layouts names '", key, "', which is not an argument of ",
                m.name(), "'s forward; its arguments are ", c10::Join(", ", names), ".");
    const size_t pos = it - names.begin();
    TORCH_CHECK(pos >= steps.size() || !steps[pos], where, ": ", argText(pos, names),
                " has a layout in both input_layouts and input_kwarg_layouts. Give it in one of them.");
    if (pos >= steps.size()) steps.resize(pos + 1);
    steps[pos] = Step{given, o.desired_input_kwarg_layouts().at(key)};
  }
  // Arguments after input_layouts are keyword arguments only where they have
  // names and keyword layouts are given (NOTE: [Argument positions]).
  const bool keywords = !names.empty() && !o.input_kwarg_layouts().empty();
  const size_t positional = o.input_layouts().size();
  host.pre_hooks.push_back([o, mesh, where, names, steps, keywords, positional](nn::Slots& in) {
    if (positional > 0) {
      TORCH_CHECK(positional <= in.size() && (positional == in.size() || keywords), where, ": forward got ",
                  in.size(), " arguments, but input_layouts has ", positional,
                  " entries. Give one entry per argument (nullopt for those to leave alone), or name the "
                  "arguments (DTP_FORWARD_ARGS) and give the trailing ones in input_kwarg_layouts.");
    }
    if (!names.empty())
      TORCH_CHECK(in.size() <= names.size(), where, ": forward got ", in.size(), " arguments, but its module names ",
                  names.size(), " (", c10::Join(", ", names), "). Name every argument in DTP_FORWARD_ARGS.");
    for (size_t i = 0; i < steps.size() && i < in.size(); ++i)
      if (steps[i]) prepare(in, i, *steps[i], mesh, o.use_local_output(), o.gradient_boundary(), where, argText(i, names));
  });
}

void PrepareModuleOutput::apply(torch::nn::Module& m, const std::string& fqn, const DeviceMesh& mesh,
                                std::optional<int>) const {
  const auto o = options_;
  const std::string where = name() + " at '" + fqn + "'";
  TORCH_CHECK(!o.output_layouts().empty() && !o.desired_output_layouts().empty(), where,
              ": output_layouts and desired_output_layouts are required (PyTorch's have no default). Give both, "
              "one entry per output: PrepareModuleOutputOptions().output_layouts(Replicate())"
              ".desired_output_layouts(Shard(0)).");
  checkPairs(where, "output_layouts", o.output_layouts(), "desired_output_layouts", o.desired_output_layouts(),
             "output");
  auto& host = hooks_of(m, fqn, name());
  host.post_hooks.push_back([o, mesh, where](nn::Slots& out) {
    TORCH_CHECK(out.size() == o.output_layouts().size(), where, ": forward returned ", out.size(),
                " outputs, but output_layouts has ", o.output_layouts().size(),
                " entries. Give one per output (nullopt for those to leave alone).");
    for (size_t i = 0; i < out.size(); ++i)
      if (o.output_layouts()[i])
        prepare(out, i, Step{*o.output_layouts()[i], *o.desired_output_layouts()[i]}, mesh, o.use_local_output(),
                /*boundary=*/false, where, "output " + std::to_string(i));
  });
}

PrepareModuleInputOutput::PrepareModuleInputOutput(const PrepareModuleInputOutputOptions& o)
    : in_(PrepareModuleInputOptions()
              .input_layouts(o.input_layouts())
              .desired_input_layouts(o.desired_input_layouts())
              .input_kwarg_layouts(o.input_kwarg_layouts())
              .desired_input_kwarg_layouts(o.desired_input_kwarg_layouts())
              .use_local_output(o.use_local_input())),
      out_(PrepareModuleOutputOptions()
               .output_layouts(o.output_layouts())
               .desired_output_layouts(o.desired_output_layouts())
               .use_local_output(o.use_local_output())) {}

void PrepareModuleInputOutput::apply(torch::nn::Module& m, const std::string& fqn, const DeviceMesh& mesh,
                                     std::optional<int> src) const {
  in_.apply(m, fqn, mesh, src);
  out_.apply(m, fqn, mesh, src);
}

}  // namespace dtp
