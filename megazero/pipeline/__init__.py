"""Pipeline parallelism: layers split over stages, schedules as timelines (GPipe, 1F1B, interleaved), batched
NCCL-ordered point-to-point transfers, the executor that runs a schedule, and the replay that checks the
recorded transfers under NCCL's matching rules."""

__all__: list[str] = []
