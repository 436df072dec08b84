// The CLI fuzzer: every subcommand of the epmoe program run with generated flag values (huge,
// negative, inf, nan, garbage, directories, missing files, /dev/zero, /dev/full, an output equal to
// its input). A case fails on a signal, a hang (past the per-case limit), an exit code other than
// 0, 1 or 2, a temporary file left behind, an output left changed after a failure or incomplete
// after a success. Deterministic: the cases come from a fixed seed (EPMOE_CLI_FUZZ_SEED), and each
// is printed before it runs. Bounded: it stops starting cases after EPMOE_CLI_FUZZ_SECONDS (60).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "run_command.h"

namespace {

namespace fs = std::filesystem;
using Args = std::vector<std::string>;

// What a value of a flag is drawn from.
enum class Kind {
  kNumber,  // any number or garbage, huge ones included
  kWork,    // a count whose huge values only mean a long run (steps, layers, rows): no huge values
  kInput,   // a path read: the flag's valid file, or a hostile one
  kOutput,  // a path written
  kWord,    // one of the flag's words, or a wrong one
};

struct Flag {
  std::string name;  // "" for a positional argument
  Kind kind;
  std::vector<std::string> valid;  // kInput: the valid file; kWord: the words
};

struct Command {
  std::string name;  // groups the summary
  Args base;         // a valid, cheap invocation (after the program name)
  std::vector<Flag> flags;
};

struct Outcome {
  int exit_code = -1;  // -1 when signaled or hung
  int signal = 0;
  bool hung = false;
  std::string output;  // stdout and stderr, for the failure message
};

constexpr int kCaseSeconds = 30;

// Runs the program with `args` (no shell) under a memory limit, its output to `log`; kills its
// process group after kCaseSeconds.
Outcome RunCase(const Args& args, const fs::path& log, const fs::path& cwd) {
  std::vector<char*> argv;
  const std::string binary = epmoe::testing::EpmoeBinary();
  argv.push_back(const_cast<char*>(binary.c_str()));
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    // A case that allocates without bound fails here (bad_alloc, a signal) instead of taking the
    // machine's memory.
    const rlimit memory{size_t{8} << 30, size_t{8} << 30};
    setrlimit(RLIMIT_AS, &memory);
    const int out = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int in = open("/dev/null", O_RDONLY);
    dup2(in, 0);
    dup2(out, 1);
    dup2(out, 2);
    if (chdir(cwd.c_str()) != 0) _exit(126);
    execv(binary.c_str(), argv.data());
    _exit(127);
  }
  Outcome outcome;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kCaseSeconds);
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      outcome.hung = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (!outcome.hung) {
    if (WIFEXITED(status)) outcome.exit_code = WEXITSTATUS(status);
    if (WIFSIGNALED(status)) outcome.signal = WTERMSIG(status);
  }
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  outcome.output = text.str();
  return outcome;
}

std::string ReadBytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The fixed inputs every case may use, made once by the program itself.
struct Fixtures {
  fs::path root;
  std::string model, trace, placement, report, eplb_report, hardware = "h100x8", garbage, empty;
};

