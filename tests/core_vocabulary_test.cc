// The shared vocabulary (ep_options.h), the load figures (load_figures.h) and EnumNames.
#include <gtest/gtest.h>

#include <vector>

#include "epmoe/enum_names.h"
#include "epmoe/ep_options.h"
#include "epmoe/load_figures.h"
#include "epmoe/weight_format.h"

namespace epmoe {
namespace {

TEST(EpOptions, NamesRoundTrip) {
  const std::vector<std::string> names = {"sliced", "whole", "hybrid", "a2a", "dwdp"};
  ASSERT_EQ(AllEpOptions().size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    const EpOption option = AllEpOptions()[i];
    EXPECT_EQ(EpOptionName(option), names[i]);
    EXPECT_EQ(EpOptionNumber(option), static_cast<int>(i) + 1);
    EXPECT_EQ(*ParseEpOption(names[i]), option);
    EXPECT_EQ(*ParseEpOption(std::to_string(i + 1)), option);
  }
  EXPECT_FALSE(ParseEpOption("tp").ok());
  EXPECT_EQ(*ParseRowOrigin("tp"), RowOrigin::kTensorParallel);
  EXPECT_FALSE(ParseRowOrigin("pp").ok());
}

TEST(EpOptions, PlannerNamesAreAliases) {
  EXPECT_EQ(*ParseEpOption("rows"), EpOption::kA2a);
  EXPECT_EQ(*ParseEpOption("weights"), EpOption::kDwdp);
  EXPECT_EQ(*ParseSharedMode("auto"), SharedMode::kDefault);
  EXPECT_FALSE(ParseEpOption("6").ok());
}

TEST(EpOptions, ParseErrorListsEveryName) {
  const Status bad = ParseEpOption("rowz").status();
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("unknown option 'rowz' (sliced, whole, hybrid, a2a, dwdp)"), std::string::npos)
      << bad.message();
  const Status mode = ParseSharedMode("half").status();
  EXPECT_NE(mode.message().find("unknown shared expert mode 'half' (default, sliced, copied)"), std::string::npos)
      << mode.message();
}

TEST(EpOptions, SharedIsSliced) {
  for (EpOption option : AllEpOptions()) {
    EXPECT_EQ(SharedIsSliced(option, SharedMode::kDefault), GathersRows(option)) << EpOptionName(option);
    EXPECT_TRUE(SharedIsSliced(option, SharedMode::kSliced));
    EXPECT_FALSE(SharedIsSliced(option, SharedMode::kCopied));
  }
  EXPECT_TRUE(GathersRows(EpOption::kHybrid));
  EXPECT_FALSE(GathersRows(EpOption::kA2a));
}

TEST(EnumNames, NameParseAllList) {
  enum class Color { kRed, kBlue };
  constexpr EnumNames<Color, 2> kColors("color", {{{Color::kRed, "red"}, {Color::kBlue, "blue"}}});
  EXPECT_STREQ(kColors.Name(Color::kBlue), "blue");
  EXPECT_STREQ(kColors.Name(static_cast<Color>(7)), "?");
  EXPECT_EQ(kColors.All(), (std::vector<Color>{Color::kRed, Color::kBlue}));
  EXPECT_EQ(kColors.List(), "red, blue");
  EXPECT_EQ(*kColors.Parse("red"), Color::kRed);
  EXPECT_EQ(*kColors.Parse("navy", {{"navy", Color::kBlue}}), Color::kBlue);
  EXPECT_EQ(kColors.Parse("green").status().message(), "unknown color 'green' (red, blue)");
}

TEST(EnumNames, WeightFormatsParseAndList) {
  for (WeightFormat format : AllWeightFormats()) EXPECT_EQ(*ParseWeightFormat(WeightFormatName(format)), format);
  EXPECT_EQ(AllWeightFormats().size(), 5u);
  EXPECT_EQ(ParseWeightFormat("fp8").status().message(),
            "unknown weight format 'fp8' (fp32, bf16, int8, nvfp4, mxfp4)");
}

TEST(LoadFigures, Balancedness) {
  EXPECT_DOUBLE_EQ(Balancedness(std::vector<double>{}), 1.0);
  EXPECT_DOUBLE_EQ(Balancedness(std::vector<double>{0, 0}), 1.0);
  EXPECT_DOUBLE_EQ(Balancedness(std::vector<double>{2, 2}), 1.0);
  EXPECT_DOUBLE_EQ(Balancedness(std::vector<double>{1, 3}), 2.0 / 3.0);
}

TEST(LoadFigures, ExpectedRanksPerRow) {
  // G (1 - C(E - E/G, k) / C(E, k)), computed here from binomials in double.
  auto binomial = [](int n, int r) {
    double v = 1;
    for (int i = 0; i < r; ++i) v = v * (n - i) / (i + 1);
    return v;
  };
  for (int g : {1, 2, 4, 8}) {
    const double want = g * (1 - binomial(128 - 128 / g, 8) / binomial(128, 8));
    EXPECT_NEAR(ExpectedRanksPerRow(128, 8, g), want, 1e-9) << g;
  }
  EXPECT_NEAR(ExpectedRanksPerRow(128, 8, 1), 1.0, 1e-12);
  EXPECT_LT(ExpectedRanksPerRow(256, 8, 64), 8.0);
  EXPECT_DOUBLE_EQ(ProbabilityNoneHeld(256, 0, 8), 1.0);
  EXPECT_DOUBLE_EQ(ProbabilityNoneHeld(256, 256, 8), 0.0);
  EXPECT_DOUBLE_EQ(ProbabilityNoneHeld(4, 1, 2), 0.5);
}

}  // namespace
}  // namespace epmoe
