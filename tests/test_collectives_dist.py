"""Two gloo ranks: the collectives forward and backward, and a Megatron-style MLP.

One process-group launch runs every check (start-up costs seconds, each check costs
milliseconds). Everything is fp32 on CPU; sums over two ranks of partial products differ
from the single-process result by round-off only, so tolerances are 1e-6.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchloom as tl
from tests.dist import spawn
from torchloom.runtime import collectives as C

WORLD = 2



def _check_collectives(rank: int) -> None:
    # Each rank holds x_r = (r + 1) * base; the reference is computed locally.
    base = torch.arange(8.0).reshape(2, 4)
    xs = [base * (r + 1) for r in range(WORLD)]
    weights = [torch.randn(2, 8, generator=torch.Generator().manual_seed(r)) for r in range(WORLD)]

    x = xs[rank].clone().requires_grad_()
    y = C.all_gather(x, axis=1)
    torch.testing.assert_close(y, torch.cat(xs, dim=1))
    (y * weights[rank]).sum().backward()
    # d/dx_r of sum_k <y, w_k> = slice r of sum_k w_k.
    torch.testing.assert_close(x.grad, sum(weights).chunk(WORLD, dim=1)[rank])

    x = xs[rank].clone().requires_grad_()
    y = C.all_gather(x, axis=0, tensor_parallel_output_grad=False)
    (y * weights[0].reshape(4, 4)).sum().backward()  # same consumer on every rank
    torch.testing.assert_close(x.grad, weights[0].reshape(4, 4).chunk(WORLD, dim=0)[rank])

    x = xs[rank].clone().requires_grad_()
    y = C.reduce_scatter(x, axis=1)
    torch.testing.assert_close(y, sum(xs).chunk(WORLD, dim=1)[rank])
    w = weights[rank][:, :2]
    (y * w).sum().backward()
    torch.testing.assert_close(x.grad, torch.cat([weights[r][:, :2] for r in range(WORLD)], dim=1))

    x = xs[rank].clone().requires_grad_()
    y = C.scatter(x, axis=1)
    torch.testing.assert_close(y, xs[rank].chunk(WORLD, dim=1)[rank])
    (y * w).sum().backward()
    torch.testing.assert_close(x.grad, torch.cat([weights[r][:, :2] for r in range(WORLD)], dim=1))

    x = xs[rank].clone().requires_grad_()
    y = C.all_reduce(x)
    torch.testing.assert_close(y, sum(xs))
    (y * weights[rank][:, :4]).sum().backward()
    torch.testing.assert_close(x.grad, weights[rank][:, :4])

    x = xs[rank].clone().requires_grad_()
    y = C.copy_to_group(x)
    assert torch.equal(y, x)
    (y * weights[rank][:, :4]).sum().backward()
    torch.testing.assert_close(x.grad, sum(w_[:, :4] for w_ in weights))


def _check_reshards(rank: int) -> None:
    from torchloom.primitives.sync import reshard

    full = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(3))
    w = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(4))
    seq = lambda t: t.chunk(WORLD, dim=-2)[rank]  # noqa: E731
    hid = lambda t: t.chunk(WORLD, dim=-1)[rank]  # noqa: E731
    layouts = {"RR": lambda t: t, "RS": hid, "SR": seq}
    for spec in ["RR->RS", "RR->SR", "RS->RR", "SR->RR", "RS->SR", "SR->RS"]:
        src, dst = spec.split("->")
        x = layouts[src](full).clone().requires_grad_()
        y = reshard(x, spec)
        torch.testing.assert_close(y, layouts[dst](full), msg=spec)
        # Convention (Megatron's): a replicated value is the same on every rank and its
        # gradient is that of one rank's loss; sharded values add up across ranks. So the
        # local input's gradient is the source-layout slice of w; a replicated input (RR)
        # feeds every rank's slice, so its gradient is all of w.
        (y * layouts[dst](w)).sum().backward()
        expected = w if src == "RR" else layouts[src](w)
        torch.testing.assert_close(x.grad, expected, msg=spec)


def _check_megatron_mlp(rank: int) -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    model = copy.deepcopy(reference)
    sch = tl.create_schedule(model)
    assert (sch.world_size, sch.rank) == (WORLD, rank)
    sch["0"].shard("weight", 0)
    sch["0"].shard("bias", 0)
    sch["0"].sync("bwd_post", "all_reduce")
    sch["2"].shard("weight", 1)
    sch["2"].sync("fwd_post", "all_reduce")  # bias added once, after the reduction
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))
    out = model(x)
    ref = reference(x)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    model(xa).square().sum().backward()
    reference(xb).square().sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-6, atol=1e-6)
    half = slice(rank * 8, (rank + 1) * 8)
    torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad[half], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model[0].bias.grad, reference[0].bias.grad[half], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model[2].weight.grad, reference[2].weight.grad[:, half], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model[2].bias.grad, reference[2].bias.grad, rtol=1e-6, atol=1e-6)


def _check_uneven_split_is_a_schedule_error(rank: int) -> None:
    from torchloom.core.errors import CollectiveShapeError

    x = torch.ones(2, 3)
    with pytest.raises(CollectiveShapeError, match=r"^scatter\(\.\.\.\): cannot split axis 1 of "
                       r"size 3 into 2 equal slices, one per rank\n    values: shape=\(2, 3\), "
                       r"axis=1, world_size=2\n    fix: make axis 1 a multiple of 2"):
        C.scatter(x, axis=1)
    with C.collective_site("h.0.attn"), pytest.raises(ValueError, match=r"^sch\['h\.0\.attn'\]"
                                                      r"\.sync\(\.\.\.\): cannot split axis -1"):
        C.reduce_scatter(x, axis=-1)  # still a ValueError, for callers that catch one


def test_collectives_and_tensor_parallel_mlp_on_two_ranks():
    spawn(_check_collectives, _check_reshards, _check_megatron_mlp,
          _check_uneven_split_is_a_schedule_error)
