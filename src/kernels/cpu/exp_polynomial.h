// Internal: the constants of the vector kernels' exp(x) for x <= 0 (SwiGLU needs exp(-|g|) only):
// x = n ln2 + r with n = round(x / ln2) and ln2 split in two (kLn2High exact in few bits, so that
// n * kLn2High is exact), |r| <= ln2/2, then exp(r) by a degree-6 Taylor polynomial (relative error
// < 2e-7) and the result scaled by 2^n; x is clamped at kExpMin, below which exp underflows.
#pragma once

namespace epmoe::kernels {

constexpr float kExpMin = -87.0f;
constexpr float kLog2E = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
// Horner's order: 1/6!, 1/5!, ..., 1/1!, 1/0!.
constexpr float kExpCoefficients[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

}  // namespace epmoe::kernels
