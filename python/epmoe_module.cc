// The compiled part of the Python module `epmoe`: converts NumPy arrays to and from the C++ types and
// a failed Status to a Python exception carrying the C++ message (ValueError for bad arguments,
// FileNotFoundError, OSError, else RuntimeError). Every computation is the C++ library's.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "epmoe/balance.h"
#include "epmoe/eplb_policy.h"
#include "epmoe/hardware.h"
#include "epmoe/load_matrix.h"
#include "epmoe/model.h"
#include "epmoe/placement.h"
#include "epmoe/plan.h"
#include "epmoe/trace.h"

namespace py = pybind11;

namespace epmoe {
namespace {

using DoubleArray = py::array_t<double, py::array::c_style | py::array::forcecast>;
using Int64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

[[noreturn]] void Raise(const Status& status) {
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange: throw py::value_error(status.message());
    case StatusCode::kNotFound:
      PyErr_SetString(PyExc_FileNotFoundError, status.message().c_str());
      throw py::error_already_set();
    case StatusCode::kIoError: PyErr_SetString(PyExc_OSError, status.message().c_str()); throw py::error_already_set();
    default: throw std::runtime_error(status.message());
  }
}

void Check(const Status& status) {
  if (!status.ok()) Raise(status);
}

template <typename T>
T Value(Result<T> result) {
  if (!result.ok()) Raise(result.status());
  return std::move(result).value();
}

// A 1-D (one layer), 2-D ([layer][expert]) or 3-D ([step][layer][expert]) array as a LoadMatrix.
LoadMatrix ToMatrix(const DoubleArray& array, const char* name) {
  if (array.ndim() < 1 || array.ndim() > 3)
    throw py::value_error(std::string(name) + ": need 1 to 3 dimensions ([step][layer][expert]), got " +
                          std::to_string(array.ndim()));
  std::vector<int64_t> shape(3 - array.ndim(), 1);
  for (py::ssize_t d = 0; d < array.ndim(); ++d) shape.push_back(array.shape(d));
  if (shape[1] > INT32_MAX || shape[2] > INT32_MAX) throw py::value_error(std::string(name) + ": too large");
  LoadMatrix load(shape[0], static_cast<int>(shape[1]), static_cast<int>(shape[2]));
  std::copy(array.data(), array.data() + array.size(), load.values.begin());
  Check(ValidateLoadMatrix(load, name));
  return load;
}

template <typename T>
py::array_t<T> ToArray(std::vector<T> values, std::vector<py::ssize_t> shape) {
  py::array_t<T> out(shape);
  std::copy(values.begin(), values.end(), out.mutable_data());
  return out;
}

py::array_t<int64_t> Phy2log(const Placement& p) {
  std::vector<int64_t> values;
  for (int layer = 0; layer < p.num_layers(); ++layer)
    values.insert(values.end(), p.phy2log(layer).begin(), p.phy2log(layer).end());
  return ToArray(std::move(values), {p.num_layers(), p.num_slots()});
}
py::array_t<int64_t> Log2phy(const Placement& p) {
  std::vector<int64_t> values;
  for (int layer = 0; layer < p.num_layers(); ++layer)
    values.insert(values.end(), p.log2phy(layer).begin(), p.log2phy(layer).end());
  return ToArray(std::move(values), {p.num_layers(), p.num_experts(), p.max_copies()});
}
py::array_t<int64_t> Logcnt(const Placement& p) {
  std::vector<int64_t> values;
  for (int layer = 0; layer < p.num_layers(); ++layer)
    values.insert(values.end(), p.logcnt(layer).begin(), p.logcnt(layer).end());
  return ToArray(std::move(values), {p.num_layers(), p.num_experts()});
}

Placement PlacementFromArray(const Int64Array& phy2log, int num_experts, int num_ranks, int num_nodes) {
  if (phy2log.ndim() != 2) throw py::value_error("phy2log: need 2 dimensions ([layer][slot])");
  std::vector<std::vector<int32_t>> rows(phy2log.shape(0));
  for (py::ssize_t layer = 0; layer < phy2log.shape(0); ++layer)
    for (py::ssize_t slot = 0; slot < phy2log.shape(1); ++slot) {
      const int64_t value = phy2log.at(layer, slot);
      if (value < INT32_MIN || value > INT32_MAX) throw py::value_error("phy2log: expert id out of range");
      rows[layer].push_back(static_cast<int32_t>(value));
    }
  return Value(Placement::Create(num_experts, num_ranks, num_nodes, std::move(rows)));
}

Placement ComputeFor(const LoadMatrix& load, int num_ranks, int num_redundant, int num_nodes, int num_groups,
                     const std::string& policy, const std::optional<Placement>& current) {
  PolicyOptions options;
  options.policy = Value(ParsePolicy(policy));
  options.shape = {num_ranks, num_nodes, num_groups, num_redundant};
  std::optional<Placement> trivial;
  if (current) {
    options.current = &*current;
  } else if (options.policy == Policy::kMinMove) {
    Check(ValidateBalanceShape(options.shape, load.num_experts));
    trivial = Value(Placement::Trivial(load.num_layers, load.num_experts, num_redundant, num_ranks, num_nodes));
    options.current = &*trivial;
  }
  py::gil_scoped_release release;
  return Value(ComputePlacement(load, options));
}

py::dict ScoreDict(const PlacementScore& s) {
  py::dict d;
  d["balancedness"] = s.balancedness;
  d["max_load_per_rank"] = s.max_picks;
  d["mean_load_per_rank"] = s.mean_picks;
  d["byte_balancedness"] = s.byte_balancedness;
  d["max_bytes_per_rank"] = s.max_bytes;
  d["mean_bytes_per_rank"] = s.mean_bytes;
  d["step_seconds"] = s.step_seconds;
  d["mean_rank_step_seconds"] = s.mean_rank_seconds;
  return d;
}

py::dict ReadTrace(const std::string& path, const std::string& format, const std::string& phase, int64_t batch,
                   const std::string& on_missing) {
  LoadReadOptions options;
  options.format = format;
  options.phase = phase;
  options.batch = batch;
  options.on_missing = on_missing;
  TraceInfo info;
  ExpertLoad load = Value(ReadExpertLoad(path, options, &info));
  py::dict d;
  d["counts"] = ToArray(load.counts, {static_cast<py::ssize_t>(load.num_steps), load.num_layers, load.num_experts});
  d["rows"] = ToArray(load.rows, {static_cast<py::ssize_t>(load.num_steps)});
  d["top_k"] = load.top_k;
  d["layer_ids"] = info.layer_ids;
  d["format"] = info.format;
  d["dropped_tokens"] = info.dropped_tokens;
  return d;
}

void WriteCountsTrace(const std::string& path, const Int64Array& counts, int top_k, std::optional<Int64Array> rows,
                      std::optional<std::vector<int>> layer_ids) {
  if (counts.ndim() != 3) throw py::value_error("counts: need 3 dimensions ([step][layer][expert])");
  TraceInfo info;
  info.format = "epmoe";
  info.num_steps = counts.shape(0);
  info.num_layers = static_cast<int>(counts.shape(1));
  info.num_experts = static_cast<int>(counts.shape(2));
  info.top_k = top_k;
  if (layer_ids) {
    info.layer_ids = *layer_ids;
  } else {
    for (int l = 0; l < info.num_layers; ++l) info.layer_ids.push_back(l);
  }
  if (rows && (rows->ndim() != 1 || rows->shape(0) != counts.shape(0)))
    throw py::value_error("rows: need one value per step");
  auto writer = Value(TraceWriter::Create(path, info));
  const size_t per_step = static_cast<size_t>(info.num_layers) * info.num_experts;
  for (int64_t s = 0; s < info.num_steps; ++s) {
    StepPicks step;
    step.rows = rows ? rows->at(s) : 0;
    step.counts.assign(counts.data() + s * per_step, counts.data() + (s + 1) * per_step);
    Check(writer->Append(step));
  }
  Check(writer->Close());
}

py::dict Plan(const std::string& model_name, const std::string& hardware_name, const std::vector<int64_t>& batches,
              const std::vector<int>& gpus, const std::string& phase, const std::optional<std::string>& trace,
              const std::string& placement, int redundant) {
  const ModelConfig model = Value(LoadModel(model_name));
  const HardwareProfile hardware = Value(LoadHardware(hardware_name));
  PlanConfig config;
  config.phase = Value(ParsePlanPhase(phase));
  config.batches = batches;
  config.gpus = gpus;
  config.placement = placement;
  config.redundant = redundant;
  std::optional<ExpertLoad> load;
  if (trace) load = Value(ReadExpertLoad(*trace, LoadReadOptions{}));
  const PlanResult result =
      Value(RunPlan(model, hardware, config, load ? &*load : nullptr, trace ? *trace : "even router"));
  py::list costs;
  for (const OptionCost& c : result.costs) {
    py::dict d;
    d["option"] = EpOptionName(c.option);
    d["gpus"] = c.gpus;
    d["batch"] = c.batch;
    d["slices"] = c.slices;
    d["label"] = CostLabel(c.option, c.slices, c.a2a);
    d["applicable"] = c.applicable;
    d["not_applicable"] = c.not_applicable;
    d["kernel_us"] = c.kernel_us;
    d["comm_us"] = c.comm_us;
    d["exposed_comm_us"] = c.exposed_comm_us;
    d["layer_us"] = c.layer_us;
    d["inter_node_mb"] = c.inter_node_mb;
    d["intra_node_mb"] = c.intra_node_mb;
    d["step_ms"] = c.step_ms;
    d["balancedness"] = c.balancedness;
    d["copies_per_row"] = c.copies_per_row;
    d["memory_bytes"] = c.memory_bytes;
    d["fits"] = c.fits;
    d["dominant"] = c.dominant;
    costs.append(d);
  }
  py::list winners;
  for (const PlanWinner& w : result.winners) {
    py::dict d;
    d["batch"] = w.batch;
    d["gpus"] = w.gpus;
    d["option"] = EpOptionName(w.option);
    d["slices"] = w.slices;
    d["label"] = CostLabel(w.option, w.slices, w.a2a);
    d["step_ms"] = w.step_ms;
    d["why"] = w.why;
    winners.append(d);
  }
  py::dict out;
  out["model"] = result.model;
  out["hardware"] = result.hardware;
  out["phase"] = phase;
  out["load"] = result.load;
  out["costs"] = costs;
  out["winners"] = winners;
  return out;
}

}  // namespace
}  // namespace epmoe

