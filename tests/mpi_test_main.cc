// main() of every *_mpi_test: initializes MPI around GoogleTest and makes only rank 0 print
// results, so the output of an 8-rank run stays readable. A failure on any rank fails the process,
// and mpirun reports the run failed.
#include <gtest/gtest.h>
#include <mpi.h>

int main(int argc, char** argv) {
  // As the library starts MPI itself: two-batch overlap and dwdp's reads run MPI from two threads.
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int result = RUN_ALL_TESTS();
  int any_failed = 0;
  MPI_Allreduce(&result, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (result != 0) std::fprintf(stderr, "rank %d: tests failed\n", rank);
  MPI_Finalize();
  return any_failed;
}
