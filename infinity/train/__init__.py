"""The main job behind `infinity-train`: data, the default model and corpus, the training loop,
export in Hugging Face format, and the run's report (see docs/train.md)."""

from infinity.train.job import JobResult, TrainOptions, run

__all__ = ["JobResult", "TrainOptions", "run"]
