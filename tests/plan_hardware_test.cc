// Hardware profiles: every built-in profile loads and names its sources; a profile with a missing,
// negative, out-of-range or unknown field is refused with a message naming the field.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "epmoe/hardware.h"
#include "epmoe/thread_pool.h"

namespace epmoe {
namespace {

using nlohmann::json;

json B300() {
  auto profile = LoadHardware("b300x8");
  EXPECT_TRUE(profile.ok()) << profile.status().message();
  return json::parse(HardwareToJson(*profile));
}

// Parses `j` and expects a refusal whose message contains every piece of `expected`.
void ExpectRefused(const json& j, std::initializer_list<const char*> expected) {
  auto parsed = ParseHardware(j.dump(), "test.json");
  ASSERT_FALSE(parsed.ok()) << j.dump();
  for (const char* piece : expected)
    EXPECT_NE(parsed.status().message().find(piece), std::string::npos) << parsed.status().message();
  EXPECT_NE(parsed.status().message().find("test.json"), std::string::npos) << parsed.status().message();
}

TEST(PlanHardwareTest, EveryBuiltInProfileLoads) {
  const std::vector<std::string> expected = {"b200x8", "b300x8", "gb200nvl72", "h100x8",
                                             "h200x8", "h20x8",  "local",      "mi355xx8"};
  EXPECT_EQ(ListHardwareProfiles(), expected);
  for (const auto& name : expected) {
    auto profile = LoadHardware(name);
    ASSERT_TRUE(profile.ok()) << name << ": " << profile.status().message();
    EXPECT_EQ(profile->name, name);
    EXPECT_GE(profile->sources.size(), 2u) << name;
    // Round trip through JSON.
    auto again = ParseHardware(HardwareToJson(*profile), name);
    ASSERT_TRUE(again.ok()) << again.status().message();
    EXPECT_EQ(HardwareToJson(*again), HardwareToJson(*profile));
  }
}

TEST(PlanHardwareTest, DataSheetFigures) {
  auto b300 = LoadHardware("b300x8");
  ASSERT_TRUE(b300.ok());
  EXPECT_EQ(b300->gpus_per_node, 8);
  EXPECT_DOUBLE_EQ(b300->memory_capacity_gb, 288);
  EXPECT_DOUBLE_EQ(b300->memory_bandwidth_gbs, 8000);
  // The seed's kernel line for NVFP4 experts on one B300: 28 us + 150 us per GB.
  auto line = b300->LineFor(WeightFormat::kNvfp4);
  ASSERT_TRUE(line.has_value());
  EXPECT_DOUBLE_EQ(line->fixed_us, 28);
  EXPECT_DOUBLE_EQ(line->us_per_gb, 150);
  EXPECT_FALSE(b300->LineFor(WeightFormat::kBf16).has_value());
  EXPECT_DOUBLE_EQ(b300->PeakTflopsFor(WeightFormat::kNvfp4), b300->peak_tflops.fp4);
  EXPECT_DOUBLE_EQ(b300->PeakTflopsFor(WeightFormat::kBf16), b300->peak_tflops.bf16);
  auto nvl72 = LoadHardware("gb200nvl72");
  ASSERT_TRUE(nvl72.ok());
  EXPECT_EQ(nvl72->gpus_per_node, 72);
  auto local = LoadHardware("local");
  ASSERT_TRUE(local.ok());
  EXPECT_TRUE(local->ranks_share_device);
}

TEST(PlanHardwareTest, MissingFieldsAreNamed) {
  for (const char* top : {"name", "sources", "gpus_per_node", "ranks_share_device", "memory", "peak_tflops",
                          "arithmetic_efficiency", "gemm_efficiency", "kernel_fixed_us", "intra_node", "inter_node"}) {
    json j = B300();
    j.erase(top);
    ExpectRefused(j, {"missing field", top});
  }
  for (const auto& [object, field] : std::vector<std::pair<const char*, const char*>>{{"memory", "bandwidth_gbs"},
                                                                                      {"memory", "capacity_gb"},
                                                                                      {"memory", "read_efficiency"},
                                                                                      {"peak_tflops", "fp4"},
                                                                                      {"peak_tflops", "bf16"},
                                                                                      {"intra_node", "latency_us"},
                                                                                      {"inter_node", "bandwidth_gbs"},
                                                                                      {"inter_node", "efficiency"}}) {
    json j = B300();
    j[object].erase(field);
    ExpectRefused(j, {"missing field", (std::string(object) + "." + field).c_str()});
  }
  json j = B300();
  j["kernel_lines"][0].erase("us_per_gb");
  ExpectRefused(j, {"kernel_lines[0]", "us_per_gb"});
}

TEST(PlanHardwareTest, NegativeOrOutOfRangeFieldsAreNamed) {
  json j = B300();
  j["memory"]["bandwidth_gbs"] = -1;
  ExpectRefused(j, {"memory.bandwidth_gbs", "must be positive"});
  j = B300();
  j["intra_node"]["latency_us"] = -3;
  ExpectRefused(j, {"intra_node.latency_us", "must not be negative"});
  j = B300();
  j["inter_node"]["efficiency"] = 1.5;
  ExpectRefused(j, {"inter_node.efficiency", "(0, 1]"});
  j = B300();
  j["peak_tflops"]["fp8"] = 0;
  ExpectRefused(j, {"peak_tflops.fp8", "must be positive"});
  j = B300();
  j["gpus_per_node"] = 2.5;
  ExpectRefused(j, {"gpus_per_node", "whole number"});
  j = B300();
  j["kernel_fixed_us"] = -1;
  ExpectRefused(j, {"kernel_fixed_us", "must not be negative"});
  j = B300();
  j["kernel_lines"][0]["us_per_gb"] = -150;
  ExpectRefused(j, {"kernel_lines[0].us_per_gb", "must be positive"});
  j = B300();
  j["kernel_lines"][0]["format"] = "fp3";
  ExpectRefused(j, {"kernel_lines[0].format"});
  j = B300();
  j["memory"]["bandwidth_gbs"] = "fast";
  ExpectRefused(j, {"memory.bandwidth_gbs", "must be a number"});
  j = B300();
  j["sources"] = json::array();
  ExpectRefused(j, {"sources"});
  j = B300();
  j["intra_node"]["one_sided_efficiency"] = -0.5;
  ExpectRefused(j, {"intra_node.one_sided_efficiency", "must not be negative"});
  j = B300();
  j["memory"]["copy_gbs"] = -1;
  ExpectRefused(j, {"memory.copy_gbs", "must not be negative"});
}

// The device's copy rate (DWDP's fetches on a shared device) when measured, half the read rate otherwise.
TEST(PlanHardwareTest, CopyRateIsOptional) {
  json j = B300();
  ASSERT_FALSE(j["memory"].contains("copy_gbs"));
  auto plain = ParseHardware(j.dump(), "test.json");
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  EXPECT_DOUBLE_EQ(plain->CopyBytesPerSecond(), plain->memory_bandwidth_gbs * 1e9 * plain->memory_read_efficiency / 2);
  EXPECT_FALSE(json::parse(HardwareToJson(*plain))["memory"].contains("copy_gbs"));
  j["memory"]["copy_gbs"] = 12.5;
  auto measured = ParseHardware(j.dump(), "test.json");
  ASSERT_TRUE(measured.ok()) << measured.status().message();
  EXPECT_DOUBLE_EQ(measured->CopyBytesPerSecond(), 12.5e9);
  EXPECT_EQ(json::parse(HardwareToJson(*measured))["memory"]["copy_gbs"], 12.5);
}

// Pick outputs and partial sums are bf16 unless the profile says fp32; anything else is refused.
TEST(PlanHardwareTest, PartialSumsAreBf16UnlessSaid) {
  json j = B300();
  ASSERT_FALSE(j.contains("partial_sums"));
  auto plain = ParseHardware(j.dump(), "test.json");
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  EXPECT_EQ(plain->partial_sum_bytes, 2);
  j["partial_sums"] = "fp32";
  auto fp32 = ParseHardware(j.dump(), "test.json");
  ASSERT_TRUE(fp32.ok()) << fp32.status().message();
  EXPECT_EQ(fp32->partial_sum_bytes, 4);
  EXPECT_EQ(json::parse(HardwareToJson(*fp32))["partial_sums"], "fp32");
  j["partial_sums"] = "fp16";
  ExpectRefused(j, {"partial_sums", "fp16"});
  j["partial_sums"] = 4;
  ExpectRefused(j, {"partial_sums"});
}

// One-sided reads (DWDP) get their own share of the link when measured, and collectives' otherwise.
TEST(PlanHardwareTest, OneSidedEfficiencyIsOptional) {
  json j = B300();
  ASSERT_FALSE(j["intra_node"].contains("one_sided_efficiency"));
  auto plain = ParseHardware(j.dump(), "test.json");
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  EXPECT_DOUBLE_EQ(plain->intra_node.one_sided_bytes_per_second(), plain->intra_node.bytes_per_second());
  j["intra_node"]["one_sided_efficiency"] = 0.25;
  auto measured = ParseHardware(j.dump(), "test.json");
  ASSERT_TRUE(measured.ok()) << measured.status().message();
  EXPECT_DOUBLE_EQ(measured->intra_node.one_sided_bytes_per_second(), measured->intra_node.bandwidth_gbs * 1e9 * 0.25);
  EXPECT_EQ(json::parse(HardwareToJson(*measured))["intra_node"]["one_sided_efficiency"], 0.25);
}

// A cluster emulated on one machine: with nodes_share_device every rank of the group shares the one
// device; without it a CPU node's ranks do, and GPUs have a device each.
TEST(PlanHardwareTest, NodesShareDeviceIsOptional) {
  json j = B300();
  ASSERT_FALSE(j.contains("nodes_share_device"));
  auto gpus = ParseHardware(j.dump(), "test.json");
  ASSERT_TRUE(gpus.ok()) << gpus.status().message();
  EXPECT_FALSE(gpus->nodes_share_device);
  EXPECT_EQ(gpus->RanksPerDevice(16), 1);
  j["ranks_share_device"] = true;
  j["gpus_per_node"] = 2;
  auto cpus = ParseHardware(j.dump(), "test.json");
  ASSERT_TRUE(cpus.ok()) << cpus.status().message();
  EXPECT_EQ(cpus->RanksPerDevice(1), 1);
  EXPECT_EQ(cpus->RanksPerDevice(4), 2);
  j["nodes_share_device"] = true;
  auto one_machine = ParseHardware(j.dump(), "test.json");
  ASSERT_TRUE(one_machine.ok()) << one_machine.status().message();
  EXPECT_EQ(one_machine->RanksPerDevice(4), 4);
  EXPECT_EQ(json::parse(HardwareToJson(*one_machine))["nodes_share_device"], true);
  j["nodes_share_device"] = "yes";
  ExpectRefused(j, {"nodes_share_device"});
}

// A link's all-to-all step costs its collective fixed cost unless measured apart.
TEST(PlanHardwareTest, ExchangeLatencyIsOptional) {
  json j = B300();
  ASSERT_FALSE(j["inter_node"].contains("exchange_latency_us"));
  auto plain = ParseHardware(j.dump(), "test.json");
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  EXPECT_DOUBLE_EQ(plain->inter_node.exchange_step_us(), plain->inter_node.latency_us);
  j["inter_node"]["exchange_latency_us"] = 7.5;
  auto measured = ParseHardware(j.dump(), "test.json");
  ASSERT_TRUE(measured.ok()) << measured.status().message();
  EXPECT_DOUBLE_EQ(measured->inter_node.exchange_step_us(), 7.5);
  EXPECT_DOUBLE_EQ(measured->intra_node.exchange_step_us(), measured->intra_node.latency_us);
  EXPECT_EQ(json::parse(HardwareToJson(*measured))["inter_node"]["exchange_latency_us"], 7.5);
  j["inter_node"]["exchange_latency_us"] = -1;
  ExpectRefused(j, {"inter_node.exchange_latency_us", "must not be negative"});
}

// The device's cores, when known, tell whether two-batch overlap's lanes outnumber them.
TEST(PlanHardwareTest, CoresAreOptional) {
  json j = B300();
  ASSERT_FALSE(j.contains("cores"));
  auto gpus = ParseHardware(j.dump(), "test.json");
  ASSERT_TRUE(gpus.ok()) << gpus.status().message();
  EXPECT_FALSE(gpus->LanesOutnumberCores(16, 2));  // not known: never
  j["ranks_share_device"] = true;
  j["gpus_per_node"] = 2;
  j["nodes_share_device"] = true;
  j["cores"] = 4;
  auto cpus = ParseHardware(j.dump(), "test.json");
  ASSERT_TRUE(cpus.ok()) << cpus.status().message();
  EXPECT_EQ(cpus->cores, 4);
  EXPECT_FALSE(cpus->LanesOutnumberCores(2, 2));  // 2 ranks x 2 lanes on 4 cores
  EXPECT_TRUE(cpus->LanesOutnumberCores(4, 2));   // 4 x 2 on 4
  EXPECT_FALSE(cpus->LanesOutnumberCores(4, 1));
  EXPECT_EQ(json::parse(HardwareToJson(*cpus))["cores"], 4);
  for (const json& bad : {json(0), json(2.5), json("many")}) {
    j["cores"] = bad;
    ExpectRefused(j, {"cores"});
  }
}

// a2a's pack and unpack are priced only where the row codec's rate was measured.
TEST(PlanHardwareTest, RowCodecRateIsOptionalAndMeasured) {
  json j = B300();
  ASSERT_FALSE(j.contains("row_codec_ns"));
  auto plain = ParseHardware(j.dump(), "test.json");
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  EXPECT_EQ(plain->row_codec_ns, 0);
  j["row_codec_ns"] = 0.75;
  auto measured = ParseHardware(j.dump(), "test.json");
  ASSERT_TRUE(measured.ok()) << measured.status().message();
  EXPECT_EQ(measured->row_codec_ns, 0.75);
  EXPECT_EQ(json::parse(HardwareToJson(*measured))["row_codec_ns"], 0.75);
  j["row_codec_ns"] = -1;
  ExpectRefused(j, {"row_codec_ns", "must not be negative"});
  RowCodecOptions small;
  small.rows = 256;
  small.cols = 64;
  small.repetitions = 2;
  auto ns = MeasureRowCodecNs(small);
  ASSERT_TRUE(ns.ok()) << ns.status().message();
  EXPECT_GT(*ns, 0);
  EXPECT_LT(*ns, 1e3);  // a microsecond per number would be no codec
  small.rows = 0;
  EXPECT_FALSE(MeasureRowCodecNs(small).ok());
  small.rows = 256;
  small.cols = 0;  // no row to code
  auto bad = MeasureRowCodecNs(small);
  EXPECT_FALSE(bad.ok());
}

// The copy-rate microbenchmark behind memory.copy_gbs: a positive rate; bad sizes refused.
TEST(PlanHardwareTest, CopyBandwidthIsMeasuredAndBadOptionsRefused) {
  ThreadPool pool(2);
  auto rate = MeasureCopyBandwidth(pool, CopyBandwidthOptions{int64_t{4} << 20, 2});
  ASSERT_TRUE(rate.ok()) << rate.status().message();
  EXPECT_GT(*rate, 0.0);
  EXPECT_TRUE(std::isfinite(*rate));
  EXPECT_EQ(MeasureCopyBandwidth(pool, CopyBandwidthOptions{1000, 2}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(MeasureCopyBandwidth(pool, CopyBandwidthOptions{int64_t{4} << 20, 0}).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(PlanHardwareTest, UnknownFieldsAndBadTextAreRefused) {
  json j = B300();
  j["memory"]["bandwith_gbs"] = 8000;  // a typo must not be silently ignored
  ExpectRefused(j, {"unknown field 'memory.bandwith_gbs'"});
  j = B300();
  j["flops"] = 1;
  ExpectRefused(j, {"unknown field 'flops'"});
  EXPECT_FALSE(ParseHardware("{", "broken.json").ok());
  EXPECT_FALSE(ParseHardware("[1,2]", "array.json").ok());
  auto missing = LoadHardware("no-such-gpu");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("b300x8"), std::string::npos);  // lists the known ones
  EXPECT_FALSE(LoadHardware("/nonexistent/profile.json").ok());
}

}  // namespace
}  // namespace epmoe
