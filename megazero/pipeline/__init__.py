"""Pipeline parallelism: stage partitioning, point-to-point communication and schedules (not landed yet)."""

__all__: list[str] = []
