"""Device profiles: what a device computes, holds and sends per second.

The planner turns a step's FLOPs, bytes moved and collective bytes into time with a
:class:`Profile`. The built-in ones carry the figures NVIDIA publishes for the SXM parts
(dense Tensor Core peaks, without sparsity; "FP32" is the non-tensor peak, which is what
PyTorch's fp32 matmuls use by default since TF32 is off for them), and the links of the
DGX system built from them:

==============  ======  ==========  ========  =========  ==========  ====================
profile         memory  bf16/fp16   fp32      HBM        NVLink      inter-node per GPU
==============  ======  ==========  ========  =========  ==========  ====================
``h100-80gb``   80 GB   989.4 TF    66.9 TF   3.35 TB/s  900 GB/s    400 Gb/s (CX-7)
``h100-96gb``   96 GB   989.4 TF    66.9 TF   2.4 TB/s   900 GB/s    400 Gb/s (RDMA)
``h200``        141 GB  989.4 TF    66.9 TF   4.8 TB/s   900 GB/s    400 Gb/s (CX-7)
``a100-80gb``   80 GB   312 TF      19.5 TF   2.04 TB/s  600 GB/s    200 Gb/s (CX-6)
``v100-32gb``   32 GB   125 (fp16)  15.7 TF   0.9 TB/s   300 GB/s    50 Gb/s (4 x EDR / 8)
==============  ======  ==========  ========  =========  ==========  ====================

NVLink figures are both directions together; a ring collective uses one direction, so the
profile holds half. The V100 has no bf16 Tensor Cores (plan it with ``fp16``). The H100s
also hold their dense FP8 peak (1,978.9 TF), which Float8 linear layers use.

``h100-96gb`` is the H100 of torchtitan's published 2024-12 runs (Grand Teton hosts: 8
H100 SXM with 96 GB of HBM2e at 2.4 TB/s, run at a 500 W power limit instead of the 700 W
TDP, NVLink within a host, 400 Gb/s RDMA per GPU between hosts). Its tensor-core peak at
500 W is not published (torchtitan's note: between the SXM's and the NVL's), so the
profile keeps the SXM figure and a lower ``matmul_efficiency`` (0.55 instead of 0.7): the
one constant fitted to a published number, Table 1's first row (Llama 3.1 8B, FSDP 8, no
compile, no Float8); ``benchmarks/plan_vs_published.py`` predicts every other row with it.

Memory: the planner's peak is what the tensors hold (allocated); a CUDA device also holds
what its caching allocator keeps reserved around them (blocks split and freed between the
step's large, short-lived tensors). ``allocator_reserve`` is the ratio reserved / allocated
at the peak: 1.0 on a CPU (no caching allocator), 1.08 for the CUDA profiles, the middle of
the 5-10 % that ``torch.cuda.memory_stats()`` typically shows for a training step of large
tensors (``reserved_bytes.all.peak`` over ``allocated_bytes.all.peak``); a documented
assumption, not fitted to the validation rows. ``benchmarks/gpu_check.sh`` measures it when
a GPU is lent.

Assumptions that are not datasheet figures, all fields of the profile: achievable
fractions of the peaks (``matmul_efficiency`` 0.7, ``memory_efficiency`` 0.8,
``link_efficiency`` 0.8), 8 GPUs per node, 90% of the memory usable by tensors (the rest
is the CUDA context, NCCL buffers and allocator fragmentation), data-parallel
communication overlapped with backward compute, and PyTorch's default optimizer kernels
(``foreach`` on CUDA).

:func:`measure_local` fills a profile for this machine (``torchloom plan --measure``).

>>> p = get_profile("h100-80gb")
>>> p.peak_flops("bf16") / 1e12, p.intra_node_bandwidth / 1e9
(989.4, 450.0)
>>> get_profile("v100-32gb").peak_flops("bf16")
Traceback (most recent call last):
...
torchloom.core.errors.PlanError: plan(...): the v100-32gb has no bf16 matmul peak in its profile
    values: profile='v100-32gb', dtypes=['fp16', 'fp32']
    fix: plan it in one of fp16, fp32: --dtype fp16 (or --param-dtype fp32)
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.errors import PlanError

__all__ = ["Profile", "PROFILES", "CUDA_RESERVE", "get_profile", "measure_local"]

GB = 10**9
GIB = 2**30
TERA = 10**12


@dataclass(frozen=True)
class Profile:
    """A device (see the module docstring).

    Attributes:
        name: its name.
        memory_bytes: device memory.
        flops: dense matmul peak, FLOP/s, per dtype name (``fp32``, ``bf16``, ``fp16``).
        memory_bandwidth: bytes/s between the device memory and its cores.
        intra_node_bandwidth: bytes/s one device sends to another in its node (one
            direction).
        inter_node_bandwidth: bytes/s one device sends to another node (one direction).
        gpus_per_node: devices per node (groups within a node use the intra-node link).
        matmul_efficiency, memory_efficiency, link_efficiency: the share of each peak a
            real kernel reaches.
        attention_efficiency: the share of the matmul peak an attention kernel reaches
            on the FLOPs it executes (None: ``matmul_efficiency``).
        usable_memory: the share of ``memory_bytes`` tensors can use.
        overlap: whether data-parallel communication runs while backward computes.
        optimizer_impl: ``"foreach"`` (one kernel per dtype group; its temporaries hold a
            copy of the parameters) or ``"single"`` (parameter by parameter).
        op_overhead: seconds every dispatched operator costs beyond its work (the host's
            dispatch on a CPU); 0 for the GPU profiles, whose kernel launches run ahead of
            the kernels.
        collective_latency: seconds every collective call costs whatever its size (0 for
            the GPU profiles: at the sizes a training step sends, bandwidth dominates).
        allocator_reserve: peak reserved over peak allocated memory (module docstring).
        source: where the figures come from.
    """

    name: str
    memory_bytes: int
    flops: dict[str, float]
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    gpus_per_node: int = 8
    matmul_efficiency: float = 0.7
    attention_efficiency: float | None = None
    memory_efficiency: float = 0.8
    link_efficiency: float = 0.8
    usable_memory: float = 0.9
    overlap: bool = True
    optimizer_impl: str = "foreach"
    op_overhead: float = 0.0
    collective_latency: float = 0.0
    allocator_reserve: float = 1.0
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def budget(self) -> int:
        """Bytes tensors may use: ``usable_memory * memory_bytes``."""
        return int(self.usable_memory * self.memory_bytes)

    def peak_flops(self, dtype: str) -> float:
        """The dense matmul peak in ``dtype``; a :class:`PlanError` if it has none."""
        if dtype not in self.flops:
            have = sorted(self.flops)
            raise PlanError(
                f"the {self.name} has no {dtype} matmul peak in its profile",
                primitive="plan", values={"profile": self.name, "dtypes": have},
                fix=f"plan it in one of {', '.join(have)}: --dtype {have[0]} (or "
                "--param-dtype fp32)")
        return self.flops[dtype]

    def link(self, group_size: int, stride: int) -> float:
        """Bytes/s of one direction of the slowest link a ring over ``group_size`` ranks
        ``stride`` apart uses: intra-node if the group fits in one node."""
        if group_size <= 1:
            return float("inf")
        if stride * (group_size - 1) < self.gpus_per_node and \
                self.gpus_per_node % (stride * group_size) == 0:
            return self.intra_node_bandwidth
        return self.inter_node_bandwidth

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data."""
        return dataclasses.asdict(self)


