// `epmoe balance`: fits expert placements on the first part of a routing trace and scores them on
// the rest (held-out), per policy, against the trivial placement, uniform replication, DeepSeek's
// placement and an even router; the fitted figures beside the held-out ones show overfitting.
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "epmoe/atomic_file.h"
#include "epmoe/balance.h"
#include "epmoe/eplb_policy.h"
#include "epmoe/load_matrix.h"
#include "epmoe/model.h"
#include "epmoe/placement.h"
#include "epmoe/trace.h"
#include "epmoe/weight_format.h"
#include "output.h"

namespace epmoe::cli {
namespace {

struct BalanceOptions {
  std::string trace;
  std::string load;        // a load matrix instead of a trace (any totals, floats)
  std::string out_sglang;  // --load: the placement as SGLang's --init-expert-location file
  std::string trace_format = "auto";
  std::string phase = "auto";
  int64_t batch = 0;
  std::string filter;
  int ranks = 0;
  int nodes = 1;
  int groups = 0;  // 0: the model preset's, else 1
  int redundant = 0;
  std::string policy = "all";
  double train = 0.5;
  std::string model;
  std::string weight_format = "bf16";
  double bandwidth_gbs = 30;
  double peak_gflops = 115;
  double fixed_us = 0;
  std::string current;
  double min_move_factor = 1.05;
  int search_rounds = 64;
  double validation = 0.5;
  double uniform_prior = 0.5;
  uint64_t seed = 1;
  bool oracle = false;  // also the best placement found fitted on the held-out steps themselves
  std::string out;
  std::string format = "text";
};

nlohmann::json ScoreJson(const PlacementScore& s) {
  return {{"balancedness", s.balancedness},      {"max_picks_per_rank", s.max_picks},
          {"mean_picks_per_rank", s.mean_picks}, {"byte_balancedness", s.byte_balancedness},
          {"max_bytes_per_rank", s.max_bytes},   {"mean_bytes_per_rank", s.mean_bytes},
          {"step_seconds", s.step_seconds},      {"mean_rank_step_seconds", s.mean_rank_seconds}};
}

// The report's fields that say what was placed, on how many steps, over which ranks (both inputs).
nlohmann::json ReportShape(const BalanceOptions& o, int groups, int layers, int experts, int64_t steps,
                           int64_t train_steps) {
  return {{"layers", layers},
          {"experts", experts},
          {"steps", steps},
          {"train_steps", train_steps},
          {"held_out_steps", steps - train_steps},
          {"ranks", o.ranks},
          {"nodes", o.nodes},
          {"groups", groups},
          {"redundant", o.redundant},
          {"slots", experts + o.redundant},
          {"current", o.current.empty() ? "trivial" : o.current}};
}

// The policies' options from the flags, with the placements they start from: the trivial one and
// --current (checked against the shape), which options.current points to.
struct PolicySetup {
  PolicyOptions options;
  Placement trivial;
  std::optional<Placement> current;

