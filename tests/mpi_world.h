// The world communicator of an MPI test binary, shared by its tests: made on first use, with a
// bounded wait so that a peer that fails ends the test instead of hanging it.
#pragma once

#include <memory>

#include "epmoe/comm.h"
#include "epmoe/status.h"

namespace epmoe::testing {

// One per process: the first call's timeout holds for the whole binary.
inline Communicator& SharedWorld(double timeout_seconds) {
  static std::unique_ptr<Communicator> comm = [timeout_seconds] {
    CommOptions options;
    options.timeout_seconds = timeout_seconds;
    auto world = WorldCommunicator(options);
    EPMOE_CHECK_MSG(world.ok(), world.status().ToString());
    return std::move(world).value();
  }();
  return *comm;
}

}  // namespace epmoe::testing