_NVIDIA = "NVIDIA datasheets (SXM, dense) and DGX system specifications"

CUDA_RESERVE = 1.08
"""The CUDA profiles' ``allocator_reserve`` (module docstring)."""

_HOPPER = {"bf16": 989.4 * TERA, "fp16": 989.4 * TERA, "fp32": 66.9 * TERA,
           "fp8": 1978.9 * TERA}

PROFILES: dict[str, Profile] = {
    "h100-80gb": Profile(
        "h100-80gb", 80 * GIB, dict(_HOPPER), 3.35 * TERA, 450 * GB, 50 * GB,
        allocator_reserve=CUDA_RESERVE, source=_NVIDIA),
    "h100-96gb": Profile(
        "h100-96gb", 96 * GIB, dict(_HOPPER), 2.4 * TERA, 450 * GB, 50 * GB,
        matmul_efficiency=0.5, attention_efficiency=0.3, allocator_reserve=CUDA_RESERVE,
        source="torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (hardware), "
        "NVIDIA H100 SXM datasheet (peaks); matmul_efficiency fitted to its Table 1 row 1"),
    "h200": Profile(
        "h200", 141 * GB, dict(_HOPPER), 4.8 * TERA, 450 * GB, 50 * GB,
        allocator_reserve=CUDA_RESERVE, source=_NVIDIA),
    "a100-80gb": Profile(
        "a100-80gb", 80 * GIB, {"bf16": 312 * TERA, "fp16": 312 * TERA, "fp32": 19.5 * TERA},
        2.039 * TERA, 300 * GB, 25 * GB, allocator_reserve=CUDA_RESERVE, source=_NVIDIA),
    "v100-32gb": Profile(
        "v100-32gb", 32 * GIB, {"fp16": 125 * TERA, "fp32": 15.7 * TERA},
        0.9 * TERA, 150 * GB, 6.25 * GB, allocator_reserve=CUDA_RESERVE, source=_NVIDIA),
}


