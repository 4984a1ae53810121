"""A custom loss for the tests: `trainer.loss.custom=custom_loss:reinforce` (tests/ on PYTHONPATH).

Plain REINFORCE, -scale * A * log pi_theta per loss token: no importance ratio, no trust region.
"""

import torch


def reinforce(inputs, scale: float = 1.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    mask = inputs.loss_mask.float()
    loss = -(scale * inputs.advantages * inputs.logprobs * mask).sum()
    stats = {"advantage": (inputs.advantages * mask).sum(), "logprob": (inputs.logprobs.detach() * mask).sum()}
    return loss, stats