Fixtures MakeFixtures(const fs::path& root) {
  Fixtures f;
  f.root = root;
  fs::create_directories(root / "dir");
  f.model = (root / "tiny.json").string();
  std::ofstream(f.model) << R"({"name": "tiny", "hidden": 64, "num_experts": 8, "expert_intermediate": 32,
    "top_k": 2, "num_shared_experts": 0, "shared_intermediate": 0, "num_layers": 3, "num_dense_layers": 1,
    "dense_intermediate": 64, "scoring": "softmax", "correction_bias": false, "num_expert_groups": 1,
    "topk_groups": 1, "renormalize": true, "routed_scaling": 1.0})";
  f.garbage = (root / "garbage.json").string();
  std::ofstream(f.garbage) << "{\"a\": [1, 2, {\"b\": \x01\xff}}}\n" << std::string(100, '[');
  f.empty = (root / "empty.json").string();
  std::ofstream{f.empty};
  f.trace = (root / "trace.bin").string();
  f.placement = (root / "placement.json").string();
  f.report = (root / "report.json").string();
  f.eplb_report = (root / "eplb_report.json").string();
  const std::string epmoe = epmoe::testing::EpmoeBinary();
  for (const std::string& setup :
       {epmoe + " trace gen " + f.trace + " --layers 2 --experts 8 --top-k 2 --steps 6 --batch 8",
        epmoe + " balance --trace " + f.trace + " --ranks 2 --redundant 0 --train 1 --policy deepseek --out " +
            f.placement,
        epmoe + " run --model " + f.model + " --tokens 8 --steps 2 --layers 2 --no-progress --format json > " +
            f.report,
        epmoe + " run --model " + f.model +
            " --tokens 8 --steps 4 --layers 2 --no-progress --eplb --eplb-interval 2 "
            "--format json > " +
            f.eplb_report}) {
    const auto result = epmoe::testing::RunCommand(setup);
    if (result.exit_code != 0) ADD_FAILURE() << setup << ": " << result.out;
  }
  return f;
}

