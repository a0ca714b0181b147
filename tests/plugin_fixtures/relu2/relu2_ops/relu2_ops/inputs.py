import torch

from kernreg.torch import bench_shapes


@bench_shapes(small={"tokens": 16, "hidden": 1024}, large={"tokens": 256, "hidden": 4096})
def relu2_inputs(dtype, device, seed, *, tokens=None, hidden=None):
    g = torch.Generator().manual_seed(seed)
    tokens = tokens or (7, 33)[seed % 2]
    hidden = hidden or 96
    x = torch.randn(tokens, hidden, generator=g).to(dtype=dtype, device=device)
    return (x,), {}
