// The binary trace format and the exports: round trips (import -> binary -> export -> import gives
// the same picks), and truncated or corrupted files of every format refused with an error naming
// the byte offset (binary) or line (text), never a crash.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <sstream>

#include "epmoe/trace.h"
#include "epmoe/trace_gen.h"
#include "trace/binary.h"
#include "trace/imported.h"

namespace epmoe {
namespace {

namespace fs = std::filesystem;
const std::string kTraces = EPMOE_TEST_DATA_DIR;
const std::string kDecode = kTraces + "/flame_moe_290m/decode_32seqs_pos1-10";
const std::string kCounts = kTraces + "/olmoe_paper_expert_counts/expert_counts.csv";

class TraceFormatTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(EPMOE_BINARY_DIR) / "trace_format_test" /
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

struct Trace {
  TraceInfo info;
  std::vector<StepPicks> steps;
};

Result<Trace> ReadAll(const std::string& path, LoadReadOptions options = {}) {
  EPMOE_ASSIGN_OR_RETURN(std::unique_ptr<TraceReader> reader, TraceReader::Open(path, options));
  Trace trace{reader->info(), {}};
  while (true) {
    StepPicks step;
    EPMOE_ASSIGN_OR_RETURN(bool more, reader->Next(&step));
    if (!more) break;
    trace.steps.push_back(std::move(step));
  }
  return trace;
}

void ExpectSamePicks(const Trace& a, const Trace& b, bool weights) {
  ASSERT_EQ(a.steps.size(), b.steps.size());
  EXPECT_EQ(a.info.num_layers, b.info.num_layers);
  EXPECT_EQ(a.info.num_experts, b.info.num_experts);
  EXPECT_EQ(a.info.top_k, b.info.top_k);
  EXPECT_EQ(a.info.layer_ids, b.info.layer_ids);
  for (size_t s = 0; s < a.steps.size(); ++s) {
    EXPECT_EQ(a.steps[s].rows, b.steps[s].rows);
    EXPECT_EQ(a.steps[s].counts, b.steps[s].counts) << "step " << s;
    ASSERT_EQ(a.steps[s].layers.size(), b.steps[s].layers.size());
    for (size_t l = 0; l < a.steps[s].layers.size(); ++l) {
      EXPECT_EQ(a.steps[s].layers[l].experts, b.steps[s].layers[l].experts) << "step " << s << " layer " << l;
      if (weights) {
        EXPECT_EQ(a.steps[s].layers[l].weights, b.steps[s].layers[l].weights);
      }
    }
  }
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}
void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Reads every step; returns the first error (or ok).
Status ReadStatus(const std::string& path, LoadReadOptions options = {}) {
  auto trace = ReadAll(path, options);
  return trace.ok() ? Status::Ok() : trace.status();
}

TEST_F(TraceFormatTest, FlameDecodeRoundTripsThroughEveryPerRowFormat) {
  auto original = ReadAll(kDecode);
  ASSERT_TRUE(original.ok()) << original.status().ToString();
  auto reader = TraceReader::Open(kDecode, {});
  ASSERT_TRUE(reader.ok());
  ASSERT_TRUE(WriteTrace(reader->get(), Path("decode.bin"), "epmoe").ok());
  auto binary = ReadAll(Path("decode.bin"));
  ASSERT_TRUE(binary.ok()) << binary.status().ToString();
  EXPECT_EQ(binary->info.format, "epmoe");
  EXPECT_TRUE(binary->info.has_weights);
  ExpectSamePicks(*original, *binary, /*weights=*/true);
  for (const char* format : {"jsonl", "topk-csv"}) {
    const std::string exported = Path(std::string("decode.") + format);
    auto from_binary = TraceReader::Open(Path("decode.bin"), {});
    ASSERT_TRUE(from_binary.ok());
    ASSERT_TRUE(WriteTrace(from_binary->get(), exported, format).ok()) << format;
    LoadReadOptions options;
    options.num_experts = 64;  // a top-k CSV does not say; the JSONL shape record does
    auto back = ReadAll(exported, options);
    ASSERT_TRUE(back.ok()) << format << ": " << back.status().ToString();
    ExpectSamePicks(*original, *back, /*weights=*/true);
  }
  for (const char* format : {"counts-csv", "sglang-json"}) {
    const std::string exported = Path(std::string("decode-counts.") + format);
    auto from_binary = TraceReader::Open(Path("decode.bin"), {});
    ASSERT_TRUE(from_binary.ok());
    ASSERT_TRUE(WriteTrace(from_binary->get(), exported, format).ok()) << format;
    auto back = ReadAll(exported);
    ASSERT_TRUE(back.ok()) << format << ": " << back.status().ToString();
    ASSERT_EQ(back->steps.size(), original->steps.size());
    EXPECT_EQ(back->info.top_k, 6) << format;
    for (size_t s = 0; s < back->steps.size(); ++s) {
      EXPECT_EQ(back->steps[s].counts, original->steps[s].counts) << format;
      EXPECT_EQ(back->steps[s].rows, 32) << format;
    }
  }
}

TEST_F(TraceFormatTest, CountOnlyBinaryRoundTrip) {
  LoadReadOptions options;
  options.filter = "model=olmoe,selection=topk";
  auto original = ReadAll(kCounts, options);
  ASSERT_TRUE(original.ok()) << original.status().ToString();
  auto reader = TraceReader::Open(kCounts, options);
  ASSERT_TRUE(reader.ok());
  ASSERT_TRUE(WriteTrace(reader->get(), Path("olmoe.bin"), "epmoe").ok());
  auto back = ReadAll(Path("olmoe.bin"));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_FALSE(back->info.has_picks);
  EXPECT_EQ(back->info.layer_ids, (std::vector<int>{0, 7, 15}));
  ExpectSamePicks(*original, *back, false);
  // The tulu series has no top1 series; its rows follow from the k the other olmoe series give.
  EXPECT_EQ(back->info.top_k, 8);
  for (const StepPicks& step : back->steps) EXPECT_GT(step.rows, 200000);
  // Count exports keep counts, rows, k and the original layer ids.
  for (const char* format : {"counts-csv", "sglang-json"}) {
    auto from_binary = TraceReader::Open(Path("olmoe.bin"), {});
    ASSERT_TRUE(from_binary.ok());
    const std::string exported = Path(std::string("olmoe.") + format);
    ASSERT_TRUE(WriteTrace(from_binary->get(), exported, format).ok()) << format;
    auto again = ReadAll(exported);
    ASSERT_TRUE(again.ok()) << format << ": " << again.status().ToString();
    EXPECT_EQ(again->info.top_k, 8) << format;
    ExpectSamePicks(*original, *again, false);
  }
  // A filter only applies to count files with series.
  LoadReadOptions filtered;
  filtered.filter = "model=olmoe";
  EXPECT_FALSE(ReadAll(Path("olmoe.bin"), filtered).ok());
  // Per-row exports of a count-only trace are refused.
  auto again = TraceReader::Open(Path("olmoe.bin"), {});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(WriteTrace(again->get(), Path("olmoe.jsonl"), "jsonl").code(), StatusCode::kFailedPrecondition);
}

TEST_F(TraceFormatTest, BinaryReaderStreamsOneStepAtATime) {
  TraceGenOptions gen;
  gen.num_layers = 2;
  gen.num_experts = 16;
  gen.top_k = 2;
  gen.steps = 5;
  gen.batch = 3;
  ASSERT_TRUE(GenerateTraceFile(gen, Path("gen.bin")).ok());
  auto reader = TraceReader::Open(Path("gen.bin"), {});
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ((*reader)->info().num_steps, 5);
  auto generator = TraceGenerator::Create(gen);
  ASSERT_TRUE(generator.ok());
  StepPicks expected, got;
  int steps = 0;
  while ((*generator)->Next(&expected)) {
    auto more = (*reader)->Next(&got);
    ASSERT_TRUE(more.ok() && *more);
    EXPECT_EQ(got.counts, expected.counts);
    EXPECT_EQ(got.layers[1].experts, expected.layers[1].experts);
    EXPECT_EQ(got.layers[1].weights, expected.layers[1].weights);
    ++steps;
  }
  EXPECT_EQ(steps, 5);
  auto end = (*reader)->Next(&got);
  ASSERT_TRUE(end.ok());
  EXPECT_FALSE(*end);
}

TEST_F(TraceFormatTest, EveryTruncationOfABinaryTraceIsRefusedWithItsOffset) {
  TraceGenOptions gen;
  gen.num_layers = 2;
  gen.num_experts = 8;
  gen.top_k = 2;
  gen.steps = 2;
  gen.batch = 2;
  ASSERT_TRUE(GenerateTraceFile(gen, Path("small.bin")).ok());
  const std::string bytes = ReadBytes(Path("small.bin"));
  ASSERT_TRUE(ReadStatus(Path("small.bin")).ok());
  for (size_t n = 0; n < bytes.size(); ++n) {
    WriteBytes(Path("cut.bin"), bytes.substr(0, n));
    LoadReadOptions options;
    options.format = "epmoe";
    Status status = ReadStatus(Path("cut.bin"), options);
    ASSERT_FALSE(status.ok()) << "prefix of " << n << " bytes read without error";
    if (n >= 8) {
      EXPECT_NE(status.message().find("byte offset"), std::string::npos) << status.message();
    }
  }
  // Bytes after the trailer are refused too.
  WriteBytes(Path("long.bin"), bytes + "x");
  EXPECT_FALSE(ReadStatus(Path("long.bin")).ok());
}

TEST_F(TraceFormatTest, CorruptedBinaryFieldsAreRefusedWithTheirOffset) {
  TraceGenOptions gen;
  gen.num_layers = 2;
  gen.num_experts = 8;
  gen.top_k = 2;
  gen.steps = 2;
  gen.batch = 2;
  ASSERT_TRUE(GenerateTraceFile(gen, Path("small.bin")).ok());
  const std::string bytes = ReadBytes(Path("small.bin"));
  auto patched = [&](size_t offset, const void* value, size_t size) {
    std::string copy = bytes;
    std::memcpy(copy.data() + offset, value, size);
    WriteBytes(Path("bad.bin"), copy);
    LoadReadOptions options;
    options.format = "epmoe";
    return ReadStatus(Path("bad.bin"), options);
  };
  auto expect_offset = [](const Status& status, int64_t offset) {
    ASSERT_FALSE(status.ok());
    EXPECT_NE(status.message().find(fmt::format("byte offset {}:", offset)), std::string::npos) << status.message();
  };
  const uint32_t big = 1u << 30;
  const uint32_t two = 2;
  expect_offset(patched(0, "XPMOETRC", 8), 0);  // magic
  expect_offset(patched(8, &two, 4), 8);        // version
  expect_offset(patched(16, &big, 4), 16);      // layers
  const int64_t steps = 7;
  expect_offset(patched(32, &steps, 8), 40 + 8 + 2 * (4 + 8 + 2 * 2 * 2 * 8) + 4);  // header vs trailer steps
  // First step: marker at 48 (40 header + 2 layer ids), rows at 52, first expert id at 60.
  const int32_t out_of_range = 8;
  expect_offset(patched(60, &out_of_range, 4), 60);
  const int32_t repeated = -1;
  expect_offset(patched(60, &repeated, 4), 60);
  int32_t first_id;
  std::memcpy(&first_id, bytes.data() + 60, 4);
  expect_offset(patched(64, &first_id, 4), 64);  // the row's second pick repeats the first
  const float nan = std::numeric_limits<float>::quiet_NaN();
  expect_offset(patched(60 + 16, &nan, 4), 76);  // first weight of layer 0
  const int64_t many_rows = int64_t{1} << 40;
  expect_offset(patched(52, &many_rows, 8), 52);  // rows beyond the file
  const uint32_t marker = 0x12345678;
  expect_offset(patched(48, &marker, 4), 48);
  const int64_t picks = 3;
  expect_offset(patched(bytes.size() - 8, &picks, 8), static_cast<int64_t>(bytes.size()) - 8);  // trailer picks
}

TEST_F(TraceFormatTest, WriterRefusesStepsThatDoNotMatchTheHeader) {
  TraceInfo info;
  info.num_layers = 1;
  info.num_experts = 4;
  info.top_k = 2;
  info.has_picks = true;
  auto writer = TraceWriter::Create(Path("w.bin"), info);
  ASSERT_TRUE(writer.ok());
  StepPicks step;
  step.rows = 1;
  step.layers = {Picks{1, 2, {0, 4}, {}}};
  EXPECT_FALSE((*writer)->Append(step).ok());  // id out of range
  step.layers = {Picks{1, 2, {1, 1}, {}}};
  EXPECT_FALSE((*writer)->Append(step).ok());  // repeated expert
  step.layers = {Picks{1, 1, {1}, {}}};
  EXPECT_FALSE((*writer)->Append(step).ok());  // wrong k
  step.layers = {Picks{1, 2, {3, 1}, {}}};
  EXPECT_TRUE((*writer)->Append(step).ok());
  EXPECT_TRUE((*writer)->Close().ok());
  auto back = ReadAll(Path("w.bin"));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->steps[0].counts, (std::vector<int64_t>{0, 1, 0, 1}));

