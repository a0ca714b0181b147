import torch


def relu2(dtype, device, seed):
    return (torch.ones(4, 8, dtype=dtype, device=device),), {}
