#include "epmoe/comm.h"

namespace epmoe {

std::vector<int64_t> PrefixOffsets(std::span<const int64_t> sizes) {
  std::vector<int64_t> offsets(sizes.size() + 1, 0);
  for (size_t i = 0; i < sizes.size(); ++i) offsets[i + 1] = offsets[i] + sizes[i];
  return offsets;
}

Status Communicator::Allgatherv(const void* send, int64_t send_bytes, void* recv, std::span<const int64_t> recv_bytes,
                                std::span<const int64_t> recv_offsets) {
  EPMOE_ASSIGN_OR_RETURN(auto request, StartAllgatherv(send, send_bytes, recv, recv_bytes, recv_offsets));
  return request->Wait();
}

Status Communicator::ReduceScatter(const float* send, float* recv, std::span<const int64_t> recv_counts) {
  EPMOE_ASSIGN_OR_RETURN(auto request, StartReduceScatter(send, recv, recv_counts));
  return request->Wait();
}

Status Communicator::Allreduce(float* data, int64_t count) {
  EPMOE_ASSIGN_OR_RETURN(auto request, StartAllreduce(data, count));
  return request->Wait();
}

Status Communicator::Alltoallv(const void* send, std::span<const int64_t> send_bytes,
                               std::span<const int64_t> send_offsets, void* recv, std::span<const int64_t> recv_bytes,
                               std::span<const int64_t> recv_offsets) {
  EPMOE_ASSIGN_OR_RETURN(auto request,
                         StartAlltoallv(send, send_bytes, send_offsets, recv, recv_bytes, recv_offsets));
  return request->Wait();
}

}  // namespace epmoe