  static Result<std::unique_ptr<PolicySetup>> Make(const BalanceOptions& o, int groups, const CostModel& cost,
                                                   int num_layers, int num_experts) {
    PolicyOptions options;
    options.shape = {o.ranks, o.nodes, groups, o.redundant};
    options.cost = cost;
    options.min_move_factor = o.min_move_factor;
    options.search_rounds = o.search_rounds;
    options.validation_fraction = o.validation;
    options.uniform_prior = o.uniform_prior;
    EPMOE_RETURN_IF_ERROR(ValidateBalanceShape(options.shape, num_experts));
    EPMOE_ASSIGN_OR_RETURN(Placement trivial,
                           Placement::Trivial(num_layers, num_experts, o.redundant, o.ranks, o.nodes));
    // Held by pointer so that options.current stays valid.
    std::unique_ptr<PolicySetup> setup(new PolicySetup{options, std::move(trivial), std::nullopt});
    if (!o.current.empty()) {
      EPMOE_ASSIGN_OR_RETURN(setup->current, ReadPlacementFile(o.current));
      EPMOE_RETURN_IF_ERROR(CheckCurrentPlacement(*setup->current, num_layers, num_experts, options.shape)
                                .WithContext(fmt::format("--current {}", o.current)));
    }
    setup->options.current = setup->current ? &*setup->current : &setup->trivial;
    return setup;
  }
};

Status RunBalanceOnLoadMatrix(const BalanceOptions& o, const std::vector<Policy>& policies,
                              std::optional<Policy> chosen, const CostModel& cost, int groups, nlohmann::json* report);

// The held-out balancedness no policy fitted on the earlier steps can be expected to pass: the best
// of the table's placements and of the policies fitted on the held-out steps themselves (per-step
// and cost on the picks as counted, without the prior against fitting noise, since here the noise
// is what they are scored on).
Result<nlohmann::json> OracleRow(const ExpertLoad& held_out, PolicyOptions options,
                                 const std::vector<Placement>& fitted, const CostModel& cost) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<Placement> candidates = fitted;
  options.uniform_prior = 0;
  for (Policy policy :
       {Policy::kUniform, Policy::kDeepseek, Policy::kDeepseekGuarded, Policy::kPerStep, Policy::kCost}) {
    options.policy = policy;
    EPMOE_ASSIGN_OR_RETURN(Placement placement, ComputePlacement(held_out, options));
    candidates.push_back(std::move(placement));
  }
  std::optional<PlacementScore> best;
  for (const Placement& candidate : candidates) {
    const PlacementScore score = ScorePlacement(candidate, held_out, cost);
    if (!best || score.balancedness > best->balancedness) best = score;
  }
  return nlohmann::json{
      {"policy", "oracle"},
      {"held_out", ScoreJson(*best)},
      {"solve_seconds", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()}};
}

Status RunBalance(const BalanceOptions& o, nlohmann::json* report) {
  if (o.trace.empty() == o.load.empty()) return InvalidArgument("give one of --trace and --load");
  if (!o.out_sglang.empty() && (o.load.empty() || o.policy == "all"))
    return InvalidArgument("--out-sglang writes one placement of a --load matrix: give --load and one --policy");
  if (!(o.train > 0 && o.train <= 1)) return InvalidArgument(fmt::format("--train {} must be in (0, 1]", o.train));
  std::optional<Policy> chosen;
  if (o.policy != "all") {
    EPMOE_ASSIGN_OR_RETURN(chosen, ParsePolicy(o.policy));
  }
  if (!o.out.empty() && !chosen) return InvalidArgument("--out writes one placement: choose one --policy");
  if (o.oracle && (!o.load.empty() || !(o.train < 1)))
    return InvalidArgument("--oracle scores fits on the held-out steps: give --trace and --train below 1");
  // Every table has uniform replication and DeepSeek's placement (besides the trivial one), so
  // the margin of a policy over them is visible.
  std::vector<Policy> policies;
  for (Policy policy : AllPolicies())
    if (!chosen || policy == *chosen || policy == Policy::kUniform || policy == Policy::kDeepseek)
      policies.push_back(policy);

  // Expert size and groups from the model preset, when given.
  CostModel cost;
  int groups = o.groups;
  std::string expert_source = "a 1024 x 1024 expert (no --model)";
  int64_t hidden = 1024, intermediate = 1024;
  EPMOE_ASSIGN_OR_RETURN(WeightFormat format, ParseWeightFormat(o.weight_format));
  int64_t expert_bytes = ExpertByteCount(format, hidden, intermediate);
  if (!o.model.empty()) {
    EPMOE_ASSIGN_OR_RETURN(ModelConfig model, LoadModel(o.model));
    hidden = model.hidden;
    intermediate = model.expert_intermediate;
    expert_bytes = RoutedExpertBytes(model, format);
    if (groups == 0) groups = model.num_expert_groups;
    expert_source = model.name;
  }
  if (groups == 0) groups = 1;
  cost.bytes_per_expert = static_cast<double>(expert_bytes);
  cost.flops_per_row = 6.0 * hidden * intermediate;
  cost.memory_bandwidth = o.bandwidth_gbs * 1e9;
  cost.peak_flops = o.peak_gflops * 1e9;
  cost.fixed_seconds = o.fixed_us * 1e-6;
  const nlohmann::json cost_model = {{"expert", expert_source},
                                     {"weight_format", WeightFormatName(format)},
                                     {"bytes_per_expert", cost.bytes_per_expert},
                                     {"flops_per_row", cost.flops_per_row},
                                     {"memory_bandwidth", cost.memory_bandwidth},
                                     {"peak_flops", cost.peak_flops},
                                     {"fixed_seconds", cost.fixed_seconds}};
  if (!o.load.empty()) {
    EPMOE_RETURN_IF_ERROR(RunBalanceOnLoadMatrix(o, policies, chosen, cost, groups, report));
    (*report)["cost_model"] = cost_model;
    return Status::Ok();
  }

  LoadReadOptions read;
  read.format = o.trace_format;
  read.phase = o.phase;
  read.batch = o.batch;
  read.filter = o.filter;
  EPMOE_ASSIGN_OR_RETURN(ExpertLoad load, ReadExpertLoad(o.trace, read));
  EPMOE_RETURN_IF_ERROR(ValidateExpertLoad(load, o.trace));
  if (load.num_steps < 1) return InvalidArgument(fmt::format("{}: the trace holds no steps", o.trace));
  const bool score = o.train < 1;
  const int64_t train_steps =
      score ? std::max<int64_t>(1, static_cast<int64_t>(std::floor(o.train * load.num_steps))) : load.num_steps;
  if (score && train_steps >= load.num_steps)
    return InvalidArgument(fmt::format("{}: {} steps; --train {} leaves none to score (use --train 1 to fit only)",
                                       o.trace, load.num_steps, o.train));
  if (!o.model.empty()) {
    EPMOE_ASSIGN_OR_RETURN(ModelConfig model, LoadModel(o.model));
    if (model.num_experts != load.num_experts)
      return InvalidArgument(
          fmt::format("--model {} has {} experts, the trace {}", model.name, model.num_experts, load.num_experts));
  }
  const ExpertLoad train = SliceSteps(load, 0, train_steps);
  const ExpertLoad test = score ? SliceSteps(load, train_steps, load.num_steps) : ExpertLoad();

  EPMOE_ASSIGN_OR_RETURN(const std::unique_ptr<PolicySetup> setup,
                         PolicySetup::Make(o, groups, cost, load.num_layers, load.num_experts));
  PolicyOptions options = setup->options;
  const Placement& trivial = setup->trivial;
  const Placement& current_placement = *options.current;

  nlohmann::json results = nlohmann::json::array();
  std::vector<Placement> fitted = {trivial};  // every placement of the table, for the oracle
  auto add = [&](const std::string& name, const Placement* placement, double solve_seconds,
                 const std::optional<PlacementScore>& forced) -> nlohmann::json& {
    nlohmann::json r = {{"policy", name}};
    if (solve_seconds >= 0) r["solve_seconds"] = solve_seconds;
    if (placement != nullptr) r["moved_copies"] = placement->MovedCopies(current_placement);
    if (forced) {
      r["held_out"] = ScoreJson(*forced);
    } else if (score && placement != nullptr) {
      r["held_out"] = ScoreJson(ScorePlacement(*placement, test, cost));
    }
    if (placement != nullptr) r["train"] = ScoreJson(ScorePlacement(*placement, train, cost));
    results.push_back(r);
    return results.back();
  };
  add("trivial", &trivial, -1, std::nullopt);
  if (score) add("even-router", nullptr, -1, ScoreEvenRouter(trivial, test, cost, o.seed));
  for (Policy policy : policies) {
    options.policy = policy;
    const auto start = std::chrono::steady_clock::now();
    // auto also reports what it saw of each candidate (fitted and validated inside the fit steps).
    std::optional<ValidatedChoice> choice;
    Result<Placement> placement = InvalidArgument("not computed");
    if (policy == Policy::kAuto) {
      auto chose = ChooseByValidation(ToLoadMatrix(train), options);
      if (chose.ok()) {
        choice.emplace(std::move(chose).value());
        placement = choice->placement;
      } else {
        placement = chose.status();
      }
    } else {
      placement = ComputePlacement(train, options);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!placement.ok()) return placement.status().WithContext(fmt::format("policy {}", PolicyName(policy)));
    nlohmann::json& row = add(PolicyName(policy), &*placement, seconds, std::nullopt);
    fitted.push_back(*placement);
    if (choice) {
      nlohmann::json candidates = nlohmann::json::array();
      for (const ValidatedCandidate& c : choice->candidates) {
        nlohmann::json entry = {{"name", c.name}, {"fitted", c.fitted}, {"chosen", c.chosen}};
        if (!std::isnan(c.validated)) entry["validated"] = c.validated;
        candidates.push_back(entry);
      }
      row["validation"] = {
          {"fit_steps", choice->fit_steps}, {"validation_steps", choice->validation_steps}, {"candidates", candidates}};
    }
    if (!o.out.empty() && policy == *chosen) EPMOE_RETURN_IF_ERROR(WritePlacementFile(*placement, o.out));
  }
  if (o.oracle) {
    EPMOE_ASSIGN_OR_RETURN(nlohmann::json oracle, OracleRow(test, options, fitted, cost));
    results.push_back(std::move(oracle));
  }
  *report = ReportShape(o, groups, load.num_layers, load.num_experts, load.num_steps, train_steps);
  report->update({{"trace", o.trace}, {"top_k", load.top_k}, {"cost_model", cost_model}, {"results", results}});
  if (!o.out.empty()) (*report)["out"] = o.out;
  return Status::Ok();
}

// `--load`: fits on every step of a load matrix and scores there (its values stand for picks). The
// report has the trace report's fields, so one printer serves both.
Status RunBalanceOnLoadMatrix(const BalanceOptions& o, const std::vector<Policy>& policies,
                              std::optional<Policy> chosen, const CostModel& cost, int groups, nlohmann::json* report) {
  EPMOE_ASSIGN_OR_RETURN(LoadMatrix load, ReadLoadMatrix(o.load));
  if (load.num_steps < 1) return InvalidArgument(fmt::format("{}: the load matrix holds no steps", o.load));
  if (!o.model.empty()) {
    EPMOE_ASSIGN_OR_RETURN(ModelConfig model, LoadModel(o.model));
    if (model.num_experts != load.num_experts)
      return InvalidArgument(fmt::format("--model {} has {} experts, the load matrix {}", model.name, model.num_experts,
                                         load.num_experts));
  }
  EPMOE_ASSIGN_OR_RETURN(const std::unique_ptr<PolicySetup> setup,
                         PolicySetup::Make(o, groups, cost, load.num_layers, load.num_experts));
  PolicyOptions options = setup->options;
  const Placement& trivial = setup->trivial;
  nlohmann::json results = nlohmann::json::array();
  auto add = [&](const std::string& name, const Placement& placement, double solve_seconds) {
    nlohmann::json r = {{"policy", name},
                        {"moved_copies", placement.MovedCopies(*options.current)},
                        {"train", ScoreJson(ScorePlacement(placement, load, cost))}};
    if (solve_seconds >= 0) r["solve_seconds"] = solve_seconds;
    results.push_back(r);
  };
  add("trivial", trivial, -1);
  for (Policy policy : policies) {
    options.policy = policy;
    const auto start = std::chrono::steady_clock::now();
    auto placement = ComputePlacement(load, options);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!placement.ok()) return placement.status().WithContext(fmt::format("policy {}", PolicyName(policy)));
    add(PolicyName(policy), *placement, seconds);
    if (policy != chosen) continue;  // the table's other lines are written nowhere
    if (!o.out.empty()) EPMOE_RETURN_IF_ERROR(WritePlacementFile(*placement, o.out));
    if (!o.out_sglang.empty()) {
      // Layer l of the matrix is hidden layer l, as in SGLang's own recorder dumps.
      EPMOE_ASSIGN_OR_RETURN(std::string sglang, PlacementToSglangJson(*placement, {}, 0));
      EPMOE_RETURN_IF_ERROR(WriteFileAtomically(o.out_sglang, sglang + "\n"));
    }
  }
  *report = ReportShape(o, groups, load.num_layers, load.num_experts, load.num_steps, load.num_steps);
  report->update({{"trace", o.load}, {"input", "load matrix"}, {"top_k", 0}, {"results", results}});
  if (!o.out.empty()) (*report)["out"] = o.out;
  return Status::Ok();
}