  TraceInfo counts = info;
  counts.has_picks = false;
  auto count_writer = TraceWriter::Create(Path("c.bin"), counts);
  ASSERT_TRUE(count_writer.ok());
  StepPicks count_step;
  count_step.rows = 2;
  count_step.counts = {1, 1, 1, 0};  // 3 picks, but 2 rows x top-2 = 4
  EXPECT_FALSE((*count_writer)->Append(count_step).ok());
  count_step.counts = {1, 1, 1, 1};
  EXPECT_TRUE((*count_writer)->Append(count_step).ok());
  EXPECT_TRUE((*count_writer)->Close().ok());
  EXPECT_TRUE(ReadStatus(Path("c.bin")).ok());
  // A count-only step claiming a huge row count is refused, not multiplied into an overflow
  // (found by trace_binary_fuzz). Its rows field is at 40 + 4 (one layer id) + 4 (step marker).
  std::string bytes = ReadBytes(Path("c.bin"));
  const int64_t huge = int64_t{1} << 62;
  std::memcpy(bytes.data() + 48, &huge, 8);
  WriteBytes(Path("huge.bin"), bytes);
  Status status = ReadStatus(Path("huge.bin"));
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("byte offset 48:"), std::string::npos) << status.message();
}

// Text formats: every truncation at a line boundary mid-file either still parses a consistent
// trace or is refused; damaged fields are refused with the line.
TEST_F(TraceFormatTest, DamagedTextFilesAreRefusedWithTheLine) {
  using trace_internal::ImportExpertCountsCsv;
  using trace_internal::ImportJsonl;
  using trace_internal::ImportSglangJson;
  using trace_internal::ImportTopkCsv;
  using trace_internal::ParseFlameLayerCsv;
  LoadReadOptions options;
  auto topk = [&](const std::string& text) {
    std::istringstream in(text);
    return ImportTopkCsv(in, "t.csv", options).status();
  };
  EXPECT_TRUE(topk("token,layer,e0,e1,w0,w1\n0,2,1,3,0.5,0.25\n0,3,0,1,0.5,0.5\n").ok());
  EXPECT_NE(topk("token,layer,e0,e1\n0,2,1,x\n").message().find("t.csv:2"), std::string::npos);
  EXPECT_NE(topk("token,layer,e0,e1\n0,2,1,1\n").message().find("picked twice"), std::string::npos);
  EXPECT_NE(topk("token,layer,e0,e1\n0,2,1\n").message().find("t.csv:2"), std::string::npos);
  EXPECT_NE(topk("token,layer,e0,e1\n0,2,1,-3\n").message().find("t.csv:2"), std::string::npos);
  // Token 1 lacks layer 3.
  EXPECT_NE(topk("token,layer,e0\n0,2,1\n0,3,1\n1,2,0\n").message().find("no record for layer 3"), std::string::npos);
  EXPECT_FALSE(topk("token,layer,e0,e1,w0,w1\n0,2,1,3,nan,0.25\n").ok());
  EXPECT_FALSE(topk("").ok());
  options.num_experts = 2;
  EXPECT_NE(topk("token,layer,e0\n0,2,5\n").message().find("out of range"), std::string::npos);
  options.num_experts = 0;

  auto jsonl = [&](const std::string& text) {
    std::istringstream in(text);
    return ImportJsonl(in, "r.jsonl", options).status();
  };
  EXPECT_TRUE(jsonl("{\"layer\":0,\"experts\":[1,2],\"gating_probs\":[0.6,0.4],\"token_idx\":0}\n").ok());
  EXPECT_NE(jsonl("{\"layer\":0,\"experts\":[1,2]}\n{\"layer\":0,\"experts\":[1,2\n").message().find("r.jsonl:2"),
            std::string::npos);
  EXPECT_FALSE(jsonl("{\"layer\":0,\"experts\":[1,2],\"gating_probs\":[0.6]}\n").ok());
  EXPECT_FALSE(jsonl("{\"layer\":-1,\"experts\":[1,2]}\n").ok());
  EXPECT_FALSE(jsonl("{\"layer\":0,\"experts\":[1,\"a\"]}\n").ok());
  EXPECT_FALSE(jsonl("{\"experts\":[1,2]}\n").ok());
  EXPECT_FALSE(jsonl("[1,2]\n").ok());

  auto sglang = [&](const std::string& text) {
    std::istringstream in(text);
    return ImportSglangJson(in, "s.json", options).status();
  };
  EXPECT_TRUE(sglang("{\"logical_count\": [[1,2,3],[3,3,0]]}").ok());
  EXPECT_TRUE(sglang("{\"logical_count\": [[[1,2,3],[3,3,0]],[[0,0,2],[1,0,1]]]}").ok());
  EXPECT_FALSE(sglang("{\"logical_count\": [[1,2,3],[3,3]]}").ok());    // ragged
  EXPECT_FALSE(sglang("{\"logical_count\": [[1,2,3],[3,3,1]]}").ok());  // 6 vs 7 picks: does not add up
  EXPECT_FALSE(sglang("{\"logical_count\": [[1,-2,3]]}").ok());
  EXPECT_FALSE(sglang("{\"logical_count\": [[1,2,3]]").ok());
  EXPECT_NE(sglang("{\"logical_count\": [[1]]}\n{\"logical\": 1}\n").message().find("s.json:2"), std::string::npos);

  auto counts = [&](const std::string& text) {
    std::istringstream in(text);
    return ImportExpertCountsCsv(in, "c.csv", options).status();
  };
  EXPECT_TRUE(counts("model,layer,expert,count\nm,0,0,5\nm,0,1,3\n").ok());
  EXPECT_NE(counts("model,layer,expert,count\nm,0,0,5\nm,0,0,3\n").message().find("second count"), std::string::npos);
  EXPECT_NE(counts("model,layer,expert,count\nm,0,0,-5\n").message().find("c.csv:2"), std::string::npos);
  EXPECT_FALSE(counts("model,layer,expert\nm,0,0\n").ok());
  EXPECT_FALSE(counts("model,layer,expert,count\nm,0,0,5\nm,1,0,4\n").ok());  // layers disagree

  auto flame = [&](const std::string& text) {
    std::istringstream in(text);
    Picks picks;
    int experts = 0;
    return ParseFlameLayerCsv(in, "layer02.csv", &picks, &experts);
  };
  EXPECT_TRUE(flame("layer_id,token_id,expert_0,expert_1,expert_2\n0,0,0.5,0,0.2\n").ok());
  EXPECT_NE(flame("layer_id,token_id,expert_0,expert_1,expert_2\n0,0,0.5,0,0.2\n0,1,0.5,0.1,0.2\n")
                .message()
                .find("layer02.csv:3"),
            std::string::npos);                                                    // k changes
  EXPECT_FALSE(flame("layer_id,token_id,expert_0,expert_2\n0,0,0.5,0.2\n").ok());  // column gap
  EXPECT_FALSE(flame("layer_id,token_id,expert_0\n0,0,-0.5\n").ok());
  EXPECT_FALSE(flame("layer_id,token_id,expert_0\n0,0,0\n").ok());
  EXPECT_FALSE(flame("layer_id,token_id,expert_0\n0,0\n").ok());
  // A score that is a finite double but overflows the float weights are stored in (found by fuzzing).
  EXPECT_NE(flame("layer_id,token_id,expert_0,expert_1\n0,0,1e300,0\n").message().find("out of range"),
            std::string::npos);
  EXPECT_NE(topk("token,layer,e0,e1,w0,w1\n0,2,1,3,1e300,0.25\n").message().find("out of range"), std::string::npos);
  EXPECT_NE(jsonl("{\"layer\":0,\"experts\":[1,2],\"gating_probs\":[1e300,0.4]}\n").message().find("out of range"),
            std::string::npos);
}

