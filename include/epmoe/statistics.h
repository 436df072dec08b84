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

// For positive values that cluster around a few levels (a read rate on a machine whose memory
// switches between speeds): the median of the largest band, the band of a value c being the values
// v within `relative` of it (|v / c - 1| <= relative); the first of equal bands in ascending order.
// Unlike the median of all values, it lies in one level even when two are about equally common. 0
// for no values.
double DensestBandMedian(std::vector<double> values, double relative);

}  // namespace epmoe
