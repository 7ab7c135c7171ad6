#include <ATen/Parallel.h>
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  // Ranks run as threads: one intra-op thread each keeps 4 ranks on 2 cores sane.
  at::set_num_threads(1);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