std::vector<Command> Commands(const Fixtures& f) {
  const Flag model{"--model", Kind::kInput, {f.model}};
  const Flag threads{"--threads", Kind::kNumber, {}};
  const Flag seed{"--seed", Kind::kNumber, {}};
  const Flag hidden{"--hidden", Kind::kNumber, {}}, intermediate{"--intermediate", Kind::kNumber, {}};
  const Flag weight_format{"--weight-format", Kind::kWord, {"fp32", "bf16", "int8", "nvfp4", "mxfp4"}};
  const Flag trace{"--trace", Kind::kInput, {f.trace}};
  return {
      {"model show", {"model", "show", f.model}, {{"", Kind::kInput, {f.model}}}},
      {"layer",
       {"layer", "--model", f.model, "--tokens", "8", "--layers", "1", "--steps", "1"},
       {model,
        {"--tokens", Kind::kNumber, {}},
        {"--layers", Kind::kWork, {}},
        {"--steps", Kind::kWork, {}},
        seed,
        threads,
        hidden,
        intermediate,
        weight_format,
        {"--max-memory-gb", Kind::kNumber, {}},
        {"--routing", Kind::kWord, {"scores", "round_robin", "uniform", "replay"}},
        trace}},
      {"run",
       {"run", "--model", f.model, "--tokens", "8", "--layers", "1", "--steps", "1", "--no-progress", "--comm-timeout",
        "20"},
       {model,
        {"--tokens", Kind::kNumber, {}},
        {"--steps", Kind::kWork, {}},
        {"--layers", Kind::kWork, {}},
        {"--option", Kind::kWord, {"sliced", "whole", "hybrid", "a2a", "dwdp", "all"}},
        {"--a2a-mode", Kind::kWord, {"normal", "low-latency", "auto"}},
        {"--a2a-levels", Kind::kWord, {"auto", "flat", "two-level"}},
        {"--max-buffer-mb", Kind::kNumber, {}},
        {"--comm-timeout", Kind::kNumber, {}},
        threads,
        seed,
        hidden,
        intermediate,
        trace,
        {"--eplb-redundant", Kind::kNumber, {}},
        {"--eplb-interval", Kind::kWork, {}},
        {"--eplb-policy", Kind::kWord, {"deepseek", "deepseek-guarded", "per-step", "cost", "min-move"}},
        {"--metrics-file", Kind::kOutput, {".prom"}},
        {"--format", Kind::kWord, {"text", "json"}}}},
      {"trace gen",
       {"trace", "gen", (f.root / "gen.bin").string(), "--layers", "2", "--experts", "8", "--top-k", "2", "--steps",
        "3", "--batch", "4"},
       {{"", Kind::kOutput, {".bin"}},
        {"--layers", Kind::kNumber, {}},
        {"--experts", Kind::kNumber, {}},
        {"--top-k", Kind::kNumber, {}},
        {"--steps", Kind::kWork, {}},
        {"--batch", Kind::kWork, {}},
        seed,
        {"--dist", Kind::kWord, {"uniform", "zipf", "gaussian"}},
        {"--zipf-s", Kind::kNumber, {}},
        {"--temperature", Kind::kNumber, {}},
        {"--correlation", Kind::kNumber, {}},
        model}},
      {"trace convert",
       {"trace", "convert", f.trace, (f.root / "converted.bin").string()},
       {{"", Kind::kInput, {f.trace}},
        {"", Kind::kOutput, {".bin", ".jsonl", ".csv", ".json"}},
        {"--to", Kind::kWord, {"auto", "epmoe", "jsonl", "topk-csv", "counts-csv", "sglang-json"}},
        {"--batch", Kind::kWork, {}},
        {"--experts", Kind::kNumber, {}}}},
      {"trace stats",
       {"trace", "stats", f.trace},
       {{"", Kind::kInput, {f.trace}}, {"--ranks", Kind::kNumber, {}}, {"--hottest", Kind::kNumber, {}}}},
      {"trace show",
       {"trace", "show", f.trace},
       {{"", Kind::kInput, {f.trace}},
        {"--step", Kind::kNumber, {}},
        {"--layer", Kind::kNumber, {}},
        {"--rows", Kind::kWork, {}}}},
      {"balance",
       {"balance", "--trace", f.trace, "--ranks", "2", "--redundant", "0", "--policy", "deepseek"},
       {trace,
        {"--ranks", Kind::kNumber, {}},
        {"--nodes", Kind::kNumber, {}},
        {"--groups", Kind::kNumber, {}},
        {"--redundant", Kind::kNumber, {}},
        {"--policy", Kind::kWord, {"deepseek", "deepseek-guarded", "per-step", "cost", "min-move"}},
        {"--train", Kind::kNumber, {}},
        {"--current", Kind::kInput, {f.placement}},
        {"--out", Kind::kOutput, {".json"}},
        {"--min-move-factor", Kind::kNumber, {}},
        {"--bandwidth-gbs", Kind::kNumber, {}},
        seed,
        model}},
      {"plan",
       {"plan", "--model", f.model, "--hardware", f.hardware, "--gpus", "2", "--batch", "8", "--samples", "2"},
       {model,
        hidden,
        intermediate,
        {"--hardware", Kind::kInput, {f.hardware}},
        trace,
        {"--gpus", Kind::kWork, {}},
        {"--batch", Kind::kWork, {}},
        {"--redundant", Kind::kNumber, {}},
        {"--placement", Kind::kInput, {f.placement}},
        {"--measured", Kind::kInput, {f.report}},
        {"--plot", Kind::kOutput, {".svg"}},
        {"--a2a-mode", Kind::kWord, {"normal", "low-latency", "auto"}},
        {"--a2a-levels", Kind::kWord, {"auto", "flat", "two-level"}},
        {"--a2a-combine", Kind::kWord, {"partial-sums", "per-pick"}},
        seed}},
      {"hardware show", {"hardware", "show", f.hardware}, {{"", Kind::kInput, {f.hardware}}}},
      {"plot-balance",
       {"plot-balance", (f.root / "plot.svg").string(), "--run", "a=" + f.eplb_report},
       {{"", Kind::kOutput, {".svg"}},
        {"--run", Kind::kInput, {f.eplb_report}},
        {"--smooth", Kind::kNumber, {}},
        {"--y-min", Kind::kNumber, {}}}},
      {"checkpoint write",
       {"checkpoint", "write", "--model", f.model, "--layers", "1", "--out", (f.root / "ckpt").string()},
       {model,
        hidden,
        intermediate,
        {"--layers", Kind::kWork, {}},
        seed,
        {"--dtype", Kind::kWord, {"f32", "bf16"}},
        {"--out", Kind::kOutput, {""}},
        threads}},
      {"checkpoint show", {"checkpoint", "show", f.model}, {{"", Kind::kInput, {f.model}}}},
  };
}