PYBIND11_MODULE(_epmoe, m) {
  using namespace epmoe;
  m.doc() = "epmoe's C++ library: expert placement (EPLB), balance scores, traces, planner";

  py::class_<Placement>(m, "Placement", "Where each layer's expert copies live (immutable)")
      .def(py::init(&PlacementFromArray), py::arg("phy2log"), py::arg("num_experts"), py::arg("num_ranks"),
           py::arg("num_nodes") = 1)
      .def_property_readonly("num_layers", &Placement::num_layers)
      .def_property_readonly("num_experts", &Placement::num_experts)
      .def_property_readonly("num_slots", &Placement::num_slots)
      .def_property_readonly("num_ranks", &Placement::num_ranks)
      .def_property_readonly("num_nodes", &Placement::num_nodes)
      .def_property_readonly("phy2log", &Phy2log)
      .def_property_readonly("log2phy", &Log2phy)
      .def_property_readonly("logcnt", &Logcnt)
      .def("moved_copies", &Placement::MovedCopies, py::arg("other"))
      .def("to_json", &PlacementToJson)
      .def_static(
          "from_json", [](const std::string& text) { return Value(PlacementFromJson(text, "placement JSON")); },
          py::arg("text"))
      .def_static(
          "read", [](const std::string& path) { return Value(ReadPlacementFile(path)); }, py::arg("path"))
      .def(
          "write", [](const Placement& p, const std::string& path) { Check(WritePlacementFile(p, path)); },
          py::arg("path"))
      .def(
          "to_sglang_json",
          [](const Placement& p, const std::vector<int>& layer_ids, int num_hidden_layers) {
            return Value(PlacementToSglangJson(p, layer_ids, num_hidden_layers));
          },
          py::arg("layer_ids") = std::vector<int>{}, py::arg("num_hidden_layers") = 0)
      .def("__eq__", [](const Placement& a, const Placement& b) { return a == b; });

  m.def(
      "compute_placement",
      [](const DoubleArray& load, int num_ranks, int num_redundant, int num_nodes, int num_groups,
         const std::string& policy, const std::optional<Placement>& current) {
        return ComputeFor(ToMatrix(load, "load"), num_ranks, num_redundant, num_nodes, num_groups, policy, current);
      },
      py::arg("load"), py::arg("num_ranks"), py::arg("num_redundant") = 0, py::arg("num_nodes") = 1,
      py::arg("num_groups") = 1, py::arg("policy") = "deepseek", py::arg("current") = py::none());
  m.def(
      "score",
      [](const Placement& placement, const DoubleArray& load) {
        const LoadMatrix matrix = ToMatrix(load, "load");
        if (matrix.num_layers != placement.num_layers() || matrix.num_experts != placement.num_experts())
          throw py::value_error("load has " + std::to_string(matrix.num_layers) + " layers of " +
                                std::to_string(matrix.num_experts) + " experts, the placement " +
                                std::to_string(placement.num_layers()) + " of " +
                                std::to_string(placement.num_experts()));
        return ScoreDict(ScorePlacement(placement, matrix, CostModel{}));
      },
      py::arg("placement"), py::arg("load"));
  m.def(
      "read_load_matrix",
      [](const std::string& path) {
        const LoadMatrix load = Value(ReadLoadMatrix(path));
        return ToArray(load.values, {static_cast<py::ssize_t>(load.num_steps), load.num_layers, load.num_experts});
      },
      py::arg("path"));
  m.def("read_trace", &ReadTrace, py::arg("path"), py::arg("format") = "auto", py::arg("phase") = "auto",
        py::arg("batch") = 0, py::arg("on_missing") = "error");
  m.def("write_trace", &WriteCountsTrace, py::arg("path"), py::arg("counts"), py::arg("top_k") = 0,
        py::arg("rows") = py::none(), py::arg("layer_ids") = py::none());
  m.def("plan", &Plan, py::arg("model"), py::arg("hardware"), py::arg("batches"), py::arg("gpus"),
        py::arg("phase") = "decode", py::arg("trace") = py::none(), py::arg("placement") = "trivial",
        py::arg("redundant") = 0);
  m.def("policies", [] {
    std::vector<std::string> names;
    for (Policy p : AllPolicies()) names.push_back(PolicyName(p));
    return names;
  });
}
