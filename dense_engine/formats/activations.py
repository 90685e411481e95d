"""The activations some families' MLPs use beyond dense.py's GELU, SiLU and tanh-GELU: Apertus' xIELU (with learned
parameters of its own), Nemotron-H's squared ReLU. Importing this module adds them to dense.ACTIVATIONS (checkpoint.py
does, so every loader has them)."""

import torch
import torch.nn.functional as F
from torch import nn

import dense


class XIELU(nn.Module):
    """xIELU (arXiv 2411.13010), as transformers computes it: alpha_p x^2 + beta x where x > 0, else
    alpha_n (expm1(min(x, eps)) - x) + beta x, with alpha_p = softplus(a_p), alpha_n = beta + softplus(a_n) learned
    per layer (a_p, a_n as stored) and beta, eps stored beside them."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha_p, self.alpha_n = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
        self.register_buffer("beta", torch.tensor(0.5))
        self.register_buffer("eps", torch.tensor(-1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p, alpha_n = F.softplus(self.alpha_p), self.beta + F.softplus(self.alpha_n)
        negative = (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n
        return torch.where(x > 0, alpha_p * x * x, negative) + self.beta * x


class ReLU2(nn.Module):
    """relu(x)^2 (Nemotron-H's MLP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x).square()


dense.ACTIVATIONS.update({"xielu": XIELU, "relu2": ReLU2})