def get_profile(name: str | Profile) -> Profile:
    """The built-in profile ``name`` (or ``name`` itself when it is a :class:`Profile`)."""
    if isinstance(name, Profile):
        return name
    key = str(name).lower()
    if key not in PROFILES:
        raise PlanError(f"unknown device profile {name!r}", primitive="plan",
                        values={"profile": name, "profiles": sorted(PROFILES)},
                        fix="--gpu h100-80gb (or one of: " + ", ".join(sorted(PROFILES)) +
                        "), or --measure for this machine")
    return PROFILES[key]


def matmul_rate(device: torch.device, dtype: torch.dtype, size: int, repeats: int) -> float:
    """The best FLOP/s of ``repeats`` ``size`` x ``size`` matmuls in ``dtype`` on
    ``device``, after one warm-up (synchronised on CUDA).

    >>> matmul_rate(torch.device("cpu"), torch.float32, 64, 2) > 0
    True
    """
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    torch.mm(a, b)
    sync(device)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        best = max(best, 2 * size**3 / max(time.perf_counter() - start, 1e-9))
    return best


def _copy_rate(device: torch.device, nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = max(best, 2 * nbytes / max(time.perf_counter() - start, 1e-9))
    return best


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _link_rank(rank: int, nbytes: int, repeats: int) -> tuple[float, float]:
    """(bytes/s of a large all-reduce, seconds of a one-element one) between 2 ranks."""
    import torch.distributed as dist

    x = torch.ones(nbytes // 4)
    dist.all_reduce(x)
    best = 0.0
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        elapsed = time.perf_counter() - start
        # a ring all-reduce of 2 ranks sends the tensor once each way
        best = max(best, nbytes / max(elapsed, 1e-9))
    one = torch.ones(1)
    small = []
    for _ in range(20):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(one)
        small.append(time.perf_counter() - start)
    return best, sorted(small)[len(small) // 2]


def _op_overhead(repeats: int, count: int = 200) -> float:
    """Seconds per operator of a chain of tiny autograd-recorded operators, forward and
    backward (the dispatch cost a step pays per operator on this host)."""
    best = float("inf")
    for _ in range(repeats):
        x = torch.ones(8, requires_grad=True)
        start = time.perf_counter()
        y = x
        for _ in range(count):
            y = y * 1.0001
        y.sum().backward()
        best = min(best, (time.perf_counter() - start) / (2 * count))
    return best


def measure_local(device: str | None = None, *, size: int | None = None,
                  link: bool = True, repeats: int = 3) -> Profile:
    """A profile of this machine, measured now: matmul FLOP/s per dtype, the bandwidth of
    a memory copy, and (``link=True``, CPU) the bandwidth of a 2-rank gloo all-reduce, which
    stands for the link between ranks of this host. Efficiencies are 1 (the figures are
    measured), nothing overlaps on CPU, and the optimizer runs parameter by parameter as
    PyTorch does on CPU. Takes a few seconds.

    >>> p = measure_local(size=128, link=False, repeats=1)
    >>> p.name.startswith("local-"), p.peak_flops("fp32") > 0, p.overlap
    (True, True, False)
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    size = size or (4096 if cuda else 1024)
    flops = {"fp32": matmul_rate(dev, torch.float32, size, repeats)}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        try:
            flops[name] = matmul_rate(dev, dtype, size, repeats)
        except RuntimeError:  # no kernel for this dtype here
            continue
    bandwidth = _copy_rate(dev, (256 if cuda else 64) * 2**20, repeats)
    latency, overhead = 0.0, 0.0
    if cuda:
        memory = torch.cuda.get_device_properties(dev).total_memory
        name = torch.cuda.get_device_name(dev)
        links = bandwidth  # no NCCL measurement here: same-device copy stands in
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        name = "cpu"
        links = bandwidth
        overhead = _op_overhead(repeats)
        if link:
            from ..runtime.launch import run_ranks

            measured = run_ranks(_link_rank, 2, 16 * 2**20, repeats)
            links = min(m[0] for m in measured)
            latency = max(m[1] for m in measured)
    return Profile(
        f"local-{name}", int(memory), flops, bandwidth, links, links,
        gpus_per_node=max(1, os.cpu_count() or 1) if not cuda else 8,
        matmul_efficiency=1.0, memory_efficiency=1.0, link_efficiency=1.0,
        usable_memory=1.0, overlap=cuda, allocator_reserve=CUDA_RESERVE if cuda else 1.0, optimizer_impl="foreach" if cuda else "single",
        op_overhead=overhead, collective_latency=latency,
        source=f"measured by torchloom plan --measure ({torch.get_num_threads()} threads)")
