import torch


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) ** 2


def relu3(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) ** 3
