"""megazero: GPT pretraining with tensor, pipeline and ZeRO data parallelism."""

__version__ = "0.1.0"
