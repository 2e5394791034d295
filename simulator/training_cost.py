"""What training a model to a token budget takes at a simulated speed: the time, the GPU-hours and their price
(``simulate`` and ``plan``'s ``--train-tokens`` and ``--gpu-hour-price``; docs/cli.md)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_TRAIN_TOKENS = 1e16  # 10,000 T tokens: past any run anyone plans, and far from float overflow
MAX_GPU_HOUR_PRICE = 1e4


@dataclass(frozen=True)
class TrainingGoal:
    """``tokens`` to train on; ``gpu_hour_price`` (None: the cost is not priced) per GPU-hour, in the user's
    currency."""

    tokens: float
    gpu_hour_price: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.tokens <= MAX_TRAIN_TOKENS:
            raise ValueError(f"--train-tokens: got {self.tokens:g}, expected a count from 1 to {MAX_TRAIN_TOKENS:g}")
        if self.gpu_hour_price is not None and not 0 <= self.gpu_hour_price <= MAX_GPU_HOUR_PRICE:
            raise ValueError(f"--gpu-hour-price: got {self.gpu_hour_price:g}, expected a price from 0 to "
                             f"{MAX_GPU_HOUR_PRICE:g} per GPU-hour")

    def estimate(self, tokens_per_s: float | None, gpus: int) -> dict[str, float | None]:
        """``time_to_train_s``, ``gpu_hours`` and ``cost`` (None without a price) at ``tokens_per_s`` on ``gpus``
        GPUs; every value None where the speed is unknown (uniform costs know no tokens)."""
        if not tokens_per_s:
            return {"train_tokens": self.tokens, "time_to_train_s": None, "gpu_hours": None, "cost": None}
        seconds = self.tokens / tokens_per_s
        gpu_hours = seconds * gpus / 3600
        cost = gpu_hours * self.gpu_hour_price if self.gpu_hour_price is not None else None
        return {"train_tokens": self.tokens, "time_to_train_s": seconds, "gpu_hours": gpu_hours, "cost": cost}
