// Summaries of measured samples (times, read rates), shared by the benchmarks, the bench library and
// the CLI's reports.
#pragma once

#include <vector>

namespace epmoe {

// The middle value (the mean of the two middle ones for an even count); 0 for no values.
double Median(std::vector<double> values);

// The nearest-rank q-quantile (q in [0, 1]): the smallest value with at least a q share of the
// values at or below it; 0 for no values.
double Quantile(std::vector<double> values, double q);

}  // namespace epmoe
