// GatherJobErrors: the failed ranks of a job agree, within a bound, on which errors rank 0 prints.
// Every rank fails here (a rank that fails alone ends the job: tests/ep_run_cli_test.cc runs that
// case under mpirun).
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <numeric>
#include <string>
#include <vector>

#include "epmoe/comm.h"

namespace epmoe {
namespace {

int WorldRank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int WorldSize() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

TEST(JobErrors, ARefusalEveryRankReachesIsGatheredOnceOnRankZero) {
  const auto start = std::chrono::steady_clock::now();
  const JobErrors job = GatherJobErrors(InvalidArgument("--layers 99: the model has 48"), 20);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 10);  // every rank arrived: nobody waits for the bound
  EXPECT_TRUE(job.every_rank_reported);
  EXPECT_EQ(job.rank, WorldRank());
  EXPECT_EQ(job.size, WorldSize());
  if (job.rank != 0) {
    EXPECT_TRUE(job.errors.empty());  // rank 0 prints
    return;
  }
  ASSERT_EQ(job.errors.size(), 1u);
  EXPECT_EQ(job.errors[0].message, "--layers 99: the model has 48");
  std::vector<int> every(job.size);
  std::iota(every.begin(), every.end(), 0);
  EXPECT_EQ(job.errors[0].ranks, every);
}

TEST(JobErrors, DifferentErrorsComeWithTheirRanks) {
  const int rank = WorldRank(), size = WorldSize();
  // The last rank fails its own way; the others alike.
  const std::string message = rank == size - 1 && size > 1 ? "expert 127: NaN in down_proj" : "shared refusal";
  const JobErrors job = GatherJobErrors(InvalidArgument(message), 20);
  EXPECT_TRUE(job.every_rank_reported);
  if (rank != 0) {
    EXPECT_TRUE(job.errors.empty());
    return;
  }
  ASSERT_EQ(job.errors.size(), size > 1 ? 2u : 1u);
  EXPECT_EQ(job.errors[0].message, "shared refusal");
  EXPECT_EQ(job.errors[0].ranks.size(), static_cast<size_t>(size > 1 ? size - 1 : 1));
  if (size > 1) {
    EXPECT_EQ(job.errors[1].message, "expert 127: NaN in down_proj");
    EXPECT_EQ(job.errors[1].ranks, std::vector<int>{size - 1});
  }
}

}  // namespace
}  // namespace epmoe
