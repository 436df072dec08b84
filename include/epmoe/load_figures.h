// Figures of a routing load spread over ranks, defined once for the executors, the balancer, the
// trace statistics and the planner: balancedness (mean / max per rank) and the ranks a row visits
// under uniform routing. Free functions on plain values; thread-safe.
#pragma once

#include <span>

namespace epmoe {

// mean / max of per-rank values (picks, bytes, seconds); 1 when every value is 0 or there are
// none (nothing to balance).
double Balancedness(std::span<const double> per_rank);

// Probability that none of a row's k distinct uniform experts is among `held` of E:
// C(E - held, k) / C(E, k) = prod_{i<k} (E - held - i) / (E - i), continued to fractional `held`.
double ProbabilityNoneHeld(int num_experts, double held, int top_k);

// Expected ranks holding at least one of a row's k distinct uniform experts, G ranks of E/G
// experts each: G (1 - C(E - E/G, k) / C(E, k)). The copies a row sends to ranks other than its
// own are (G - 1) / G of it.
double ExpectedRanksPerRow(int num_experts, int top_k, int num_ranks);

}  // namespace epmoe