const std::vector<std::string> kNumbers = {
    "-1",   "0",   "1",   "3", "2147483647", "2147483648", "-2147483649", "9223372036854775807", "1e10", "1e300", "inf",
    "-inf", "nan", "abc", "",  "0.5",        "-0",         "1e-300"};
const std::vector<std::string> kWorkCounts = {"-1", "0", "1", "2", "nan", "inf", "-inf", "abc", "", "0.5"};

// One generated invocation and what its outputs must look like afterwards.
struct Case {
  std::string command;
  Args args;
  std::vector<fs::path> outputs;           // written paths to check
  std::map<fs::path, std::string> before;  // their content before the run (absent: did not exist)
  std::string same_as_input;               // an output drawn to be the input: the input is set to it too
};

// A hostile or valid value of `flag`, prepared inside `dir` (the case's own folder).
std::string Draw(const Flag& flag, const Fixtures& f, const fs::path& dir, const std::string& last_input,
                 std::mt19937_64& rng, Case* c) {
  auto pick = [&](const std::vector<std::string>& values) { return values[rng() % values.size()]; };
  switch (flag.kind) {
    case Kind::kNumber: return pick(kNumbers);
    case Kind::kWork: return pick(kWorkCounts);
    case Kind::kWord: return pick({flag.valid[rng() % flag.valid.size()], "bogus", ""});
    case Kind::kInput:
      return pick({flag.valid[0], flag.valid[0], (f.root / "missing.json").string(), (f.root / "dir").string(),
                   "/dev/zero", "/dev/null", f.empty, f.garbage, f.model, f.trace, f.report});
    case Kind::kOutput: {
      const std::string extension = pick(flag.valid);
      std::string choice = pick({"new", "new", "existing", "/dev/full", "dir", "missing folder", "input"});
      // An output equal to the input is a question for `trace convert` alone; a folder output (a
      // checkpoint's) may be an existing folder.
      if ((choice == "input" && c->command != "trace convert") || (choice == "dir" && extension.empty()))
        choice = "new";
      fs::path path;
      if (choice == "new") {
        path = dir / ("out" + extension);
      } else if (choice == "existing") {
        path = dir / ("existing" + extension);
        if (extension.empty()) {
          fs::create_directories(path);
          std::ofstream(path / "model.safetensors.index.json") << "previous\n";
        } else {
          std::ofstream(path) << "previous content\n";
        }
      } else if (choice == "/dev/full") {
        return "/dev/full";
      } else if (choice == "dir") {
        return (f.root / "dir").string();
      } else if (choice == "missing folder") {
        path = dir / "missing" / ("out" + extension);
      } else {
        // The input itself, copied into the case's folder so the fixture survives.
        path = dir / ("input" + fs::path(last_input).extension().string());
        if (!fs::is_regular_file(last_input)) return (dir / ("out" + extension)).string();
        fs::copy_file(last_input, path, fs::copy_options::overwrite_existing);
        c->same_as_input = path.string();
      }
      c->outputs.push_back(path);
      return path.string();
    }
  }
  return "";
}

// Whether an output written by a successful command is whole: JSON parses, an SVG and a text file
// end where they should, a binary trace reads back.
std::string IncompleteOutput(const fs::path& path) {
  if (fs::is_directory(path)) {
    const fs::path index = path / "model.safetensors.index.json";
    if (!fs::exists(index)) return "";  // a checkpoint of one file has no index
    return nlohmann::json::accept(ReadBytes(index)) ? "" : "index is not JSON";
  }
  const std::string text = ReadBytes(path);
  const std::string extension = path.extension().string();
  if (extension == ".json" && !nlohmann::json::accept(text)) {
    // Or one JSON value per line (SGLang's dump, as `trace convert` writes it).
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);)
      if (!line.empty() && !nlohmann::json::accept(line)) return "not JSON";
    if (text.empty() || text.back() != '\n') return "not JSON";
  }
  if (extension == ".svg" && text.find("</svg>") == std::string::npos) return "no </svg>";
  if ((extension == ".csv" || extension == ".jsonl" || extension == ".prom") && !text.empty() && text.back() != '\n')
    return "does not end with a newline";
  if (extension == ".bin") {
    const auto back = epmoe::testing::Epmoe("trace stats " + path.string());
    if (back.exit_code != 0) return "does not read back: " + back.out;
  }
  return "";
}