void PrintText(const nlohmann::json& r) {
  const bool scored = r["held_out_steps"].get<int64_t>() > 0;
  std::printf("%s: %d layers, %d experts, top-%d, %lld steps (fit on %lld, %s)\n",
              r["trace"].get<std::string>().c_str(), r["layers"].get<int>(), r["experts"].get<int>(),
              r["top_k"].get<int>(), static_cast<long long>(r["steps"].get<int64_t>()),
              static_cast<long long>(r["train_steps"].get<int64_t>()),
              scored ? fmt::format("scored on the other {}", r["held_out_steps"].get<int64_t>()).c_str()
                     : "no held-out steps: figures are on the fitted steps");
  const auto& c = r["cost_model"];
  std::printf(
      "shape: %d ranks, %d nodes, %d groups, %d redundant (%d slots); cost model: %s, %s, %s per expert, "
      "%.0f GB/s, %.0f GFLOP/s, %.1f us fixed\n",
      r["ranks"].get<int>(), r["nodes"].get<int>(), r["groups"].get<int>(), r["redundant"].get<int>(),
      r["slots"].get<int>(), c["expert"].get<std::string>().c_str(), c["weight_format"].get<std::string>().c_str(),
      HumanBytes(static_cast<int64_t>(c["bytes_per_expert"].get<double>())).c_str(),
      c["memory_bandwidth"].get<double>() / 1e9, c["peak_flops"].get<double>() / 1e9,
      c["fixed_seconds"].get<double>() * 1e6);
  std::printf("%-17s %8s %8s %9s %9s %8s %11s %11s %7s %10s %9s\n", "policy", "balanced", "fit bal", "max pick",
              "mean pick", "byte bal", "max bytes", "mean bytes", "moved", "step us", "solve ms");
  for (const auto& p : r["results"]) {
    const auto& s = scored ? p["held_out"] : p["train"];
    std::printf(
        "%-17s %8.4f %8s %9.1f %9.1f %8.4f %11s %11s %7s %10.1f %9s\n", p["policy"].get<std::string>().c_str(),
        s["balancedness"].get<double>(),
        p.contains("train") ? fmt::format("{:.4f}", p["train"]["balancedness"].get<double>()).c_str() : "-",
        s["max_picks_per_rank"].get<double>(), s["mean_picks_per_rank"].get<double>(),
        s["byte_balancedness"].get<double>(),
        HumanBytes(static_cast<int64_t>(s["max_bytes_per_rank"].get<double>())).c_str(),
        HumanBytes(static_cast<int64_t>(s["mean_bytes_per_rank"].get<double>())).c_str(),
        p.contains("moved_copies") ? std::to_string(p["moved_copies"].get<int64_t>()).c_str() : "-",
        s["step_seconds"].get<double>() * 1e6,
        p.contains("solve_seconds") ? fmt::format("{:.2f}", p["solve_seconds"].get<double>() * 1e3).c_str() : "-");
  }
  for (const auto& p : r["results"]) {
    if (!p.contains("validation")) continue;
    const auto& v = p["validation"];
    std::printf(
        "%s: fitted on the first %lld of those steps, validated on the other %lld; per candidate: fitted / "
        "validated balancedness\n",
        p["policy"].get<std::string>().c_str(), static_cast<long long>(v["fit_steps"].get<int64_t>()),
        static_cast<long long>(v["validation_steps"].get<int64_t>()));
    for (const auto& c : v["candidates"])
      std::printf("  %-17s %8.4f %8s%s\n", c["name"].get<std::string>().c_str(), c["fitted"].get<double>(),
                  c.contains("validated") ? fmt::format("{:.4f}", c["validated"].get<double>()).c_str() : "-",
                  c["chosen"].get<bool>() ? "  chosen" : "");
  }
  if (r.contains("out")) std::printf("placement written to %s\n", r["out"].get<std::string>().c_str());
}

}  // namespace