TEST_F(TraceFormatTest, TruncatedRealFilesAreRefusedOrConsistent) {
  // Cut the real files at many points: the importers either refuse them or return a trace that
  // passes every check (a cut at a line end is a shorter, valid file); they never crash.
  const std::vector<std::pair<std::string, std::string>> files = {
      {kTraces + "/flame_moe_290m/prefill_4seqs_x64tok_topk_derived.csv", "flame-topk-csv"},
      {kDecode + "/pos01/layer02.csv", "flame-csv"},
      {kCounts, "expert-counts-csv"},
  };
  for (const auto& [file, format] : files) {
    const std::string bytes = ReadBytes(file);
    const std::string ext = fs::path(file).extension().string();
    for (int i = 1; i < 24; ++i) {
      const size_t cut = bytes.size() * i / 24 + i;  // mostly mid-line
      WriteBytes(Path("cut" + ext), bytes.substr(0, std::min(cut, bytes.size())));
      LoadReadOptions options;
      options.format = format;
      options.filter = format == "expert-counts-csv" ? "model=mistral,domain=arxiv,selection=topk" : "";
      auto trace = ReadAll(Path("cut" + ext), options);
      if (trace.ok()) {
        for (const StepPicks& step : trace->steps)
          EXPECT_EQ(step.counts.size(), static_cast<size_t>(trace->info.num_layers) * trace->info.num_experts);
      } else {
        EXPECT_FALSE(trace.status().message().empty());
      }
    }
  }
}

}  // namespace
}  // namespace epmoe