TEST(CliFuzz, EveryCommandRefusesHostileFlagsCleanly) {
  const char* seed_text = std::getenv("EPMOE_CLI_FUZZ_SEED");
  const char* seconds_text = std::getenv("EPMOE_CLI_FUZZ_SECONDS");
  const uint64_t seed = seed_text ? std::strtoull(seed_text, nullptr, 10) : 1;
  const double budget = seconds_text ? std::atof(seconds_text) : 60;
  const fs::path root = fs::temp_directory_path() / ("epmoe_cli_fuzz_" + std::to_string(getpid()));
  fs::remove_all(root);
  const Fixtures fixtures = MakeFixtures(root);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const std::vector<Command> commands = Commands(fixtures);
  std::mt19937_64 rng(seed);
  std::map<std::string, std::map<std::string, int>> summary;  // command -> outcome -> cases
  const auto start = std::chrono::steady_clock::now();
  int ran = 0, failures = 0;
  constexpr int kCases = 600;
  for (int i = 0; i < kCases; ++i) {
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > budget) {
      std::printf("cli_fuzz: stopped after %d of %d cases: the %.0f s budget is spent\n", ran, kCases, budget);
      break;
    }
    // Run (the MPI singleton starts in about a second) is drawn less often than the quick commands.
    const Command& command = commands[rng() % commands.size()];
    if (command.name == "run" && rng() % 3 != 0) continue;
    const fs::path dir = root / ("case" + std::to_string(i));
    fs::create_directories(dir);
    Case c{command.name, command.base, {}, {}, ""};
    // For a positional output equal to the input: remember the input given last.
    std::string last_input = command.base.size() > 2 ? command.base[2] : "";
    const int mutations = 1 + static_cast<int>(rng() % 2);
    for (int m = 0; m < mutations; ++m) {
      const Flag& flag = command.flags[rng() % command.flags.size()];
      const std::string value = Draw(flag, fixtures, dir, last_input, rng, &c);
      if (flag.kind == Kind::kInput) last_input = value;
      if (flag.name.empty()) {
        // A positional: replace the base's value in the same place (inputs first, then outputs).
        for (size_t a = 0; a < c.args.size(); ++a) {
          const bool is_input_slot = flag.kind == Kind::kInput && a == 2 && command.base[0] != "plot-balance";
          const bool is_output_slot =
              flag.kind == Kind::kOutput && ((command.base[0] == "trace" && command.base[1] == "convert" && a == 3) ||
                                             (command.base[0] == "trace" && command.base[1] == "gen" && a == 2) ||
                                             (command.base[0] == "plot-balance" && a == 1));
          const bool is_model_show = flag.kind == Kind::kInput && command.base.size() == 3 && a == 2;
          if (is_input_slot || is_output_slot || is_model_show) c.args[a] = value;
        }
      } else {
        c.args.push_back(flag.name);
        c.args.push_back(flag.name == "--run" ? "a=" + value : value);
      }
    }
    if (!c.same_as_input.empty()) c.args[2] = c.same_as_input;
    // The base's own outputs count too.
    for (size_t a = 0; a + 1 < c.args.size(); ++a)
      if (c.args[a] == "--out" || c.args[a] == "--plot" || c.args[a] == "--metrics-file")
        c.outputs.push_back(c.args[a + 1]);
    if (command.base[0] == "trace" && (command.base[1] == "gen" || command.base[1] == "convert"))
      c.outputs.push_back(c.args[command.base[1] == "gen" ? 2 : 3]);
    if (command.base[0] == "plot-balance") c.outputs.push_back(c.args[1]);
    std::vector<fs::path> checked;
    for (const fs::path& out : c.outputs) {
      // A later draw for the same flag or positional may have replaced this one.
      if (std::find(c.args.begin(), c.args.end(), out.string()) == c.args.end()) continue;
      if (out.string().rfind("/dev/", 0) == 0 || out == fixtures.root / "dir") continue;
      checked.push_back(out);
      if (fs::is_regular_file(out)) c.before[out] = ReadBytes(out);
      if (fs::is_directory(out) && fs::exists(out / "model.safetensors.index.json"))
        c.before[out] = ReadBytes(out / "model.safetensors.index.json");
    }
    std::string line = "epmoe";
    for (const std::string& a : c.args) line += " '" + a + "'";
    std::printf("cli_fuzz %d: %s\n", i, line.c_str());
    std::fflush(stdout);
    const Outcome outcome = RunCase(c.args, root / "log.txt", dir);
    ++ran;
    std::string verdict = outcome.hung     ? "hang"
                          : outcome.signal ? "signal"
                                           : "exit " + std::to_string(outcome.exit_code);
    std::string problem;
    if (outcome.hung) problem = "hung past " + std::to_string(kCaseSeconds) + " s";
    if (outcome.signal) problem = "killed by signal " + std::to_string(outcome.signal);
    if (!outcome.hung && !outcome.signal && outcome.exit_code > 2)
      problem = "exit code " + std::to_string(outcome.exit_code);
    for (const auto& entry : fs::recursive_directory_iterator(dir))
      if (entry.path().filename().string().find(".tmp") != std::string::npos)
        problem += " left a temporary " + entry.path().string();
    for (const auto& entry : fs::directory_iterator(fixtures.root / "dir"))
      problem += " wrote into the fixture folder: " + entry.path().string();
    for (const auto& entry : fs::directory_iterator(fixtures.root))
      if (entry.path().filename().string().find(".tmp") != std::string::npos)
        problem += " left a temporary " + entry.path().string();
    for (const fs::path& out : checked) {
      const bool was = c.before.count(out) > 0;
      if (outcome.exit_code != 0) {
        const std::string now = fs::is_directory(out) ? (fs::exists(out / "model.safetensors.index.json")
                                                             ? ReadBytes(out / "model.safetensors.index.json")
                                                             : std::string("<none>"))
                                : fs::exists(out)     ? ReadBytes(out)
                                                      : "<none>";
        if (was ? now != c.before[out] : (fs::is_regular_file(out) && now != "<none>"))
          problem += " failed but changed " + out.string();
      } else if (fs::exists(out)) {
        const std::string incomplete = IncompleteOutput(out);
        if (!incomplete.empty()) problem += " succeeded but " + out.string() + " is incomplete: " + incomplete;
      }
    }
    if (!problem.empty()) {
      verdict = "FAILED";
      ++failures;
      ADD_FAILURE() << line << ": " << problem << "\n" << outcome.output.substr(0, 2000);
    }
    ++summary[command.name][verdict];
    fs::remove_all(dir);
    for (const auto& entry : fs::directory_iterator(fixtures.root / "dir")) fs::remove_all(entry.path());
  }
  std::printf("cli_fuzz: seed %llu, %d cases, %d failed, %.1f s\n", static_cast<unsigned long long>(seed), ran,
              failures, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  for (const auto& [name, outcomes] : summary) {
    std::string counts;
    for (const auto& [verdict, n] : outcomes) counts += " " + verdict + ": " + std::to_string(n) + ",";
    std::printf("cli_fuzz: %-17s%s\n", name.c_str(), counts.substr(0, counts.size() - 1).c_str());
  }
  fs::remove_all(root);
}

}  // namespace