void AddBalanceCommand(CLI::App& app, int* exit_code) {
  auto o = std::make_shared<BalanceOptions>();
  auto* cmd = app.add_subcommand(
      "balance", "Fit expert placements (EPLB policies) on the first part of a trace and score them on the rest");
  auto* trace = cmd->add_option("--trace", o->trace, "Routing trace: file or folder (see `epmoe trace`)");
  cmd->add_option("--load", o->load,
                  "Load matrix instead of a trace: .npy, JSON [[..]] or {\"weight\": [[..]]}, or CSV; "
                  "[step][layer][expert] or [layer][expert], any non-negative numbers; fits on all of it")
      ->excludes(trace);
  cmd->add_option("--trace-format", o->trace_format, "Trace format (auto detects)")->capture_default_str();
  cmd->add_option("--phase", o->phase, "Steps of per-token traces: decode (batches of rows) or prefill (chunks)")
      ->check(CLI::IsMember({"auto", "decode", "prefill"}))
      ->capture_default_str();
  cmd->add_option("--batch", o->batch, "Rows per decode step or tokens per prefill chunk (0: the trace's own)")
      ->check(kNonNegative);
  cmd->add_option("--filter", o->filter, "Series of a count file, e.g. model=olmoe,selection=topk");
  cmd->add_option("--ranks,-g", o->ranks, "Ranks in the EP group (G)")->required()->check(kPositive);
  cmd->add_option("--nodes", o->nodes, "Nodes (G/N ranks each)")->check(kPositive)->capture_default_str();
  cmd->add_option("--groups", o->groups, "Expert groups (0: the model preset's, else 1)")->check(kNonNegative);
  cmd->add_option("--redundant,-r", o->redundant, "Redundant copies per layer (R; P = E + R slots)")
      ->required()
      ->check(kNonNegative);
  std::vector<std::string> policy_names = {"all"};
  for (Policy p : AllPolicies()) policy_names.push_back(PolicyName(p));
  cmd->add_option("--policy", o->policy,
                  "deepseek, deepseek-guarded, per-step, cost, min-move, uniform, auto or all (trivial, uniform "
                  "and deepseek are always scored)")
      ->check(CLI::IsMember(policy_names))
      ->capture_default_str();
  cmd->add_option("--train", o->train, "Fraction of steps to fit on (the rest is scored; 1: fit on all, no scoring)")
      ->capture_default_str();
  cmd->add_option("--model", o->model, "Model preset or .json: expert size for bytes and time, expert groups");
  cmd->add_option("--weight-format", o->weight_format, "Expert weight format for bytes read")
      ->check(CLI::IsMember({"fp32", "bf16", "int8", "nvfp4", "mxfp4"}))
      ->capture_default_str();
  cmd->add_option("--bandwidth-gbs", o->bandwidth_gbs, "Cost model: weight read bandwidth per rank, GB/s")
      ->check(kPositive)
      ->capture_default_str();
  cmd->add_option("--peak-gflops", o->peak_gflops, "Cost model: peak per rank, GFLOP/s")
      ->check(kPositive)
      ->capture_default_str();
  cmd->add_option("--fixed-us", o->fixed_us, "Cost model: fixed time per rank and layer, microseconds")
      ->check(kNonNegative)
      ->capture_default_str();
  cmd->add_option("--current", o->current,
                  "Placement JSON in use (min-move starts from it; moved copies count "
                  "against it); default: the trivial placement");
  cmd->add_option("--min-move-factor", o->min_move_factor,
                  "min-move: allowed max load relative to deepseek-guarded's (>= 1)")
      ->capture_default_str();
  cmd->add_option("--search-rounds", o->search_rounds, "per-step and cost: improving swaps per layer (bound)")
      ->check(kNonNegative)
      ->capture_default_str();
  cmd->add_option("--uniform-prior", o->uniform_prior,
                  "per-step and cost: how far each step's picks are shrunk toward an even split over the experts "
                  "[0, 1]")
      ->capture_default_str();
  cmd->add_option("--validation", o->validation,
                  "auto and min-move: fraction of the fitted steps, the latest, that validates a fit (0, 1)")
      ->capture_default_str();
  cmd->add_option("--seed", o->seed, "Seed of the even router")->check(kNonNegative)->capture_default_str();
  cmd->add_flag("--oracle", o->oracle,
                "Add an oracle line: the best held-out balancedness of the placements found, policies also fitted "
                "on the held-out steps themselves (a ceiling for any fit on the earlier steps)");
  cmd->add_option("--out", o->out, "Write the placement (one --policy) as JSON");
  cmd->get_option("--load")->excludes("--train");  // a load matrix is fitted whole
  cmd->add_option("--out-sglang", o->out_sglang,
                  "With --load (e.g. an SGLang recorder dump's JSON): write the placement as SGLang's "
                  "--init-expert-location file (physical_to_logical_map, layer l = hidden layer l)");
  AddFormatOption(cmd, &o->format, {"text", "json"});
  SetReportCallback(
      cmd, exit_code, &o->format, [o](nlohmann::json* report) { return RunBalance(*o, report); }, PrintText);
}

}  // namespace epmoe::cli
