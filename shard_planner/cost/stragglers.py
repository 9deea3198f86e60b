"""The slowest GPU of the job sets the pace of every rank (synchronous FSDP).

[Note: Stragglers: the slowest of N GPUs]
FSDP synchronises every rank at every collective: an all-gather completes only when every rank has
joined it, a reduce-scatter only when every rank has finished the unit's backward, and the optimizer
step of every rank waits for the last reduce-scatter. A rank that computes more slowly than the others
cannot fall behind by more than the slack of one prefetch, so over a step all ranks run at the pace of
the slowest GPU of the job. GPUs of one SKU do not compute equally fast: under the same power limit each
chip settles at its own clock (manufacturing variability and the chip's power management), and the
differences persist from step to step (Sinha et al., "Not All GPUs Are Created Equal: Characterizing
Variability in Large-Scale, Accelerator-Rich Systems", SC'22, arXiv 2208.11035: across the GPUs of
Summit, Vortex, Frontera, Longhorn (V100) and Corona (MI60), 8% (max 22%) average performance variation
for one SKU, outliers up to 1.5x slower than the median GPU). Inside one node too: the maximum achievable
matmul FLOPS of the eight GPUs of one NVIDIA node differ by "5% and higher", "even when all of them pass
the same factory binning" (stas00/ml-engineering, compute/accelerator/README.md, "Not all accelerators are
created equal": silicon lottery and uneven cooling), which the GPU profiles read as the expected range of
8 samples, 2 m_8 sigma: sigma = 5% / 2.85 = 1.76%.

Model: the sustained speed of a GPU relative to the typical one (the profile's compute constants) is
1 + sigma Z, Z standard normal, independent between GPUs; sigma is the profile's ``gpu_speed_spread``
(the relative standard deviation of per-GPU sustained speed). A job on N GPUs computes at the speed of
the slowest, whose expected speed is 1 - sigma E[max of N standard normals] (the normal distribution
is symmetric, so the expected minimum of N is minus the expected maximum); every device second of
compute takes

    1 / (1 - sigma m_N) seconds,   m_N = E[max(Z_1..Z_N)] = integral x N phi(x) Phi(x)^(N-1) dx

(m_1 = 0, m_2 = 0.564, m_8 = 1.424, m_16 = 1.766, m_32 = 2.070, m_64 = 2.344, m_128 = 2.595: the expected largest of
N normal samples, e.g. Tippett 1925, tabulated in Harter 1961, "Expected values of normal order
statistics", Biometrika 48). The slowdown grows with N as sqrt(2 ln N) and is already present inside
one node. Host time (kernel launches, hooks) is not scaled: it is the CPU's, not the GPU's.

``gpu_speed_spread`` = 0 (the default: profiles without the key, CPU profiles) prices exactly as
before; a single GPU (N = 1) is never slowed.
"""

from __future__ import annotations

import math
from functools import lru_cache

# Simpson's rule over [-_Z_MAX, _Z_MAX]: N phi(x) Phi(x)^(N-1) is below 1e-20 beyond 9 for N <= 1e6.
_Z_MAX = 9.0
_STEPS = 1800  # even; the integrand is smooth: error < 1e-9 against Harter's tables


@lru_cache(maxsize=256)
def expected_max_std_normal(n: int) -> float:
    """E[max of ``n`` independent standard normal samples] (0 for n <= 1)."""
    if n <= 1:
        return 0.0
    h = 2 * _Z_MAX / _STEPS
    total = 0.0
    for i in range(_STEPS + 1):
        x = -_Z_MAX + i * h
        cdf = 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))
        pdf = math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
        weight = 1 if i in (0, _STEPS) else (4 if i % 2 else 2)
        total += weight * x * n * pdf * cdf ** (n - 1)
    return total * h / 3


def straggler_factor(n_gpus: int, spread: float) -> float:
    """How much longer every device second of compute takes on ``n_gpus`` GPUs whose sustained speeds
    spread with relative standard deviation ``spread``: 1 / (1 - spread x E[max of n]) ([Note:
    Stragglers: the slowest of N GPUs]); 1 when ``spread`` is 0 or the job has one GPU."""
    if spread <= 0.0 or n_gpus <= 1:
        return 1.0
    slowest = 1.0 - spread * expected_max_std_normal(n_gpus)
    if slowest <= 0.0:
        raise ValueError(f"gpu_speed_spread {spread} is too large for {n_gpus} GPUs: the slowest would not run")
    return 1.0 / slowest
