// AtomicFile (a file appears whole or not at all) and the bounded readers of user input.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "epmoe/atomic_file.h"
#include "epmoe/bounded_input.h"

namespace epmoe {
namespace {

namespace fs = std::filesystem;

class AtomicFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / "epmoe_atomic_file_test";
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }
  // Every name in the folder: a temporary left behind shows up here.
  std::vector<std::string> Names() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir_)) names.push_back(entry.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
  static std::string Read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }
  fs::path dir_;
};

TEST_F(AtomicFileTest, CommitPutsTheWholeFileInPlace) {
  auto file = AtomicFile::Create(Path("out.txt"));
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  ASSERT_TRUE((*file)->Append("header ").ok());
  ASSERT_TRUE((*file)->Append("0000 tail").ok());
  EXPECT_FALSE(fs::exists(Path("out.txt")));  // nothing under the final name before the commit
  ASSERT_TRUE((*file)->WriteAt(7, "1234").ok());
  ASSERT_TRUE((*file)->Append("!").ok());
  ASSERT_TRUE((*file)->Commit().ok());
  EXPECT_EQ(Read(Path("out.txt")), "header 1234 tail!");
  EXPECT_EQ(Names(), std::vector<std::string>{"out.txt"});
}

TEST_F(AtomicFileTest, AnUncommittedWriterLeavesTheOldFileAndNoTemporary) {
  std::ofstream(Path("out.txt")) << "old";
  {
    auto file = AtomicFile::Create(Path("out.txt"));
    ASSERT_TRUE(file.ok());
    ASSERT_TRUE((*file)->Append("half of the new").ok());
  }
  EXPECT_EQ(Read(Path("out.txt")), "old");
  EXPECT_EQ(Names(), std::vector<std::string>{"out.txt"});
}

TEST_F(AtomicFileTest, TwoWritersOfOnePathDoNotCollide) {
  auto first = AtomicFile::Create(Path("shared.prom"));
  auto second = AtomicFile::Create(Path("shared.prom"));
  ASSERT_TRUE(first.ok() && second.ok());
  ASSERT_TRUE((*first)->Append("first").ok());
  ASSERT_TRUE((*second)->Append("second").ok());
  EXPECT_TRUE((*first)->Commit().ok());
  EXPECT_TRUE((*second)->Commit().ok());
  EXPECT_EQ(Read(Path("shared.prom")), "second");
  EXPECT_EQ(Names(), std::vector<std::string>{"shared.prom"});
}

TEST_F(AtomicFileTest, RefusesADirectoryAndAMissingFolderNamingThePath) {
  auto directory = AtomicFile::Create(dir_.string());
  ASSERT_FALSE(directory.ok());
  EXPECT_NE(directory.status().message().find("is a directory"), std::string::npos);
  const Status missing = WriteFileAtomically(Path("no/such/folder/x.json"), "{}");
  EXPECT_EQ(missing.code(), StatusCode::kIoError);
  EXPECT_NE(missing.message().find("x.json: cannot create"), std::string::npos) << missing.message();
  EXPECT_TRUE(Names().empty());
}

TEST_F(AtomicFileTest, AFullDeviceIsWrittenInPlaceAndItsErrorReported) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  const Status full = WriteFileAtomically("/dev/full", std::string(1 << 16, 'x'));
  EXPECT_EQ(full.code(), StatusCode::kIoError);
  EXPECT_NE(full.message().find("/dev/full: write failed"), std::string::npos) << full.message();
  EXPECT_TRUE(fs::is_character_file("/dev/full"));  // the device node was not replaced
  EXPECT_TRUE(WriteFileAtomically("/dev/null", "discarded").ok());
}

TEST_F(AtomicFileTest, AnOutputThatIsItsInputIsRefused) {
  std::ofstream(Path("t.bin")) << "trace";
  fs::create_symlink(Path("t.bin"), Path("link.bin"));
  EXPECT_FALSE(CheckOutputIsNotInput(Path("t.bin"), Path("t.bin")).ok());
  const Status linked = CheckOutputIsNotInput(Path("t.bin"), Path("link.bin"));
  EXPECT_EQ(linked.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(linked.message().find("would destroy the input"), std::string::npos);
  EXPECT_TRUE(CheckOutputIsNotInput(Path("t.bin"), Path("new.bin")).ok());
  // Writing through the link replaces the file it names and keeps the link.
  ASSERT_TRUE(WriteFileAtomically(Path("link.bin"), "new").ok());
  EXPECT_TRUE(fs::is_symlink(Path("link.bin")));
  EXPECT_EQ(Read(Path("t.bin")), "new");
}

TEST_F(AtomicFileTest, ReadFileTextIsBounded) {
  std::ofstream(Path("small.json")) << "{\"a\": 1}";
  auto small = ReadFileText(Path("small.json"), 100, "test file");
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(*small, "{\"a\": 1}");
  EXPECT_EQ(ReadFileText(Path("small.json"), 4, "test file").status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(ReadFileText(Path("missing.json"), 100, "test file").status().code(), StatusCode::kNotFound);
  const auto directory = ReadFileText(dir_.string(), 100, "test file");
  EXPECT_EQ(directory.status().code(), StatusCode::kIoError);
  EXPECT_NE(directory.status().message().find("cannot read test file"), std::string::npos);
  if (fs::exists("/dev/zero")) {
    EXPECT_EQ(ReadFileText("/dev/zero", 1 << 20, "test file").status().code(), StatusCode::kOutOfRange);
  }
}

TEST(JsonDepth, RefusesDeepNestingOutsideStringsOnly) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const Status status = CheckJsonDepth(deep, "deep.json");
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("deep.json: JSON nested deeper than 512"), std::string::npos);
  const std::string at_limit = std::string(kMaxJsonDepth, '[') + std::string(kMaxJsonDepth, ']');
  EXPECT_TRUE(CheckJsonDepth(at_limit, "x").ok());
  EXPECT_FALSE(CheckJsonDepth("[" + at_limit + "]", "x").ok());
  EXPECT_TRUE(CheckJsonDepth("{\"k\": \"" + std::string(1000, '[') + "\\\"[\"}", "x").ok());
}

}  // namespace
}  // namespace epmoe
